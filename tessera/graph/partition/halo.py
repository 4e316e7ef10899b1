"""Per-rank execution plans for partition-parallel aggregation (SuperGCN §5.2–5.3), pure numpy.

On rank ``r`` with owned node features ``h`` (rows in ``owned`` order) the runtime computes::

    sendbuf = S_r @ h                                   # (n_send, F); peer blocks in rank order
    recv    = all_to_all(sendbuf, send_counts, recv_counts)
    out     = A_r @ h + R_r @ recv                       # == (A @ h_global)[owned]

where ``A[i, j]`` sums the weights of the edges ``j -> i``. Each cut edge ``j -> i`` (``j`` owned by
``p``, ``i`` by ``q != p``) is *post*-aggregated (``p`` sends ``h[j]`` once, ``q`` applies the edge)
or *pre*-aggregated (``p`` sends one partial sum per destination ``i``). ``prepost`` picks, for
each ordered pair ``(p, q)``, a minimum vertex cover of the pair's cut edges: edges whose source is
in the cover go post, the rest pre, so the pair sends ``|cover|`` rows, never more than pure pre
or pure post. Within a peer's block post rows come first, then pre rows, each by global id.

Backward is the transpose: ``grad_h = A^T g + S^T all_to_all_back(R^T g)``.

Both ends of a pair compute the pair's cover from the same edge set (the cover depends on the
set only), so each rank can build its plan alone, from the global graph or from its part file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import maximum_bipartite_matching

from tessera.errors import ConfigError
from tessera.graph.csr import rows_of
from tessera.graph.partition.cover import min_vertex_cover

MODES = ("post", "pre", "prepost")

# split(p, q, src_global, dst_global) -> bool per edge: True where the edge is post-aggregated
SplitFn = Callable[[int, int, np.ndarray, np.ndarray], np.ndarray]

# CSR arrays: (indptr, indices, values or None)
CSRArrays = tuple[np.ndarray, np.ndarray, np.ndarray | None]

# What a rank's plan is built from (see graph_rank_inputs): owned ids; in-edges (indptr over owned
# rows, global sources, weights, source owners); outgoing cut edges (local sources, global
# destinations, weights, destination owners)
RankInputs = tuple[
    np.ndarray,
    np.ndarray,
    np.ndarray,
    np.ndarray | None,
    np.ndarray,
    np.ndarray,
    np.ndarray,
    np.ndarray | None,
    np.ndarray,
]


class LocalCSR(NamedTuple):
    """``A_r``: in-edges among owned vertices, ``n_owned x n_owned`` (``weight`` None = all ones)."""

    indptr: np.ndarray
    indices: np.ndarray
    weight: np.ndarray | None


class SendCSR(NamedTuple):
    """``S_r``: ``n_rows x n_owned``, one row per row sent (source row or partial sum)."""

    indptr: np.ndarray
    indices: np.ndarray
    weight: np.ndarray | None
    n_rows: int


class RecvCSR(NamedTuple):
    """``R_r``: ``n_owned x n_cols``, adds received rows into owned destinations."""

    indptr: np.ndarray
    indices: np.ndarray
    weight: np.ndarray | None
    n_cols: int


@dataclass
class RankPlan:
    """Everything rank ``rank`` needs to aggregate its owned rows (see the module docstring)."""

    rank: int
    world: int
    mode: str
    owned: np.ndarray  # global ids, sorted; local id = position
    A: LocalCSR
    S: SendCSR
    R: RecvCSR
    send_counts: np.ndarray  # int64 (world,), rows sent to each peer (0 for self)
    recv_counts: np.ndarray  # int64 (world,), rows received from each peer (0 for self)
    in_degree_global: np.ndarray  # int64 per owned vertex, local + remote in-edges
    rows_post: np.ndarray  # int64 (world,), source rows sent to each peer
    rows_pre: np.ndarray  # int64 (world,), partial-sum rows sent to each peer
    recv_src: np.ndarray  # int64 per received row: the global source id of a post row, -1 for a partial sum

    @property
    def n_owned(self) -> int:
        """Number of owned vertices."""
        return int(self.owned.size)


# ---------------------------------------------------------------------------------------- splitting
def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ConfigError(f"unknown aggregation mode {mode!r}; choose one of: {', '.join(MODES)}")


def make_split(mode: str, memo: dict | None = None) -> SplitFn:
    """The post/pre decision per cut edge for ``mode`` (covers memoised per pair in ``memo``)."""
    _check_mode(mode)

    def split(p: int, q: int, s: np.ndarray, d: np.ndarray) -> np.ndarray:
        if mode == "post":
            return np.ones(s.size, dtype=bool)
        if mode == "pre":
            return np.zeros(s.size, dtype=bool)
        if memo is not None and (p, q) in memo:
            cover_src = memo[(p, q)]
        else:
            cover_src = min_vertex_cover(s, d)[0]
            if memo is not None:
                memo[(p, q)] = cover_src
        return np.isin(s, cover_src, assume_unique=False)

    return split


# ---------------------------------------------------------------------------------------- core
def _csr(rows: np.ndarray, cols: np.ndarray, vals: np.ndarray | None, n_rows: int) -> CSRArrays:
    """CSR arrays (entries sorted by row, then column) from COO."""
    order = np.lexsort((cols, rows))
    indptr = np.zeros(n_rows + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=n_rows), out=indptr[1:])
    w = None if vals is None else vals[order].astype(np.float32)
    return indptr, cols[order].astype(np.int64), w


def _groups(owner: np.ndarray, world: int) -> tuple[np.ndarray, np.ndarray]:
    """Stable order grouping entries by owner, and each owner's [start, end) in that order."""
    order = np.argsort(owner, kind="stable")
    bounds = np.searchsorted(owner[order], np.arange(world + 1))
    return order, bounds


def _build(
    rank: int,
    world: int,
    mode: str,
    owned: np.ndarray,
    in_indptr: np.ndarray,
    in_src: np.ndarray,
    in_w: np.ndarray | None,
    in_owner: np.ndarray,
    out_src: np.ndarray,
    out_dst: np.ndarray,
    out_w: np.ndarray | None,
    out_owner: np.ndarray,
    split: SplitFn,
) -> RankPlan:
    """Assemble rank ``rank``'s plan from its in-edges (CSR over owned destinations, global
    sources) and its outgoing cut edges (local source, global destination)."""
    n = owned.size
    deg = np.diff(in_indptr).astype(np.int64)
    dst_loc = rows_of(in_indptr)
    weighted = in_w is not None

    # A: local in-edges, in the graph's CSR order
    loc = in_owner == rank
    a_indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst_loc[loc], minlength=n), out=a_indptr[1:])
    a = LocalCSR(
        a_indptr,
        np.searchsorted(owned, in_src[loc]).astype(np.int64),
        in_w[loc].astype(np.float32) if in_w is not None else None,
    )

    # R: cut in-edges, grouped by the peer that owns the source
    cut = np.flatnonzero(~loc)
    order, bounds = _groups(in_owner[cut], world)
    recv_counts = np.zeros(world, dtype=np.int64)
    r_rows, r_cols, r_vals, r_src, base = [], [], [], [], 0
    for p in range(world):
        e = cut[order[bounds[p] : bounds[p + 1]]]
        if p == rank or e.size == 0:
            continue
        s, dl = in_src[e], dst_loc[e]
        post = split(p, rank, s, owned[dl])
        post_rows = np.unique(s[post])
        pre_rows = np.unique(dl[~post])  # local ids sort like global ids
        r_rows += [dl[post], pre_rows]
        r_src += [post_rows, np.full(pre_rows.size, -1, dtype=np.int64)]
        r_cols += [base + np.searchsorted(post_rows, s[post]), base + post_rows.size + np.arange(pre_rows.size)]
        if in_w is not None:
            r_vals += [in_w[e][post], np.ones(pre_rows.size, dtype=np.float32)]
        recv_counts[p] = post_rows.size + pre_rows.size
        base += int(recv_counts[p])
    r = RecvCSR(*_cat_csr(r_rows, r_cols, r_vals if weighted else None, n), base)

    # S: outgoing cut edges, grouped by the peer that owns the destination
    order, bounds = _groups(out_owner, world)
    send_counts = np.zeros(world, dtype=np.int64)
    rows_post = np.zeros(world, dtype=np.int64)
    rows_pre = np.zeros(world, dtype=np.int64)
    s_rows, s_cols, s_vals, base = [], [], [], 0
    for q in range(world):
        e = order[bounds[q] : bounds[q + 1]]
        if q == rank or e.size == 0:
            continue
        sl, d = out_src[e], out_dst[e]
        post = split(rank, q, owned[sl], d)
        post_rows = np.unique(sl[post])  # local ids sort like global ids
        pre_rows = np.unique(d[~post])
        s_rows += [base + np.arange(post_rows.size), base + post_rows.size + np.searchsorted(pre_rows, d[~post])]
        s_cols += [post_rows, sl[~post]]
        if weighted:
            assert out_w is not None  # a weighted graph's cut edges carry weights too
            s_vals += [np.ones(post_rows.size, dtype=np.float32), out_w[e][~post]]
        rows_post[q], rows_pre[q] = post_rows.size, pre_rows.size
        send_counts[q] = post_rows.size + pre_rows.size
        base += int(send_counts[q])
    s_csr = SendCSR(*_cat_csr(s_rows, s_cols, s_vals if weighted else None, base), base)

    return RankPlan(
        rank=rank,
        world=world,
        mode=mode,
        owned=owned.astype(np.int64),
        A=a,
        S=s_csr,
        R=r,
        send_counts=send_counts,
        recv_counts=recv_counts,
        in_degree_global=deg,
        rows_post=rows_post,
        rows_pre=rows_pre,
        recv_src=np.concatenate([np.zeros(0, dtype=np.int64), *r_src]).astype(np.int64),
    )


def _cat_csr(rows: list, cols: list, vals: list | None, n_rows: int) -> CSRArrays:
    empty = np.zeros(0, dtype=np.int64)
    rr = np.concatenate([empty, *rows]).astype(np.int64)
    cc = np.concatenate([empty, *cols]).astype(np.int64)
    vv = None if vals is None else np.concatenate([np.zeros(0, dtype=np.float32), *vals]).astype(np.float32)
    return _csr(rr, cc, vv, n_rows)


# ---------------------------------------------------------------------------------------- from a graph
def _check_inputs(
    indptr, indices, weight, part, world: int | None
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray, int]:
    indptr = np.asarray(indptr).astype(np.int64, copy=False)
    indices = np.asarray(indices).astype(np.int64, copy=False)
    part = np.asarray(part).astype(np.int64, copy=False)
    n = indptr.size - 1
    if part.shape != (n,):
        raise ValueError(f"part has shape {part.shape}, expected ({n},)")
    if weight is not None:
        weight = np.asarray(weight, dtype=np.float32)
        if weight.shape != indices.shape:
            raise ValueError(f"weight has shape {weight.shape}, expected {indices.shape}")
    w = int(world) if world is not None else (int(part.max()) + 1 if n else 1)
    if n and (int(part.min()) < 0 or int(part.max()) >= w):
        raise ValueError(f"part ids must lie in [0, {w})")
    return indptr, indices, weight, part, w


def row_edges(indptr: np.ndarray, rows: np.ndarray) -> np.ndarray:
    """Edge ids of CSR rows ``rows``, row after row, each row's edges in stored order."""
    deg = indptr[rows + 1] - indptr[rows]
    offs = np.zeros(rows.size, dtype=np.int64)
    np.cumsum(deg[:-1], out=offs[1:])
    return np.repeat(indptr[rows] - offs, deg) + np.arange(int(deg.sum()), dtype=np.int64)


def _rank_inputs(indptr, indices, weight, part, rank, owned, out_e, dst) -> RankInputs:
    eid = row_edges(indptr, owned)
    in_indptr = np.zeros(owned.size + 1, dtype=np.int64)
    np.cumsum(indptr[owned + 1] - indptr[owned], out=in_indptr[1:])
    in_src = indices[eid]
    out_src = np.searchsorted(owned, indices[out_e])
    out_dst = dst[out_e]
    return (
        owned,
        in_indptr,
        in_src,
        None if weight is None else weight[eid],
        part[in_src],
        out_src,
        out_dst,
        None if weight is None else weight[out_e],
        part[out_dst],
    )


def build_rank_plan(
    indptr: np.ndarray,
    indices: np.ndarray,
    weight: np.ndarray | None,
    part: np.ndarray,
    mode: str,
    rank: int,
    world: int | None = None,
) -> RankPlan:
    """Rank ``rank``'s plan from the global destination-major CSR and the part vector
    (``world`` defaults to ``max(part) + 1``; pass it when trailing ranks may own nothing)."""
    _check_mode(mode)
    world, args, _ = graph_rank_inputs(indptr, indices, weight, part, rank, world)
    return _build(rank, world, mode, *args, make_split(mode))


def graph_rank_inputs(
    indptr: np.ndarray, indices: np.ndarray, weight: np.ndarray | None, part: np.ndarray, rank: int, world: int | None
) -> tuple[int, RankInputs, np.ndarray]:
    """Rank ``rank``'s edges of the global destination-major CSR: the world size, the arrays a
    plan is built from (owned ids; in-edges as CSR over owned rows with global sources, weights
    and source owners; outgoing cut edges' local sources, global destinations, weights and
    destination owners) and the graph's edge ids of the outgoing cut edges."""
    indptr, indices, weight, part, world = _check_inputs(indptr, indices, weight, part, world)
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} out of range for world size {world}")
    dst = rows_of(indptr)
    out_e = np.flatnonzero((part[indices] == rank) & (part[dst] != rank))
    owned = np.flatnonzero(part == rank).astype(np.int64)
    return world, _rank_inputs(indptr, indices, weight, part, rank, owned, out_e, dst), out_e


def build_plans(
    indptr: np.ndarray,
    indices: np.ndarray,
    weight: np.ndarray | None,
    part: np.ndarray,
    mode: str = "prepost",
    world: int | None = None,
) -> list[RankPlan]:
    """Every rank's plan (each pair's cover is computed once and shared by both ends)."""
    _check_mode(mode)
    indptr, indices, weight, part, world = _check_inputs(indptr, indices, weight, part, world)
    dst = rows_of(indptr)
    ps = part[indices]
    cut = np.flatnonzero(ps != part[dst])
    order, bounds = _groups(ps[cut], world)
    owner_order, owner_bounds = _groups(part, world)
    split = make_split(mode, memo={})
    plans = []
    for r in range(world):
        owned = np.sort(owner_order[owner_bounds[r] : owner_bounds[r + 1]]).astype(np.int64)
        out_e = cut[order[bounds[r] : bounds[r + 1]]]
        args = _rank_inputs(indptr, indices, weight, part, r, owned, out_e, dst)
        plans.append(_build(r, world, mode, *args, split))
    return plans


def plan_from_part(data: dict[str, Any], mode: str = "prepost") -> RankPlan:
    """Rank ``data['rank']``'s plan from its own part file (``tessera.graph.partition.assign.load_part``)."""
    _check_mode(mode)
    return _build(int(data["rank"]), int(data["parts"]), mode, *part_rank_inputs(data), make_split(mode))


def part_rank_inputs(data: dict[str, Any]) -> RankInputs:
    """The arrays a plan is built from (as :func:`graph_rank_inputs`) from a rank's own part file."""
    ref_ids, ref_part = data["ref_ids"].astype(np.int64), data["ref_part"].astype(np.int64)
    src = data["src"].astype(np.int64)
    out_dst = data["out_dst"].astype(np.int64)

    def owner(ids: np.ndarray) -> np.ndarray:
        return ref_part[np.searchsorted(ref_ids, ids)] if ids.size else np.zeros(0, dtype=np.int64)

    w, ow = data.get("weight"), data.get("out_weight")
    return (
        data["owned"].astype(np.int64),
        data["indptr"].astype(np.int64),
        src,
        None if w is None else w.astype(np.float32),
        owner(src),
        data["out_src"].astype(np.int64),
        out_dst,
        None if ow is None else ow.astype(np.float32),
        owner(out_dst),
    )


# ---------------------------------------------------------------------------------------- volumes
def pair_rows(
    indptr: np.ndarray, indices: np.ndarray, part: np.ndarray, world: int | None = None, modes=MODES
) -> dict[str, np.ndarray]:
    """Rows each rank ``p`` sends each rank ``q`` per exchange (the plans' ``send_counts``) without
    building plans, a ``(world, world)`` int64 matrix per mode: distinct cut sources (post),
    distinct cut destinations (pre), or the pair's minimum vertex cover (prepost), whose size is
    the pair's maximum matching (König); the matchings of all pairs come from one Hopcroft–Karp
    run on their disjoint union instead of one cover per pair."""
    for m in modes:
        _check_mode(m)
    indptr, indices, _, part, world = _check_inputs(indptr, indices, None, part, world)
    n = max(indptr.size - 1, 1)
    dst = rows_of(indptr)
    ps, pd = part[indices], part[dst]
    cut = ps != pd
    pair = ps[cut] * world + pd[cut]
    keys_u, u = np.unique(pair * n + indices[cut], return_inverse=True)  # (pair, source) vertices
    keys_v, v = np.unique(pair * n + dst[cut], return_inverse=True)  # (pair, destination) vertices
    out: dict[str, np.ndarray] = {}
    for m in modes:
        if m == "post":
            counted = keys_u // n
        elif m == "pre":
            counted = keys_v // n
        elif keys_u.size:
            b = sp.csr_matrix((np.ones(u.size, dtype=np.int8), (u, v)), shape=(keys_u.size, keys_v.size))
            b.sum_duplicates()
            counted = keys_u[maximum_bipartite_matching(b, perm_type="column") >= 0] // n
        else:
            counted = keys_u
        out[m] = np.bincount(counted, minlength=world * world).reshape(world, world).astype(np.int64)
    return out


def compare_modes(
    indptr: np.ndarray, indices: np.ndarray, part: np.ndarray, world: int | None = None
) -> dict[str, dict[str, int]]:
    """Total and worst-rank rows sent per exchange under each mode (SuperGCN §5.4's bottleneck)."""
    rows = pair_rows(indptr, indices, part, world)
    return {m: {"total": int(r.sum()), "max_rank": int(r.sum(axis=1).max(initial=0))} for m, r in rows.items()}
