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
        # accumulate, as indexing's own backward does, so repeated rows add up the same way
        out.index_put_((ctx.rows,), g_picked, accumulate=True)
        return out, None, None


def cross_entropy_rows(logits: torch.Tensor, rows: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``F.cross_entropy(logits[rows], target, reduction="sum")``, the same value and gradient."""
    return _RowsCrossEntropy.apply(logits, rows, target)
