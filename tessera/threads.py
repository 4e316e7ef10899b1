"""One thread count for torch and the numba kernels."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numba
import torch


def set_num_threads(n: int) -> None:
    """Use ``n`` threads in torch's ops and in tessera's numba kernels."""
    # Starting numba's pool shares torch's OpenMP runtime and resets its thread count, so start
    # it before setting torch's (otherwise a fresh process asked for 1 thread silently runs 2).
    numba.get_num_threads()
    torch.set_num_threads(n)
    numba.set_num_threads(max(1, min(n, numba.config.NUMBA_NUM_THREADS)))  # type: ignore[attr-defined]


def sync_numba_threads() -> None:
    """Make numba follow ``torch.get_num_threads()`` (called before parallel kernels)."""
    n = max(1, min(torch.get_num_threads(), numba.config.NUMBA_NUM_THREADS))  # type: ignore[attr-defined]
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` torch threads, then restore the previous count."""
    before = torch.get_num_threads()
    if n == before:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


@contextmanager
def flush_denormals() -> Iterator[None]:
    """Run the block with denormal floats flushed to zero on the calling thread, then restore."""
    # torch has no getter: a denormal times one is zero exactly when flushing is on already
    if (torch.tensor([1e-39]) * 1.0).item() == 0.0 or not torch.set_flush_denormal(True):
        yield
        return
    try:
        yield
    finally:
        torch.set_flush_denormal(False)
