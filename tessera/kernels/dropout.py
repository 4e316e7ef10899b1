"""Dropout whose mask is a counter-based hash of (seed, element index).

The element index is the element's position in the whole tensor, or, when the rows are given
global ids (``rows=``), ``rows[r] * width + column``: then any split of the rows over processes
and any vertex order draws the mask one process draws in the original order.

torch's CPU dropout spends most of its time drawing Bernoulli samples (on a small graph such as
Cora, one call can take longer than a whole PyG epoch: docs/design/dropout-hash.md).
Hashing the element index instead is branch-free, vectorises with AVX-512, gives the same mask
for any thread count, and lets backward recompute the mask from the seed rather than store it.
The seed is drawn from torch's default generator, so ``torch.manual_seed`` governs it.
Tensors off the CPU draw the same masks through torch's integer ops (:mod:`tessera.kernels.dropout_torch`).
"""

from __future__ import annotations

import numba
import numpy as np
import torch

from tessera import workspace
from tessera.bfloat16 import BF16, as_numpy, narrow, widen
from tessera.kernels.dropout_torch import (
    _BLOCK,
    _ELU_DROP,
    _ELU_DROP_GRAD,
    _MASK,
    _RELU_DROP,
    _RELU_DROP_GRAD,
    DROP,
    DROP_IN_PLACE,
    ELEMENT_MUL,
    hashed_width,
    keep_threshold,
    run_hashed_torch,
)
from tessera.kernels.hashing import hash32, index_hash
from tessera.kernels.placement import host_kernels
from tessera.kernels.vector_math import expm1
from tessera.threads import sync_numba_threads

_element_hash = index_hash(ELEMENT_MUL)


@numba.njit(inline="always")
def block_key(seed_lo, seed_hi, start):
    """The hash key of the block starting at element ``start``: the high bits of the index are
    mixed in so tensors over 2**32 elements do not repeat their mask."""
    return np.uint32(hash32(np.uint64(seed_hi) ^ np.uint64(start >> 32)) ^ np.uint64(seed_lo))


@numba.njit(inline="always")
def element_kept(g, seed_lo, seed_hi, threshold):
    """Whether the element of global index ``g`` is kept: the test :func:`_hashed` makes, for one
    element (kernels that visit only some elements, such as a sparse matrix's non-zeros)."""
    return _element_hash(g, block_key(seed_lo, seed_hi, (g // _BLOCK) * _BLOCK)) >= threshold


@numba.njit(parallel=True, fastmath=True, cache=True, nogil=True)
def _hashed(src, aux, out, rows, has_rows, width, mode, seed_lo, seed_hi, threshold, scale):
    # out = mode's function of src (and aux) per element. The flat arrays are taken as rows of
    # ``width`` elements whose global index starts at rows[r] * width (r * width without row ids;
    # the last row may be short), hashed in blocks of _BLOCK global indices with one key per block.
    # src, aux and out may hold bfloat16 bits (tessera.bfloat16): values are widened to scale's
    # float32 and results rounded once.
    n = np.int64(out.size)
    # Every value is computed and then selected, never loaded under the keep test: a load under
    # a condition needs a masked load, which AVX2 lacks for 16-bit (bfloat16) elements, and a
    # float64 literal would widen float32 lanes. Loaded under the test, bfloat16 rows ran several
    # times and float32 ones up to twice as slow in the forward modes on an AVX2-only CPU
    # (python benchmarks/bench_dropout.py; docs/design/dropout-hash.md).
    z0 = scale - scale  # zero in scale's type: float32 for float32 and bfloat16 rows
    for r in numba.prange((n + width - 1) // width):
        lo = np.int64(r) * width
        hi = min(n, lo + width)
        g0 = (rows[r] if has_rows else np.int64(r)) * width
        c = lo
        while c < hi:
            g = g0 + (c - lo)
            start = (g // _BLOCK) * _BLOCK
            stop = min(hi, c + (start + _BLOCK - g))
            key = block_key(seed_lo, seed_hi, start)
            o = out[c:stop]
            # slices with a local index vectorise; indexing by the global index did not
            if mode == _MASK:
                for i in range(stop - c):
                    o[i] = _element_hash(g + i, key) >= threshold
            elif mode == DROP:
                a = src[c:stop]
                for i in range(stop - c):
                    v = widen(a[i]) * scale
                    o[i] = narrow(o, v if _element_hash(g + i, key) >= threshold else z0)
            elif mode == DROP_IN_PLACE:
                for i in range(stop - c):
                    v = widen(o[i]) * scale
                    o[i] = narrow(o, v if _element_hash(g + i, key) >= threshold else z0)
            elif mode == _RELU_DROP:
                a = src[c:stop]
                for i in range(stop - c):
                    v = max(widen(a[i]), z0) * scale
                    o[i] = narrow(o, v if _element_hash(g + i, key) >= threshold else z0)
            elif mode == _ELU_DROP:
                a = src[c:stop]
                for i in range(stop - c):
                    ai = widen(a[i])
                    v = (ai if ai > z0 else expm1(ai)) * scale
                    o[i] = narrow(o, v if _element_hash(g + i, key) >= threshold else z0)
            elif mode == _RELU_DROP_GRAD:
                a, y = src[c:stop], aux[c:stop]
                for i in range(stop - c):
                    v = widen(a[i]) * scale
                    o[i] = narrow(o, v if widen(y[i]) > z0 else z0)
            else:
                a, y = src[c:stop], aux[c:stop]
                for i in range(stop - c):
                    yi = widen(y[i])
                    v = widen(a[i]) * (scale if yi > z0 else yi + scale)
                    o[i] = narrow(o, v if _element_hash(g + i, key) >= threshold else z0)
            c = stop


_NO_ROWS = np.zeros(1, np.int64)
#: dtypes the hashed kernels run on (bfloat16 stored, computed in float32)
HASHED_DTYPES = (torch.float32, torch.float64, BF16)


def run_hashed(
    src: torch.Tensor, out: torch.Tensor, seed: int, p: float, rows: torch.Tensor | None, mode: int,
    aux: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """Fill ``out`` (``src``'s shape; bool for ``_MASK``) by ``mode`` for drop probability ``p`` < 1:
    by the numba kernel on the CPU, by :func:`run_hashed_torch` (the same values) elsewhere and
    under the portable kernels (:func:`~tessera.kernels.placement.host_kernels`)."""
    if not host_kernels(out):
        return run_hashed_torch(src, out, seed, p, rows, mode, aux)
    sync_numba_threads()
    masking = mode == _MASK
    width = hashed_width(out, rows, mode)
    flat = out.view(torch.uint8) if masking else out
    scale = 1.0 / (1.0 - p)
    flat_out = as_numpy(flat.reshape(-1))
    flat_src = flat_out if masking or mode == DROP_IN_PLACE else as_numpy(src.reshape(-1))
    _hashed(
        flat_src,
        flat_src if aux is None else as_numpy(aux.reshape(-1)),
        flat_out,
        _NO_ROWS if rows is None else rows.to(torch.int64).contiguous().numpy(),
        rows is not None,
        np.int64(width),
        mode,
        np.uint64(seed & 0xFFFFFFFF),
        np.uint64(seed >> 32),
        keep_threshold(p),
        np.float32(scale) if src.dtype in (torch.float32, BF16) else np.float64(scale),
    )


def seeded_dropout(x: torch.Tensor, seed: int, p: float, rows: torch.Tensor | None) -> torch.Tensor:
    """``x`` with the mask drawn from ``seed`` (keyed by ``rows``) applied and scaled, into a workspace block."""
    x = x.contiguous()
    if keep_threshold(p) is None:
        return torch.zeros_like(x)
    out = workspace.empty_like(x)
    run_hashed(x, out, seed, p, rows, DROP)
    return out


def draw_seed() -> int:
    """A 63-bit seed from torch's default generator (``torch.manual_seed`` governs it)."""
    return int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item())


class _Dropout(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, p, seed, rows):
        ctx.p, ctx.seed, ctx.rows = p, seed, rows
        return seeded_dropout(x, seed, p, rows)

    @staticmethod
    def backward(ctx, g):
        return seeded_dropout(g, ctx.seed, ctx.p, ctx.rows), None, None, None


def dropout(x: torch.Tensor, p: float = 0.5, training: bool = True, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Inverted dropout with drop probability ``p``; identity when not training or ``p == 0``.
    ``rows`` (int64, one per row of ``x``) are the rows' global ids: the mask of row ``r`` is then
    the one row ``rows[r]`` of the whole tensor gets, whichever process holds it and in any order."""
    if not training or p == 0.0:
        return x
    if not 0.0 <= p < 1.0:
        if p == 1.0:
            return x * 0.0
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if x.dtype not in HASHED_DTYPES:
        return torch.nn.functional.dropout(x, p, training)
    return _Dropout.apply(x, p, draw_seed(), rows)


ACT_MODES = {"relu": (_RELU_DROP, _RELU_DROP_GRAD), "elu": (_ELU_DROP, _ELU_DROP_GRAD)}
ACTIVATIONS = tuple(ACT_MODES)


def dropout_mask(
    shape: tuple[int, ...], p: float, rows: torch.Tensor | None = None, device: torch.device | str | None = None
) -> torch.Tensor:
    """The keep mask (bool) that :func:`dropout` would draw for a tensor of ``shape`` (with the
    same ``rows``) and drop probability ``p``, from the same generator state; on ``device``
    (default: ``rows``'s device, else the CPU)."""
    seed = draw_seed()
    if device is None:
        device = "cpu" if rows is None else rows.device
    out = torch.empty(shape, dtype=torch.bool, device=device)
    if keep_threshold(p) is None:
        return out.fill_(False)
    run_hashed(out, out, seed, p, rows, _MASK)
    return out


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
    """Inverted dropout with a keep mask drawn ahead (:func:`dropout_mask`): the
    same values :func:`dropout` gives when that mask came from the same generator state."""
    scale = float(np.float32(1.0 / (1.0 - p))) if x.dtype == torch.float32 else 1.0 / (1.0 - p)
    return _KeepMask.apply(x, keep, scale)
