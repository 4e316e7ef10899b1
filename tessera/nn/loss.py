"""Cross-entropy over a subset of a full-graph output's rows, with its gradient in a workspace block."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tessera import workspace


class _RowsCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, rows, target):
        # autograd over the selected rows only (n_train x C); the full-size gradient is written
        # once, into a kept block, where ``F.cross_entropy(logits[rows], ...)`` would map a fresh
        # zero tensor of the logits' size every step
        with torch.enable_grad():
            picked = logits.detach()[rows].requires_grad_()
            loss = F.cross_entropy(picked, target, reduction="sum")
        ctx.picked, ctx.loss, ctx.rows = picked, loss, rows
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss.detach()

    @staticmethod
    def backward(ctx, g):
        (g_picked,) = torch.autograd.grad(ctx.loss, ctx.picked, g)
        out = workspace.zeros(ctx.shape, ctx.dtype) if g.device.type == "cpu" else g.new_zeros(ctx.shape)
        # the rows are distinct, so a copy gives what indexing's accumulating backward gives
        # (0 + v), in a tenth of its time (91 k rows x 40: 2.1 against 22.3 ms)
        if ctx.rows.dtype == torch.bool:
            out[ctx.rows] = g_picked
        else:
            out.index_copy_(0, ctx.rows, g_picked)
        return out, None, None


def cross_entropy_rows(logits: torch.Tensor, rows: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits[rows], target, reduction="sum")``, the same value and gradient, for
    distinct ``rows`` (int64 ids or a bool mask)."""
    return _RowsCrossEntropy.apply(logits, rows, target)
