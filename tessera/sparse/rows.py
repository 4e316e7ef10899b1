"""Rows of a full-graph tensor picked out, with the gradient written into one kept block."""

from __future__ import annotations

import torch

from tessera import workspace


class _TakeRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, rows):
        ctx.save_for_backward(rows)
        ctx.shape, ctx.dtype = x.shape, x.dtype
        if rows.dtype == torch.bool or x.device.type != "cpu":
            return x[rows]
        # into a kept block: indexing maps a fresh output, page-faulted in every step
        return torch.index_select(x, 0, rows, out=workspace.empty((rows.numel(), *x.shape[1:]), x.dtype))

    @staticmethod
    def backward(ctx, g):
        (rows,) = ctx.saved_tensors
        out = workspace.zeros(ctx.shape, ctx.dtype) if g.device.type == "cpu" else g.new_zeros(ctx.shape)
        # the rows are distinct, so a copy gives what indexing's accumulating backward gives
        # (0 + v), in about a tenth of its time (docs/design/chunk-sizes.md), and the zeros
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


# bytes of rows gathered per chunk of add_rows_: about a megabyte, added while still in cache
_GATHER_BYTES = 1 << 20


def add_rows_(out: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``out += alpha * x[rows]`` in place (int64 ``rows``, one per row of ``out``), gathering a
    chunk of rows at a time: no ``x[rows]`` block is formed, which runs several times faster than
    ``out.add_(x[rows])`` (docs/design/chunk-sizes.md)."""
    if out.device.type != "cpu" or out.dim() != 2 or out.shape[0] == 0:
        return out.add_(x[rows], alpha=alpha)
    step = workspace.chunk_rows(out.shape[1], out.element_size(), out.shape[0], _GATHER_BYTES)
    buf = torch.empty((step, out.shape[1]), dtype=x.dtype)
    for r0 in range(0, out.shape[0], step):
        r1 = min(out.shape[0], r0 + step)
        chunk = buf[: r1 - r0]
        torch.index_select(x, 0, rows[r0:r1], out=chunk)
        out[r0:r1].add_(chunk, alpha=alpha)
    return out
