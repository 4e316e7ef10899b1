"""Typed row blocks times per-type weights, ``out[rows of block b] = x[rows of b] @ W[type]``, with
autograd: the dense products of RGCN's segment GEMM and of the gTask micro-kernels.

Every product writes into one output buffer (no per-block tensors to concatenate) and the
backward accumulates each weight's gradient in place (``addmm_`` into ``grad_w[r]``), so a layout
of thousands of blocks costs their GEMMs and nothing per block beyond the call.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Block:
    """One dense product: rows ``[offset, offset + units * size)`` of the input, ``units`` slots of
    ``size`` rows, slot ``i`` multiplied by ``W[types[i]]`` (one GEMM with ``W[single_type]`` when
    every slot has that type); ``category`` labels it for profiling."""

    offset: int
    units: int
    size: int
    types: torch.Tensor
    single_type: int | None
    category: str = ""

    @property
    def rows(self) -> int:
        """Input rows the block covers."""
        return self.units * self.size


def segment_blocks(ptr: Sequence[int]) -> tuple[Block, ...]:
    """One single-type block per non-empty segment: rows ``ptr[r]:ptr[r+1]`` times ``W[r]``."""
    bounds = [int(p) for p in ptr]
    return tuple(Block(a, 1, b - a, torch.tensor([r]), r) for r, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a)


def fuse(blocks: Sequence[Block]) -> tuple[Block, ...]:
    """``blocks`` with each run of adjacent single-type blocks of one type and category merged into
    one block: a batch of units that share a weight is one GEMM over their stacked rows, and so
    are consecutive batches."""
    out: list[Block] = []
    for b in blocks:
        last = out[-1] if out else None
        if (
            last is not None
            and b.single_type is not None
            and last.single_type == b.single_type
            and last.category == b.category
            and last.offset + last.rows == b.offset
        ):
            out[-1] = Block(last.offset, 1, last.rows + b.rows, last.types[:1], last.single_type, last.category)
        else:
            out.append(b)
    return tuple(out)


def _uncovered(blocks: Sequence[Block], num_rows: int) -> list[tuple[int, int]]:
    """Row ranges no block covers (they give zeros)."""
    gaps, at = [], 0
    for b in sorted(blocks, key=lambda b: b.offset):
        if b.offset > at:
            gaps.append((at, b.offset))
        at = max(at, b.offset + b.rows)
    return gaps + ([(at, num_rows)] if num_rows > at else [])


def products(
    blocks: Sequence[Block], a: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, transpose: bool = False
) -> None:
    """``out[b] = a[b] @ W[b]`` (``W^T`` when ``transpose``) for every block, in place and without
    autograd (the rows of ``out`` no block covers are left as they are)."""
    for b in blocks:
        lo, hi = b.offset, b.offset + b.rows
        if b.single_type is not None:
            w = weight[b.single_type]
            torch.mm(a[lo:hi], w.t() if transpose else w, out=out[lo:hi])
        else:
            w = weight.index_select(0, b.types)
            dst = out[lo:hi].view(b.units, b.size, out.shape[1])
            torch.bmm(a[lo:hi].view(b.units, b.size, a.shape[1]), w.transpose(1, 2) if transpose else w, out=dst)


class BlockMatmulFn(torch.autograd.Function):
    """:func:`block_matmul` with its backward: ``grad_x[b] = g[b] @ W^T``, ``grad_W[r] += x[b]^T g[b]``."""

    @staticmethod
    def forward(ctx, x, weight, blocks):
        out = x.new_empty(x.shape[0], weight.shape[2])
        products(blocks, x, weight, out, False)
        gaps = _uncovered(blocks, x.shape[0])
        for lo, hi in gaps:
            out[lo:hi] = 0
        ctx.blocks, ctx.gaps = blocks, gaps
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g = g.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[0]:
            gx = x.new_empty(x.shape)
            products(ctx.blocks, g, weight, gx, True)
            for lo, hi in ctx.gaps:
                gx[lo:hi] = 0
        if ctx.needs_input_grad[1]:
            gw = torch.zeros_like(weight)
            for b in ctx.blocks:
                lo, hi = b.offset, b.offset + b.rows
                if b.single_type is not None:
                    gw[b.single_type].addmm_(x[lo:hi].t(), g[lo:hi])
                else:
                    xs, gs = x[lo:hi].view(b.units, b.size, -1), g[lo:hi].view(b.units, b.size, -1)
                    gw.index_add_(0, b.types, torch.bmm(xs.transpose(1, 2), gs))
        return gx, gw, None


def block_matmul(x: torch.Tensor, weight: torch.Tensor, blocks: Sequence[Block]) -> torch.Tensor:
    """``x`` ``(M, fi)`` times ``weight`` ``(R, fi, fo)`` block by block (:class:`Block`); rows no
    block covers give zeros. Blocks must not overlap. Autograd for ``x`` and ``weight``."""
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x (M, fi) and weight (R, fi, fo), got {tuple(x.shape)} and {tuple(weight.shape)}")
    return BlockMatmulFn.apply(x.contiguous(), weight.contiguous(), tuple(blocks))
