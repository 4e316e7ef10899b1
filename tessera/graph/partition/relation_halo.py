"""Per-rank plans of the transform-first exchange of relational layers (RGCN), pure numpy.

A relational layer adds ``norm_e W_r x_j`` over every in-edge ``e = j -> i`` of relation ``r``
(``norm_e``: 1, or ``1 / |N_r(i)|`` for a per-relation mean). Under partition parallelism a rank
either gathers its remote sources' input rows (the post-mode plan of :mod:`.halo`) or has the
owner of each remote source transform first: rank ``p`` computes ``W_r x_j`` once per distinct
(relation ``r``, owned source ``j``) pair that some in-edge of rank ``q``'s rows carries, and sends
``q`` one row per such pair. ``q`` adds the received pair rows into its rows with its edges'
factors (:attr:`PairPlan.remote`), and sums its in-edges from its own sources locally
(:attr:`PairPlan.local`); both carry each edge's relation degree over the whole row (local and
remote in-edges), which a per-relation mean divides by.

Within a peer's block pairs are ordered by source (global id; owned local ids sort alike), then
relation, so both ends order a block alike from their own edges, and each rank builds its plan
alone, from the global graph or from its part file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np

from tessera.graph.csr import rows_of
from tessera.graph.partition.halo import graph_rank_inputs, part_rank_inputs, row_edges


class TypedCSR(NamedTuple):
    """Some in-edges of a rank's rows, CSR over the rows in the graph's edge order: each edge's
    column, relation, and relation degree (its row's in-edges of that relation in the whole graph)."""

    indptr: np.ndarray
    indices: np.ndarray
    edge_type: np.ndarray
    degree: np.ndarray


@dataclass
class PairPlan:
    """Rank ``rank``'s transform-first exchange (see the module docstring). Sent pair rows are
    peer blocks in rank order; ``local`` holds the in-edges from owned sources (columns: owned
    local ids), ``remote`` those from other ranks' sources (columns: received pair rows)."""

    rank: int
    world: int
    num_relations: int
    owned: np.ndarray  # global ids, sorted; local id = position
    send_src: np.ndarray  # int64 per sent pair row: its source's local id
    send_rel: np.ndarray  # int64 per sent pair row: its relation
    send_counts: np.ndarray  # int64 (world,): pair rows sent to each peer
    recv_counts: np.ndarray  # int64 (world,): pair rows received from each peer
    local: TypedCSR
    remote: TypedCSR

    @property
    def n_owned(self) -> int:
        """Number of owned vertices."""
        return int(self.owned.size)


def distinct_pairs(group: np.ndarray, vertex: np.ndarray, rel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct ``(group, vertex, rel)`` triples ordered by group, vertex, relation: the
    position of one input holding each, and each input's triple number."""
    order = np.lexsort((rel, vertex, group))
    g, v, r = group[order], vertex[order], rel[order]
    new = np.ones(order.size, dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (v[1:] != v[:-1]) | (r[1:] != r[:-1])
    inverse = np.empty(order.size, dtype=np.int64)
    inverse[order] = np.cumsum(new) - 1
    return order[new], inverse


def _typed(rows: np.ndarray, cols: np.ndarray, rel: np.ndarray, degree: np.ndarray, n: int) -> TypedCSR:
    """Edges already in row-major order as a :class:`TypedCSR` over ``n`` rows."""
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=n), out=indptr[1:])
    return TypedCSR(indptr, cols.astype(np.int64), rel.astype(np.int64), degree.astype(np.int64))


def _build(
    rank: int,
    world: int,
    num_relations: int,
    owned: np.ndarray,
    in_indptr: np.ndarray,
    in_src: np.ndarray,
    in_type: np.ndarray,
    in_owner: np.ndarray,
    out_src: np.ndarray,
    out_type: np.ndarray,
    out_owner: np.ndarray,
) -> PairPlan:
    """Assemble the plan from the rank's typed in-edges (CSR over owned rows, global sources,
    their owners) and its outgoing cut edges (local source, relation, destination owner)."""
    n = owned.size
    dst = rows_of(in_indptr)
    in_type = in_type.astype(np.int64)
    _, at, degree = np.unique(dst * max(num_relations, 1) + in_type, return_inverse=True, return_counts=True)
    degree = degree[at.reshape(-1)]
    loc = in_owner == rank
    local = _typed(dst[loc], np.searchsorted(owned, in_src[loc]), in_type[loc], degree[loc], n)
    cut = ~loc
    first, pair = distinct_pairs(in_owner[cut], in_src[cut], in_type[cut])
    remote = _typed(dst[cut], pair, in_type[cut], degree[cut], n)
    out_type = out_type.astype(np.int64)
    sent, _ = distinct_pairs(out_owner, out_src, out_type)
    return PairPlan(
        rank=rank,
        world=world,
        num_relations=num_relations,
        owned=owned.astype(np.int64),
        send_src=out_src[sent].astype(np.int64),
        send_rel=out_type[sent],
        send_counts=np.bincount(out_owner[sent], minlength=world).astype(np.int64),
        recv_counts=np.bincount(in_owner[cut][first], minlength=world).astype(np.int64),
        local=local,
        remote=remote,
    )


def build_pair_plan(
    indptr: np.ndarray,
    indices: np.ndarray,
    edge_type: np.ndarray,
    num_relations: int,
    part: np.ndarray,
    rank: int,
    world: int | None = None,
) -> PairPlan:
    """Rank ``rank``'s plan from the global destination-major CSR, its edge types and the part vector."""
    world, (owned, in_indptr, in_src, _, in_owner, out_src, _, _, out_owner), out_e = graph_rank_inputs(
        indptr, indices, None, part, rank, world
    )
    t = np.asarray(edge_type).astype(np.int64, copy=False)
    in_type = t[row_edges(np.asarray(indptr).astype(np.int64, copy=False), owned)]
    return _build(rank, world, num_relations, owned, in_indptr, in_src, in_type, in_owner, out_src, t[out_e], out_owner)


def pair_plan_from_part(data: dict[str, Any], num_relations: int) -> PairPlan:
    """Rank ``data['rank']``'s plan from its own part file (with edge types)."""
    owned, in_indptr, in_src, _, in_owner, out_src, _, _, out_owner = part_rank_inputs(data)
    return _build(
        int(data["rank"]),
        int(data["parts"]),
        num_relations,
        owned,
        in_indptr,
        in_src,
        data["etype"],
        in_owner,
        out_src,
        data["out_etype"],
        out_owner,
    )


def relation_pair_rows(
    indptr: np.ndarray, indices: np.ndarray, edge_type: np.ndarray, part: np.ndarray, world: int
) -> np.ndarray:
    """Pair rows each rank ``p`` sends each rank ``q`` per transform-first exchange (the plans'
    ``send_counts``), a ``(world, world)`` int64 matrix: the distinct (relation, source) pairs of
    the edges from ``p``'s sources into ``q``'s rows."""
    indptr, indices, part = (np.asarray(a).astype(np.int64, copy=False) for a in (indptr, indices, part))
    dst = rows_of(indptr)
    ps, pd = part[indices], part[dst]
    cut = np.flatnonzero(ps != pd)
    peers = ps[cut] * world + pd[cut]
    first, _ = distinct_pairs(peers, indices[cut], np.asarray(edge_type).astype(np.int64, copy=False)[cut])
    return np.bincount(peers[first], minlength=world * world).reshape(world, world).astype(np.int64)
