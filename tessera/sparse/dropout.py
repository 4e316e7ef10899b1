"""Dropout whose mask is a counter-based hash of (seed, element index).

torch 2.13's CPU dropout spends most of its time drawing Bernoulli samples (about 56 ms for
Cora's 2708 x 1433 input, more than a whole PyG epoch; measured in benchmarks/bench_small.py).
Hashing the element index instead is branch-free, vectorises with AVX-512, gives the same mask
for any thread count, and lets backward recompute the mask from the seed rather than store it.
The seed is drawn from torch's default generator, so ``torch.manual_seed`` governs it.
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from tessera.sparse.hashing import hash32, index_hash
from tessera.threads import sync_numba_threads

_BLOCK = 1 << 14


_element_hash = index_hash(0x9E3779B9)


@numba.njit(inline="always")
def block_key(seed_lo, seed_hi, start):
    """The hash key of the block starting at element ``start``: the high bits of the index are
    mixed in so tensors over 2**32 elements do not repeat their mask."""
    return np.uint32(hash32(np.uint64(seed_hi) ^ np.uint64(start >> 32)) ^ np.uint64(seed_lo))


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _masked_scale(src, out, seed_lo, seed_hi, threshold, scale):
    n = src.size
    nblocks = (n + _BLOCK - 1) // _BLOCK
    for b in numba.prange(nblocks):
        start = b * _BLOCK
        stop = min(n, start + _BLOCK)
        key = block_key(seed_lo, seed_hi, start)
        # Slices with a local index vectorise; indexing the whole array by the global index did
        # not (measured 3x slower on 169k x 256).
        a, o = src[start:stop], out[start:stop]
        for i in range(stop - start):
            o[i] = a[i] * scale if _element_hash(start + i, key) >= threshold else 0.0


def keep_threshold(p: float) -> np.uint32 | None:
    """An element is kept when its 32-bit hash is at least this; None when ``p`` rounds to dropping all."""
    t = int(round(p * 2**32))
    return None if t >= 2**32 else np.uint32(t)


def _apply(x: torch.Tensor, seed: int, p: float) -> torch.Tensor:
    sync_numba_threads()
    x = x.contiguous()
    threshold = keep_threshold(p)
    if threshold is None:
        return torch.zeros_like(x)
    out = torch.empty_like(x)
    scale = 1.0 / (1.0 - p)
    _masked_scale(
        x.view(-1).numpy(),
        out.view(-1).numpy(),
        np.uint64(seed & 0xFFFFFFFF),
        np.uint64(seed >> 32),
        threshold,
        np.float32(scale) if x.dtype == torch.float32 else np.float64(scale),
    )
    return out


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, seed):
        ctx.p, ctx.seed = p, seed
        return _apply(x, seed, p)

    @staticmethod
    def backward(ctx, g):
        return _apply(g, ctx.seed, ctx.p), None, None


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True) -> torch.Tensor:
    """Inverted dropout with drop probability ``p``; identity when not training or ``p == 0``."""
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        if p == 1.0:
            return x * 0.0
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.float64):
        return torch.nn.functional.dropout(x, p, training)
    seed = int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item())
    return _Dropout.apply(x, p, seed)


class _KeepMask(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, keep, scale):
        ctx.save_for_backward(keep)
        ctx.scale = scale
        return torch.where(keep, x * scale, 0.0)

    @staticmethod
    def backward(ctx, g):
        (keep,) = ctx.saved_tensors
        return torch.where(keep, g * ctx.scale, 0.0), None, None


def dropout_with_mask(x: torch.Tensor, keep: torch.Tensor, p: float) -> torch.Tensor:
    """Inverted dropout with a keep mask drawn ahead (:func:`tessera.sparse.masked.dropout_mask`): the
    same values :func:`dropout` gives when that mask came from the same generator state."""
    scale = float(np.float32(1.0 / (1.0 - p))) if x.dtype == torch.float32 else 1.0 / (1.0 - p)
    return _KeepMask.apply(x, keep, scale)
