"""Fused GAT attention as Triton kernels: per destination row ``i`` and head,
``out[i] = sum_e alpha_e * x[j]`` with ``alpha = softmax over the row's entries of
leaky_relu(a_src[j] + a_dst[i])``, the row's maximum subtracted before ``exp`` (the semantics of
:func:`tessera.sparse.gat_attention` followed by a weighted sum), without an ``(E, H)`` array of
weights in the forward.

Forward: the rows are split into items as the CSR products split them
(:func:`~tessera.backends.triton_csr.row_items`); a program takes ``ROWS`` items, one head and one
block of features, and makes two passes over the items' entries: the scores' maximum, then the
exponentials, their sum and the weighted sum of the source rows. A hub's pieces each write their
maximum, sum and partial row; a second kernel rescales them to the row's maximum and adds them in
piece order. The row's maximum and sum are kept for backward, and the output in float32 for
bfloat16 features (rounded to bfloat16 once, for the caller).

Backward: one entry-parallel kernel recomputes ``alpha`` from the kept maximum and sum and writes
the pre-activation score gradient ``alpha * (<g_i, x_j> - <g_i, out_i>) * leaky_relu'``; the
feature gradient ``A_alpha^T g`` and the sums of the score gradient over rows (``a_dst``) and
columns (``a_src``) run on the Triton backend's products, in a fixed order (no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from tessera.backends.base import get_backend
from tessera.backends.triton_csr import TritonBackend, bits, on_device
from tessera.bfloat16 import compute_dtype
from tessera.graph.csr import CSRStructure
from tessera.kernels.triton_csr_kernels import TL_DTYPE


@triton.jit
def _forward_kernel(
    indices,
    a_src,
    a_dst,
    x,
    out,
    rowmax,
    rowsum,
    part,
    part_m,
    part_l,
    item_row,
    item_lo,
    item_hi,
    item_slot,
    n_items,
    width,
    heads,
    nfb,
    slope_ptr,
    BF16: tl.constexpr,
    ACC: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    it = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    imask = it < n_items
    h = tl.program_id(1) // nfb
    fb = tl.program_id(1) % nfb
    cols = fb * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = cols < width
    row = tl.load(item_row + it, mask=imask, other=0).to(tl.int64)
    lo = tl.load(item_lo + it, mask=imask, other=0).to(tl.int64)
    hi = tl.load(item_hi + it, mask=imask, other=0).to(tl.int64)
    slot = tl.load(item_slot + it, mask=imask, other=-1).to(tl.int64)
    ad = tl.load(a_dst + row * heads + h, mask=imask, other=0.0)
    slope = tl.load(slope_ptr)
    # items are sorted by entry count, largest first: the program's first item is its longest
    first = tl.program_id(0) * ROWS
    steps = tl.load(item_hi + first).to(tl.int64) - tl.load(item_lo + first).to(tl.int64)
    # pass 1: the maximum score of each item
    mx = tl.full([ROWS], float("-inf"), dtype=ACC)
    for k in range(0, steps, BLOCK_E):
        e = lo[:, None] + k + tl.arange(0, BLOCK_E)[None, :]
        emask = e < hi[:, None]
        j = tl.load(indices + e, mask=emask, other=0).to(tl.int64)
        s = tl.load(a_src + j * heads + h, mask=emask, other=0.0) + ad[:, None]
        s = tl.where(s > 0, s, s * slope)
        mx = tl.maximum(mx, tl.max(tl.where(emask, s, float("-inf")), axis=1))
    # pass 2: exponentials, their sum and the weighted sum of the source rows
    stride = width * heads
    xh = x + h * width + cols[None, None, :]
    total = tl.zeros([ROWS], dtype=ACC)
    acc = tl.zeros([ROWS, BLOCK_E, BLOCK_F], dtype=ACC)
    for k in range(0, steps, BLOCK_E):
        e = lo[:, None] + k + tl.arange(0, BLOCK_E)[None, :]
        emask = e < hi[:, None]
        j = tl.load(indices + e, mask=emask, other=0).to(tl.int64)
        s = tl.load(a_src + j * heads + h, mask=emask, other=0.0) + ad[:, None]
        s = tl.where(s > 0, s, s * slope)
        p = tl.where(emask, tl.exp(s - mx[:, None]), 0.0)
        total += tl.sum(p, axis=1)
        m = emask[:, :, None] & fmask[None, None, :]
        if BF16:
            xb = tl.load(xh + j[:, :, None] * stride, mask=m, other=0)
            xv = ((xb.to(tl.uint32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            xv = tl.load(xh + j[:, :, None] * stride, mask=m, other=0.0)
        acc += p[:, :, None] * xv
    summed = tl.sum(acc, axis=1)
    whole = imask & (slot < 0)
    piece = imask & (slot >= 0)
    safe = tl.where(total > 0, total, 1.0)  # an empty row's output is 0
    tl.store(
        out + row[:, None] * stride + h * width + cols[None, :],
        summed / safe[:, None],
        mask=whole[:, None] & fmask[None, :],
    )
    tl.store(part + slot[:, None] * stride + h * width + cols[None, :], summed, mask=piece[:, None] & fmask[None, :])
    if fb == 0:
        tl.store(rowmax + row * heads + h, mx, mask=whole)
        tl.store(rowsum + row * heads + h, total, mask=whole)
        tl.store(part_m + slot * heads + h, mx, mask=piece)
        tl.store(part_l + slot * heads + h, total, mask=piece)


@triton.jit
def _combine_kernel(
    part, part_m, part_l, out, rowmax, rowsum, hub_rows, hub_ptr, width, heads, nfb, BLOCK_F: tl.constexpr
):
    # a hub row's pieces rescaled to the row's maximum and added in piece order
    r = tl.program_id(0)
    h = tl.program_id(1) // nfb
    fb = tl.program_id(1) % nfb
    cols = fb * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = cols < width
    row = tl.load(hub_rows + r).to(tl.int64)
    s0 = tl.load(hub_ptr + r).to(tl.int64)
    s1 = tl.load(hub_ptr + r + 1).to(tl.int64)
    stride = width * heads
    mx = tl.load(part_m + s0 * heads + h)
    for s in range(s0 + 1, s1):
        mx = tl.maximum(mx, tl.load(part_m + s * heads + h))
    c = tl.exp(tl.load(part_m + s0 * heads + h) - mx)
    total = tl.load(part_l + s0 * heads + h) * c
    acc = tl.load(part + s0 * stride + h * width + cols, mask=fmask, other=0.0) * c
    for s in range(s0 + 1, s1):
        c = tl.exp(tl.load(part_m + s * heads + h) - mx)
        total += tl.load(part_l + s * heads + h) * c
        acc += tl.load(part + s * stride + h * width + cols, mask=fmask, other=0.0) * c
    tl.store(out + row * stride + h * width + cols, acc / total, mask=fmask)
    if fb == 0:
        tl.store(rowmax + row * heads + h, mx)
        tl.store(rowsum + row * heads + h, total)


@triton.jit
def _edge_grad_kernel(
    indices,
    dst,
    a_src,
    a_dst,
    x,
    g,
    d,
    rowmax,
    rowsum,
    alpha,
    dpre,
    num_edges,
    width,
    heads,
    slope_ptr,
    BF16: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    # per entry e = (j -> i) and head: alpha, and the gradient of its pre-activation score
    e = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    h = tl.program_id(1)
    emask = e < num_edges
    i = tl.load(dst + e, mask=emask, other=0).to(tl.int64)
    j = tl.load(indices + e, mask=emask, other=0).to(tl.int64)
    slope = tl.load(slope_ptr)
    pre = tl.load(a_src + j * heads + h, mask=emask, other=0.0) + tl.load(a_dst + i * heads + h, mask=emask, other=0.0)
    s = tl.where(pre > 0, pre, pre * slope)
    mx = tl.load(rowmax + i * heads + h, mask=emask, other=0.0)
    total = tl.load(rowsum + i * heads + h, mask=emask, other=1.0)
    a = tl.exp(s - mx) / total
    stride = width * heads
    gi = g + i[:, None] * stride + h * width
    xj = x + j[:, None] * stride + h * width
    dot = tl.zeros([BLOCK_E, BLOCK_F], dtype=ACC)
    for f0 in range(0, width, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)[None, :]
        m = emask[:, None] & (cols < width)
        if BF16:
            gv = ((tl.load(gi + cols, mask=m, other=0).to(tl.uint32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
            xv = ((tl.load(xj + cols, mask=m, other=0).to(tl.uint32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            gv = tl.load(gi + cols, mask=m, other=0.0)
            xv = tl.load(xj + cols, mask=m, other=0.0)
        dot += gv * xv
    ga = tl.sum(dot, axis=1)
    dd = a * (ga - tl.load(d + i * heads + h, mask=emask, other=0.0))
    tl.store(alpha + e * heads + h, a, mask=emask)
    tl.store(dpre + e * heads + h, tl.where(pre > 0, dd, dd * slope), mask=emask)


def _slope(negative_slope: float, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # a tensor, not a scalar argument: Triton passes Python floats as float32
    return torch.tensor([negative_slope], dtype=dtype, device=device)


def _backend() -> TritonBackend:
    b = get_backend("triton")
    assert isinstance(b, TritonBackend)
    return b


def attend_forward(
    graph: CSRStructure, a_src: torch.Tensor, a_dst: torch.Tensor, x: torch.Tensor, negative_slope: float = 0.2
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(out, rowmax, rowsum)``: the attention-weighted sums ``(num_rows, H, F)`` in the arithmetic
    dtype (float32 for bfloat16 ``x``) and each row's score maximum and exponential sum ``(num_rows, H)``."""
    backend = _backend()
    acc = compute_dtype(x.dtype)
    x = x.detach().contiguous()
    a_src, a_dst = (a.detach().to(acc).contiguous() for a in (a_src, a_dst))
    rows, heads, width = graph.num_rows, x.shape[1], x.shape[2]
    dev = x.device
    out = torch.zeros((rows, heads, width), dtype=acc, device=dev)
    rowmax = torch.full((rows, heads), float("-inf"), dtype=acc, device=dev)
    rowsum = torch.zeros((rows, heads), dtype=acc, device=dev)
    if rows == 0 or heads == 0 or width == 0 or graph.num_edges == 0:
        return out, rowmax, rowsum
    m = on_device(graph, dev)
    items = backend.items(graph, m.indptr, False)
    slots = max(1, items.slots)
    part = torch.empty((slots, heads * width), dtype=acc, device=dev)
    part_m = torch.empty((slots, heads), dtype=acc, device=dev)
    part_l = torch.empty((slots, heads), dtype=acc, device=dev)
    tile = backend.tile_for()
    bf, nr = tile.block_f(width), tile.rows(width, items.row.numel())
    nfb = triton.cdiv(width, bf)
    _forward_kernel[(triton.cdiv(items.row.numel(), nr), heads * nfb)](
        m.indices, a_src, a_dst, bits(x), out, rowmax, rowsum, part, part_m, part_l,
        items.row, items.lo, items.hi, items.slot, items.row.numel(), width, heads, nfb, _slope(negative_slope, acc, dev),
        BF16=x.dtype == torch.bfloat16, ACC=TL_DTYPE[acc], ROWS=nr, BLOCK_E=tile.block_e, BLOCK_F=bf,
    )  # fmt: skip
    if items.hub_rows.numel():
        _combine_kernel[(items.hub_rows.numel(), heads * nfb)](
            part, part_m, part_l, out, rowmax, rowsum, items.hub_rows, items.hub_ptr, width, heads, nfb, BLOCK_F=bf
        )
    return out, rowmax, rowsum


def attend_backward(
    graph: CSRStructure,
    a_src: torch.Tensor,
    a_dst: torch.Tensor,
    x: torch.Tensor,
    out: torch.Tensor,
    rowmax: torch.Tensor,
    rowsum: torch.Tensor,
    g: torch.Tensor,
    negative_slope: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(grad a_src, grad a_dst, grad x)`` of :func:`attend_forward`'s ``out`` for its gradient ``g``."""
    backend = _backend()
    acc = compute_dtype(x.dtype)
    x = x.detach().contiguous()
    g = g.detach().to(x.dtype).contiguous()
    a_src, a_dst = (a.detach().to(acc).contiguous() for a in (a_src, a_dst))
    heads, width = x.shape[1], x.shape[2]
    edges = graph.num_edges
    alpha = torch.zeros((edges, heads), dtype=acc, device=x.device)
    dpre = torch.zeros((edges, heads), dtype=acc, device=x.device)
    if edges and heads:
        m = on_device(graph, x.device)
        d = (g.to(acc) * out).sum(-1).contiguous()  # <g_i, out_i> = sum over the row of alpha * <g_i, x_j>
        tile = backend.tile_for()
        bf, be = tile.block_f(width), tile.entries(width, edges)
        _edge_grad_kernel[(triton.cdiv(edges, be), heads)](
            m.indices, m.dst_index(), a_src, a_dst, bits(x), bits(g), d, rowmax, rowsum, alpha, dpre,
            edges, width, heads, _slope(negative_slope, acc, x.device),
            BF16=x.dtype == torch.bfloat16, ACC=TL_DTYPE[acc], BLOCK_E=be, BLOCK_F=bf,
        )  # fmt: skip
    gx = backend.spmm_t(graph, g, alpha)
    ones_src = torch.ones((graph.num_cols, heads, 1), dtype=acc, device=x.device)
    ones_dst = torch.ones((graph.num_rows, heads, 1), dtype=acc, device=x.device)
    g_dst = backend.spmm(graph, ones_src, dpre).squeeze(-1)
    g_src = backend.spmm_t(graph, ones_dst, dpre).squeeze(-1)
    return g_src, g_dst, gx


class _Attend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_src, a_dst, x, graph: CSRStructure, negative_slope: float):
        out, rowmax, rowsum = attend_forward(graph, a_src, a_dst, x, negative_slope)
        ctx.graph, ctx.slope = graph, negative_slope
        ctx.save_for_backward(a_src, a_dst, x, out, rowmax, rowsum)
        return out.to(x.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        a_src, a_dst, x, out, rowmax, rowsum = ctx.saved_tensors
        g_src, g_dst, gx = attend_backward(ctx.graph, a_src, a_dst, x, out, rowmax, rowsum, g, ctx.slope)
        need = ctx.needs_input_grad
        return (
            g_src.to(a_src.dtype) if need[0] else None,
            g_dst.to(a_dst.dtype) if need[1] else None,
            gx if need[2] else None,
            None,
            None,
        )


def triton_attend(
    graph: CSRStructure, a_src: torch.Tensor, a_dst: torch.Tensor, x: torch.Tensor, negative_slope: float = 0.2
) -> torch.Tensor:
    """``sum_e softmax_row(leaky_relu(a_src[j] + a_dst[i])) * x[j]`` per row ``i`` and head, with
    autograd for ``a_src`` ``(num_cols, H)``, ``a_dst`` ``(num_rows, H)`` and ``x`` ``(num_cols, H, F)``."""
    if x.dim() != 3 or a_src.shape != (graph.num_cols, x.shape[1]) or a_dst.shape != (graph.num_rows, x.shape[1]):
        raise ValueError(
            f"need a_src ({graph.num_cols}, H), a_dst ({graph.num_rows}, H) and x ({graph.num_cols}, H, F); "
            f"got {tuple(a_src.shape)}, {tuple(a_dst.shape)} and {tuple(x.shape)}"
        )
    return _Attend.apply(a_src, a_dst, x, graph, float(negative_slope))
