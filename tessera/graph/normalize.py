"""Per-edge normalisation values computed in one pass over the CSR (no E-entry temporaries)."""

from __future__ import annotations

import numba
import numpy as np
import torch

from tessera.memo import PlanCache
from tessera.threads import sync_numba_threads


@numba.njit(parallel=True, cache=True, nogil=True)
def _inv_sqrt_degree(indptr, weight, weighted, out):
    # a row's weighted in-degree summed in float32 in stored order (as torch's index_add_ sums it)
    for r in numba.prange(indptr.size - 1):
        s = np.float32(0.0)
        for q in range(indptr[r], indptr[r + 1]):
            s += weight[q] if weighted else np.float32(1.0)
        out[r] = np.float32(0.0) if s == 0 else np.float32(1.0) / np.sqrt(s)


@numba.njit(parallel=True, cache=True, nogil=True)
def _sym_values(indptr, indices, weight, weighted, dis, out):
    for r in numba.prange(indptr.size - 1):
        for q in range(indptr[r], indptr[r + 1]):
            w = weight[q] if weighted else np.float32(1.0)
            out[q] = dis[indices[q]] * w * dis[r]


def gcn_values(indptr: np.ndarray, indices: np.ndarray, weight: np.ndarray | None) -> np.ndarray:
    """``w_ji / sqrt(deg_i deg_j)`` per entry of a square CSR (float32), ``deg`` the weighted
    in-degree (row sum; 0 gives 0), ``w`` all ones when ``weight`` is None."""
    weighted = weight is not None
    w = np.ascontiguousarray(weight, np.float32) if weighted else np.empty(0, np.float32)
    sync_numba_threads()
    dis = np.empty(indptr.size - 1, np.float32)
    _inv_sqrt_degree(indptr, w, weighted, dis)
    out = np.empty(indices.size, np.float32)
    _sym_values(indptr, indices, w, weighted, dis, out)
    return out


_mirrored = PlanCache()  # values -> their version when recorded


def mark_mirrored(values: torch.Tensor) -> torch.Tensor:
    """Record that ``values`` (per entry of a square CSR) equal their mirror entries' wherever the
    structure is symmetric, as :func:`gcn_values` of an unweighted graph do (``1 / sqrt(d_i d_j)``
    both ways): a symmetric structure's transpose then needs no walk to check them. The record
    lapses once ``values`` dies or is changed in place."""
    _mirrored.entries(values)["version"] = values._version
    return values


def known_mirrored(values: torch.Tensor) -> bool:
    """Whether ``values`` were recorded by :func:`mark_mirrored` and are unchanged since."""
    return _mirrored.find(values, "version") == values._version
