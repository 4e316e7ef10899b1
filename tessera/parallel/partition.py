"""Partition parallelism with halo exchange (SuperGCN §5.2): each rank owns a METIS part.

For owned features ``h`` the rank computes ``A h + R . all_to_all(S h)`` where ``A`` holds the
in-edges among owned vertices, ``S`` builds the rows this rank sends (a source row for
post-aggregated edges, a partial sum for pre-aggregated ones) and ``R`` adds the received rows
into their destinations (:mod:`tessera.graph.partition.halo` builds them). Backward is the
transpose through the reverse exchange. The exchange starts asynchronously and the local product
runs while it is in flight.

Everything a rank needs is local: self loops only touch ``A``, and GCN's symmetric normalisation
factorises as ``D^-1/2 Â D^-1/2 x = dis * (Â (dis * x))`` with ``dis_i`` computed from ``i``'s own
in-edges (and is kept in the values of ``A``, ``S`` and ``R``), so a rank built from its part file
alone trains the same model.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tessera.backends import LocalOperand
from tessera.comm.accounting import FORWARD, CommLog, Timer
from tessera.comm.exchange import Exchange
from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.graph.csr import CSRMatrix, rows_of
from tessera.graph.partition.halo import RankPlan, build_rank_plan, plan_from_part, row_edges
from tessera.graph.partition.relation_halo import PairPlan, build_pair_plan, pair_plan_from_part
from tessera.graph.relations import edge_types
from tessera.parallel.base import SPLITS, ExchangeOperand, Shard, Strategy, row_split
from tessera.parallel.halo_attention import UNTYPED, AttentionOperand, SourceGather, TypedInEdges
from tessera.parallel.halo_relational import PairExchange, PairOperand, exchange_bytes, transform_first_wins
from tessera.sparse import LayerSpec, Operand


@dataclass
class HaloMatrices:
    """One variant of a rank's plan as CSR matrices: ``A`` (owned x owned), ``S`` (sent x owned),
    ``R`` (owned x received) and the global in-degree of every owned row."""

    A: CSRMatrix
    S: CSRMatrix
    R: CSRMatrix
    in_degree: torch.Tensor


class HaloPlan:
    """A rank's halo plan and its variants (pattern, weighted, self loops, GCN normalisation),
    each built once and shared by every layer's operand."""

    def __init__(self, plan: RankPlan, in_weight: np.ndarray, exchange: Exchange, backend: str) -> None:
        self.plan, self.exchange, self.backend = plan, exchange, backend
        self._in_weight = np.asarray(in_weight, dtype=np.float64)  # weighted in-degree (= count unweighted)
        self._variants: dict[tuple, HaloMatrices] = {}

    def variant(self, kind: str, add_self_loops: bool = False, improved: bool = False) -> HaloMatrices:
        """``kind`` is ``pattern``, ``weighted`` or ``gcn``; the matrices are made once."""
        key = (kind, add_self_loops, improved)
        if key not in self._variants:
            self._variants[key] = self._make(kind, add_self_loops, improved)
        return self._variants[key]

    def _make(self, kind: str, add_self_loops: bool, improved: bool) -> HaloMatrices:
        p, n = self.plan, self.plan.n_owned
        weighted = kind != "pattern"
        a_indptr, a_cols, a_w = p.A.indptr, p.A.indices, p.A.weight if weighted else None
        deg, in_weight = p.in_degree_global, self._in_weight if weighted else p.in_degree_global.astype(np.float64)
        if add_self_loops:
            a_indptr, a_cols, a_w, deg, in_weight = _with_self_loops(
                a_indptr, a_cols, a_w, deg, in_weight, 2.0 if improved else 1.0
            )
        s_w, r_w = (p.S.weight, p.R.weight) if weighted else (None, None)
        if kind == "gcn":
            # D^-1/2 Â D^-1/2 folded into the values: A' = D A D, S' = S D (rows sent are built from
            # owned sources), R' = D R (received rows land in owned destinations); dis is local.
            dis = np.where(in_weight > 0, 1.0 / np.sqrt(np.maximum(in_weight, 1e-300)), 0.0)
            a_w = _ones_if_none(a_w, a_cols.size) * dis[rows_of(a_indptr)] * dis[a_cols]
            s_w = _ones_if_none(s_w, p.S.indices.size) * dis[p.S.indices]
            r_w = _ones_if_none(r_w, p.R.indices.size) * dis[rows_of(p.R.indptr)]
        return HaloMatrices(
            CSRMatrix.from_numpy(a_indptr, a_cols, _f32(a_w), n, n),
            CSRMatrix.from_numpy(p.S.indptr, p.S.indices, _f32(s_w), p.S.n_rows, n),
            CSRMatrix.from_numpy(p.R.indptr, p.R.indices, _f32(r_w), n, p.R.n_cols),
            torch.from_numpy(np.asarray(deg, dtype=np.int64)),
        )


def _ones_if_none(w: np.ndarray | None, size: int) -> np.ndarray:
    return np.ones(size) if w is None else w.astype(np.float64)


def _f32(w: np.ndarray | None) -> np.ndarray | None:
    return None if w is None else w.astype(np.float32)


def _with_self_loops(indptr, cols, w, deg, in_weight, fill: float):
    """``A`` with exactly one self loop per row (as :meth:`Graph.add_self_loops`), and the global
    in-degree and weighted in-degree that go with it."""
    rows = rows_of(indptr)
    n = indptr.size - 1
    loop = rows == cols
    loop_w = np.full(n, float(fill), dtype=np.float64)
    old_loop_w = np.bincount(rows[loop], weights=None if w is None else w[loop], minlength=n)
    loop_w[rows[loop]] = 1.0 if w is None else w[loop]
    keep = ~loop
    r = np.concatenate([rows[keep], np.arange(n)])
    c = np.concatenate([cols[keep], np.arange(n)])
    vals = None
    if w is not None or fill != 1.0:
        base = w[keep].astype(np.float64) if w is not None else np.ones(int(keep.sum()))
        vals = np.concatenate([base, loop_w])
    order = np.lexsort((c, r))
    new_indptr = np.concatenate([[0], np.cumsum(np.bincount(r, minlength=n))]).astype(np.int64)
    loops_per_row = np.bincount(rows[loop], minlength=n)
    new_deg = deg - loops_per_row + 1
    new_in_weight = in_weight - (old_loop_w if w is not None else loops_per_row) + loop_w
    return new_indptr, c[order], None if vals is None else vals[order].astype(np.float32), new_deg, new_in_weight


class HaloOperand(ExchangeOperand):
    """Layer ``layer``'s operand on this rank: local product plus the halo exchange."""

    def __init__(self, plan: HaloPlan, layer: int, mats: HaloMatrices) -> None:
        self.plan, self.layer, self.m = plan, layer, mats

    @property
    def num_rows(self) -> int:
        return self.m.A.num_rows

    @property
    def num_cols(self) -> int:
        return self.m.A.num_cols

    def _product(self, h: torch.Tensor, direction: int) -> torch.Tensor:
        """``A h + R . exchange(S h)`` forward, ``A^T g + S^T . exchange_back(R^T g)`` backward."""
        m, ex, log, layer = self.m, self.plan.exchange, self.plan.exchange.log, self.layer
        first, last = (m.S, m.R) if direction == FORWARD else (m.R, m.S)

        def mul(mat: CSRMatrix, t: torch.Tensor) -> torch.Tensor:
            a = LocalOperand(mat, self.plan.backend, mat.edge_weight)
            return a.spmm(t) if direction == FORWARD else a.spmm_t(t)

        h = h.contiguous()
        with Timer(log, layer, direction, "compute_s"):
            out_rows = mul(first, h)
        pending = ex.start(out_rows, layer, direction)
        with Timer(log, layer, direction, "compute_s"):
            out = mul(m.A, h)
        received = ex.finish(pending)
        with Timer(log, layer, direction, "compute_s"):
            out += mul(last, received)
        return out

    def in_degree(self) -> torch.Tensor:
        return self.m.in_degree

    def _variant(self, *args) -> HaloOperand:
        return HaloOperand(self.plan, self.layer, self.plan.variant(*args))

    def pattern(self) -> HaloOperand:
        return self._variant("pattern")

    def weighted(self) -> HaloOperand:
        return self._variant("weighted")

    def gcn_normalized(self, add_self_loops: bool = True, improved: bool = False) -> HaloOperand:
        return self._variant("gcn", add_self_loops, improved)

    def with_self_loops(self) -> HaloOperand:
        return self._variant("pattern", True)


class PartitionStrategy(Strategy):
    """Each rank owns a part of the vertices and exchanges halo rows every layer."""

    name = "partition"
    reads = ("remote_agg",)

    def shard(self, graph: Graph) -> Shard:
        graph.require("x", "y", "train_mask", "val_mask", "test_mask")
        return Shard.of_graph(graph, self.plan_rows(graph, row_split(graph, self.comm, self.options)))

    def plan_rows(self, graph: Graph, part: np.ndarray) -> torch.Tensor:
        """Build this rank's halo plan and exchange for the split ``part`` (the part of every
        vertex, one part per member of ``self.comm``) and return the global ids of its rows."""
        comm, opt = self.comm, self.options
        w = None if graph.edge_weight is None else graph.edge_weight.numpy()

        def plan_for(mode: str) -> RankPlan:
            return build_rank_plan(graph.indptr.numpy(), graph.indices.numpy(), w, part, mode, comm.rank, comm.world)

        plan = plan_for(opt.remote_agg)
        owned = torch.from_numpy(plan.owned.astype(np.int64))
        in_weight = graph.in_degree()[owned].numpy().astype(np.float64)
        if w is not None:
            wsum = np.zeros(graph.num_nodes)
            np.add.at(wsum, graph.dst_index().numpy(), w.astype(np.float64))
            in_weight = wsum[plan.owned]

        def typed() -> TypedInEdges | None:
            if graph.edge_type is None:
                return None
            t, r = edge_types(graph)
            indptr = graph.indptr.numpy()
            eid = row_edges(indptr, plan.owned)
            return TypedInEdges(
                np.concatenate([[0], np.cumsum(np.diff(indptr)[plan.owned])]), graph.indices.numpy()[eid], t[eid], r
            )

        def pairs() -> PairPlan | None:
            if graph.edge_type is None:
                return None
            t, r = edge_types(graph)
            return build_pair_plan(graph.indptr.numpy(), graph.indices.numpy(), t, r, part, comm.rank, comm.world)

        self._start(plan, in_weight, plan_for, typed, pairs)
        return owned

    def shard_from_part(self, data: dict[str, Any]) -> Shard:
        meta = data.get("meta", {})
        plan = plan_from_part(data, self.options.remote_agg)
        indptr = data["indptr"].astype(np.int64)
        w = data.get("weight")
        in_weight = np.diff(indptr).astype(np.float64)
        if w is not None:
            in_weight = np.bincount(rows_of(indptr), weights=w.astype(np.float64), minlength=indptr.size - 1)

        def typed() -> TypedInEdges | None:
            if "etype" not in data:
                return None
            return TypedInEdges(indptr, data["src"], data["etype"], int(meta.get("num_relations")))

        def pairs() -> PairPlan | None:
            return pair_plan_from_part(data, int(meta.get("num_relations"))) if "etype" in data else None

        self._start(plan, in_weight, lambda mode: plan_from_part(data, mode), typed, pairs)
        missing = [k for k in ("x", "y", *(f"{s}_mask" for s in SPLITS)) if k not in data]
        if missing:
            raise ConfigError(
                f"partition of {meta.get('name', 'graph')!r} has no {', '.join(missing)}; training needs it"
            )
        return Shard(
            ids=torch.from_numpy(plan.owned.astype(np.int64)),
            x=torch.from_numpy(np.ascontiguousarray(data["x"])).float(),
            y=torch.from_numpy(np.ascontiguousarray(data["y"])).long(),
            masks={s: torch.from_numpy(np.ascontiguousarray(data[f"{s}_mask"])) for s in SPLITS},
            num_classes=int(meta.get("num_classes")),
            name=meta.get("name", "graph"),
            fingerprint=str(data["fingerprint"]),
            num_nodes=int(meta.get("num_nodes", data["num_nodes"])),
            num_edges=int(meta.get("num_edges", 0)),
        )

    def _start(
        self,
        plan: RankPlan,
        in_weight: np.ndarray,
        plan_for: Callable[[str], RankPlan],
        typed: Callable[[], TypedInEdges | None],
        pairs: Callable[[], PairPlan | None],
    ) -> None:
        self.log = CommLog(self.comm.job_rank, self.comm.job_size)
        self.halo = HaloPlan(plan, in_weight, self._exchange(plan), self.options.backend)
        self._plan, self._plan_for, self._typed, self._pairs_for = plan, plan_for, typed, pairs
        self._gather: SourceGather | None = None
        self._pairs: PairExchange | None = None

    def _source_gather(self) -> SourceGather:
        """Attention and relational layers' post-mode exchange of remote source rows, made on first use."""
        if self._gather is None:
            post = self._plan if self._plan.mode == "post" else self._plan_for("post")
            self._gather = SourceGather(post, self._exchange(post), self._typed)
        return self._gather

    def _pair_exchange(self) -> PairExchange:
        """Relational layers' transform-first exchange of (relation, source) pair rows, made on first use."""
        if self._pairs is None:
            plan = self._pairs_for()
            if plan is None:
                raise ConfigError(UNTYPED)
            self._pairs = PairExchange(plan, self._exchange(plan), self.options.backend)
        return self._pairs

    def _exchange(self, plan: RankPlan | PairPlan) -> Exchange:
        exchange = Exchange(self.comm, plan.send_counts, plan.recv_counts)
        exchange.configure(self.options.exchange_bits(), self.log)
        return exchange

    def _transform_first(self, spec: LayerSpec) -> bool:
        """A relational layer's placement: fixed by ``spec``, or the one whose forward exchange
        moves fewer bytes over all ranks at ``--comm-bits`` (:func:`transform_first_wins`)."""
        if not spec.choose_placement:
            return not spec.aggregates_first
        bits = self.options.comm_bits
        gather, pairs = self._source_gather().plan.send_counts, self._pair_exchange().plan.send_counts
        mine = [exchange_bytes(gather, spec.in_width, bits), exchange_bytes(pairs, spec.out_width, bits)]
        total = self.comm.all_reduce_sum(torch.tensor(mine, dtype=torch.int64))
        return transform_first_wins(int(total[0]), int(total[1]))

    def operand(self, spec: LayerSpec, layer: int) -> Operand:
        backend = self.options.backend
        if spec.relations and self._transform_first(spec):
            return PairOperand(self._pair_exchange(), layer, backend)
        if spec.edge_values:
            return AttentionOperand(self._source_gather(), layer, backend)
        return HaloOperand(self.halo, layer, self.halo.variant("pattern"))
