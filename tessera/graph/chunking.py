"""Locality-aware chunking and column compression (NeutronAscend §6.2, Algorithm 2).

The destination vertices (rows of the destination-major CSR) are split into chunks of about
``chunk_rows`` vertices that share in-neighbours, so that each chunk, restricted to the union of its
in-neighbours (*column compression*), is a small and comparatively dense matrix ``A_k``; the
aggregation of that chunk is then the dense product ``A_k @ H[N_k]``.

Algorithm 2, as implemented here (``k = ceil(rows / chunk_rows)`` chunks):

1. *Seeds.* The source range is split into ``k`` contiguous intervals ``I_i``; chunk ``i`` is
   seeded with the unvisited row having the most in-neighbours in ``I_i`` (ties: lowest id). Each
   source's out-list is scanned once, so this phase is ``O(E)``.
2. *Fill.* For each chunk in turn, every unvisited row ``u`` is scored by the number of
   in-neighbours it shares with the seed (two hops through the source-major CSR), and the
   ``chunk_rows - 1`` best-scored rows join the chunk (ties: lowest id). Two caps bound the work:
   sources with more than ``hub_cap`` out-edges are skipped (a hub is shared by
   everyone and says nothing about locality; it ends up a dense column of many chunks anyway), and
   at most ``src_cap`` sources of each seed are expanded, so the phase costs ``O(E)`` plus at
   most ``k * src_cap * hub_cap`` expansion steps and the sort of each chunk's candidates (with
   the defaults at most ``4 * chunk_rows`` steps per vertex: linear in ``V`` for a fixed chunk
   size; timings in docs/design/startup-caches.md).
3. *Rest.* Rows still unvisited fill the unfilled chunks in id order (keeping whatever locality
   the vertex numbering already has).

Column compression (:func:`compress`) keeps, per chunk, the columns hit by at least
``min_col_density`` of the chunk's rows; a chunk whose kept block holds enough non-zeros becomes a
dense block, every other edge (sparse columns, sparse chunks) is the *remainder*, left to a CSR
kernel. The chunking depends on the structure only: the backend that uses it keeps it per graph,
and it can also be stored on disk keyed by the graph's fingerprint.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numba
import numpy as np

_DEFAULT_L2 = 1 << 20


@lru_cache(maxsize=1)
def l2_cache_bytes() -> int:
    """Per-core L2 size from sysfs (1 MiB when it cannot be read)."""
    base = Path("/sys/devices/system/cpu/cpu0/cache")
    try:
        for d in sorted(base.glob("index*")):
            if (d / "level").read_text().strip() == "2" and (d / "type").read_text().strip() in ("Unified", "Data"):
                s = (d / "size").read_text().strip().upper()
                mult = {"K": 1 << 10, "M": 1 << 20}.get(s[-1], 1)
                return int(s.rstrip("KM")) * mult
    except (OSError, ValueError):
        pass
    return _DEFAULT_L2


def chunk_rows_for_cache(width: int = 128, cache_bytes: int | None = None) -> int:
    """Cache-size rule: the largest power of two ``r`` such that one chunk's working set, a square
    ``r x r`` block plus ``r`` gathered source rows and ``r`` output rows of ``width`` float32,
    fits in half the L2 (the other half holds the next chunk's gather: double buffering)."""
    budget = (cache_bytes or l2_cache_bytes()) // 2
    r = 16
    while 4 * ((2 * r) * (2 * r) + 2 * (2 * r) * width) <= budget:
        r *= 2
    return r


@dataclass(frozen=True)
class Chunking:
    """A partition of the rows into chunks: ``order[chunk_ptr[c]:chunk_ptr[c+1]]`` are the rows of
    chunk ``c`` (ascending within a chunk); ``order`` is a permutation of ``range(num_rows)``."""

    order: np.ndarray
    chunk_ptr: np.ndarray

    @property
    def num_chunks(self) -> int:
        return int(self.chunk_ptr.size - 1)

    def chunk(self, c: int) -> np.ndarray:
        return self.order[self.chunk_ptr[c] : self.chunk_ptr[c + 1]]


@numba.njit(cache=True, nogil=True)
def _greedy(indptr, indices, tptr, tind, num_cols, chunk, hub_cap, src_cap):  # pragma: no cover - numba
    n = indptr.size - 1
    k = (n + chunk - 1) // chunk
    visited = np.zeros(n, np.bool_)
    cnt = np.zeros(n, np.int64)
    touched = np.empty(n, np.int64)
    seeds = np.full(k, -1, np.int64)
    nxt = 0
    # Phase 1: one seed per chunk, the unvisited row with most in-neighbours in interval I_i.
    for i in range(k):
        lo = (i * num_cols) // k
        hi = ((i + 1) * num_cols) // k
        nt = 0
        for j in range(lo, hi):
            for e in range(tptr[j], tptr[j + 1]):
                v = tind[e]
                if not visited[v]:
                    if cnt[v] == 0:
                        touched[nt] = v
                        nt += 1
                    cnt[v] += 1
        best = -1
        bc = 0
        for t in range(nt):
            v = touched[t]
            c = cnt[v]
            if c > bc or (c == bc and v < best):
                best = v
                bc = c
            cnt[v] = 0
        if best < 0:
            while nxt < n and visited[nxt]:
                nxt += 1
            if nxt < n:
                best = nxt
        if best >= 0:
            seeds[i] = best
            visited[best] = True
    assign = np.full(n, -1, np.int64)
    size = np.zeros(k, np.int64)
    for i in range(k):
        if seeds[i] >= 0:
            assign[seeds[i]] = i
            size[i] = 1
    # Phase 2: each chunk takes the chunk - 1 unvisited rows sharing most in-neighbours with its seed.
    # (Its counting loop has phase 1's shape over another set of sources: the seed's capped in-neighbours.)
    for i in range(k):
        s = seeds[i]
        if s < 0:
            continue
        nt = 0
        used = 0
        for e in range(indptr[s], indptr[s + 1]):
            j = indices[e]
            if tptr[j + 1] - tptr[j] > hub_cap:
                continue
            used += 1
            if used > src_cap:
                break
            for f in range(tptr[j], tptr[j + 1]):
                u = tind[f]
                if not visited[u]:
                    if cnt[u] == 0:
                        touched[nt] = u
                        nt += 1
                    cnt[u] += 1
        if nt > 0:
            maxc = 0
            for t in range(nt):
                if cnt[touched[t]] > maxc:
                    maxc = cnt[touched[t]]
            keys = np.empty(nt, np.int64)
            for t in range(nt):
                u = touched[t]
                keys[t] = (maxc - cnt[u]) * n + u
                cnt[u] = 0
            take = min(chunk - 1, nt)
            keys.sort()
            for t in range(take):
                u = keys[t] % n
                visited[u] = True
                assign[u] = i
            size[i] += take
    # Phase 3: the rest fill the unfilled chunks in id order.
    i = 0
    for u in range(n):
        if not visited[u]:
            while size[i] >= chunk:
                i += 1
            assign[u] = i
            size[i] += 1
    # Rows grouped by chunk, ascending within a chunk (counting sort); empty chunks dropped.
    ptr = np.zeros(k + 1, np.int64)
    for i in range(k):
        ptr[i + 1] = ptr[i] + size[i]
    fill = ptr[:-1].copy()
    order = np.empty(n, np.int64)
    for u in range(n):
        c = assign[u]
        order[fill[c]] = u
        fill[c] += 1
    nonempty = 1
    for i in range(k):
        if size[i] > 0:
            nonempty += 1
    chunk_ptr = np.zeros(nonempty, np.int64)
    m = 0
    for i in range(k):
        if size[i] > 0:
            m += 1
            chunk_ptr[m] = ptr[i + 1]
    return order, chunk_ptr


def locality_chunks(
    indptr: np.ndarray,
    indices: np.ndarray,
    t_indptr: np.ndarray,
    t_indices: np.ndarray,
    chunk_rows: int,
    hub_cap: int | None = None,
    src_cap: int | None = None,
) -> Chunking:
    """Algorithm 2 on a row-major CSR (``indptr``, ``indices``: the in-neighbours of each row) and
    its column-major transpose (``t_indptr``, ``t_indices``: the rows each column feeds).
    ``hub_cap`` defaults to ``4 * chunk_rows``, ``src_cap`` to ``chunk_rows``."""
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    n = int(indptr.size - 1)
    if n == 0:
        return Chunking(np.zeros(0, np.int64), np.zeros(1, np.int64))
    num_cols = int(t_indptr.size - 1)
    order, ptr = _greedy(
        np.ascontiguousarray(indptr, dtype=np.int64),
        np.ascontiguousarray(indices, dtype=np.int64),
        np.ascontiguousarray(t_indptr, dtype=np.int64),
        np.ascontiguousarray(t_indices, dtype=np.int64),
        num_cols,
        int(chunk_rows),
        int(hub_cap if hub_cap is not None else 4 * chunk_rows),
        int(src_cap if src_cap is not None else chunk_rows),
    )
    return Chunking(order, ptr)


def _is_chunking_of(ch: Chunking, n: int) -> bool:
    """Whether ``ch`` partitions ``range(n)``: int64 arrays, ``chunk_ptr`` from 0 to ``n`` in
    order, ``order`` a permutation."""
    order, ptr = ch.order, ch.chunk_ptr
    if order.dtype != np.int64 or ptr.dtype != np.int64 or order.shape != (n,) or ptr.ndim != 1 or ptr.size < 1:
        return False
    if ptr[0] != 0 or ptr[-1] != n or np.any(np.diff(ptr) < 0):
        return False
    if n and (order.min() < 0 or order.max() >= n):
        return False
    seen = np.zeros(n, np.bool_)
    seen[order] = True
    return bool(seen.all())


def _csr_arrays(graph, transposed: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    t = graph.transpose()
    fwd = (graph.indptr.numpy(), graph.indices.numpy())
    bwd = (t.indptr.numpy(), t.indices.numpy())
    a, b = (bwd, fwd) if transposed else (fwd, bwd)
    return a[0], a[1], b[0], b[1]


def locality_chunking(graph, chunk_rows: int | None = None, transposed: bool = False, disk_cache: bool | None = None):
    """The :class:`Chunking` of a graph's destination rows (of its transpose's rows when
    ``transposed``); with ``disk_cache`` (default: on unless ``TESSERA_CHUNK_CACHE=0``) also
    stored under the tessera cache directory keyed by ``graph.fingerprint()`` (matrices without a
    fingerprint are not stored), so a second run on the graph skips Algorithm 2 (a noticeable part
    of a large graph's first epoch). Callers keep the result; this recomputes."""
    rows = chunk_rows or chunk_rows_for_cache()
    use_disk = disk_cache if disk_cache is not None else os.environ.get("TESSERA_CHUNK_CACHE") != "0"
    fingerprint = graph.fingerprint() if use_disk else None
    n = graph.num_cols if transposed else graph.num_rows

    def make() -> Chunking:
        return locality_chunks(*_csr_arrays(graph, transposed), rows)

    if fingerprint is None:
        return make()
    from tessera.files import atomic_write, default_cache_dir, kept

    path = default_cache_dir() / "chunks" / f"{fingerprint}-{rows}-{int(transposed)}.npz"

    def load() -> Chunking:
        with np.load(path, allow_pickle=False) as z:
            return Chunking(z["order"], z["chunk_ptr"])

    def write(ch: Chunking) -> None:
        def to(tmp: Path) -> None:
            with open(tmp, "wb") as f:  # a file object, so numpy does not append ".npz"
                np.savez(f, order=ch.order, chunk_ptr=ch.chunk_ptr)

        atomic_write(path, to)

    # the kernels index with these unchecked: a stale or damaged file is recomputed
    return kept(path, [path], load, lambda ch: _is_chunking_of(ch, n), make, write, "chunking")


# ------------------------------------------------------------------------------ column compression
@dataclass(frozen=True)
class DenseBlocks:
    """Column-compressed dense blocks of a chunked CSR plus the remainder.

    Dense block ``b`` covers rows ``rows[row_ptr[b]:row_ptr[b+1]]`` (``r_b`` of them) and columns
    ``cols[col_ptr[b]:col_ptr[b+1]]`` (``c_b``, ascending); its ``r_b x c_b`` row-major values live
    at ``val_ptr[b]`` in one flat buffer. Edge ``dense_eid[t]`` adds its value at flat position
    ``dense_pos[t]`` (duplicate edges share a position). ``rem_eid`` are the remaining edges,
    ascending (so in CSR order), and ``rem_indptr`` their per-row CSR offsets."""

    rows: np.ndarray
    row_ptr: np.ndarray
    cols: np.ndarray
    col_ptr: np.ndarray
    val_ptr: np.ndarray
    dense_eid: np.ndarray
    dense_pos: np.ndarray
    rem_eid: np.ndarray
    rem_indptr: np.ndarray

    @property
    def num_blocks(self) -> int:
        return int(self.row_ptr.size - 1)

    @property
    def block_values(self) -> int:
        return int(self.val_ptr[-1])


@numba.njit(cache=True, nogil=True)
def _compress(indptr, indices, num_cols, order, chunk_ptr, min_col_density, min_nnz):  # pragma: no cover
    n = indptr.size - 1
    e_total = indices.size
    cnt = np.zeros(num_cols, np.int64)
    colpos = np.full(num_cols, -1, np.int64)
    touched = np.empty(num_cols, np.int64)
    pos = np.full(e_total, -1, np.int64)
    nch = chunk_ptr.size - 1
    blk_chunk = np.empty(nch, np.int64)
    col_ptr = np.zeros(nch + 1, np.int64)
    val_ptr = np.zeros(nch + 1, np.int64)
    cols = np.empty(min(e_total, num_cols * nch) + 1, np.int64)
    nb = 0
    for c in range(nch):
        r0 = chunk_ptr[c]
        r1 = chunk_ptr[c + 1]
        r = r1 - r0
        nt = 0
        for p in range(r0, r1):
            v = order[p]
            for e in range(indptr[v], indptr[v + 1]):
                j = indices[e]
                if cnt[j] == 0:
                    touched[nt] = j
                    nt += 1
                cnt[j] += 1
        thr = max(2.0, min_col_density * r)
        nc = 0
        nnz = 0
        base = col_ptr[nb]
        for t in range(nt):
            j = touched[t]
            if cnt[j] >= thr:
                cols[base + nc] = j
                nc += 1
                nnz += cnt[j]
        if nc > 0 and nnz >= min_nnz:
            blk = cols[base : base + nc]
            blk.sort()
            for q in range(nc):
                colpos[blk[q]] = q
            off = val_ptr[nb]
            for p in range(r0, r1):
                v = order[p]
                li = p - r0
                for e in range(indptr[v], indptr[v + 1]):
                    q = colpos[indices[e]]
                    if q >= 0:
                        pos[e] = off + li * nc + q
            for q in range(nc):
                colpos[blk[q]] = -1
            blk_chunk[nb] = c
            col_ptr[nb + 1] = base + nc
            val_ptr[nb + 1] = off + r * nc
            nb += 1
        for t in range(nt):
            cnt[touched[t]] = 0
    nd = 0
    for e in range(e_total):
        if pos[e] >= 0:
            nd += 1
    dense_eid = np.empty(nd, np.int64)
    dense_pos = np.empty(nd, np.int64)
    rem_eid = np.empty(e_total - nd, np.int64)
    rem_indptr = np.zeros(n + 1, np.int64)
    a = 0
    b = 0
    for v in range(n):
        for e in range(indptr[v], indptr[v + 1]):
            if pos[e] >= 0:
                dense_eid[a] = e
                dense_pos[a] = pos[e]
                a += 1
            else:
                rem_eid[b] = e
                b += 1
        rem_indptr[v + 1] = b
    row_ptr = np.zeros(nb + 1, np.int64)
    for i in range(nb):
        c = blk_chunk[i]
        row_ptr[i + 1] = row_ptr[i] + chunk_ptr[c + 1] - chunk_ptr[c]
    rows = np.empty(row_ptr[nb], np.int64)
    for i in range(nb):
        c = blk_chunk[i]
        rows[row_ptr[i] : row_ptr[i + 1]] = order[chunk_ptr[c] : chunk_ptr[c + 1]]
    return (
        rows,
        row_ptr,
        cols[: col_ptr[nb]].copy(),
        col_ptr[: nb + 1].copy(),
        val_ptr[: nb + 1].copy(),
        dense_eid,
        dense_pos,
        rem_eid,
        rem_indptr,
    )


def compress(
    indptr: np.ndarray,
    indices: np.ndarray,
    num_cols: int,
    chunking: Chunking,
    min_col_density: float,
    min_nnz: int,
) -> DenseBlocks:
    """Column-compress every chunk: keep the columns hit by at least ``min_col_density`` of the
    chunk's rows (and at least twice); the chunk becomes a dense block when those columns hold at
    least ``min_nnz`` edges. Everything else is the remainder."""
    out = _compress(
        np.ascontiguousarray(indptr, dtype=np.int64),
        np.ascontiguousarray(indices, dtype=np.int64),
        int(num_cols),
        chunking.order,
        chunking.chunk_ptr,
        float(min_col_density),
        int(min_nnz),
    )
    return DenseBlocks(*out)
