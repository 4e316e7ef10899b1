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
                add_weight_grad(gw, b, x[lo:hi], g[lo:hi])
        return gx, gw, None


def add_weight_grad(gw: torch.Tensor, b: Block, xs: torch.Tensor, gs: torch.Tensor) -> None:
    """``gw[r] += xs^T gs`` for block ``b``'s input rows ``xs`` and output gradient rows ``gs``
    (each unit with its own relation ``r``, or one GEMM where the block has a single type)."""
    if b.single_type is not None:
        gw[b.single_type].addmm_(xs.t(), gs)
    else:
        xv, gv = xs.view(b.units, b.size, -1), gs.view(b.units, b.size, -1)
        gw.index_add_(0, b.types, torch.bmm(xv.transpose(1, 2), gv))


def block_matmul(x: torch.Tensor, weight: torch.Tensor, blocks: Sequence[Block]) -> torch.Tensor:
    """``x`` ``(M, fi)`` times ``weight`` ``(R, fi, fo)`` block by block (:class:`Block`); rows no
    block covers give zeros. Blocks must not overlap. Autograd for ``x`` and ``weight``."""
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x (M, fi) and weight (R, fi, fo), got {tuple(x.shape)} and {tuple(weight.shape)}")
    return BlockMatmulFn.apply(x.contiguous(), weight.contiguous(), tuple(blocks))


# Rows of ``x`` one chunk of :func:`gather_block_matmul` gathers at a time: at most this many bytes of
# gathered input (128 MiB: 262,144 rows of 128 floats, 131,072 of 256). Few enough calls that a
# loaded 2-core machine does not wait on each one's threads (32 MiB chunks made the weight gradient
# of arxiv-rel8's second layer 3x slower there), and the transient is one chunk, not every gathered
# row (docs/design/rgcn-memory.md).
GATHER_CHUNK_BYTES = 128 * 2**20


def chunk_blocks(blocks: Sequence[Block], max_rows: int) -> tuple[Block, ...]:
    """``blocks`` cut into pieces of at most ``max_rows`` rows (a multi-type block at its unit
    boundaries, so a piece of one is at least one unit); the pieces cover the same rows with the
    same weights."""
    out: list[Block] = []
    for b in blocks:
        if b.rows <= max_rows:
            out.append(b)
        elif b.single_type is not None and b.units == 1:
            for lo in range(0, b.rows, max_rows):
                out.append(Block(b.offset + lo, 1, min(max_rows, b.rows - lo), b.types, b.single_type, b.category))
        else:
            per = max(1, max_rows // b.size)
            for u in range(0, b.units, per):
                n = min(per, b.units - u)
                out.append(Block(b.offset + u * b.size, n, b.size, b.types[u : u + n], b.single_type, b.category))
    return tuple(out)


def _pads_by_block(blocks: Sequence[Block], pad_rows: torch.Tensor | None) -> list[torch.Tensor | None]:
    """For each block, the positions (relative to its offset) of the padding rows it covers."""
    if pad_rows is None or pad_rows.numel() == 0:
        return [None] * len(blocks)
    pads = pad_rows.sort().values
    lo = torch.tensor([b.offset for b in blocks], dtype=pads.dtype)
    hi = torch.tensor([b.offset + b.rows for b in blocks], dtype=pads.dtype)
    a, z = torch.searchsorted(pads, lo).tolist(), torch.searchsorted(pads, hi).tolist()
    return [pads[i:j] - b.offset if j > i else None for b, i, j in zip(blocks, a, z, strict=True)]


def _gather(x: torch.Tensor, index: torch.Tensor, b: Block, pads: torch.Tensor | None) -> torch.Tensor:
    xs = x.index_select(0, index[b.offset : b.offset + b.rows])
    return xs if pads is None else xs.index_fill_(0, pads.to(xs.device), 0)


class GatherBlockMatmulFn(torch.autograd.Function):
    """:func:`gather_block_matmul`: the gathered rows live one chunk at a time, in the forward and
    again (recomputed) in the backward; what is saved is ``x`` and the index, not the rows."""

    @staticmethod
    def forward(ctx, x, weight, index, blocks, pads, num_rows):
        out = x.new_empty(num_rows, weight.shape[2])
        for b, p in zip(blocks, pads, strict=True):
            products((Block(0, b.units, b.size, b.types, b.single_type),), _gather(x, index, b, p), weight,
                     out[b.offset : b.offset + b.rows])  # fmt: skip
        gaps = _uncovered(blocks, num_rows)
        for lo, hi in gaps:
            out[lo:hi] = 0
        ctx.blocks, ctx.pads, ctx.index, ctx.gaps = blocks, pads, index, gaps
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g = g.contiguous()
        gx = gw = None
        if ctx.needs_input_grad[1]:
            gw = torch.zeros_like(weight)
            for b, p in zip(ctx.blocks, ctx.pads, strict=True):
                add_weight_grad(gw, b, _gather(x, ctx.index, b, p), g[b.offset : b.offset + b.rows])
        if ctx.needs_input_grad[0]:
            # the rows' gradients at once, then one index_add: one call over every row ran 2-3x
            # faster than one per chunk (2 threads; a transient of the backward, not kept)
            gxs = g.new_empty(g.shape[0], x.shape[1])
            products(ctx.blocks, g, weight, gxs, True)
            for lo, hi in ctx.gaps:
                gxs[lo:hi] = 0
            for b, p in zip(ctx.blocks, ctx.pads, strict=True):
                if p is not None:  # a padding row is a zero, not a row of x: no gradient flows back
                    gxs[b.offset : b.offset + b.rows].index_fill_(0, p.to(gxs.device), 0)
            gx = torch.zeros_like(x).index_add_(0, ctx.index, gxs)
        return gx, gw, None, None, None, None


def gather_block_matmul(
    x: torch.Tensor,
    index: torch.Tensor,
    weight: torch.Tensor,
    blocks: Sequence[Block],
    pad_rows: torch.Tensor | None = None,
    chunk_bytes: int | None = None,
) -> torch.Tensor:
    """``block_matmul(x.index_select(0, index), weight, blocks)`` (rows ``pad_rows`` of the gathered
    matrix taken as zeros) without holding the gathered matrix: it is gathered and multiplied one
    chunk of at most ``chunk_bytes`` (default :data:`GATHER_CHUNK_BYTES`) at a time (:func:`chunk_blocks`), and the backward gathers each
    chunk again for the weight gradient and adds each chunk's input gradient into ``x``'s. Only
    ``x`` (which the caller usually holds anyway) is saved; the result has ``index.numel()`` rows.
    Autograd for ``x`` and ``weight``."""
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"need x (N, fi) and weight (R, fi, fo), got {tuple(x.shape)} and {tuple(weight.shape)}")
    chunk_bytes = GATHER_CHUNK_BYTES if chunk_bytes is None else chunk_bytes
    max_rows = max(1, chunk_bytes // max(1, x.shape[1] * x.element_size()))
    chunks = chunk_blocks(blocks, max_rows)
    index = index.to(x.device)
    pads = _pads_by_block(chunks, None if pad_rows is None else pad_rows.to(index.device))
    return GatherBlockMatmulFn.apply(x.contiguous(), weight.contiguous(), index, chunks, pads, int(index.numel()))
