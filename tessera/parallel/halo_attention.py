"""Attention layers (GAT) under partition parallelism: every in-edge of a rank's rows, local.

An attention coefficient needs both ends of its edge (``a_src[j] + a_dst[i]``) and a softmax over
all of ``i``'s in-edges, so partial sums (pre-aggregation) cannot carry it. Instead each rank
receives, once per layer, the rows of its remote sources (post-aggregation's exchange): their
features and their per-vertex attention terms in one block. Then the rank holds every in-edge of
its rows as one local matrix whose columns are its own rows followed by the received ones, and
computes attention and aggregation exactly as one process does. Backward sends the received rows'
gradients back to their owners, which add them into their own.

Relational layers (RGCN) placed to gather do the same: the received rows serve every relation, so
a layer exchanges its input rows once, not once per relation, and the rank runs the one-process
relational aggregation over its rows' typed in-edges (:meth:`SourceGather.typed_in_edges`). The
other placement, transform first, is :mod:`tessera.parallel.halo_relational`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tessera.backends import local_operand
from tessera.comm.accounting import BACKWARD, FORWARD
from tessera.comm.exchange import Exchange
from tessera.errors import ConfigError
from tessera.graph.csr import CSRMatrix, CSRStructure, rows_of
from tessera.graph.partition.halo import RankPlan
from tessera.relational.operand import RelationalOperand
from tessera.relational.plan import Relations
from tessera.sparse import Operand

UNTYPED = "this graph has no edge types: relational layers (RGCN) need a typed graph"


@dataclass(frozen=True)
class TypedInEdges:
    """A rank's in-edges with their relations: CSR over the owned rows (``indptr``), each edge's
    global source and relation, in the graph's order, and the graph's relation count."""

    indptr: np.ndarray
    src: np.ndarray
    edge_type: np.ndarray
    num_relations: int


class SourceGather:
    """The post-mode exchange of ``plan`` as a gather: owned rows -> owned rows + received rows.
    ``typed`` gives the rank's typed in-edges (None: the graph has no relations), read on first use."""

    def __init__(
        self, plan: RankPlan, exchange: Exchange, typed: Callable[[], TypedInEdges | None] | None = None
    ) -> None:
        if plan.mode != "post":
            raise ValueError(f"attention gathers sources with a post-mode plan, got {plan.mode!r}")
        self.plan, self.n_owned, self.exchange = plan, plan.n_owned, exchange
        self._matrices: dict[bool, CSRMatrix] = {}
        self._typed = typed
        self._typed_matrix: CSRMatrix | None = None
        # In post mode every sent row is one owned row: S is a selection matrix. It indexes the
        # step's rows, on the group's device; the received ids key per-edge draws, made on the host.
        self.send_rows = torch.from_numpy(plan.S.indices.astype(np.int64)).to(exchange.comm.device)
        self.recv_ids = torch.from_numpy(plan.recv_src.astype(np.int64))

    def in_edges(self, self_loops: bool) -> CSRMatrix:
        """Every in-edge of the owned rows over owned + received columns (made once per variant)."""
        if self_loops not in self._matrices:
            self._matrices[self_loops] = _local_in_edges(self.plan, self_loops)
        return self._matrices[self_loops]

    def typed_in_edges(self) -> CSRMatrix:
        """Every in-edge of the owned rows with its relation, over owned + received columns (as
        :meth:`in_edges`); a ConfigError when the graph has no edge types."""
        if self._typed_matrix is None:
            edges = self._typed() if self._typed is not None else None
            if edges is None:
                raise ConfigError(UNTYPED)
            self._typed_matrix = _typed_local(self.plan, edges)
        return self._typed_matrix

    def forward(self, flat: torch.Tensor, layer: int) -> torch.Tensor:
        """``flat`` (owned rows) with the received remote sources' rows appended."""
        ex = self.exchange
        received = ex.finish(ex.start(flat.index_select(0, self.send_rows), layer, FORWARD))
        return torch.cat([flat, received])

    def backward(self, grad: torch.Tensor, layer: int) -> torch.Tensor:
        """The owned rows' gradient: their own plus what the ranks that received them send back."""
        ex, n = self.exchange, self.n_owned
        back = ex.finish(ex.start(grad[n:].contiguous(), layer, BACKWARD))
        return grad[:n].index_add(0, self.send_rows, back.to(grad.dtype))


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, flat: torch.Tensor, gather: SourceGather, layer: int) -> torch.Tensor:
        ctx.gather, ctx.layer = gather, layer
        return gather.forward(flat, layer)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.gather.backward(grad, ctx.layer), None, None


def _local_in_edges(plan: RankPlan, self_loops: bool) -> CSRMatrix:
    """Every in-edge of the owned rows: columns ``0..n-1`` are owned rows, ``n + k`` received row
    ``k``; with ``self_loops`` exactly one loop per row (existing loops replaced, as one process does)."""
    n = plan.n_owned
    rows = np.concatenate([rows_of(plan.A.indptr), rows_of(plan.R.indptr)])
    cols = np.concatenate([plan.A.indices, n + plan.R.indices]).astype(np.int64)
    if self_loops:
        keep = rows != cols
        rows = np.concatenate([rows[keep], np.arange(n)])
        cols = np.concatenate([cols[keep], np.arange(n)])
    order = np.lexsort((cols, rows))
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(rows, minlength=n), out=indptr[1:])
    return CSRMatrix.from_numpy(indptr, cols[order], None, n, n + int(plan.R.n_cols))


def _typed_local(plan: RankPlan, edges: TypedInEdges) -> CSRMatrix:
    """``edges`` with each source as its column: owned sources ``0..n-1``, remote ones ``n + k``
    for received row ``k`` (a post-mode plan receives every remote source once)."""
    n, src = plan.n_owned, edges.src.astype(np.int64)
    pos = np.minimum(np.searchsorted(plan.owned, src), max(n - 1, 0))
    own = (plan.owned[pos] == src) if n else np.zeros(src.size, dtype=bool)
    recv = plan.recv_src
    by_id = np.argsort(recv, kind="stable")
    cols = np.where(own, pos, 0)
    cols[~own] = n + by_id[np.searchsorted(recv[by_id], src[~own])]
    m = CSRMatrix.from_numpy(edges.indptr.astype(np.int64), cols, None, n, n + int(plan.R.n_cols))
    m.edge_type = torch.from_numpy(edges.edge_type.astype(np.int64))
    m.num_relations = int(edges.num_relations)
    return m


class AttentionOperand(RelationalOperand):
    """Layer ``layer``'s operand for an attention layer on this rank (see the module docstring)."""

    edge_values = True

    def __init__(self, gather: SourceGather, layer: int, backend: str, self_loops: bool = False) -> None:
        self.gather, self.layer, self.backend, self.self_loops = gather, layer, backend, self_loops
        self.local = local_operand(gather.in_edges(self_loops), backend)

    @property
    def num_rows(self) -> int:
        return self.local.num_rows

    @property
    def num_cols(self) -> int:
        return self.local.num_cols

    def spmm(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return self.local.spmm(x, weight)

    def spmm_t(self, g: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return self.local.spmm_t(g, weight)

    def sddmm_dot(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.local.sddmm_dot(g, x)

    def in_degree(self) -> torch.Tensor:
        return self.local.in_degree()

    def edge_structure(self) -> CSRStructure:
        return self.local.matrix

    def gather_sources(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = self.gather.n_owned
        widths = [int(np.prod(x.shape[1:])) if x.dim() > 1 else 1 for x in xs]
        flat = torch.cat([x.reshape(n, w) for x, w in zip(xs, widths, strict=True)], 1)
        both = _Gather.apply(flat, self.gather, self.layer)
        parts = torch.split(both, widths, dim=1)
        return tuple(p.reshape(-1, *x.shape[1:]) for p, x in zip(parts, xs, strict=True))

    def edge_ids(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return rows, torch.cat([rows.to(torch.int64), self.gather.recv_ids])

    def relations(self) -> Relations:
        return local_operand(self.gather.typed_in_edges(), self.backend).relations()

    def _variant(self, self_loops: bool) -> AttentionOperand:
        if self_loops == self.self_loops:
            return self
        return AttentionOperand(self.gather, self.layer, self.backend, self_loops)

    def pattern(self) -> AttentionOperand:
        return self._variant(False)

    def with_self_loops(self) -> AttentionOperand:
        return self._variant(True)

    def weighted(self) -> Operand:
        raise ConfigError("an attention layer's operand has no edge weights (GAT ignores them)")

    def gcn_normalized(self, add_self_loops: bool = True, improved: bool = False) -> Operand:
        raise ConfigError("an attention layer's operand is not GCN-normalised: give gcn layers the halo operand")
