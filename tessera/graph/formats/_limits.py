"""Size limits the loaders check before they allocate: what a file's bytes can justify, and the
memory this process can use at all."""

from __future__ import annotations

import os
import resource
from typing import BinaryIO

import numpy as np

from tessera.errors import DatasetError

# Vertices an edge list or OGB directory may declare without features or labels to back them:
# beyond max(2 x edges, FREE_VERTICES) most vertices would be isolated ids nothing describes.
FREE_VERTICES = 1 << 20
# The most a deflate stream expands (RFC 1951's longest match per 2-bit code): an .npz member's
# array can be at most this many times the bytes stored for it.
DEFLATE_RATIO = 1032


def format_bytes(n: float) -> str:
    """``n`` bytes as a short human-readable size (``16.0 GiB``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


def _meminfo_bytes(key: str) -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _mapped_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0


def memory_limit() -> int:
    """Bytes this process could ever allocate: physical memory plus swap, capped by the room left
    under its address-space limit (``RLIMIT_AS``) when one is set."""
    physical = _meminfo_bytes("MemTotal")
    if physical is None:
        physical = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = physical + (_meminfo_bytes("SwapTotal") or 0)
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft != resource.RLIM_INFINITY:
        limit = min(limit, soft - _mapped_bytes())
    return max(limit, 0)


def require_memory(nbytes: int, what: str, source: str) -> None:
    """Raise DatasetError when ``what`` (``nbytes``, sized by the file's own declarations rather than
    by its data) would not fit in :func:`memory_limit`."""
    limit = memory_limit()
    if nbytes > limit:
        raise DatasetError(
            f"{source}: {what} would need {format_bytes(nbytes)}, more than the {format_bytes(limit)} "
            "this process can use; the file's declared sizes are not backed by its data"
        )


def check_vertex_count(n: int, edges: int, source: str, fix: str) -> None:
    """Refuse ``n`` vertices that neither features nor labels back: at most max(2 x edges, 2^20)."""
    limit = max(2 * edges, FREE_VERTICES)
    if n > limit:
        raise DatasetError(
            f"{source}: {n:,} vertices (the largest vertex id + 1, or the declared count) but only {edges:,} edges; "
            f"without features or labels a graph may have at most max(2 x edges, 2^20) = {limit:,} vertices ({fix})"
        )


def npy_header(fp: BinaryIO, source: str) -> tuple[tuple[int, ...], np.dtype, int]:
    """Shape, dtype and data size in bytes from the ``.npy`` header at ``fp``'s position, read
    without touching the data; DatasetError for a malformed header."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fp)
        if version == (1, 0):
            shape, _, dtype = fmt.read_array_header_1_0(fp)
        elif version == (2, 0):
            shape, _, dtype = fmt.read_array_header_2_0(fp)
        else:
            raise ValueError(f"unsupported .npy format version {version}")
    except (ValueError, OSError, EOFError, SyntaxError) as e:
        raise DatasetError(f"{source} is not a valid .npy array ({e})") from None
    return shape, dtype, int(np.prod(shape, dtype=object)) * dtype.itemsize


def check_npy_size(nbytes: int, stored: int, source: str, shape: tuple[int, ...], expands: bool = False) -> None:
    """Refuse an array whose header claims more data than ``stored`` bytes can hold (``expands``:
    the bytes are deflate-compressed, which expands at most :data:`DEFLATE_RATIO` times)."""
    room = stored * (DEFLATE_RATIO if expands else 1)
    if nbytes > room:
        how = f"at most {DEFLATE_RATIO} x its {stored:,} compressed bytes" if expands else f"{stored:,} bytes"
        raise DatasetError(
            f"{source}: the header claims an array of shape {tuple(shape)} ({format_bytes(nbytes)}) "
            f"but the file holds {how}; the file is truncated or crafted"
        )
