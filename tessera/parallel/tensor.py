"""Tensor (feature) parallelism: MixGCN's mixture of parallelism (§3.1, Algorithm 2).

At a layer boundary every rank holds its own rows, the same row split as partition parallelism,
so strategies can change between layers with no extra traffic. Inside an aggregation one
all-to-all turns the node split into a feature split: rank ``i`` then holds columns
``[floor(d i / P), floor(d (i + 1) / P))`` of every vertex, multiplies them by the whole graph
on the local backends, and a second all-to-all gives every rank its rows back. The backward pass
is the transpose. Each rank sends ``n_i (d - w_i)`` values per all-to-all whatever the graph's cut,
so the volume does not grow with P (Prop. 3.4), and the work is balanced by construction
(Prop. 3.3). Widths not divisible by P, and P above the width (empty column slices), work.

Every rank multiplies by the whole graph, so each holds its structure (``graph`` in the rank-block
vertex order: rank 0's rows, then rank 1's, ...). Attention (GAT) is not run here: its per-edge
softmax needs every head's full feature rows of both endpoints, which the column split divides.
"""

from __future__ import annotations

import numpy as np
import torch

from tessera.backends import LocalOperand, local_operand
from tessera.comm.accounting import FORWARD, CommLog, Timer
from tessera.comm.exchange import all_to_all_flat
from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.graph.order import permute_graph
from tessera.parallel.base import ExchangeOperand, Shard, Strategy, row_split
from tessera.sparse import LayerSpec, Operand


def column_bounds(width: int, world: int) -> list[int]:
    """``[floor(width * i / world) for i in 0..world]``: rank ``i`` holds columns ``[b[i], b[i+1])``."""
    return [width * i // world for i in range(world + 1)]


def exchange_sizes(counts: list[int] | np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Elements rank ``i`` sends rank ``j`` (``[i, j]``, int64 ``P x P``) in one aggregation at
    ``width``: to the feature split (``n_i w_j``: its rows of ``j``'s columns) and back to the node
    split (``n_j w_i``: ``j``'s rows of its columns). The diagonal stays on the rank. The runtime
    sizes its all-to-alls and the simulator its volumes from this one function."""
    n = np.asarray(counts, dtype=np.int64)
    b = np.asarray(column_bounds(width, n.size), dtype=np.int64)
    w = np.diff(b)
    return np.outer(n, w), np.outer(w, n)


class TensorPlan:
    """The whole graph in rank-block order and this rank's place in it."""

    def __init__(self, graph: Graph, counts: list[int], rank: int, backend: str, log: CommLog) -> None:
        self.graph, self.counts, self.rank, self.backend, self.log = graph, counts, rank, backend, log
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)

    @property
    def rows(self) -> slice:
        """This rank's rows in the rank-block order."""
        return slice(int(self.offsets[self.rank]), int(self.offsets[self.rank + 1]))


class TensorOperand(ExchangeOperand):
    """Layer ``layer``'s operand: node split -> feature split, whole-graph product, and back."""

    def __init__(self, plan: TensorPlan, comm, layer: int, local: LocalOperand) -> None:
        self.plan, self.comm, self.layer, self.local = plan, comm, layer, local

    @property
    def num_rows(self) -> int:
        return self.plan.counts[self.plan.rank]

    @property
    def num_cols(self) -> int:
        return self.plan.counts[self.plan.rank]

    def _exchange(self, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int], direction: int):
        me = self.plan.rank
        log = self.plan.log
        sent = [0 if q == me else s for q, s in enumerate(send_sizes)]
        log.record(self.layer, direction, sent, 1, 32)  # one float per counted element
        with Timer(log, self.layer, direction, "exchange_s"):
            return all_to_all_flat(self.comm, send, send_sizes, recv_sizes)

    def _product(self, x: torch.Tensor, direction: int) -> torch.Tensor:
        p, world, me = self.plan, self.comm.world, self.plan.rank
        n = p.counts
        h = x.reshape(x.shape[0], -1)
        width = h.shape[1]
        b = column_bounds(width, world)
        w = [b[j + 1] - b[j] for j in range(world)]
        to_cols, to_rows = (m.tolist() for m in exchange_sizes(n, width))
        # node split -> feature split: peer j gets my rows' columns [b[j], b[j+1])
        send = torch.cat([h[:, b[j] : b[j + 1]].reshape(-1) for j in range(world)])
        cols = self._exchange(send, to_cols[me], [row[me] for row in to_cols], direction)
        cols = cols.view(sum(n), w[me])
        with Timer(p.log, self.layer, direction, "compute_s"):
            y = self.local.spmm(cols) if direction == FORWARD else self.local.spmm_t(cols)
        # feature split -> node split: peer j gets its rows of my columns
        back = self._exchange(y.contiguous().view(-1), to_rows[me], [row[me] for row in to_rows], direction)
        out = h.new_empty((n[me], width))
        start = 0
        for q in range(world):
            out[:, b[q] : b[q + 1]] = back[start : start + n[me] * w[q]].view(n[me], w[q])
            start += n[me] * w[q]
        # a fresh tensor, not a view of one: layers may add to it in place
        return out if x.dim() == 2 else out.view(n[me], *x.shape[1:]).clone()

    def in_degree(self) -> torch.Tensor:
        return self.local.in_degree()[self.plan.rows]

    def _variant(self, local: LocalOperand) -> TensorOperand:
        return TensorOperand(self.plan, self.comm, self.layer, local)

    def pattern(self) -> TensorOperand:
        return self._variant(self.local.pattern())

    def weighted(self) -> TensorOperand:
        return self._variant(self.local.weighted())

    def gcn_normalized(self, add_self_loops: bool = True, improved: bool = False) -> TensorOperand:
        return self._variant(self.local.gcn_normalized(add_self_loops, improved))

    def with_self_loops(self) -> TensorOperand:
        return self._variant(self.local.with_self_loops())


class TensorStrategy(Strategy):
    """MixGCN's mixture of parallelism: feature-split aggregation between node-split layers."""

    name = "tensor"

    def check(self, specs: list[LayerSpec]) -> None:
        if any(s.edge_values for s in specs):
            raise ConfigError(
                "the tensor strategy runs gcn, sage and gin, not gat: use --strategy partition or one process"
            )
        if self.options.comm_bits != 32:
            raise ConfigError(
                "the tensor strategy exchanges 32-bit values: drop --comm-bits or use --strategy partition"
            )

    def shard(self, graph: Graph) -> Shard:
        graph.require("x", "y", "train_mask", "val_mask", "test_mask")
        part = row_split(graph, self.comm, self.options)
        world = self.comm.world
        order = np.argsort(part, kind="stable")  # rank 0's rows, then rank 1's, ... each by id
        counts = np.bincount(part, minlength=world).astype(np.int64).tolist()
        structure = Graph(graph.indptr, graph.indices, graph.num_nodes, edge_weight=graph.edge_weight)
        self.log = CommLog(self.comm.rank, world)
        self.plan = TensorPlan(permute_graph(structure, order), counts, self.comm.rank, self.options.backend, self.log)
        owned = torch.from_numpy(order[self.plan.rows].astype(np.int64))
        return Shard.of_graph(graph, owned)

    def operand(self, spec: LayerSpec, layer: int) -> Operand:
        return TensorOperand(self.plan, self.comm, layer, local_operand(self.plan.graph, self.plan.backend))
