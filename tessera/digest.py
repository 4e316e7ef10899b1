"""Content digests of large arrays for on-disk cache keys, hashed on every thread.

A graph's fingerprint keys every on-disk cache (vertex orders, backend choices, plans), so each run
hashes its E-entry arrays at least twice. SHA-256 runs on the CPU's SHA extensions where it has
them (about twice blake2b's speed where it has them: docs/design/startup-caches.md), and hashlib
releases the GIL on large buffers, so fixed-size chunks hash in parallel. The chunk size is fixed,
so the digest does not depend on the thread count.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

CHUNK_BYTES = 32 << 20


def _chunk_digest(buf: memoryview) -> bytes:
    return hashlib.sha256(buf).digest()


def digest(header: str, arrays: Iterable[torch.Tensor | np.ndarray | None], size: int = 16) -> str:
    """Hex digest (``size`` bytes) of ``header`` and each array's dtype, shape and bytes, as stored
    (no copy of a contiguous array); ``None`` entries count as absent."""
    h = hashlib.sha256(header.encode())
    pieces: list[memoryview] = []
    marks: list[tuple[int, bytes]] = []  # (chunks before this array, its description)
    for a in arrays:
        if a is None:
            marks.append((len(pieces), b"|none"))
            continue
        arr = np.ascontiguousarray(a.numpy() if isinstance(a, torch.Tensor) else a)
        marks.append((len(pieces), f"|{arr.dtype.str}{arr.shape}".encode()))
        flat = memoryview(arr.reshape(-1).view(np.uint8))  # type: ignore[arg-type]  # numpy arrays are buffers
        pieces.extend(flat[i : i + CHUNK_BYTES] for i in range(0, len(flat), CHUNK_BYTES))
    threads = max(1, min(torch.get_num_threads(), len(pieces)))
    if threads > 1:
        with ThreadPoolExecutor(threads) as pool:
            sums = list(pool.map(_chunk_digest, pieces))
    else:
        sums = [_chunk_digest(p) for p in pieces]
    marks.append((len(sums), b""))
    for (start, desc), (end, _) in zip(marks, marks[1:]):
        h.update(desc)
        for s in sums[start:end]:
            h.update(s)
    return h.hexdigest()[: 2 * size]
