"""One thread count for torch and the numba kernels."""

from __future__ import annotations

import numba
import torch


def set_num_threads(n: int) -> None:
    """Use ``n`` threads in torch's ops and in tessera's numba kernels."""
    # Starting numba's pool shares torch's OpenMP runtime and resets its thread count, so start
    # it before setting torch's (otherwise a fresh process asked for 1 thread silently runs 2).
    numba.get_num_threads()
    torch.set_num_threads(n)
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))


def sync_numba_threads() -> None:
    """Make numba follow ``torch.get_num_threads()`` (called before parallel kernels)."""
    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
