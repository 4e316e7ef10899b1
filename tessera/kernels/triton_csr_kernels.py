"""The Triton kernels of the CSR backend (:mod:`tessera.backends.triton_csr`): the row-item SpMM,
the combination of a hub's pieces and the per-entry dot products. Imported on the backend's first
product, so that a process that never runs one never loads Triton (about 70 MB resident)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TL_DTYPE = {torch.float32: tl.float32, torch.float64: tl.float64}


# Loads and stores are written out in each kernel rather than called as @triton.jit helpers: the
# interpreter re-patches triton.language on every nested call, which made the kernels several
# times slower there. A bfloat16 value's bits b widen exactly to the float32 with bits b << 16;
# a float32 with bits u rounds to (u + 0x7FFF + ((u >> 16) & 1)) >> 16 (ties to even; NaN 0x7FC0).
@triton.jit
def spmm_kernel(
    indices,
    weight,
    wperm,
    x,
    out,
    part,
    item_row,
    item_lo,
    item_hi,
    item_slot,
    n_items,
    width,
    heads,
    nfb,
    HAS_W: tl.constexpr,
    HAS_PERM: tl.constexpr,
    W_PER_HEAD: tl.constexpr,
    HAS_PIECES: tl.constexpr,
    BF16: tl.constexpr,
    ACC: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    # out[row, h, f] = sum_e w[e(, h)] * x[indices[e], h, f] over each item's entries lo:hi
    it = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    imask = it < n_items
    h = tl.program_id(1) // nfb
    cols = (tl.program_id(1) % nfb) * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = cols < width
    row = tl.load(item_row + it, mask=imask, other=0).to(tl.int64)
    lo = tl.load(item_lo + it, mask=imask, other=0).to(tl.int64)
    hi = tl.load(item_hi + it, mask=imask, other=0).to(tl.int64)
    stride = width * heads
    xh = x + h * width + cols[None, None, :]
    acc = tl.zeros([ROWS, BLOCK_E, BLOCK_F], dtype=ACC)
    # items are sorted by entry count, largest first: the program's first item is its longest
    first = tl.program_id(0) * ROWS
    steps = tl.load(item_hi + first).to(tl.int64) - tl.load(item_lo + first).to(tl.int64)
    for k in range(0, steps, BLOCK_E):
        e = lo[:, None] + k + tl.arange(0, BLOCK_E)[None, :]
        emask = e < hi[:, None]
        j = tl.load(indices + e, mask=emask, other=0).to(tl.int64)
        m = emask[:, :, None] & fmask[None, None, :]
        if BF16:
            bits = tl.load(xh + j[:, :, None] * stride, mask=m, other=0)
            xv = ((bits.to(tl.uint32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            xv = tl.load(xh + j[:, :, None] * stride, mask=m, other=0.0).to(ACC)
        if HAS_W:
            if HAS_PERM:
                we = tl.load(wperm + e, mask=emask, other=0).to(tl.int64)
            else:
                we = e
            if W_PER_HEAD:
                wv = tl.load(weight + we * heads + h, mask=emask, other=0.0)
            else:
                wv = tl.load(weight + we, mask=emask, other=0.0)
            xv = xv * wv[:, :, None]
        acc += xv
    total = tl.sum(acc, axis=1)
    if HAS_PIECES:
        slot = tl.load(item_slot + it, mask=imask, other=-1).to(tl.int64)
        whole = imask & (slot < 0)
        piece = (imask & (slot >= 0))[:, None] & fmask[None, :]
        tl.store(part + slot[:, None] * stride + h * width + cols[None, :], total, mask=piece)
    else:
        whole = imask
    dst = out + row[:, None] * stride + h * width + cols[None, :]
    if BF16:
        u = total.to(tl.uint32, bitcast=True)
        b = tl.where(total != total, 0x7FC0, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
        tl.store(dst, b.to(tl.int16), mask=whole[:, None] & fmask[None, :])
    else:
        tl.store(dst, total, mask=whole[:, None] & fmask[None, :])


@triton.jit
def combine_kernel(part, out, hub_rows, hub_ptr, width, heads, nfb, BF16: tl.constexpr, BLOCK_F: tl.constexpr):
    # out[hub row] = its pieces' partial sums, added in piece order
    r = tl.program_id(0)
    h = tl.program_id(1) // nfb
    cols = (tl.program_id(1) % nfb) * BLOCK_F + tl.arange(0, BLOCK_F)
    fmask = cols < width
    row = tl.load(hub_rows + r).to(tl.int64)
    s0 = tl.load(hub_ptr + r).to(tl.int64)
    s1 = tl.load(hub_ptr + r + 1).to(tl.int64)
    stride = width * heads
    src = part + h * width + cols
    acc = tl.load(src + s0 * stride, mask=fmask, other=0.0)
    for s in range(s0 + 1, s1):
        acc += tl.load(src + s * stride, mask=fmask, other=0.0)
    dst = out + row * stride + h * width + cols
    if BF16:
        u = acc.to(tl.uint32, bitcast=True)
        b = tl.where(acc != acc, 0x7FC0, (u + 0x7FFF + ((u >> 16) & 1)) >> 16)
        tl.store(dst, b.to(tl.int16), mask=fmask)
    else:
        tl.store(dst, acc, mask=fmask)


@triton.jit
def sddmm_kernel(
    indices,
    dst,
    g,
    x,
    out,
    num_edges,
    width,
    heads,
    BF16: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_F: tl.constexpr,
):
    # out[e, h] = <g[dst[e], h, :], x[indices[e], h, :]>
    e = tl.program_id(0).to(tl.int64) * BLOCK_E + tl.arange(0, BLOCK_E)
    h = tl.program_id(1)
    emask = e < num_edges
    stride = width * heads
    gi = g + tl.load(dst + e, mask=emask, other=0).to(tl.int64)[:, None] * stride + h * width
    xj = x + tl.load(indices + e, mask=emask, other=0).to(tl.int64)[:, None] * stride + h * width
    acc = tl.zeros([BLOCK_E, BLOCK_F], dtype=ACC)
    for f0 in range(0, width, BLOCK_F):
        cols = f0 + tl.arange(0, BLOCK_F)[None, :]
        m = emask[:, None] & (cols < width)
        if BF16:
            gv = ((tl.load(gi + cols, mask=m, other=0).to(tl.uint32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
            xv = ((tl.load(xj + cols, mask=m, other=0).to(tl.uint32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            gv = tl.load(gi + cols, mask=m, other=0.0)
            xv = tl.load(xj + cols, mask=m, other=0.0)
        acc += gv * xv
    tl.store(out + e * heads + h, tl.sum(acc, axis=1), mask=emask)
