"""CSR kernel backend: numba row-parallel SpMM over the destination-major CSR (SuperGCN §4).

Each output row is accumulated once, by one thread, into a small L1-resident buffer and written
once, so there are no atomics and results do not depend on the thread count. Rows are grouped
into work items of about equal non-zeros rather than equal rows, and a row heavier than one
item's share is split along the feature dimension into cache-line tiles, a second parallel axis
(SuperGCN's 2D dynamic parallelism), so a power-law hub does not stall one thread. Backward runs
the same kernel over the cached source-major (transposed) CSR. ``masked_spmm`` is S-SpMM
(MixGCN §3.2.1, see :mod:`tessera.sparse.masked`).

What makes it fast, against a plain kernel accumulating ``out[i, f] +=`` per edge (each point's
figures: ``docs/design/aggregation-kernels.md``):

* **software prefetch** of the neighbour rows ``dist`` edges ahead (every cache line of the row,
  through ``llvm.prefetch``): the gather is latency-bound and hardware prefetchers cannot follow
  the indirection; the largest gain by far;
* the prefetch loop is a ``while``, not ``range(0, n, step)``: numba computes a range's length
  with an integer division, once per edge here;
* four edges per inner iteration (independent loads in flight, the accumulator loaded and
  stored once per four edges): faster than one, and eight are no better than four;
* a compile-time feature width of 128 (fully unrolled AVX-512 loop), faster than the generic
  loop; wider products run as passes over 128-feature column blocks, so that more of the
  gathered rows stay in cache;
* explicit 2-D indexing ``x[j, f]`` with indices numba can prove non-negative: with ``f0 + f``
  signed, numba's wrap-around selects turned the feature loop into gathers;
* outputs from the workspace (:func:`new_output`), blocks kept between steps on transparent huge
  pages: a fresh output is cheaper to first-touch in 2 MiB pages than in 4 KiB ones, and a kept
  block costs nothing.

Tried without gain: accumulating straight into ``out`` instead of a local buffer (not faster;
unvectorised unless the feature loop is ``range(F)``), non-temporal stores of the output rows
(slower), ``fastmath`` (no faster, and it would let the tile and full-row paths round
differently), dynamic scheduling with more work items (no change).

No ``fastmath``: every sum is evaluated in the written order, so the full-row and feature-tile
paths (which one runs depends on the thread count) give bitwise-identical rows.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numba
import numpy as np
import torch
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tessera import workspace
from tessera.backends.base import Backend, changes_every_step
from tessera.bfloat16 import as_numpy, compute_dtype, narrow, widen
from tessera.dense.liveness import live_rows
from tessera.graph.csr import CSRStructure
from tessera.kernels.llvm import prefetch
from tessera.threads import sync_numba_threads

_TILE = 16  # float32 per cache line (64 B)
_COLUMN_BLOCK = 128  # features per pass of a wide product
_ITEMS_PER_THREAD = 8
_JIT: dict[str, Any] = {"parallel": True, "cache": True, "nogil": True}


# ---------------------------------------------------------------------------------- prefetch
@intrinsic
def _prefetch(typingctx, arr, row, col):
    """``llvm.prefetch`` (read, keep in all cache levels) of ``&arr[row, col]`` for a 2-D array."""
    sig = types.void(arr, row, col)

    def codegen(context, builder, signature, args):
        aryty, rowty, colty = signature.args
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = [
            context.cast(builder, args[1], rowty, types.intp),
            context.cast(builder, args[2], colty, types.intp),
        ]
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, idx, wraparound=False, boundscheck=False)
        prefetch(builder, ptr)
        return context.get_dummy_value()

    return sig, codegen


def prefetch_distance(width: int, itemsize: int = 4) -> int:
    """Edges to prefetch ahead: about 12 KiB of rows in flight, between 4 and 32 edges (the
    distances that ran best at each width: docs/design/aggregation-kernels.md)."""
    return int(min(32, max(4, 12288 // max(1, width * itemsize))))


# ---------------------------------------------------------------------------------- work items
def work_items(indptr: np.ndarray, width: int, threads: int) -> np.ndarray:
    """``(K, 4)`` int64 items ``(row0, row1, f0, f1)`` of about equal non-zeros: contiguous row
    ranges, with rows heavier than one share split into feature tiles."""
    n = indptr.size - 1
    nnz = int(indptr[-1])
    parts = max(1, threads * _ITEMS_PER_THREAD)
    if n == 0:
        return np.zeros((0, 4), np.int64)
    width = max(1, int(width))
    share = max(nnz / parts, 1.0)
    targets = np.arange(1, parts) * share
    cuts = np.unique(np.concatenate([[0], np.minimum(np.searchsorted(indptr, targets, side="left"), n), [n]]))
    deg = np.diff(indptr)
    heavy = np.flatnonzero(deg > 2 * share)
    # Heavy rows become their own row ranges so they can be split by feature tiles.
    cuts = np.unique(np.concatenate([cuts, heavy, heavy + 1]))
    items = []
    ntiles_max = max(1, -(-width // _TILE))
    for r0, r1 in zip(cuts[:-1], cuts[1:]):
        load = int(indptr[r1] - indptr[r0])
        tiles = 1
        if r1 - r0 == 1 and load > 2 * share:
            tiles = min(ntiles_max, int(np.ceil(load / share)))
        step = -(-ntiles_max // tiles) * _TILE
        for f0 in range(0, width, step):
            items.append((r0, r1, f0, min(width, f0 + step)))
    return np.asarray(items, dtype=np.int64).reshape(-1, 4)


# ---------------------------------------------------------------------------------- row kernels
# ``_make_rows(W)`` sums rows ``r0 .. r1`` over the feature range ``[f0, f0 + nf)`` and writes
# them; ``W`` is a compile-time width (the feature loop is then fully unrolled) or 0 for any
# width. Each is a separate function called once per work item, not numba IR inlined into the
# parallel kernel: inlining made numba's own compiler passes far slower per signature. ``f0`` and
# ``nf`` are unsigned so numba emits no wrap-around selects. Every variant (and the masked
# kernel) groups edges the same way, four at a time with pairwise sums, and no fastmath is used,
# so a row's value does not depend on which variant, feature tiling or thread count computed it.


@numba.njit(nogil=True)
def _prefetch_row(x, indices, p, last, f0, nf, step):
    # a while loop, not range(0, nf, step): a range with a run-time step costs an integer
    # division per call, and this runs once per edge
    jp = indices[min(p, last)]
    c = f0
    end = f0 + nf
    while c < end:
        _prefetch(x, jp, c)
        c += step
    # A row that is not a whole number of cache lines wide starts mid-line, so the steps above
    # miss its last line: one demand miss per edge made such widths run much slower per feature
    # than whole-line ones (docs/design/aggregation-kernels.md). step is a power of two (% would divide).
    if x.shape[1] & (step - 1):
        _prefetch(x, jp, end - 1)


def _make_rows(width: int):
    @numba.njit(nogil=True)
    def rows(indptr, indices, w, has_w, x, out, acc, r0, r1, f0, nf, dist, last, step):
        n = np.uint64(width) if width else nf
        for i in range(r0, r1):
            for f in range(n):
                acc[f] = 0.0
            e = indptr[i]
            end = indptr[i + 1]
            if has_w:
                while e + 4 <= end:
                    for d in range(4):
                        _prefetch_row(x, indices, e + dist + d, last, f0, n, step)
                    j0, j1, j2, j3 = indices[e], indices[e + 1], indices[e + 2], indices[e + 3]
                    c0, c1, c2, c3 = w[e], w[e + 1], w[e + 2], w[e + 3]
                    for f in range(n):
                        g = f0 + f
                        acc[f] += (c0 * widen(x[j0, g]) + c1 * widen(x[j1, g])) + (
                            c2 * widen(x[j2, g]) + c3 * widen(x[j3, g])
                        )
                    e += 4
                while e < end:
                    _prefetch_row(x, indices, e + dist, last, f0, n, step)
                    j0 = indices[e]
                    c0 = w[e]
                    for f in range(n):
                        acc[f] += c0 * widen(x[j0, f0 + f])
                    e += 1
            else:
                while e + 4 <= end:
                    for d in range(4):
                        _prefetch_row(x, indices, e + dist + d, last, f0, n, step)
                    j0, j1, j2, j3 = indices[e], indices[e + 1], indices[e + 2], indices[e + 3]
                    for f in range(n):
                        g = f0 + f
                        acc[f] += (widen(x[j0, g]) + widen(x[j1, g])) + (widen(x[j2, g]) + widen(x[j3, g]))
                    e += 4
                while e < end:
                    _prefetch_row(x, indices, e + dist, last, f0, n, step)
                    j0 = indices[e]
                    for f in range(n):
                        acc[f] += widen(x[j0, f0 + f])
                    e += 1
            for f in range(n):
                out[i, f0 + f] = narrow(out, acc[f])

    return rows


_ROWS = _make_rows(0)
_ROWS_128 = _make_rows(128)


@numba.njit(**_JIT)
def _spmm(indptr, indices, w, has_w, x, out, items, dist):
    # x, out: (N, F) C-contiguous (float, or bfloat16 bits); w: (E,) in the arithmetic dtype,
    # its values ignored unless has_w.
    last = indices.shape[0] - 1
    step = np.uint64(max(1, 64 // x.itemsize))
    for k in numba.prange(items.shape[0]):
        r0, r1, f0, f1 = items[k, 0], items[k, 1], items[k, 2], items[k, 3]
        acc = np.empty(f1 - f0, w.dtype)  # w is in the arithmetic dtype, given or not
        fu, nf = np.uint64(f0), np.uint64(f1 - f0)
        if f1 - f0 == 128:  # every full block of a wide product (see CSRBackend._passes)
            _ROWS_128(indptr, indices, w, has_w, x, out, acc, r0, r1, fu, nf, dist, last, step)
        else:
            _ROWS(indptr, indices, w, has_w, x, out, acc, r0, r1, fu, nf, dist, last, step)


# ---------------------------------------------------------------------------------- S-SpMM
# The masked kernel visits only live rows (rows whose mask keeps something) and, in a live row,
# only its live 16-wide tiles. Where most edges are live it prefetches ``e + dist`` in CSR order
# like the plain kernel; where many rows are skipped that would fetch rows nobody needs, so a
# cursor walks the edges of the live rows ``dist`` edges ahead of the computation and prefetches
# the live tiles of each. The cursor is written out in place with scalar state: as an inlined
# numba helper returning a tuple it cost many times the same loop written out.


@numba.njit(nogil=True)
def _masked_item(indptr, indices, w, has_w, x, mask, words, scale, has_scale, out, r0, r1, f0, f1, dist, step):
    nwords = words.shape[1]
    zero = narrow(out, np.zeros(1, scale.dtype)[0])  # typed like out: a float64 literal would widen the select
    t0 = f0 // _TILE
    ntiles = (f1 - f0 + _TILE - 1) // _TILE
    full = np.uint64(0xFFFFFFFFFFFFFFFF) if ntiles >= 64 else (np.uint64(1) << np.uint64(ntiles)) - np.uint64(1)
    # pass 1: live rows (those with edges) and their live-tile bitmasks (rows of more than 64
    # tiles: all or none); dead rows are written as zeros
    live = np.empty(r1 - r0, np.int64)
    bits = np.empty(r1 - r0, np.uint64)
    nlive = 0
    live_edges = 0
    for i in range(r0, r1):
        b = np.uint64(0)
        if indptr[i + 1] > indptr[i]:
            for t in range(ntiles):
                a = 2 * (t0 + t)
                v = words[i, a]
                if a + 1 < nwords:
                    v |= words[i, a + 1]
                if v != 0:
                    b |= np.uint64(1) << np.uint64(min(t, 63))
        if b == 0:
            for f in range(f0, f1):
                out[i, f] = zero
            continue
        live[nlive] = i
        bits[nlive] = full if ntiles > 64 else b
        nlive += 1
        live_edges += indptr[i + 1] - indptr[i]
    if nlive == 0:
        return
    # pass 2
    acc = np.empty(f1 - f0, scale.dtype)  # scale is in the arithmetic dtype, given or not
    last = indices.shape[0] - 1
    ustep = np.uint64(step)
    dense = live_edges * 10 >= 9 * (indptr[r1] - indptr[r0])
    # the cursor: edge ce of live row cq (whose edges end at cend), `dist` live edges ahead
    cq = 0
    ce = indptr[live[0]]
    cend = indptr[live[0] + 1]
    if not dense:
        for _ in range(dist):
            if cq < nlive:
                jp = indices[ce]
                b = bits[cq]
                if b == full:
                    _prefetch_row(x, indices, ce, ce, np.uint64(f0), np.uint64(f1 - f0), ustep)
                    b = np.uint64(0)
                t = 0
                while b != 0:
                    if b & np.uint64(1):
                        c = f0 + t * _TILE
                        ce_ = min(f1, c + _TILE)
                        while c < ce_:
                            _prefetch(x, jp, c)
                            c += step
                    b >>= np.uint64(1)
                    t += 1
                ce += 1
                if ce >= cend:
                    cq += 1
                    if cq < nlive:
                        ce = indptr[live[cq]]
                        cend = indptr[live[cq] + 1]
    for q in range(nlive):
        i = live[q]
        s = scale[i] if has_scale else scale[0]  # scale[0] == 1 when not has_scale
        b = bits[q]
        if b != full:
            for f in range(f0, f1):
                out[i, f] = zero
        first = True
        t = 0
        while b != 0:
            # the next segment of columns [a, a + n): the whole range, or one live tile
            if b == full:
                a, n = f0, f1 - f0
                b = np.uint64(0)
            else:
                while not (b & np.uint64(1)):
                    b >>= np.uint64(1)
                    t += 1
                a = f0 + t * _TILE
                n = min(f1, a + _TILE) - a
                b >>= np.uint64(1)
                t += 1
            fu, nf = np.uint64(a), np.uint64(n)
            walk = first and not dense  # the cursor advances once per edge of the row
            for f in range(nf):
                acc[f] = 0.0
            e = indptr[i]
            end = indptr[i + 1]
            while e < end:
                four = e + 4 <= end
                cnt = 4 if four else 1
                if dense:
                    for d in range(cnt):
                        _prefetch_row(x, indices, e + dist + d, last, fu, nf, ustep)
                elif walk:
                    # the warm-up's cursor advance, written out again (a helper is far slower: see above)
                    for _ in range(cnt):  # prefetch the cursor edge's live tiles, advance it
                        if cq < nlive:
                            jp = indices[ce]
                            bc = bits[cq]
                            if bc == full:
                                _prefetch_row(x, indices, ce, ce, np.uint64(f0), np.uint64(f1 - f0), ustep)
                                bc = np.uint64(0)
                            tc = 0
                            while bc != 0:
                                if bc & np.uint64(1):
                                    c = f0 + tc * _TILE
                                    ce_ = min(f1, c + _TILE)
                                    while c < ce_:
                                        _prefetch(x, jp, c)
                                        c += step
                                bc >>= np.uint64(1)
                                tc += 1
                            ce += 1
                            if ce >= cend:
                                cq += 1
                                if cq < nlive:
                                    ce = indptr[live[cq]]
                                    cend = indptr[live[cq] + 1]
                if four:
                    j0, j1, j2, j3 = indices[e], indices[e + 1], indices[e + 2], indices[e + 3]
                    if has_w:
                        c0, c1, c2, c3 = w[e], w[e + 1], w[e + 2], w[e + 3]
                        for f in range(nf):
                            g = fu + f
                            acc[f] += (c0 * widen(x[j0, g]) + c1 * widen(x[j1, g])) + (
                                c2 * widen(x[j2, g]) + c3 * widen(x[j3, g])
                            )
                    else:
                        for f in range(nf):
                            g = fu + f
                            acc[f] += (widen(x[j0, g]) + widen(x[j1, g])) + (widen(x[j2, g]) + widen(x[j3, g]))
                else:
                    j0 = indices[e]
                    if has_w:
                        c0 = w[e]
                        for f in range(nf):
                            acc[f] += c0 * widen(x[j0, fu + f])
                    else:
                        for f in range(nf):
                            acc[f] += widen(x[j0, fu + f])
                e += cnt
            for f in range(nf):
                g = fu + f
                out[i, g] = narrow(out, acc[f] * s) if mask[i, g] else zero
            first = False


@numba.njit(**_JIT)
def _spmm_masked(indptr, indices, w, has_w, x, mask, words, scale, has_scale, out, items, dist):
    # out[i, f] = mask[i, f] ? scale[i] * sum_e w_e x[j, f] : 0, computing only the 16-wide
    # feature tiles of row i that keep at least one entry (a row that keeps nothing costs nothing).
    # words: the mask as uint64 (N, ceil(F / 8)), zero-padded, so a tile is tested with two loads.
    step = max(1, 64 // x.itemsize)
    for k in numba.prange(items.shape[0]):
        _masked_item(
            indptr, indices, w, has_w, x, mask, words, scale, has_scale, out,
            items[k, 0], items[k, 1], items[k, 2], items[k, 3], dist, step,
        )  # fmt: skip


@numba.njit(**_JIT)
def _spmm_heads(indptr, indices, w, wpos, has_pos, x, x2, out, items, dist):
    # x, out: (N, H, F); x2: x viewed as (N, H * F) for prefetching; w: (E, H), entry e's row
    # wpos[e] when has_pos (a transposed product reading untransposed weights). Items split rows.
    heads, width = x.shape[1], x.shape[2]
    last = indices.shape[0] - 1
    step = np.uint64(max(1, 64 // x.itemsize))
    rowlen = np.uint64(x2.shape[1])
    wlen = np.uint64(w.shape[1])
    for k in numba.prange(items.shape[0]):
        r0, r1 = items[k, 0], items[k, 1]
        acc = np.empty((heads, width), w.dtype)
        for i in range(r0, r1):
            for h in range(heads):
                for f in range(width):
                    acc[h, f] = 0.0
            for e in range(indptr[i], indptr[i + 1]):
                _prefetch_row(x2, indices, e + dist, last, np.uint64(0), rowlen, step)
                if has_pos:  # weights read out of order: their rows miss the cache as x's do
                    _prefetch_row(w, wpos, e + dist, last, np.uint64(0), wlen, step)
                j = indices[e]
                we = wpos[e] if has_pos else e
                for h in range(heads):
                    c = w[we, h]
                    for f in range(width):
                        acc[h, f] += c * widen(x[j, h, f])
            for h in range(heads):
                for f in range(width):
                    out[i, h, f] = narrow(out, acc[h, f])


@numba.njit(fastmath=True, **_JIT)
def _sddmm_dot(indptr, indices, g, x, x2, out, items, dist):
    # out[e, h] = <g[i, h], x[j, h]> for edge e = (j -> i); g, x: (N, H, F). Each edge's dot is
    # computed by one fixed code path, so fastmath's reassociation is still deterministic.
    heads, width = x.shape[1], x.shape[2]
    last = indices.shape[0] - 1
    step = np.uint64(max(1, 64 // x.itemsize))
    rowlen = np.uint64(x2.shape[1])
    for k in numba.prange(items.shape[0]):
        r0, r1 = items[k, 0], items[k, 1]
        for i in range(r0, r1):
            for e in range(indptr[i], indptr[i + 1]):
                _prefetch_row(x2, indices, e + dist, last, np.uint64(0), rowlen, step)
                j = indices[e]
                for h in range(heads):
                    s = 0.0
                    for f in range(width):
                        s += widen(g[i, h, f]) * widen(x[j, h, f])
                    out[e, h] = narrow(out, s)


_NO_POS = np.zeros(1, np.int64)


def _np(t: torch.Tensor) -> np.ndarray:
    return as_numpy(t.detach().contiguous())


def _arith(t: torch.Tensor | None, x: torch.Tensor, fill: float = 0.0) -> np.ndarray:
    """``t`` in the dtype ``x``'s values are summed in (float32 for bfloat16 storage); one
    ``fill`` entry of that dtype when ``t`` is None."""
    dt = compute_dtype(x.dtype)
    return _np(t.to(dt)) if t is not None else np.full(1, fill, torch.empty(0, dtype=dt).numpy().dtype)


def new_output(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised output from the process's :mod:`~tessera.workspace` (a large one is a
    warm block on huge pages once the first step has run)."""
    return workspace.empty(shape, dtype)


# ---------------------------------------------------------------------------------- live rows
# A backward product ``A^T g`` whose gradient ``g`` is zero in most rows (the loss gradient of the
# last layer is non-zero only on the training vertices) gathers only the edges into live rows:
# zero rows add nothing, so the result is the same, for a fraction of the memory traffic.
_LIVE_KEEP = 4  # filtered graphs kept per graph (one per live-row pattern)


@numba.njit(parallel=True, cache=True, nogil=True)
def _count_live_edges(indptr, indices, live, counts):
    for r in numba.prange(indptr.shape[0] - 1):
        c = 0
        for e in range(indptr[r], indptr[r + 1]):
            c += live[indices[e]]
        counts[r] = c


@numba.njit(parallel=True, cache=True, nogil=True)
def _keep_live_edges(indptr, indices, live, sub_indptr, sub_indices, pos):
    for r in numba.prange(indptr.shape[0] - 1):
        k = sub_indptr[r]
        for e in range(indptr[r], indptr[r + 1]):
            if live[indices[e]]:
                sub_indices[k] = indices[e]
                pos[k] = e
                k += 1


def live_subgraph(indptr: np.ndarray, indices: np.ndarray, live: np.ndarray) -> tuple[np.ndarray, ...]:
    """The CSR ``(indptr, indices)`` restricted to entries whose column is ``live``, and each kept
    entry's position in the original arrays."""
    counts = np.empty(indptr.size - 1, np.int64)
    _count_live_edges(indptr, indices, live, counts)
    sub_indptr = np.zeros(indptr.size, indptr.dtype)
    np.cumsum(counts, out=sub_indptr[1:])
    sub_indices = np.empty(int(sub_indptr[-1]), indices.dtype)
    pos = np.empty(sub_indices.size, np.int64)
    _keep_live_edges(indptr, indices, live, sub_indptr, sub_indices, pos)
    return sub_indptr, sub_indices, pos


def column_passes(indptr: np.ndarray, width: int, threads: int) -> list[np.ndarray]:
    """Work items per pass over column blocks of at most ``_COLUMN_BLOCK`` features: a wide
    product runs as one parallel pass per block, so the rows being gathered at a time span
    one block of every neighbour's row and more of them stay in cache (faster at widths 256 and
    512 than one pass; blocks of 64 are slower: docs/design/aggregation-kernels.md)."""
    if width <= _COLUMN_BLOCK + _COLUMN_BLOCK // 2:
        return [work_items(indptr, width, threads)]
    passes = []
    for c0 in range(0, width, _COLUMN_BLOCK):
        items = work_items(indptr, min(_COLUMN_BLOCK, width - c0), threads)
        items[:, 2:] += c0
        passes.append(items)
    return passes


class CSRBackend(Backend):
    """numba CSR SpMM with nnz-balanced 2D work items; deterministic forward and backward."""

    name = "csr"
    masked = True
    row_sparse_t = True
    efficiency = 1.0
    call_overhead_s = 25e-6
    # bfloat16 rows are widened to float32 as they are gathered, and sums rounded once when stored
    dtypes = (torch.float32, torch.float64, torch.bfloat16)

    def _items(self, graph: CSRStructure, transposed: bool, width: int) -> np.ndarray:
        threads = numba.get_num_threads()
        key = ("csr_items", transposed, width, threads, _ITEMS_PER_THREAD)

        def make() -> np.ndarray:
            return work_items(self._indptr64(graph, transposed), width, threads)

        return self.plans.get(graph, key, make)

    def _passes(self, graph: CSRStructure, transposed: bool, width: int) -> list[np.ndarray]:
        """:func:`column_passes` of this graph (or its transpose), kept in this backend's plans."""
        threads = numba.get_num_threads()
        key = ("csr_passes", transposed, width, threads, _ITEMS_PER_THREAD, _COLUMN_BLOCK)

        def make() -> list[np.ndarray]:
            return column_passes(self._indptr64(graph, transposed), width, threads)

        return self.plans.get(graph, key, make)

    def _live_plan(self, graph: CSRStructure, x: torch.Tensor):
        """For ``A^T x`` with mostly-zero rows of ``x``: the transposed CSR kept to the edges into
        live rows, those edges' positions, and its work items; None when too many rows are live.
        Cached per live-row pattern (the training rows' pattern repeats every epoch)."""
        live = live_rows(x)
        if live is None:
            return None
        plans = self.plans.get(graph, "live_plans", dict)
        key = (hashlib.blake2b(live.tobytes(), digest_size=16).digest(), x.shape[1], numba.get_num_threads())
        if key not in plans:
            indptr, indices = self._csr(graph, True)
            sub_indptr, sub_indices, pos = live_subgraph(indptr, indices, live)
            passes = column_passes(sub_indptr.astype(np.int64), x.shape[1], numba.get_num_threads())
            while len(plans) >= _LIVE_KEEP:
                plans.pop(next(iter(plans)))
            plans[key] = (sub_indptr, sub_indices, torch.from_numpy(pos), passes)
        return plans[key]

    def _indptr64(self, graph: CSRStructure, transposed: bool) -> np.ndarray:
        """Row pointers of the graph (or its transpose) as int64, for the work-item planners."""
        return self._csr(graph, transposed)[0].astype(np.int64)

    def _csr(self, graph: CSRStructure, transposed: bool) -> tuple[np.ndarray, np.ndarray]:
        if transposed:
            t = graph.transpose()
            return t.indptr.numpy(), t.indices.numpy()
        return graph.indptr.numpy(), graph.indices.numpy()

    def _run(self, graph: CSRStructure, transposed: bool, x: torch.Tensor, w: torch.Tensor | None, out=None, wpos=None):
        sync_numba_threads()
        given = x  # live_rows remembers its last answer by the caller's tensor object
        x = workspace.contiguous(x.detach())
        rows = graph.num_cols if transposed else graph.num_rows
        if out is None:
            out = new_output((rows, *x.shape[1:]), x.dtype)
        if rows == 0 or x.numel() == 0 or graph.num_edges == 0:
            return out.zero_()
        indptr, indices = self._csr(graph, transposed)
        dist = prefetch_distance(int(np.prod(x.shape[1:])), x.element_size())
        if x.dim() == 2 and (w is None or w.dim() == 1):
            plan = self._live_plan(graph, given) if transposed else None
            if plan is not None:
                indptr, indices, pos, passes = plan
                w = None if w is None else w[pos]
            else:
                passes = self._passes(graph, transposed, x.shape[1])
            wn = _arith(w, x)
            dist = prefetch_distance(x.shape[1] if len(passes) == 1 else _COLUMN_BLOCK, x.element_size())
            for items in passes:
                _spmm(indptr, indices, wn, w is not None, as_numpy(x), as_numpy(out), items, dist)
            return out
        if x.dim() == 3 and (w is None or w.dim() == 1):  # same weight for every head: one wide row
            n, h, f = x.shape
            self._run(graph, transposed, x.view(n, h * f), w, out.view(rows, h * f))
            return out
        items = self._items(graph, transposed, 1)
        xn = as_numpy(x)
        pos = _NO_POS if wpos is None else wpos.numpy()
        wn = _arith(w, x)
        _spmm_heads(
            indptr, indices, wn, pos, wpos is not None, xn, xn.reshape(xn.shape[0], -1), as_numpy(out), items, dist
        )
        return out

    def spmm(self, graph: CSRStructure, x: torch.Tensor, weight: torch.Tensor | None, out: torch.Tensor | None = None):
        """``out[i] = sum_{e=(j->i)} w_e * x[j]``; ``out`` (optional) is a C-contiguous buffer to reuse."""
        return self._run(graph, False, x, weight, out)

    def spmm_t(
        self, graph: CSRStructure, g: torch.Tensor, weight: torch.Tensor | None, out: torch.Tensor | None = None
    ):
        """``out[j] = sum_{e=(j->i)} w_e * g[i]`` over the cached transposed CSR."""
        if weight is not None and weight.dim() == 2 and g.dim() == 3 and changes_every_step(weight):
            # per-head weights of one step (attention) are read through the transpose's
            # permutation: no permuted E x heads copy each backward
            return self._run(graph, True, g, weight, out, graph.transpose(with_perm=True).perm)
        w = None if weight is None else self.transposed_weight(graph, weight)
        return self._run(graph, True, g, w, out)

    def masked_spmm(
        self,
        graph: CSRStructure,
        x: torch.Tensor,
        mask: torch.Tensor,
        weight: torch.Tensor | None,
        row_scale: torch.Tensor | None = None,
        transposed: bool = False,
    ) -> torch.Tensor:
        """S-SpMM: ``(diag(row_scale) A x) * mask`` (``A^T`` when ``transposed``), computing only
        the 16-wide feature tiles where ``mask`` keeps something; ``mask`` is bool/uint8 ``(rows, F)``."""
        sync_numba_threads()
        x = workspace.contiguous(x.detach())
        rows = graph.num_cols if transposed else graph.num_rows
        if x.dim() != 2 or mask.shape != (rows, x.shape[1]):
            raise ValueError(
                f"masked_spmm needs x (N, F) and mask ({rows}, F); got {tuple(x.shape)}, {tuple(mask.shape)}"
            )
        out = new_output((rows, x.shape[1]), x.dtype)
        if rows == 0 or x.numel() == 0 or graph.num_edges == 0:
            return out.zero_()
        if weight is not None and transposed:
            weight = self.transposed_weight(graph, weight)
        indptr, indices = self._csr(graph, transposed)
        m = mask.detach().contiguous()
        m = m.view(torch.uint8) if m.dtype == torch.bool else (m != 0).view(torch.uint8)
        pad = -x.shape[1] % 8
        words = (torch.nn.functional.pad(m, (0, pad)) if pad else m).view(torch.int64)
        wn, sn = _arith(weight, x), _arith(row_scale, x, 1.0)
        # one pass over all features: 128-feature column passes, a gain for the plain product,
        # made the masked one slower (docs/design/aggregation-kernels.md)
        items = self._items(graph, transposed, x.shape[1])
        dist = prefetch_distance(x.shape[1], x.element_size())
        _spmm_masked(
            indptr, indices, wn, weight is not None, as_numpy(x), m.numpy(), words.numpy(), sn, row_scale is not None,
            as_numpy(out), items, dist,
        )  # fmt: skip
        return out

    def sddmm_dot(self, graph: CSRStructure, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        sync_numba_threads()
        squeeze = g.dim() == 2
        g3 = g.unsqueeze(1) if squeeze else g
        x3 = x.unsqueeze(1) if squeeze else x
        # per-edge scores in the arithmetic dtype: float32 for bfloat16 rows (attention stays float32)
        out = workspace.empty((graph.num_edges, g3.shape[1]), compute_dtype(g.dtype))
        if graph.num_edges == 0 or g3.shape[1] == 0:
            return out.zero_().squeeze(1) if squeeze else out.zero_()
        items = self._items(graph, False, 1)
        xn = _np(x3.to(g.dtype))
        dist = prefetch_distance(xn.shape[1] * xn.shape[2], xn.itemsize)
        indptr, indices = self._csr(graph, False)
        _sddmm_dot(indptr, indices, _np(g3), xn, xn.reshape(xn.shape[0], -1), as_numpy(out), items, dist)
        return out.squeeze(1) if squeeze else out
