"""Opt-in: keep freed memory in the process heap so each epoch's large tensors reuse warm pages.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap``
and unmaps it on free, so a full-graph epoch page-faults its activations in again on every
step. ``TESSERA_MALLOC=retain`` turns that off for the process (no ``mmap`` for large blocks,
no trimming): on ``synthetic:arxiv`` a SAGE step went from 624 to 395 ms, but glibc's heap then
fragments and peak RSS rose from 1.6 to 2.7 GB (``benchmarks/RESULTS.md``, allocator section).
jemalloc (``LD_PRELOAD=libjemalloc.so.2``) gives the same speed at 1.7 GB, so it stays the
recommendation and this stays off by default.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_state: bool | None = None


def retain_freed_memory() -> bool:
    """With ``TESSERA_MALLOC=retain``, make glibc keep freed blocks for reuse (no ``mmap`` per
    large tensor, no trimming); True when that took effect. Idempotent; a no-op otherwise."""
    global _state
    if _state is not None:
        return _state
    _state = False
    if os.environ.get("TESSERA_MALLOC", "") != "retain" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
        libc.gnu_get_libc_version  # noqa: B018  (glibc only: musl has no mallopt semantics to rely on)
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _state = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _state
