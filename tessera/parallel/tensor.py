"""Tensor (feature) parallelism: MixGCN's mixture of parallelism (§3.1, Algorithm 2).

At a layer boundary every rank holds its own rows, the same row split as partition parallelism,
so strategies can change between layers with no extra traffic. Inside an aggregation one
all-to-all turns the node split into a feature split: rank ``i`` then holds columns
``[floor(d i / P), floor(d (i + 1) / P))`` of every vertex, multiplies them by the whole graph
on the local backends, and a second all-to-all gives every rank its rows back. The backward pass
is the transpose. Each rank sends ``n_i (d - w_i)`` values per all-to-all whatever the graph's cut,
so the volume does not grow with P (Prop. 3.4), and the work is balanced by construction
(Prop. 3.3). Widths not divisible by P, and P above the width (empty column slices), work.
Both all-to-alls go through :class:`~tessera.comm.exchange.BlockExchange`: ``--comm-bits`` below
32 quantizes them in the halo exchange's wire format, counted the same way.

Fine-grained pipeline (§3.2.2, ``pipeline_stages`` s > 1): the product's output rows are cut into
s batches, batch ``k`` holding the ``k``-th of s equal runs of every rank's rows
(:func:`stage_rows`), so each batch's all-to-all returns a piece to every rank. Batch ``k``'s
all-to-all back to the node split is in flight while batch ``k + 1`` is aggregated. The
all-to-all into the feature split is not pipelined: any output row may need any rank's rows,
so a batch can start only once every rank's columns have arrived (an idle-free pipeline on that
side needs a bandwidth-limited order, Prop. 3.5: :mod:`tessera.graph.bandwidth` reports it). A
batch is the same rows of the same matrix multiplied on the backend the whole product would use,
so the result equals the unpipelined product bit for bit in float32 (below 32 bits the batches'
blocks form other quantization groups, so the rounding differs, unbiased all the same).

Every rank multiplies by the whole graph, so each holds its structure (``graph`` in the rank-block
vertex order: rank 0's rows, then rank 1's, ...): one read-only copy per host, mapped by each of
its ranks, with the normalised and transposed graphs the layers derive from it
(:mod:`tessera.parallel.shared_graph`). Attention layers (GAT) stay exact: their
per-vertex attention terms are computed in the node split and all-gathered (N x 2 heads scalars),
every rank computes every edge's coefficient and multiplies its column slice by them, and the
coefficients' gradient shares meet in one reduce-scatter (:mod:`tessera.parallel.tensor_attention`);
they run unpipelined.
"""

from __future__ import annotations

import numpy as np
import torch

from tessera.backends import LocalOperand
from tessera.comm.accounting import BACKWARD, FORWARD, CommLog, Timer
from tessera.comm.exchange import BlockExchange, Blocks
from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.graph.csr import CSRMatrix, CSRStructure, rows_of
from tessera.graph.order import permute_graph
from tessera.memo import PlanCache
from tessera.parallel.base import ExchangeOperand, Shard, Strategy, row_split
from tessera.parallel.shared_graph import SharedOperand, shared_graph
from tessera.parallel.tensor_attention import TermExchange, gather_terms, slice_sddmm, slice_spmm
from tessera.sparse import LayerSpec, Operand

TO_COLS, TO_ROWS = 1, 2  # exchange tags: node -> feature split; feature -> node split (stage k: TO_ROWS + k)
_batches = PlanCache()  # per matrix: its row batches, per direction, stage count and row split


def column_bounds(width: int, world: int) -> list[int]:
    """``[floor(width * i / world) for i in 0..world]``: rank ``i`` holds columns ``[b[i], b[i+1])``."""
    return [width * i // world for i in range(world + 1)]


def stage_rows(counts: list[int] | np.ndarray, stages: int) -> np.ndarray:
    """``(P, stages)`` int64: rows of rank ``q``'s block in pipeline stage ``k``, the ``k``-th of
    ``stages`` near-equal consecutive runs of its ``counts[q]`` rows (``n k // s`` to ``n (k + 1) // s``)."""
    n = np.asarray(counts, dtype=np.int64).reshape(-1, 1)
    k = np.arange(stages + 1, dtype=np.int64)
    return np.diff(n * k // int(stages), axis=1)


def exchange_blocks(counts: list[int] | np.ndarray, width: int, stages: int = 1) -> list[tuple[np.ndarray, np.ndarray]]:
    """The blocks of one aggregation's all-to-alls at ``width``: ``(rows, widths)``, two int64
    ``P x P`` matrices per all-to-all, ``[i, j]`` the block rank ``i`` sends rank ``j``. First the
    node -> feature split (``n_i`` rows of ``j``'s ``w_j`` columns), then one per pipeline stage
    back to the node split (``j``'s stage-``k`` rows of ``i``'s ``w_i`` columns). A block without
    values has no rows. The diagonal stays on the rank. The runtime sizes its all-to-alls and the
    simulator its bytes from this one function."""
    n = np.asarray(counts, dtype=np.int64)
    w = np.diff(np.asarray(column_bounds(width, n.size), dtype=np.int64))
    ones = np.ones((n.size, n.size), dtype=np.int64)
    out = [(np.outer(n, w > 0), ones * w[None, :])]
    for c in stage_rows(n, stages).T:
        out.append((np.outer(w > 0, c), ones * w[:, None]))
    return out


def exchange_sizes(counts: list[int] | np.ndarray, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Elements rank ``i`` sends rank ``j`` (``[i, j]``, int64 ``P x P``) in one aggregation at
    ``width``: to the feature split (``n_i w_j``) and back to the node split (``n_j w_i``)."""
    (r0, w0), (r1, w1) = exchange_blocks(counts, width)
    return r0 * w0, r1 * w1


def row_batches(matrix: CSRStructure, weight: torch.Tensor | None, counts, stages: int, transposed: bool):
    """The product's output rows cut into the :func:`stage_rows` batches, as CSR matrices: rows
    of ``matrix`` (``transposed`` False: batch ``k`` of ``A x`` is ``batches[k] @ x``) or columns
    (True: batch ``k`` of ``A^T g`` is ``batches[k]^T g``), every entry in its original order."""
    n = matrix.num_rows
    indptr = matrix.indptr.numpy().astype(np.int64)
    indices = matrix.indices.numpy().astype(np.int64)
    c = stage_rows(counts, stages)
    stage_of = np.repeat(np.tile(np.arange(stages), c.shape[0]), c.reshape(-1))
    dst = rows_of(indptr)
    out = []
    for k in range(stages):
        rows = np.flatnonzero(stage_of == k)
        if transposed:
            keep = stage_of[indices] == k
            pos = np.searchsorted(rows, indices[keep])  # column -> its place in the batch
            sub_ptr = np.concatenate([[0], np.cumsum(np.bincount(dst[keep], minlength=n))])
            m = CSRMatrix.from_numpy(sub_ptr, pos, None, n, rows.size)
        else:
            keep = stage_of[dst] == k
            sub_ptr = np.concatenate([[0], np.cumsum(indptr[rows + 1] - indptr[rows])])
            m = CSRMatrix.from_numpy(sub_ptr, indices[keep], None, rows.size, matrix.num_cols)
        m.edge_weight = None if weight is None else weight[torch.from_numpy(keep)]
        out.append(m)
    return out


def refuse_relational(specs: list[LayerSpec], strategy: str) -> None:
    """Raise :class:`ConfigError` for relational layers (RGCN), which ``strategy`` does not run."""
    if any(s.relations for s in specs):
        raise ConfigError(
            f"the {strategy} strategy does not run rgcn (its per-relation weights could split by feature "
            "columns, but that is not built): use --strategy partition or one process"
        )


def check_layers(specs: list[LayerSpec], stages: int) -> None:
    """Raise :class:`ConfigError` for ``stages`` this strategy cannot run ``specs`` in (the
    runtime and the simulator both ask)."""
    if stages < 1:
        raise ConfigError(f"--pipeline-stages must be at least 1, got {stages}")
    refuse_relational(specs, "tensor")
    if not all(s.column_separable for s in specs):
        raise ConfigError(
            "the tensor strategy runs gcn, sage, gin and gat, not sage-lstm (an LSTM over a vertex's "
            "neighbours mixes whole feature rows, not column slices): use --strategy partition or one process"
        )
    if stages > 1 and any(s.edge_values for s in specs):
        raise ConfigError(
            "the tensor strategy pipelines gcn, sage and gin aggregations, not gat's: leave --pipeline-stages at 1"
        )


class TensorPlan:
    """The whole graph in rank-block order, this rank's place in it, and its exchange."""

    def __init__(
        self,
        graph: Graph,
        counts: list[int],
        rank: int,
        backend: str,
        log: CommLog,
        exchange: BlockExchange,
        stages: int = 1,
        ids: torch.Tensor | None = None,
    ) -> None:
        self.graph, self.counts, self.rank, self.backend, self.log = graph, counts, rank, backend, log
        self.exchange, self.stages = exchange, int(stages)
        self.offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        #: the global id of every vertex in the rank-block order
        self.ids = torch.arange(graph.num_nodes) if ids is None else ids
        self._blocks: dict[int, list[tuple[Blocks, Blocks]]] = {}
        self._terms: TermExchange | None = None

    @property
    def rows(self) -> slice:
        """This rank's rows in the rank-block order."""
        return slice(int(self.offsets[self.rank]), int(self.offsets[self.rank + 1]))

    def blocks(self, width: int) -> list[tuple[Blocks, Blocks]]:
        """(send, receive) blocks of this rank in each all-to-all of an aggregation at ``width``."""
        if width not in self._blocks:
            me = self.rank
            self._blocks[width] = [
                (Blocks.of(r[me], w[me]), Blocks.of(r[:, me], w[:, me]))
                for r, w in exchange_blocks(self.counts, width, self.stages)
            ]
        return self._blocks[width]

    def terms(self) -> TermExchange:
        """The all-gather of attention layers' per-vertex terms (made on first use)."""
        if self._terms is None:
            self._terms = TermExchange(self.exchange.comm, self.counts, self.log)
        return self._terms


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

    def _product(self, x: torch.Tensor, direction: int) -> torch.Tensor:
        return self._to_rows(self._aggregate(self._to_cols(x, direction), direction), x, direction)

    def _to_cols(self, x: torch.Tensor, direction: int) -> torch.Tensor:
        """Node split -> feature split: ``x``'s rows (flattened past the first dimension) go out,
        this rank's columns of every vertex, ``(N, w_me)`` in rank-block order, come back."""
        p, world, me = self.plan, self.comm.world, self.plan.rank
        ex, h = p.exchange, x.reshape(x.shape[0], -1)
        b = column_bounds(h.shape[1], world)
        send, recv = p.blocks(h.shape[1])[0]
        # peer j gets my rows' columns [b[j], b[j+1])
        pieces = [h[:, b[j] : b[j + 1]] for j in range(world)]
        cols = ex.finish_blocks(ex.start_blocks(pieces, send, recv, self.layer, direction, TO_COLS))
        return cols.view(sum(p.counts), b[me + 1] - b[me])

    def _to_rows(self, ys, x: torch.Tensor, direction: int) -> torch.Tensor:
        """Feature split -> node split: the product's output columns (``ys``, one tensor per
        pipeline stage, each sent as soon as it is made) become this rank's rows, shaped as ``x``."""
        p, world, me = self.plan, self.comm.world, self.plan.rank
        ex, n_me = p.exchange, p.counts[me]
        width = int(np.prod(x.shape[1:]))
        b, blocks = column_bounds(width, world), p.blocks(width)
        pending = [ex.start_blocks(y, *blocks[1 + k], self.layer, direction, TO_ROWS + k) for k, y in enumerate(ys)]
        # peer q's block holds my stage-k rows of its columns
        out = x.new_empty((n_me, width))
        starts = np.concatenate([[0], np.cumsum(stage_rows([n_me], p.stages)[0])]).tolist()
        for k, pend in enumerate(pending):
            recv = blocks[1 + k][1]
            for q, block in enumerate(recv.split(ex.finish_blocks(pend))):
                if b[q + 1] > b[q]:
                    out[starts[k] : starts[k + 1], b[q] : b[q + 1]] = block
        # a fresh tensor, not a view of one: layers may add to it in place
        return out if x.dim() == 2 else out.view(n_me, *x.shape[1:]).clone()

    def _aggregate(self, cols: torch.Tensor, direction: int):
        """The product's output rows (all, or one pipeline batch after another, each computed
        when the caller asks for it, so the previous batch's exchange runs meanwhile)."""
        p, forward = self.plan, direction == FORWARD
        if p.stages == 1:
            with Timer(p.log, self.layer, direction, "compute_s"):
                y = self.local.spmm(cols) if forward else self.local.spmm_t(cols)
            yield y
            return
        # the backend the whole product would run on: the batches' rows are then its rows bit for bit
        backend = self.local._backend(cols, self.local.values, "forward" if forward else "backward")
        for m in self._batches(not forward):
            with Timer(p.log, self.layer, direction, "compute_s"):
                y = backend.spmm(m, cols, m.edge_weight) if forward else backend.spmm_t(m, cols, m.edge_weight)
            yield y

    def _batches(self, transposed: bool) -> list[CSRMatrix]:
        # the operand's values are its matrix's edge weights or none (every variant's), so the
        # matrix and whether it is weighted name the batches
        m, values, p = self.local.matrix, self.local.values, self.plan
        key = (transposed, values is not None, p.stages, tuple(p.counts))
        return _batches.get(m, key, lambda: row_batches(m, values, p.counts, p.stages, transposed))

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


class TensorAttentionOperand(TensorOperand):
    """An attention layer's operand: every rank computes the edge values of the whole graph from
    every vertex's gathered terms and multiplies its column slice by them, each column by its
    head's values (:mod:`tessera.parallel.tensor_attention`)."""

    edge_values = True

    def __init__(self, plan: TensorPlan, comm, layer: int, local: LocalOperand) -> None:
        super().__init__(plan, comm, layer, local)
        # direction -> (the tensor last sent to the feature split, its columns): sddmm_dot
        # reuses the forward input's and the backward gradient's instead of exchanging them again
        self._split: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def edge_structure(self) -> CSRStructure:
        return self.local.matrix

    def gather_edge_terms(self, src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        src, dst = gather_terms(self.plan.terms(), self.layer, src, dst)
        return src, dst

    def edge_ids(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.plan.ids, self.plan.ids  # every vertex's, which the plan holds (``rows`` among them)

    def spmm(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return super().spmm(x) if weight is None else self._weighted(x, weight, FORWARD)

    def spmm_t(self, g: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return super().spmm_t(g) if weight is None else self._weighted(g, weight, BACKWARD)

    def _weighted(self, x: torch.Tensor, weight: torch.Tensor, direction: int) -> torch.Tensor:
        cols = self._own_cols(x, direction)
        self._split[direction] = (x, cols)
        lo, head = self._columns(x)
        with Timer(self.plan.log, self.layer, direction, "compute_s"):
            y = slice_spmm(self.local, cols, weight, lo, head, direction == BACKWARD)
        return self._to_rows([y], x, direction)

    def _columns(self, x: torch.Tensor) -> tuple[int, int]:
        """The first of this rank's columns of ``x``'s flattened rows, and the width of a head."""
        width = int(np.prod(x.shape[1:]))
        return column_bounds(width, self.comm.world)[self.plan.rank], x.shape[-1] if x.dim() == 3 else width

    def _own_cols(self, t: torch.Tensor, direction: int) -> torch.Tensor:
        """:meth:`_to_cols` in a tensor of its own (below 32 bits the exchange reuses its buffer)."""
        cols = self._to_cols(t, direction)
        return cols.clone() if self.plan.exchange.bits(direction) < 32 else cols

    def _cols_of(self, t: torch.Tensor, direction: int) -> torch.Tensor:
        kept = self._split.get(direction)
        if kept is not None and kept[0] is t:
            return kept[1]
        return self._own_cols(t, BACKWARD)  # not multiplied here before: exchange it now

    def sddmm_dot(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """This rank's share (its columns) of every edge's per-head ``<g[i], x[j]>`` (see
        :meth:`Operand.sddmm_dot`)."""
        gc, xc = self._cols_of(g, BACKWARD), self._cols_of(x, FORWARD)
        lo, head = self._columns(x)
        with Timer(self.plan.log, self.layer, BACKWARD, "compute_s"):
            d = slice_sddmm(self.local, gc, xc, lo, head, x.shape[1] if x.dim() == 3 else 1)
        return d if x.dim() == 3 else d.view(-1)

    def _variant(self, local: LocalOperand) -> TensorAttentionOperand:
        return TensorAttentionOperand(self.plan, self.comm, self.layer, local)


class TensorStrategy(Strategy):
    """MixGCN's mixture of parallelism: feature-split aggregation between node-split layers."""

    name = "tensor"
    reads = ("pipeline_stages",)

    def check(self, specs: list[LayerSpec]) -> None:
        check_layers(specs, self.options.pipeline_stages)

    def shard(self, graph: Graph) -> Shard:
        graph.require("x", "y", "train_mask", "val_mask", "test_mask")
        part = row_split(graph, self.comm, self.options)
        world = self.comm.world
        order = np.argsort(part, kind="stable")  # rank 0's rows, then rank 1's, ... each by id
        counts = np.bincount(part, minlength=world).astype(np.int64).tolist()
        structure = Graph(graph.indptr, graph.indices, graph.num_nodes, edge_weight=graph.edge_weight)
        self.log = CommLog(self.comm.rank, world)
        exchange = BlockExchange(self.comm)
        exchange.configure(self.options.exchange_bits(), self.log)
        self.plan = TensorPlan(
            shared_graph(self.comm, lambda: permute_graph(structure, order), "whole-graph structure"),
            counts,
            self.comm.rank,
            self.options.backend,
            self.log,
            exchange,
            self.options.pipeline_stages,
            torch.from_numpy(order.astype(np.int64)),
        )
        owned = self.plan.ids[self.plan.rows]
        return Shard.of_graph(graph, owned)

    def operand(self, spec: LayerSpec, layer: int) -> Operand:
        make = TensorAttentionOperand if spec.edge_values else TensorOperand
        return make(self.plan, self.comm, layer, SharedOperand(self.plan.graph, self.comm, self.plan.backend))
