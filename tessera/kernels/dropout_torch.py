"""The hashed dropout of :mod:`tessera.kernels.dropout` in torch integer ops, for any device.

The mask is defined here once: the modes, the block of global indices that shares one hash key,
and the keep threshold; the numba kernel in :mod:`tessera.kernels.dropout` is its fast CPU form.
The hash (lowbias32) runs on int64 tensors holding 32-bit values, each product split so that no
int64 overflows, so CPU and CUDA tensors draw bitwise the masks the numba kernel draws. Tensors
are processed in chunks of about a million elements, so no int64 temporary spans a large tensor.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

_BLOCK = 1 << 14  # global indices [k * _BLOCK, (k + 1) * _BLOCK) share one hash key
ELEMENT_MUL = 0x9E3779B9  # an element's hash is lowbias32(index * ELEMENT_MUL + key) mod 2**32

# What the kernel writes per element, given its input a, the saved forward output y (backward
# only) and whether its hash keeps it.
DROP = 0  # a * scale if kept else 0
_MASK = 1  # the keep flag itself
_RELU_DROP = 2  # relu(a) * scale if kept else 0
_ELU_DROP = 3  # elu(a) * scale if kept else 0
_RELU_DROP_GRAD = 4  # a * scale where y > 0, else 0: y is zero where dropped, so no hash needed
_ELU_DROP_GRAD = 5  # kept: a * scale where y > 0, else a * (y + scale), as elu'(x) = elu(x) + 1 there
DROP_IN_PLACE = 6  # out itself * scale if kept else 0 (DROP with src = out, which would not vectorise)

_M32 = 0xFFFFFFFF
_CHUNK = 1 << 20  # elements per chunk of the torch implementation
_LN2 = 0.6931471805599453
# 1/n! for n = 2..11, the Taylor coefficients tessera.kernels.vector_math.expm1_f32 uses
_TAYLOR = tuple(1.0 / float(np.prod(np.arange(1, n + 1, dtype=np.float64))) for n in range(2, 12))


def keep_threshold(p: float) -> np.uint32 | None:
    """An element is kept when its 32-bit hash is at least this; None when ``p`` rounds to dropping all."""
    t = int(round(p * 2**32))
    return None if t >= 2**32 else np.uint32(t)


def hashed_width(out: torch.Tensor, rows: torch.Tensor | None, mode: int) -> int:
    """The row width the hashed kernels index ``out`` by (``_BLOCK`` without ``rows``), after checking the arguments."""
    if mode == DROP_IN_PLACE and not out.is_contiguous():
        raise ValueError("dropout in place needs a contiguous tensor")
    if rows is None:
        return _BLOCK
    if rows.numel() != out.shape[0]:
        raise ValueError(f"rows has {rows.numel()} ids for {out.shape[0]} rows")
    return max(1, out[0].numel()) if out.shape[0] else 1


def _lowbias32_int(v: int) -> int:
    """lowbias32 of the low 32 bits of ``v``, on a Python int."""
    v &= _M32
    v ^= v >> 16
    v = (v * 0x7FEB352D) & _M32
    v ^= v >> 15
    v = (v * 0x846CA68B) & _M32
    return v ^ (v >> 16)


def _mul32(v: torch.Tensor, m: int) -> torch.Tensor:
    """``v * m`` modulo 2**32 for int64 ``v`` in [0, 2**32), by 16-bit halves of ``m`` (no int64 overflow)."""
    return (v * (m & 0xFFFF) + (((v * (m >> 16)) & 0xFFFF) << 16)) & _M32


def _lowbias32(v: torch.Tensor) -> torch.Tensor:
    """lowbias32 of int64 ``v`` in [0, 2**32), elementwise."""
    v = v ^ (v >> 16)
    v = _mul32(v, 0x7FEB352D)
    v ^= v >> 15
    v = _mul32(v, 0x846CA68B)
    return v ^ (v >> 16)


def _block_key(hi, seed: int):
    """The hash key of the blocks whose global indices have ``hi`` as their bits above 32 (an int
    or an int64 tensor): :func:`tessera.kernels.dropout.block_key`."""
    seed_lo, seed_hi = seed & _M32, (seed >> 32) & _M32
    return (_lowbias32_int if isinstance(hi, int) else _lowbias32)(hi ^ seed_hi) ^ seed_lo


def _kept(g: torch.Tensor, key, threshold: int) -> torch.Tensor:
    """Whether the elements of global indices ``g`` are kept, their blocks' hash keys ``key``."""
    return _lowbias32((_mul32(g & _M32, ELEMENT_MUL) + key) & _M32) >= threshold


def keep_flags(index: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    """Whether each global element index (int64, any device) is kept for drop probability ``p``:
    :func:`tessera.kernels.dropout.element_kept` elementwise."""
    threshold = keep_threshold(p)
    if threshold is None:
        return torch.zeros(index.shape, dtype=torch.bool, device=index.device)
    return _kept(index, _block_key(index >> 32, seed), int(threshold))


def _expm1_f32(x: torch.Tensor) -> torch.Tensor:
    """``expm1`` of float32 ``x`` as :func:`tessera.kernels.vector_math.expm1_f32` evaluates it
    (float64 Taylor form rounded once), in IEEE float64 ops that every device rounds alike."""
    v = x.to(torch.float64).clamp_(-40.0, 88.0)
    k = torch.floor(v * (1.0 / _LN2) + 0.5)
    r = v - k * _LN2
    p = torch.full_like(r, _TAYLOR[-1])
    for c in reversed(_TAYLOR[:-1]):
        p = p * r + c
    e = r + r * r * p
    s = ((k.to(torch.int64) + 1023) << 52).view(torch.float64)  # 2**k, exact
    return (s * e + (s - 1.0)).to(torch.float32)


def _chunks(n: int, width: int, rows: torch.Tensor | None) -> Iterator[tuple[int, int, torch.Tensor | None, int, int]]:
    """(first element, element count, global ids of the rows it spans, first column, columns):
    row-major pieces of about ``_CHUNK`` elements of a flat tensor of ``n`` elements."""
    if rows is None:  # the global index is the flat index: one row of n elements
        for c0 in range(0, n, _CHUNK):
            yield c0, min(_CHUNK, n - c0), None, c0, min(_CHUNK, n - c0)
    elif width >= _CHUNK:  # a row at a time, in pieces of columns
        for r in range(rows.numel()):
            for c0 in range(0, width, _CHUNK):
                cols = min(_CHUNK, width - c0)
                yield r * width + c0, cols, rows[r : r + 1], c0, cols
    else:
        per = _CHUNK // width
        for r0 in range(0, rows.numel(), per):
            ids = rows[r0 : r0 + per]
            yield r0 * width, ids.numel() * width, ids, 0, width


def _chunk_kept(
    row_ids: torch.Tensor | None, width: int, c0: int, cols: int, seed: int, threshold: int, device: torch.device
) -> torch.Tensor:
    """The keep flags of one piece of :func:`_chunks` (flat, row-major)."""
    col = torch.arange(c0, c0 + cols, dtype=torch.int64, device=device)
    if row_ids is None:  # global index = flat index; one key unless the piece crosses 2**32
        hi = c0 >> 32
        key = _block_key(hi, seed) if hi == (c0 + cols - 1) >> 32 else _block_key(col >> 32, seed)
        return _kept(col, key, threshold)
    # A row's indices span at most two values of g >> 32 (width < 2**32): the keys of its first
    # and last element, chosen per element, hash once per row rather than once per element.
    g0 = row_ids[:, None] * width
    hi0 = g0 >> 32
    g = g0 + col
    key = torch.where((g >> 32) == hi0, _block_key(hi0, seed), _block_key((g0 + (width - 1)) >> 32, seed))
    return _kept(g, key, threshold).reshape(-1)


def run_hashed_torch(
    src: torch.Tensor, out: torch.Tensor, seed: int, p: float, rows: torch.Tensor | None, mode: int,
    aux: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """:func:`tessera.kernels.dropout.run_hashed` in torch ops on ``out``'s device: the same masks, bitwise."""
    width = hashed_width(out, rows, mode)
    flat_out = out.view(-1)
    flat_src = flat_out if mode in (_MASK, DROP_IN_PLACE) else src.reshape(-1)
    flat_aux = flat_out if aux is None else aux.reshape(-1)
    t = keep_threshold(p)
    threshold = 2**32 if t is None else int(t)
    compute = torch.float64 if out.dtype == torch.float64 else torch.float32
    scale = 1.0 / (1.0 - p)
    if compute == torch.float32:
        scale = float(np.float32(scale))  # the kernel multiplies by float32(scale)
    ids = None if rows is None else rows.to(out.device, torch.int64)
    for e0, count, row_ids, c0, cols in _chunks(flat_out.numel(), width, ids):
        o = flat_out[e0 : e0 + count]
        if mode == _RELU_DROP_GRAD:  # y is zero where dropped: no hash
            a, y = flat_src[e0 : e0 + count].to(compute), flat_aux[e0 : e0 + count].to(compute)
            o.copy_(torch.where(y > 0, a * scale, 0.0))
            continue
        kept = _chunk_kept(row_ids, width, c0, cols, seed, threshold, out.device)
        if mode == _MASK:
            o.copy_(kept)
            continue
        a = flat_src[e0 : e0 + count].to(compute)
        if mode in (DROP, DROP_IN_PLACE):
            v = a * scale
        elif mode == _RELU_DROP:
            v = torch.where(a < 0, 0.0, a) * scale  # max(a, 0) as the kernel takes it: -0.0 and NaN pass
        elif mode == _ELU_DROP:
            v = torch.where(a > 0, a, _expm1_f32(a) if compute == torch.float32 else torch.expm1(a)) * scale
        elif mode == _ELU_DROP_GRAD:
            y = flat_aux[e0 : e0 + count].to(compute)
            v = a * torch.where(y > 0, scale, y + scale)
        else:
            raise ValueError(f"unknown hashed mode {mode}")
        o.copy_(torch.where(kept, v, 0.0))
