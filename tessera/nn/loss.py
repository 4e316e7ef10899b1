"""Cross-entropy (one class per row) and binary cross-entropy (multi-label) over a full-graph
output's rows, or over a subset of them."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera.sparse.rows import take_rows

_SUM = 2  # at::Reduction::Sum
_IGNORE = -100  # F.cross_entropy's default ignore_index


class _SumCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target):
        # The aten ops cross_entropy and its backward run, called directly: a nested
        # torch.autograd.grad imports sympy (0.4 s) on first use. In float32 when the logits are
        # stored in bfloat16 (the gradient is stored as they are).
        lsm = torch.log_softmax(logits.detach().to(torch.promote_types(logits.dtype, torch.float32)), 1)
        loss, total_weight = torch.ops.aten.nll_loss_forward(lsm, target, None, _SUM, _IGNORE)
        ctx.save_for_backward(lsm, target, total_weight)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        lsm, target, total_weight = ctx.saved_tensors
        g_lsm = torch.ops.aten.nll_loss_backward(g, lsm, target, None, _SUM, _IGNORE, total_weight)
        return torch._log_softmax_backward_data(g_lsm, lsm, 1, lsm.dtype).to(ctx.dtype), None


def cross_entropy_rows(logits: torch.Tensor, rows: torch.Tensor | None, target: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits[rows], target, reduction="sum")``, the same value and gradient, for
    distinct ``rows`` (int64 ids or a bool mask; None: every row, as a model asked for only the
    rows its loss reads returns them)."""
    return _SumCrossEntropy.apply(logits if rows is None else take_rows(logits, rows), target)


def bce_rows(logits: torch.Tensor, rows: torch.Tensor | None, target: torch.Tensor) -> torch.Tensor:
    """``F.binary_cross_entropy_with_logits(logits[rows], target, reduction="sum")``, the same value
    and gradient, for multi-label targets ``target`` (0/1 per row and task; an entry -1 is
    unlabelled and left out of the sum); computed in float32 when the logits are bfloat16 (the
    gradient is stored as they are). ``rows`` as :func:`cross_entropy_rows`."""
    picked = logits if rows is None else take_rows(logits, rows)
    x = picked.to(torch.promote_types(picked.dtype, torch.float32))
    labelled = target >= 0
    if bool(labelled.all()):
        return F.binary_cross_entropy_with_logits(x, target.to(x.dtype), reduction="sum")
    weight = labelled.to(x.dtype)
    return F.binary_cross_entropy_with_logits(x, target.clamp(min=0).to(x.dtype), weight, reduction="sum")
