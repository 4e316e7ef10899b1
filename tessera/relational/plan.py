"""What an operand offers relational layers (:class:`Relations`), and the cost model of the five
ways :mod:`tessera.relational.variants` computes ``sum_r A_r x W_r``."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tessera.errors import ConfigError
from tessera.graph.csr import CSRStructure
from tessera.graph.relations import (
    RelationEdges,
    RelationPairs,
    all_pairs,
    destination_pairs,
    edge_norm,
    edges_by_relation,
    pair_counts,
    source_pairs,
)
from tessera.memo import PlanCache
from tessera.relational.gtask import GTaskPlan, build_plan, parse_restrictions

VARIANTS = ("transform_first", "unique_source", "aggregate_first", "edge_wise", "gtask")
# The gTask plan of the ``gtask`` variant (WiseGraph §4): one relation per gTask and at most 64
# distinct sources, so each gTask is one dense product of its unique sources' rows
GTASK_RESTRICTIONS = "uniq(Src.ID)=64 & uniq(Edge.Type)=1"


def split_variant(variant: str) -> tuple[str, str]:
    """``(name, gTask restrictions)`` of a variant string: ``auto``, one of :data:`VARIANTS`, or
    ``gtask:RESTRICTIONS`` (the ``gtask`` variant on the plan those restrictions cut, e.g.
    ``gtask:uniq(Dst.ID)=8 & uniq(Edge.Type)=1``); the restrictions are
    :data:`GTASK_RESTRICTIONS` unless given. A ConfigError says what is wrong in one line."""
    name, sep, restrictions = variant.partition(":")
    if (name != "auto" and name not in VARIANTS) or (sep and name != "gtask"):
        raise ConfigError(
            f"unknown RGCN variant {variant!r}; choose auto, one of {', '.join(VARIANTS)}, "
            f"or gtask:RESTRICTIONS (e.g. gtask:{GTASK_RESTRICTIONS})"
        )
    if not sep:
        return name, GTASK_RESTRICTIONS
    try:
        parse_restrictions(restrictions)
    except ConfigError as e:
        raise ConfigError(f"RGCN variant {variant!r}: {e}") from None
    return name, restrictions.strip()


# The cost model's machine: fp32 GEMM FLOP/s per thread and memory bytes/s, set for a 2-core CPU
# with AVX-512 (absolute values matter less than their ratio; docs/design/relation-cost-model.md).
GEMM_FLOPS_PER_THREAD = 60e9
MEMORY_BANDWIDTH = 12e9
# A variant whose modelled time is within this factor of the best one is measured; the rest are pruned.
PRUNE_FACTOR = 2.0
_plans = PlanCache()  # per typed matrix: its relation structures and the operands over them


# ---------------------------------------------------------------------------------------- operand side
@dataclass(frozen=True)
class RelationStats:
    """The sizes the cost model reads: vertices (rows, cols), edges, relations and distinct pairs."""

    rows: int
    cols: int
    edges: int
    relations: int
    source_pairs: int
    destination_pairs: int


class Relations:
    """What an operand offers relational layers: its typed matrix's per-relation structures
    (:mod:`tessera.graph.relations`), wrapped as operands by ``wrap`` so their products run on
    the operand's backends, and the variant choice (``choose``: the cost model's best, unless
    the operand's backends layer measures)."""

    def __init__(
        self,
        matrix: CSRStructure,
        wrap: Callable[[CSRStructure, torch.Tensor | None], Any],
        key: Hashable = None,
        choose: Callable[[Relations, torch.Tensor, torch.Tensor, str], str] | None = None,
    ) -> None:
        """``key`` tells apart the ``wrap`` functions of one matrix (the operands they make are
        kept per matrix and key, so building a Relations again is free)."""
        self.matrix, self.wrap, self.key, self._choose = matrix, wrap, key, choose

    @property
    def num_relations(self) -> int:
        """The relation count (what ``weight``'s first dimension must be)."""
        assert self.matrix.num_relations is not None  # a typed matrix
        return int(self.matrix.num_relations)

    def _plan(self, key: tuple, make):
        return _plans.get(self.matrix, (self.key, *key), make)

    def stats(self) -> RelationStats:
        """Sizes for :func:`variant_cost`."""

        def make() -> RelationStats:
            s, d = pair_counts(self.matrix)
            m = self.matrix
            return RelationStats(m.num_rows, m.num_cols, m.num_edges, self.num_relations, s, d)

        return self._plan(("stats",), make)

    def all_pairs(self, reduce: str) -> Any:
        """The ``N x (R N)`` operand of :func:`tessera.graph.relations.all_pairs`."""

        def make() -> Any:
            m = all_pairs(self.matrix, reduce)
            return self.wrap(m, m.edge_weight)

        return self._plan(("all", reduce), make)

    def pairs(self, side: str, reduce: str) -> tuple[Any, RelationPairs]:
        """The operand over the distinct (relation, ``side``) pairs (``source`` or ``destination``)."""

        def make() -> tuple[Any, RelationPairs]:
            p = (source_pairs if side == "source" else destination_pairs)(self.matrix, reduce)
            return self.wrap(p.matrix, p.matrix.edge_weight), p

        return self._plan((side, reduce), make)

    def edges(self, reduce: str) -> RelationEdges:
        """The edges sorted by relation."""
        return self._plan(("edges", reduce), lambda: edges_by_relation(self.matrix, reduce))

    def gtasks(self, reduce: str, restrictions: str = GTASK_RESTRICTIONS) -> tuple[GTaskPlan, torch.Tensor | None]:
        """The typed edges cut into gTasks by ``restrictions``, and the per-edge factors of
        ``reduce`` in CSR order (``mean``: ``1 / |N_r(i)|``; ``sum``: None)."""

        def make() -> tuple[GTaskPlan, torch.Tensor | None]:
            m = self.matrix
            src = m.indices.numpy().astype(np.int64)
            dst = np.repeat(np.arange(m.num_rows, dtype=np.int64), np.diff(m.indptr.numpy()))
            assert m.edge_type is not None  # a typed matrix
            etype = m.edge_type.numpy().astype(np.int64)
            plan = build_plan((src, dst, etype, max(m.num_rows, m.num_cols)), restrictions)
            norm = edge_norm(m, reduce)
            return plan, None if norm is None else torch.from_numpy(norm)

        return self._plan(("gtask", reduce, restrictions), make)

    def release(self, keep: set[str]) -> None:
        """Forget the structures of the variants not in ``keep`` (names of :data:`VARIANTS`): after a
        measured choice, the losers' pair matrices, gTask plans and the backend plans made for
        them would otherwise stay for the rest of the run (one is rebuilt if a later choice takes it)."""
        side = {"transform_first": "all", "unique_source": "source", "aggregate_first": "destination",
                "edge_wise": "edges", "gtask": "gtask"}  # fmt: skip
        kept = {side[v] for v in keep if v in side}
        entries = _plans.entries(self.matrix)
        for key in [k for k in entries if k[0] == self.key and len(k) > 1 and k[1] in side.values()]:
            if key[1] not in kept:
                del entries[key]

    def choose(self, x: torch.Tensor, weight: torch.Tensor, reduce: str) -> str:
        """The variant ``auto`` runs for this input."""
        if self._choose is not None:
            return self._choose(self, x, weight, reduce)
        return ranked_variants(self.stats(), x.shape[1], weight.shape[2])[0]


def variant_cost(stats: RelationStats, fi: int, fo: int, variant: str) -> tuple[float, float]:
    """Modelled (FLOPs, bytes) of one forward and backward pass of ``variant``: the GEMMs (the
    backward's two products counted as two more), plus float32 rows gathered, written and
    scattered and the index and value arrays read (8 bytes per entry)."""
    n, e, r = stats.rows, stats.edges, stats.relations
    ps, pd = stats.source_pairs, stats.destination_pairs
    if variant == "transform_first":
        rows, gathered, extra = r * stats.cols, e * fo, r * stats.cols * fo
    elif variant in ("unique_source", "gtask"):
        # a gTask multiplies its unique sources' rows; a relation's batches run as one GEMM, so the
        # gtask variant makes a few products per relation, as unique_source does (no per-gTask term)
        rows, gathered, extra = ps, e * fo + ps * fi, ps * (fi + fo)
    elif variant == "aggregate_first":
        rows, gathered, extra = pd, e * fi + pd * fo, pd * (fi + fo)
    elif variant == "edge_wise":
        rows, gathered, extra = e, e * fi + e * fo, e * (fi + fo)
    else:
        raise ConfigError(f"unknown RGCN variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    flops = 3 * 2.0 * rows * fi * fo
    nbytes = 3 * (4.0 * (gathered + extra + n * fo) + 8.0 * e)
    return flops, nbytes


def variant_memory(stats: RelationStats, fi: int, fo: int, variant: str) -> float:
    """Modelled bytes of ``variant``'s row-sized intermediates at the peak of a forward and backward
    pass (float32): what it holds beside the layer's own input and output.

    ``transform_first``: ``x W_r`` for every relation and vertex, its gradient and the per-relation
    input gradient; ``unique_source`` and ``gtask``: the product rows and their gradient (the gathered
    inputs exist a chunk at a time, :func:`~tessera.relational.block_matmul.gather_block_matmul`;
    an input gradient's ``P x fi`` rows, made at once late in the backward, are not counted);
    ``aggregate_first``: the aggregated inputs (kept for the weight gradient) and their gradient, the
    product rows and theirs; ``edge_wise``: gathered inputs and messages per edge, and their gradients."""
    r, n, e = stats.relations, stats.cols, stats.edges
    ps, pd = stats.source_pairs, stats.destination_pairs
    rows = {
        "transform_first": r * n * (2 * fo + fi),
        "unique_source": ps * 2 * fo,
        "gtask": ps * 2 * fo,
        "aggregate_first": pd * 2 * (fi + fo),
        "edge_wise": e * (2 * fi + 3 * fo),
    }
    if variant not in rows:
        raise ConfigError(f"unknown RGCN variant {variant!r}; choose one of {', '.join(VARIANTS)}")
    return 4.0 * rows[variant]


def model_seconds(stats: RelationStats, fi: int, fo: int, variant: str, threads: int | None = None) -> float:
    """:func:`variant_cost` in seconds at :data:`GEMM_FLOPS_PER_THREAD` and :data:`MEMORY_BANDWIDTH`."""
    flops, nbytes = variant_cost(stats, fi, fo, variant)
    t = threads or torch.get_num_threads()
    return flops / (GEMM_FLOPS_PER_THREAD * t) + nbytes / MEMORY_BANDWIDTH


def ranked_variants(stats: RelationStats, fi: int, fo: int) -> list[str]:
    """The variants worth measuring, modelled fastest first: those within :data:`PRUNE_FACTOR` of
    the best (the rest are pruned)."""
    cost = {v: model_seconds(stats, fi, fo, v) for v in VARIANTS}
    ranked = sorted(VARIANTS, key=cost.__getitem__)
    return [v for v in ranked if cost[v] <= PRUNE_FACTOR * cost[ranked[0]]]
