"""CSR restructuring without a global sort: transpose, renumbered rows and added self loops.

A CSR is already grouped by row, so what a derived CSR needs is a counting pass over the rows
(transpose) or a sort within each row (renumbering, self loops), never a comparison sort of all
``E`` composite keys (``benchmarks/bench_startup.py`` measures the start-up these serve).
"""

from __future__ import annotations

import numba
import numpy as np

from tessera.threads import sync_numba_threads


@numba.njit(inline="always")
def _insertion_sort(keys, payload, lo, hi):
    for i in range(lo + 1, hi):
        k, v = keys[i], payload[i]
        j = i - 1
        while j >= lo and keys[j] > k:
            keys[j + 1], payload[j + 1] = keys[j], payload[j]
            j -= 1
        keys[j + 1], payload[j + 1] = k, v


@numba.njit(inline="always")
def _insertion_sort_keys(keys, lo, hi):
    for i in range(lo + 1, hi):
        k = keys[i]
        j = i - 1
        while j >= lo and keys[j] > k:
            keys[j + 1] = keys[j]
            j -= 1
        keys[j + 1] = k


@numba.njit(cache=True, nogil=True)
def _sort_span(keys, payload, lo, hi):
    # keys[lo:hi] stably sorted with payload alongside: short or sorted spans by insertion (no
    # allocation; linear on a sorted span), long unsorted ones by a merge sort
    if hi - lo > 64:
        for i in range(lo + 1, hi):
            if keys[i] < keys[i - 1]:
                by = np.argsort(keys[lo:hi], kind="mergesort")
                k, v = keys[lo:hi].copy(), payload[lo:hi].copy()
                for j in range(hi - lo):
                    keys[lo + j], payload[lo + j] = k[by[j]], v[by[j]]
                return
        return
    _insertion_sort(keys, payload, lo, hi)


@numba.njit(parallel=True, cache=True, nogil=True)
def _renumbered(indptr, indices, perm, inv, new_indptr, src, eid, want_eid):
    # new row r is old row perm[r] with every source renamed, then stably sorted in place (with
    # its entry ids alongside, or, without want_eid, the sources alone: no payload to move)
    for r in numba.prange(perm.size):
        lo = p = new_indptr[r]
        for q in range(indptr[perm[r]], indptr[perm[r] + 1]):
            src[p] = inv[indices[q]]
            if want_eid:
                eid[p] = q
            p += 1
        if want_eid:
            _sort_span(src, eid, lo, p)
        elif p - lo > 64:
            src[lo:p].sort()
        else:
            _insertion_sort_keys(src, lo, p)


@numba.njit(parallel=True, cache=True, nogil=True)
def _loops(indptr, indices, counts, kept):
    # per row: how many loops r -> r it stores, and which one stays (the last; num_edges + r if none)
    for r in numba.prange(indptr.size - 1):
        c, last = 0, indices.size + r
        for q in range(indptr[r], indptr[r + 1]):
            if indices[q] == r:
                c += 1
                last = q
        counts[r], kept[r] = c, last


@numba.njit(parallel=True, cache=True, nogil=True)
def _with_self_loops(indptr, indices, kept, new_indptr, out_indices, take, want_take):
    # row r: its entries but loops, plus one loop r -> r (entry kept[r]), sources stably sorted;
    # without want_take, take is out_indices itself (the sort's payload: rewritten with the same keys)
    for r in numba.prange(indptr.size - 1):
        p = new_indptr[r]
        placed = False
        for q in range(indptr[r], indptr[r + 1]):
            c = indices[q]
            if c == r:
                continue
            if not placed and c > r:
                out_indices[p] = r
                if want_take:
                    take[p] = kept[r]
                p += 1
                placed = True
            out_indices[p] = c
            if want_take:
                take[p] = q
            p += 1
        if not placed:
            out_indices[p] = r
            if want_take:
                take[p] = kept[r]
            p += 1
        _sort_span(out_indices, take, new_indptr[r], p)  # linear on a row already sorted


@numba.njit(nogil=True, inline="always")
def _first_at_least(indices, a, b, v):
    # the first position in [a, b) of a sorted run whose column is >= v
    while a < b:
        m = (a + b) // 2
        if indices[m] < v:
            a = m + 1
        else:
            b = m
    return a


@numba.njit(parallel=True, cache=True, nogil=True)
def _mirror(indptr, indices, perm, want_perm, values, check_values, bounds, ok):
    # Each part t walks its rows [bounds[t], bounds[t + 1]) in order: row i's k-th entry of column
    # j pairs with the next unpaired slot of row j among those holding the part's columns, which
    # in a symmetric CSR with sorted rows holds column i (the entry transpose_csr would place
    # there). Every pairing is checked, and a slot of column i can only be paired by row i's part,
    # so passes without a mismatch have matched each entry with a distinct mirror entry: the
    # structure is symmetric, and with every row checked sorted, perm is transpose_csr's.
    # want_perm writes each entry's mirror into perm; check_values also requires values to agree
    # with their mirrors'.
    n = indptr.size - 1
    for t in numba.prange(bounds.size - 1):
        b0, b1 = bounds[t], bounds[t + 1]
        cursor = np.empty(n, np.int64)
        stop = np.empty(n, np.int64)
        for j in range(n):
            cursor[j] = _first_at_least(indices, indptr[j], indptr[j + 1], b0)
            stop[j] = _first_at_least(indices, cursor[j], indptr[j + 1], b1)
        good = True
        for i in range(b0, b1):
            for q in range(indptr[i], indptr[i + 1]):
                j = indices[q]
                if j < 0 or j >= n or (q > indptr[i] and j < indices[q - 1]):
                    good = False
                    break
                p = cursor[j]
                if p >= stop[j] or indices[p] != i or (check_values and values[p] != values[q]):
                    good = False
                    break
                if want_perm:
                    perm[q] = p
                cursor[j] = p + 1
            if not good:
                break
        ok[t] = good


@numba.njit(cache=True, nogil=True)
def _transpose(indptr, indices, num_cols, t_indptr, t_indices, perm):
    # Rows ascend and each row's entries ascend in position, so placing entries in that order
    # is a stable sort by column: within a column, rows ascending, duplicates in stored order.
    for e in range(indices.size):
        t_indptr[indices[e] + 1] += 1
    for c in range(num_cols):
        t_indptr[c + 1] += t_indptr[c]
    nxt = t_indptr[:-1].copy()
    for r in range(indptr.size - 1):
        for e in range(indptr[r], indptr[r + 1]):
            c = indices[e]
            p = nxt[c]
            t_indices[p] = r
            perm[p] = e
            nxt[c] = p + 1


def renumbered_csr(
    indptr: np.ndarray, indices: np.ndarray, perm: np.ndarray, inv: np.ndarray, want_eid: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A square CSR with vertex ``perm[i]`` renamed ``i``: ``(indptr, indices, eid)`` in the input's
    index dtype, ``eid`` each entry's old entry id; sources stably sorted within each row. ``eid``
    is None unless ``want_eid``: a graph with no per-edge data to carry over need not write (and
    page in) it, and its rows sort without a payload."""
    indptr, indices = np.ascontiguousarray(indptr), np.ascontiguousarray(indices)
    perm, inv = np.ascontiguousarray(perm), np.ascontiguousarray(inv)
    new_indptr = np.zeros(perm.size + 1, indptr.dtype)
    np.cumsum(np.diff(indptr)[perm], out=new_indptr[1:])
    src = np.empty(indices.size, indices.dtype)
    eid = np.empty(indices.size if want_eid else 0, indices.dtype)
    sync_numba_threads()
    _renumbered(indptr, indices, perm, inv, new_indptr, src, eid, want_eid)
    return new_indptr, src, eid if want_eid else None


def with_self_loops(
    indptr: np.ndarray, indices: np.ndarray, want_take: bool = True
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """A square CSR with exactly one self loop per row: ``(indptr, indices, take)``, where ``take``
    holds each entry's old entry id; a row's loop is its last stored loop, or, if it had none,
    ``num_edges + row``. Sources stay stably sorted within each row. int32 where every id and
    offset fits (as :func:`~tessera.graph.csr.index_dtype`), else int64. ``take`` is None unless
    ``want_take``: a graph with no per-edge data to carry over need not write (and page in) it."""
    indptr, indices = np.ascontiguousarray(indptr), np.ascontiguousarray(indices)
    n = indptr.size - 1
    sync_numba_threads()
    loops, kept = np.empty(n, np.int64), np.empty(n, np.int64)
    _loops(indptr, indices, loops, kept)
    counts = np.diff(indptr) - loops + 1
    size = int(counts.sum())
    dtype = np.int32 if max(indices.size + n, size) <= np.iinfo(np.int32).max else np.int64
    new_indptr = np.zeros(n + 1, dtype)
    np.cumsum(counts, out=new_indptr[1:])
    out = np.empty(size, dtype)
    take = np.empty(size, dtype) if want_take else out
    _with_self_loops(indptr, indices, kept, new_indptr, out, take, want_take)
    return new_indptr, out, take if want_take else None


def transpose_csr(
    indptr: np.ndarray,
    indices: np.ndarray,
    num_cols: int,
    dtype: np.dtype | type = np.int64,
    perm: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Column-major form of a CSR: ``(t_indptr, t_indices, perm)`` with ``t_indices`` the rows of
    each column's entries (ascending; duplicates in stored order) and ``perm`` each transposed
    position's entry id, all of integer ``dtype``; ``perm`` may be given (overwritten)."""
    indptr, indices = np.ascontiguousarray(indptr), np.ascontiguousarray(indices)
    t_indptr = np.zeros(int(num_cols) + 1, dtype)
    t_indices = np.empty(indices.size, dtype)
    perm = np.empty(indices.size, dtype) if perm is None else perm
    _transpose(indptr, indices, int(num_cols), t_indptr, t_indices, perm)
    return t_indptr, t_indices, perm


def mirror_transpose(indptr: np.ndarray, indices: np.ndarray, perm: np.ndarray | None = None) -> bool:
    """Whether a square CSR equals its own transpose in structure (rows sorted, every entry
    ``j -> i`` matched by an ``i -> j``, duplicates alike); if so, and ``perm`` (E entries) is
    given, it is written with what :func:`transpose_csr` would return as ``perm``, whose
    ``t_indptr`` and ``t_indices`` are then ``indptr`` and ``indices``. One pass over the
    entries, split over the threads by rows, no E-entry copies."""
    return _mirror_walk(indptr, indices, perm, None)


def mirrored_values_equal(indptr: np.ndarray, indices: np.ndarray, values: np.ndarray) -> bool:
    """Whether a square CSR is symmetric in structure (as :func:`mirror_transpose`) and every
    entry's value equals its mirror entry's: the matrix is its own transpose, values and all.
    Checked in the same pass, without the permutation."""
    return _mirror_walk(indptr, indices, None, np.ascontiguousarray(values))


def _mirror_walk(indptr: np.ndarray, indices: np.ndarray, perm: np.ndarray | None, values: np.ndarray | None) -> bool:
    """:func:`_mirror` over parts of about equal entry counts, one per thread."""
    indptr, indices = np.ascontiguousarray(indptr), np.ascontiguousarray(indices)
    n = indptr.size - 1
    sync_numba_threads()
    # each part holds two int64 cursors per vertex: at most E / 8n parts keeps them within two
    # bytes per entry (half an int32 perm), however many threads a sparse graph meets
    parts = max(1, min(numba.get_num_threads(), n, indices.size // max(8 * n, 1)))
    # parts of about equal entry counts (searchsorted of ascending offsets: ascending rows <= n)
    bounds = np.searchsorted(indptr, np.linspace(0, indices.size, parts + 1)).astype(np.int64)
    bounds[0], bounds[-1] = 0, n
    ok = np.zeros(parts, np.bool_)
    none = indices[:0]  # an unused operand: typed as the indices, never read
    _mirror(
        indptr,
        indices,
        none if perm is None else perm,
        perm is not None,
        none if values is None else values,
        values is not None,
        bounds,
        ok,
    )
    return bool(ok.all())
