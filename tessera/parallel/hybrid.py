"""Hybrid tensor-data parallelism (NeutronAscend §5.2): P = M x G ranks in an M x G grid.

Rank ``r`` owns part ``r`` of the P-way row split every strategy shares at layer boundaries
(:func:`~tessera.parallel.base.row_split`), so layers can change strategy with no extra traffic.
The G-way split nests it: G-part ``g`` is the union of the M consecutive parts ``g M .. g M + M - 1``
(METIS numbers its parts so that neighbouring ids are neighbouring regions: on synthetic:arxiv at
P = 4, 16 and 64, every M, the G-parts made this way send 0.4-5.2 % more prepost halo rows than a
direct G-way METIS split, and cut up to 14 % more edges). The *row group* of G-part ``g`` is its
M ranks; the *column group* ``c`` is the G ranks ``g M + c``, one per G-part.

An aggregation at width D runs as the tensor strategy does inside each row group (its
:class:`~tessera.parallel.tensor.TensorOperand`, over the row group's process group): one
all-to-all turns the M members' rows into M column slices of all the G-part's rows (member ``c``
gets columns ``column_bounds(D, M)[c:c+2]``), member ``c`` aggregates its slice with the partition
strategy's halo exchange among column group ``c`` (a
:class:`~tessera.parallel.partition.PartitionStrategy` over the column group's process group, at
width about D / M: its plan, ``--remote-agg`` mode, quantization and accounting), and a second
all-to-all returns every member its rows. Backward is the transpose. M = 1 is partition
parallelism (row groups of one rank, nothing crosses them) and M = P tensor parallelism (one
G-part: the halo exchange sends nothing). Every exchange is counted in one log over the job's ranks.
``--pipeline-stages S`` sends the all-to-all back in tensor parallelism's S row batches (the same
blocks and bytes), but the halo product is computed whole before the first batch leaves, so no
exchange overlaps aggregation yet.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from tessera.comm.accounting import FORWARD
from tessera.comm.exchange import BlockExchange
from tessera.comm.group import subgroup
from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.parallel.base import Shard, Strategy, row_split
from tessera.parallel.partition import PartitionStrategy
from tessera.parallel.tensor import TensorOperand, TensorPlan, check_layers, refuse_relational, stage_rows
from tessera.sparse import LayerSpec, Operand


def check_groups(world: int, groups: int) -> None:
    """Raise :class:`ConfigError` unless ``groups`` (M) is at least 1 and divides ``world`` (P)."""
    if groups < 1:
        raise ConfigError(f"--groups must be at least 1, got {groups}")
    if world % groups:
        fits = ", ".join(str(m) for m in range(1, world + 1) if world % m == 0)
        raise ConfigError(f"--groups {groups} does not divide the {world} ranks; choose one of {fits}")


def refuse_attention(specs: list[LayerSpec]) -> None:
    """Raise :class:`ConfigError` for attention and relational layers (the runtime and the simulator
    both ask)."""
    refuse_relational(specs, "hybrid")
    if any(s.edge_values for s in specs):
        raise ConfigError(
            "the hybrid strategy runs gcn, sage and gin, not gat: use --strategy partition, tensor or one process"
        )


def hybrid_layout(world: int, groups: int) -> np.ndarray:
    """``(G, M)`` int64: ``[g, c]`` is the rank of row group ``g``'s member ``c`` (``g M + c``); row
    ``g`` lists a row group, column ``c`` a column group."""
    check_groups(world, groups)
    return np.arange(world, dtype=np.int64).reshape(world // groups, groups)


class HybridPlan(TensorPlan):
    """A row group's tensor plan (its members' row counts, this rank's place, its exchange) and
    the permutations between its block order (member 0's rows, member 1's, ... each by id) and
    the id order of the G-part, in which the halo plan numbers the rows."""

    def __init__(self, ids: np.ndarray, counts: list[int], rank: int, backend: str, log, exchange, stages: int) -> None:
        # no graph: the column group's halo plan holds the G-part's structure
        super().__init__(None, counts, rank, backend, log, exchange, stages, torch.from_numpy(ids))  # type: ignore[arg-type]
        order = np.argsort(ids, kind="stable")  # block position of each row in id order
        inverse = np.empty_like(order)
        inverse[order] = np.arange(order.size)
        identity = bool((order == np.arange(order.size)).all())
        self.to_ids = None if identity else torch.from_numpy(order)
        # per pipeline stage: the id-order positions of the stage's rows (each member's k-th run), in block order
        runs = stage_rows(counts, stages)
        bounds = (
            np.concatenate([np.zeros((len(counts), 1), dtype=np.int64), runs.cumsum(1)], 1) + self.offsets[:-1, None]
        )
        self.stage_rows = [
            torch.from_numpy(inverse[np.concatenate([np.arange(a, b) for a, b in zip(bounds[:, k], bounds[:, k + 1])])])
            for k in range(stages)
        ]
        self.own = torch.from_numpy(inverse[self.rows])  # this rank's rows, in id order positions
        self.identity = identity and stages == 1


class HybridOperand(TensorOperand):
    """Layer ``layer``'s operand: the row group's all-to-alls around the column group's halo product."""

    plan: HybridPlan

    def _aggregate(self, cols: torch.Tensor, direction: int) -> Iterator[torch.Tensor]:
        p = self.plan
        x = cols if p.to_ids is None else cols.index_select(0, p.to_ids)
        y = self.local.spmm(x) if direction == FORWARD else self.local.spmm_t(x)
        if p.identity:
            yield y
            return
        for rows in p.stage_rows:
            yield y.index_select(0, rows)

    def in_degree(self) -> torch.Tensor:
        return self.local.in_degree()[self.plan.own]

    def _variant(self, local) -> HybridOperand:
        return HybridOperand(self.plan, self.comm, self.layer, local)


class HybridStrategy(Strategy):
    """M tensor-parallel column slices of G data-parallel (halo-exchanging) parts."""

    name = "hybrid"
    reads = ("groups", "remote_agg", "pipeline_stages")

    def check(self, specs: list[LayerSpec]) -> None:
        check_groups(self.comm.world, self.options.groups)
        refuse_attention(specs)
        check_layers(specs, self.options.pipeline_stages)  # the tensor strategy's: its pipeline stages

    def shard(self, graph: Graph) -> Shard:
        graph.require("x", "y", "train_mask", "val_mask", "test_mask")
        comm, opt = self.comm, self.options
        layout = hybrid_layout(comm.world, opt.groups)
        if graph.num_nodes < comm.world:
            raise ConfigError(
                f"cannot split {graph.num_nodes} vertices over {comm.world} ranks (more ranks than vertices); "
                f"use at most {graph.num_nodes} processes (--nprocs)"
            )
        part = row_split(graph, comm, opt)
        self.rows_comm = subgroup(comm, layout.tolist())
        columns = subgroup(comm, layout.T.tolist())
        # the column group's halo exchange among the G-parts (part // M: M consecutive parts each)
        self.halo = PartitionStrategy(columns, opt)
        part_ids = self.halo.plan_rows(graph, part // opt.groups).numpy()
        self.log = self.halo.log
        exchange = BlockExchange(self.rows_comm)
        exchange.configure(opt.exchange_bits(), self.log)
        rows = [np.flatnonzero(part == r) for r in layout[comm.rank // opt.groups]]
        ids = np.concatenate(rows)
        assert np.array_equal(np.sort(ids), part_ids), "the G-part must be its row group's rows"
        self.plan = HybridPlan(
            ids, [r.size for r in rows], self.rows_comm.rank, opt.backend, self.log, exchange, opt.pipeline_stages
        )
        return Shard.of_graph(graph, torch.from_numpy(rows[self.rows_comm.rank].astype(np.int64)))

    def operand(self, spec: LayerSpec, layer: int) -> Operand:
        # the halo operand in the place of the tensor strategy's local one: HybridOperand uses only
        # what every operand has of it
        return HybridOperand(self.plan, self.rows_comm, layer, self.halo.operand(spec, layer))  # type: ignore[arg-type]
