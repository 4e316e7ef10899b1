"""Arrays derived from a large graph, kept on disk between runs and mapped back rather than read.

A derived structure of a products-sized graph (its renumbered CSR, its GCN-normalised one) takes a
few hundred milliseconds to compute and as long again to read back into new memory: new pages cost
the kernel (and a virtual machine's host) time to provide (``benchmarks/bench_startup.py
--first-touch 2``; ``docs/design/workspace-memory.md``). Mapped copy-on-write from its ``.npy`` files, it costs neither: the pages are
the page cache's, filled when the file was written or last read.

Each kept structure has a manifest beside it (:func:`tessera.files.kept`): what it was derived from
and each file's size and SHA-256. A file whose bytes changed (values scaled, columns shifted by one:
still a valid CSR) is computed again, said once and rewritten; checking costs one read of the mapped
pages at about 1.5 GB/s per core (a few per cent of what computing them again costs).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from tessera.files import kept, save_npy

# Structures with at least this many entries are kept; smaller ones are cheaper to compute again.
KEEP_EDGES = 1 << 20


def csr_fits(indptr: np.ndarray, indices: np.ndarray, num_nodes: int) -> bool:
    """Whether ``(indptr, indices)`` is a CSR of ``num_nodes`` rows and columns: row pointers from 0
    to the entry count, never decreasing, every column in range (one pass over each array)."""
    e = indices.size
    return bool(
        indptr.shape == (num_nodes + 1,)
        and indices.ndim == 1
        and indptr[0] == 0
        and indptr[-1] == e
        and (num_nodes == 0 or np.diff(indptr).min() >= 0)
        and (e == 0 or (indices.min() >= 0 and indices.max() < num_nodes))
    )


def kept_arrays(
    stem: Path,
    names: tuple[str, ...],
    make: Callable[[], dict[str, np.ndarray]],
    fits: Callable[[dict[str, np.ndarray]], bool],
) -> dict[str, np.ndarray]:
    """The arrays ``names`` kept under ``stem`` (mapped copy-on-write) when every file is there,
    their manifest (``<stem>.digest.json``) vouches for their bytes and ``fits`` accepts them, else
    ``make()``'s, then kept for the next run (:func:`tessera.files.kept`: a damaged file is said
    once and rewritten; a non-regular file in the way is left alone and nothing is kept). ``stem``
    must name their contents (a digest of what they are derived from): files of one stem are
    interchangeable. Each array is the file ``<stem>.<name>.npy``."""
    paths = {name: stem.with_name(f"{stem.name}.{name}.npy") for name in names}

    def load() -> dict[str, np.ndarray]:
        arrays = {name: np.load(path, mmap_mode="c", allow_pickle=False) for name, path in paths.items()}
        return {name: a.view(np.ndarray) for name, a in arrays.items()}  # plain arrays over the maps

    def write(arrays: dict[str, np.ndarray]) -> None:
        for name, path in paths.items():
            save_npy(path, arrays[name])

    return kept(stem, list(paths.values()), load, fits, make, write, "derived arrays")
