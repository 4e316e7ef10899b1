"""The hashed dropout of :mod:`tessera.kernels.dropout` as a Triton kernel: the same keep mask, bit
for bit, for the same seed, ``p``, ``rows`` and width, from the same 32-bit integer arithmetic
(lowbias32 of ``(index * 0x9E3779B9 + key) mod 2**32`` against :func:`keep_threshold`, the key
mixing the seed with the index's high 32 bits as :func:`~tessera.kernels.dropout.block_key` does).

:func:`triton_hashed` has :func:`~tessera.kernels.dropout.run_hashed`'s meaning and modes. DROP,
DROP_IN_PLACE, _MASK, _RELU_DROP and _RELU_DROP_GRAD give the numba kernel's outputs bit for bit
(one multiplication by the same float32 or float64 ``scale``, bfloat16 rounded once, to nearest
even, in integer arithmetic). The ELU modes compute ``expm1`` in float64 (Kahan's
``(u - 1) * x / log(u)``) and round once: the correctly rounded float32 but for rare ties, as the
numba kernel's; they are not promised bit for bit. CUDA tensors run compiled; CPU tensors run in
Triton's interpreter (``TRITON_INTERPRET=1``), as the suite tests them.
"""

from __future__ import annotations

import os

import numpy as np
import torch
import triton
import triton.language as tl

from tessera.kernels.dropout import (
    _ELU_DROP,
    _ELU_DROP_GRAD,
    _MASK,
    _RELU_DROP,
    _RELU_DROP_GRAD,
    DROP,
    DROP_IN_PLACE,
    keep_threshold,
)

_BLOCK_GPU = 1024
_BLOCK_INTERPRETED = 1 << 16  # the interpreter's cost is per operation, whatever the block


# the modes as compile-time constants the kernel branches on
_K_DROP_IN_PLACE = tl.constexpr(DROP_IN_PLACE)
_K_MASK = tl.constexpr(_MASK)
_K_RELU_DROP = tl.constexpr(_RELU_DROP)
_K_ELU_DROP = tl.constexpr(_ELU_DROP)
_K_RELU_DROP_GRAD = tl.constexpr(_RELU_DROP_GRAD)
_K_ELU_DROP_GRAD = tl.constexpr(_ELU_DROP_GRAD)


@triton.jit
def _lowbias32(v):
    # lowbias32 (C. Wellons) on uint32 lanes, wrapping modulo 2**32 as tessera.kernels.hashing's
    v ^= v >> 16
    v *= 0x7FEB352D
    v ^= v >> 15
    v *= 0x846CA68B
    v ^= v >> 16
    return v


@triton.jit
def _hashed_kernel(
    src,
    aux,
    out,
    rows,
    params,
    scale_ptr,
    n,
    width,
    MODE: tl.constexpr,
    HAS_ROWS: tl.constexpr,
    BF16: tl.constexpr,
    ACC: tl.constexpr,
    BLOCK: tl.constexpr,
):
    c = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = c < n
    if HAS_ROWS:
        r = c // width
        g = tl.load(rows + r, mask=m, other=0).to(tl.int64) * width + (c - r * width)
    else:
        g = c
    seed_lo = tl.load(params).to(tl.uint32)
    seed_hi = tl.load(params + 1)
    threshold = tl.load(params + 2).to(tl.uint32)
    key = _lowbias32((seed_hi ^ (g >> 32)).to(tl.uint32)) ^ seed_lo
    kept = _lowbias32(g.to(tl.uint32) * 0x9E3779B9 + key) >= threshold
    if MODE == _K_MASK:
        tl.store(out + c, kept.to(tl.uint8), mask=m)
    else:
        scale = tl.load(scale_ptr)
        if MODE == _K_DROP_IN_PLACE:
            a_ptr = out
        else:
            a_ptr = src
        if BF16:
            a = ((tl.load(a_ptr + c, mask=m, other=0).to(tl.uint32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
        else:
            a = tl.load(a_ptr + c, mask=m, other=0.0)
        if MODE == _K_RELU_DROP_GRAD or MODE == _K_ELU_DROP_GRAD:  # these read the saved output y
            if BF16:
                y = ((tl.load(aux + c, mask=m, other=0).to(tl.uint32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)
            else:
                y = tl.load(aux + c, mask=m, other=0.0)
        zero = tl.zeros([BLOCK], dtype=ACC)
        if MODE == _K_RELU_DROP:
            v = tl.where(kept, tl.maximum(a, zero) * scale, zero)
        elif MODE == _K_ELU_DROP:
            d = a.to(tl.float64)
            u = tl.exp(d)
            safe = tl.where((u == 1.0) | (u == 0.0), 0.5, u)  # the lanes the other cases take
            em1 = tl.where(u == 1.0, d, tl.where(u - 1.0 == -1.0, -1.0, (u - 1.0) * d / tl.log(safe)))
            v = tl.where(kept, tl.where(a > zero, a, em1.to(ACC)) * scale, zero)
        elif MODE == _K_RELU_DROP_GRAD:  # y is zero where dropped: no hash needed
            v = tl.where(y > zero, a * scale, zero)
        elif MODE == _K_ELU_DROP_GRAD:
            v = tl.where(kept, a * tl.where(y > zero, scale, y + scale), zero)
        else:  # DROP, DROP_IN_PLACE
            v = tl.where(kept, a * scale, zero)
        if BF16:
            u32 = v.to(tl.uint32, bitcast=True)
            b = tl.where(v != v, 0x7FC0, (u32 + 0x7FFF + ((u32 >> 16) & 1)) >> 16)
            tl.store(out + c, b.to(tl.int16), mask=m)
        else:
            tl.store(out + c, v, mask=m)


_MODES = (DROP, _MASK, _RELU_DROP, _ELU_DROP, _RELU_DROP_GRAD, _ELU_DROP_GRAD, DROP_IN_PLACE)
_DTYPES = {torch.float32: tl.float32, torch.float64: tl.float64, torch.bfloat16: tl.float32}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def triton_hashed(
    src: torch.Tensor,
    out: torch.Tensor,
    seed: int,
    p: float,
    rows: torch.Tensor | None,
    mode: int,
    aux: torch.Tensor | None = None,
) -> None:
    """Fill ``out`` (``src``'s shape; bool for ``_MASK``) by ``mode`` for drop probability ``p`` < 1,
    as :func:`~tessera.kernels.dropout.run_hashed` does, on ``out``'s device."""
    threshold = keep_threshold(p)
    if threshold is None:
        raise ValueError(f"p = {p} drops every element: no hash decides")
    if mode not in _MODES:
        raise ValueError(f"unknown dropout mode {mode}")
    if not out.is_contiguous() or (mode != _MASK and not src.is_contiguous()):
        raise ValueError("the Triton dropout kernel needs contiguous tensors")
    width = 1
    if rows is not None:
        if rows.numel() != out.shape[0]:
            raise ValueError(f"rows has {rows.numel()} ids for {out.shape[0]} rows")
        width = max(1, out[0].numel()) if out.shape[0] else 1
    n = out.numel()
    if n == 0:
        return
    masking = mode == _MASK
    dtype = src.dtype if masking else out.dtype
    acc = _DTYPES.get(dtype, tl.float32)
    device = out.device
    params = torch.tensor([seed & 0xFFFFFFFF, seed >> 32, int(threshold)], dtype=torch.int64, device=device)
    scale = 1.0 / (1.0 - p)
    scale_t = torch.tensor(
        [np.float64(scale) if acc == tl.float64 else np.float32(scale)],
        dtype=torch.float64 if acc == tl.float64 else torch.float32,
        device=device,
    )
    flat_out = out.view(torch.uint8) if masking else _bits(out)
    flat_src = flat_out if masking or mode == DROP_IN_PLACE else _bits(src)
    block = _BLOCK_INTERPRETED if os.environ.get("TRITON_INTERPRET") == "1" else _BLOCK_GPU
    block = min(block, max(16, triton.next_power_of_2(n)))
    _hashed_kernel[(triton.cdiv(n, block),)](
        flat_src,
        flat_src if aux is None else _bits(aux.contiguous()),
        flat_out,
        flat_out if rows is None else rows.to(device=device, dtype=torch.int64).contiguous(),
        params,
        scale_t,
        n,
        width,
        MODE=mode,
        HAS_ROWS=rows is not None,
        BF16=dtype == torch.bfloat16,
        ACC=acc,
        BLOCK=block,
    )
