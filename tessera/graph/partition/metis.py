"""METIS through pymetis: the symmetrised graph METIS partitions, and one partition call.

pymetis's public ``part_graph`` serves every call with one balance constraint (one weight per
vertex, or none), k-way or recursive. It cannot pass more than one: pymetis 2025.2 derives
``ncon`` as ``len(vweights) // len(xadj)``, which is 1 for the interleaved ``N * ncon`` layout
METIS expects (``len(xadj)`` is ``N + 1``). A call with several constraints therefore goes to
``METIS_PartGraphKway`` / ``METIS_PartGraphRecursive`` of pymetis's bundled METIS through
``ctypes`` (:func:`_part_graph_ctypes`, tessera's only binding into pymetis's internals), which
raises RuntimeError where that entry point is unavailable or fails so the caller can fall back.
"""

from __future__ import annotations

import ctypes
import functools
from typing import Any

import numpy as np
import scipy.sparse as sp

from tessera.graph.csr import rows_of
from tessera.graph.graph import Graph


def metis_graph(graph: Graph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Symmetrised structure without self loops: ``(xadj, adjncy, eweights)`` (int64), where the
    weight of ``{i, j}`` is the number of stored edges ``i -> j`` and ``j -> i``, so METIS
    minimises exactly the number of CSR entries cut."""
    n = graph.num_nodes
    src = graph.indices.numpy().astype(np.int64, copy=False)
    dst = rows_of(graph.indptr.numpy())
    keep = src != dst
    a = sp.csr_matrix((np.ones(int(keep.sum()), dtype=np.int64), (dst[keep], src[keep])), shape=(n, n))
    sym = (a + a.T).tocsr()
    sym.sum_duplicates()
    return sym.indptr.astype(np.int64), sym.indices.astype(np.int64), sym.data.astype(np.int64)


def part_graph(
    xadj: np.ndarray,
    adjncy: np.ndarray,
    eweights: np.ndarray,
    parts: int,
    *,
    vweights: np.ndarray | None = None,
    recursive: bool = False,
    seed: int = 0,
) -> np.ndarray:
    """Part id (int64) of every vertex of the METIS graph ``(xadj, adjncy, eweights)`` split into
    ``parts`` parts by k-way partitioning or (``recursive``) recursive bisection, with METIS's
    default options and ``seed``. ``vweights`` is ``None`` (unit weights), one weight per vertex
    or ``(N, ncon)`` constraints; a constraint no vertex carries is dropped (METIS rejects it)."""
    n = np.asarray(xadj).size - 1
    if vweights is not None:
        vw = np.asarray(vweights, dtype=np.int64).reshape(n, -1)
        vw = vw[:, vw.any(axis=0)]
        if vw.shape[1] > 1:
            return _part_graph_ctypes(xadj, adjncy, eweights, vw, parts, recursive, seed)
        vweights = vw[:, 0] if vw.shape[1] else None
    import pymetis

    res = pymetis.part_graph(
        parts,
        pymetis.CSRAdjacency(xadj, adjncy),
        vweights=vweights,
        eweights=eweights,
        recursive=recursive,
        options=pymetis.Options(seed=int(seed)),
    )
    return np.asarray(res.vertex_part, dtype=np.int64)


@functools.cache
def _metis_lib() -> Any | None:
    """pymetis's extension module as a ctypes library, when its METIS uses 64-bit ``idx_t``."""
    try:
        import pymetis._internal as internal

        if internal._idx_type_width() != 64:
            return None
        return ctypes.CDLL(internal.__file__)
    except (ImportError, OSError, AttributeError):
        return None


def _part_graph_ctypes(xadj, adjncy, eweights, vweights: np.ndarray, parts: int, recursive: bool, seed: int):
    """METIS with ``ncon = vweights.shape[1]`` constraints through ctypes (see the module docstring)."""
    lib = _metis_lib()
    name = "METIS_PartGraphRecursive" if recursive else "METIS_PartGraphKway"
    fn = getattr(lib, name, None) if lib is not None else None
    if lib is None or fn is None:
        raise RuntimeError(f"{name} of pymetis's METIS (64-bit idx_t) is not reachable through ctypes")
    import pymetis._internal as internal

    def ptr(a: np.ndarray):
        return a.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))

    n, ncon = vweights.shape
    xadj = np.ascontiguousarray(xadj, dtype=np.int64)
    adjncy = np.ascontiguousarray(adjncy, dtype=np.int64)
    if adjncy.size == 0:  # METIS wants a non-null adjacency array
        adjncy = np.zeros(1, dtype=np.int64)
    ew = np.ascontiguousarray(eweights, dtype=np.int64) if eweights.size else np.ones(1, dtype=np.int64)
    vw = np.ascontiguousarray(vweights, dtype=np.int64).ravel()
    options = np.full(128, -1, dtype=np.int64)  # METIS_NOPTIONS is 40; room to spare
    lib.METIS_SetDefaultOptions(ptr(options))
    options[int(internal.OptionKey.SEED)] = int(seed)  # type: ignore[attr-defined]  # absent from its stub
    options[int(internal.OptionKey.NUMBERING)] = 0  # type: ignore[attr-defined]
    nv, nc, npart, objval = (ctypes.c_int64(v) for v in (n, ncon, parts, 0))
    out = np.zeros(max(n, 1), dtype=np.int64)
    fn.restype = ctypes.c_int
    status = fn(
        ctypes.byref(nv), ctypes.byref(nc), ptr(xadj), ptr(adjncy), ptr(vw), None, ptr(ew),
        ctypes.byref(npart), None, None, ptr(options), ctypes.byref(objval), ptr(out),
    )  # fmt: skip
    if status != 1:  # METIS_OK
        raise RuntimeError(f"{name} failed with status {status}")
    return out[:n]
