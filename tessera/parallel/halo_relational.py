"""Relational layers (RGCN) under partition parallelism, transformed first by the sources' owners.

A relational layer adds ``norm_e W_r x_j`` over every in-edge ``j -> i`` of relation ``r``. Placed
transform first, the owner of each remote source ``j`` computes ``W_r x_j`` (the layer's
effective per-relation weight, whatever its decomposition) once per distinct (relation, source)
pair some other rank needs, and sends each such rank the pair's row, ``out`` wide
(:mod:`tessera.graph.partition.relation_halo` builds the plan). The receiver adds the rows into
its own with its edges' factors (1, or ``1 / |N_r(i)|`` over the whole row for a mean) and runs
the one-process relational sum over its in-edges from its own sources. Backward sends the
received rows' gradients back to the owners, whose autograd turns them into the weight's and
their inputs' gradients.

The other placement gathers the remote sources' input rows, ``in`` wide, once per layer for all
relations (:mod:`tessera.parallel.halo_attention`). With no placement fixed, the strategy takes
the one whose forward exchange moves fewer bytes over all ranks (:func:`transform_first_wins`).
"""

from __future__ import annotations

from typing import NoReturn

import numpy as np
import torch

from tessera.backends import local_operand
from tessera.comm.accounting import BACKWARD, FORWARD
from tessera.comm.exchange import Exchange
from tessera.comm.wire import wire_bytes
from tessera.errors import ConfigError
from tessera.graph.csr import CSRMatrix
from tessera.graph.partition.relation_halo import PairPlan, TypedCSR, distinct_pairs
from tessera.graph.relations import edge_norm
from tessera.relational.operand import RelationalOperand
from tessera.relational.plan import Relations
from tessera.relational.variants import segment_matmul
from tessera.sparse import Operand, aggregate


def exchange_bytes(counts, width: int, bits: int) -> int:
    """Wire bytes of one exchange whose blocks hold ``counts`` rows of ``width`` values (one
    block per peer, or per ordered pair of ranks for a sender x receiver matrix)."""
    return int(np.sum(wire_bytes(np.asarray(counts, dtype=np.int64), int(width), bits)))


def transform_first_wins(gather_bytes: int, pair_bytes: int) -> bool:
    """The automatic placement of a relational layer: transform first when its forward exchange
    moves strictly fewer bytes than the gather's; a tie gathers (no transforms computed for other
    ranks, and a layer on the raw features sends no gradients back)."""
    return pair_bytes < gather_bytes


def _typed_matrix(edges: TypedCSR, num_rows: int, num_cols: int, num_relations: int) -> CSRMatrix:
    m = CSRMatrix.from_numpy(edges.indptr, edges.indices, None, num_rows, num_cols)
    m.edge_type = torch.from_numpy(edges.edge_type)
    m.num_relations = int(num_relations)
    m.relation_degree = torch.from_numpy(edges.degree)
    return m


class PairExchange:
    """A rank's transform-first exchange of :class:`PairPlan` ``plan`` and the matrices its
    relational layers multiply with, shared by every such layer."""

    def __init__(self, plan: PairPlan, exchange: Exchange, backend: str) -> None:
        self.plan, self.exchange, self.backend = plan, exchange, backend
        n, r = plan.n_owned, plan.num_relations
        self.local = _typed_matrix(plan.local, n, n, r)
        self.remote_edges = _typed_matrix(plan.remote, n, int(plan.recv_counts.sum()), r)
        self._remote_operands: dict[str, Operand] = {}
        # every distinct pair sent, ordered by relation: transformed once however many peers need it
        first, sent_pair = distinct_pairs(plan.send_rel, plan.send_src, np.zeros_like(plan.send_src))
        rel = plan.send_rel[first]
        # the step's row selections live on the group's device; the segment bounds are read on the host
        device = exchange.comm.device
        self.pair_src = torch.from_numpy(plan.send_src[first]).to(device)
        self.pair_ptr = torch.from_numpy(np.searchsorted(rel, np.arange(r + 1)).astype(np.int64))
        self.sent_pair = torch.from_numpy(sent_pair).to(device)

    def remote(self, reduce: str) -> Operand:
        """The received pair rows -> owned rows, each edge's entry its factor under ``reduce``."""
        if reduce not in self._remote_operands:
            m, e = self.remote_edges, self.plan.remote
            weighted = CSRMatrix.from_numpy(e.indptr, e.indices, edge_norm(m, reduce), m.num_rows, m.num_cols)
            self._remote_operands[reduce] = local_operand(weighted, self.backend).weighted()
        return self._remote_operands[reduce]

    def received_sum(self, x: torch.Tensor, weight: torch.Tensor, reduce: str, layer: int) -> torch.Tensor:
        """Every remote in-edge's ``norm_e W_r x_j`` summed into the owned rows: this rank's pairs
        transformed and sent, the other ranks' received and reduced."""
        sent = segment_matmul(x.index_select(0, self.pair_src), self.pair_ptr, weight).index_select(0, self.sent_pair)
        return aggregate(self.remote(reduce), _Exchanged.apply(sent, self.exchange, layer), "sum")


class _Exchanged(torch.autograd.Function):
    """Rows sent forward by an :class:`Exchange`; their gradients sent back the other way."""

    @staticmethod
    def forward(ctx, rows: torch.Tensor, exchange: Exchange, layer: int) -> torch.Tensor:
        ctx.exchange, ctx.layer = exchange, layer
        return exchange.finish(exchange.start(rows.contiguous(), layer, FORWARD))

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        ex = ctx.exchange
        return ex.finish(ex.start(grad.contiguous(), ctx.layer, BACKWARD)), None, None


class PairOperand(RelationalOperand):
    """Layer ``layer``'s operand for a relational layer placed transform first on this rank: its
    relations span the in-edges from owned sources; the remote ones arrive as pair rows
    (:meth:`relational_sources`). It offers relational sums only."""

    def __init__(self, pairs: PairExchange, layer: int, backend: str) -> None:
        self.pairs, self.layer, self.backend = pairs, layer, backend

    @property
    def num_rows(self) -> int:
        return self.pairs.local.num_rows

    @property
    def num_cols(self) -> int:
        return self.pairs.local.num_cols

    def relations(self) -> Relations:
        return local_operand(self.pairs.local, self.backend).relations()

    def relational_sources(
        self, x: torch.Tensor, weight: torch.Tensor, reduce: str
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        return x, self.pairs.received_sum(x, weight, reduce, self.layer)

    def in_degree(self) -> torch.Tensor:
        return self.pairs.local.in_degree() + self.pairs.remote_edges.in_degree()

    def _refuse(self) -> NoReturn:
        raise ConfigError(
            "a relational layer placed transform first offers relational sums only; give other layers the halo operand"
        )

    def spmm(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return self._refuse()

    def spmm_t(self, g: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return self._refuse()

    def sddmm_dot(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._refuse()

    def pattern(self) -> Operand:
        return self._refuse()

    def weighted(self) -> Operand:
        return self._refuse()

    def gcn_normalized(self, add_self_loops: bool = True, improved: bool = False) -> Operand:
        return self._refuse()

    def with_self_loops(self) -> Operand:
        return self._refuse()
