"""Keep freed memory in the process heap so each epoch's large tensors reuse warm pages.

glibc serves every allocation above its mmap threshold (at most 32 MiB) with a fresh ``mmap``
and unmaps it on free, so a full-graph epoch page-faults its activations in again on every
step; ``benchmarks/bench_train.py`` measures a training step under glibc's default, under
jemalloc and with this setting (``benchmarks/RESULTS.md``). Setting ``TESSERA_MALLOC=system``
leaves the C allocator as it is.
"""

from __future__ import annotations

import ctypes
import os
import sys

_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_state: bool | None = None


def retain_freed_memory() -> bool:
    """Make glibc keep freed blocks for reuse (no ``mmap`` per large tensor, no trimming); True
    when it took effect. Idempotent; a no-op off glibc or with ``TESSERA_MALLOC=system``."""
    global _state
    if _state is not None:
        return _state
    _state = False
    if os.environ.get("TESSERA_MALLOC", "") == "system" or not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None)
        mallopt, version = libc.mallopt, libc.gnu_get_libc_version
    except (OSError, AttributeError):
        return False  # not glibc (musl, or an allocator without mallopt)
    del version
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _state = bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))
    return _state
