"""A layer's candidate strategies and their modelled time, one registry entry per kind.

A candidate is a :class:`~tessera.parallel.mixed.LayerChoice`: a strategy with its options and
the layer's operation placement (WiseGraph §5.4: aggregating before or after the dense transform
decides the exchanged width, and whether layer 0 exchanges gradients at all). Its modelled time
for one training step of the layer, on the slowest rank, is

    dense       GEMM FLOPs of the transform (forward, weight gradient, input gradient if needed)
                at the measured FLOP rate;
    aggregate   edges x (per-edge + per-value x width) at the measured rates, per pass (forward,
                and backward where the layer exchanges gradients);
    comm        SuperGCN Eq. 2/6 over the exact blocks the runtime sends (planner/model.py);
    memory      values written into fresh row tensors, at the measured first-write rate: about
                four ``rows x width`` tensors per aggregation pass (the scaled input, the local
                product, the received rows' product and their sum), the transform's output and,
                when needed, its input gradient. The term is what tells the placements apart
                beyond FLOPs: a fresh tensor's first write costs several times an in-place one
                under glibc's allocator (calibrate.py; docs/design/planner-calibration.md).

A kind (:class:`CandidateKind`) lists its choices for a layer and models the last two terms;
``register_kind`` adds one. ``hybrid(M)`` (M column groups of G = P / M ranks, M dividing P with
1 < M < P) costs its all-to-alls at the layer's width (each one the slowest sender of any row
group, over its M members' rows in rank order: the tensor kind's blocks) plus the column groups'
halo exchange and aggregation over the G-way split (the partition kind's, at the widest column
slice D / M): the blocks ``hybrid_volumes`` counts.

Two more terms are NeutronAscend's Algorithm 1 (§5.3), charged to every candidate as the ``M`` it
is (partition M = 1, hybrid M, tensor M = P; G = P / M ranks per column group, each aggregating a
slice of width S, the widest of ``column_bounds(D, M)``), per aggregation pass:

    idle        T_idle = pad / S * T_comp, ``pad`` the columns that fill S up to whole 16-lane
                (AVX-512 fp32) vectors and T_comp = edges x S x the measured per-value rate: the
                padded columns at the rate real ones cost;
    saved       T_saved = T_mem (1 - 1 / (1 + (G - 1)(r - 1))), T_mem the slice's gathered rows
                and written rows (edges + rows) x S x 4 bytes at the measured main-memory
                bandwidth, at most the slice's aggregation time, and ``r`` the measured cache /
                main-memory bandwidth ratio (calibrate.py). It is subtracted from the total.

The saving is the paper's model of G cores sharing one slice through a cache; tessera's CPU ranks
are processes holding their own copies, so on them it is a modelled preference for larger G that
the measured steps of the surviving candidates check.

Bit widths (SuperGCN §6.1): every kind's choices come at each of the context's ``bits``, one width
for both directions. With ``auto_bits`` (``--comm-bits auto``) the forward and backward exchanges
take their widths independently, and a candidate below 32 bits is kept only where its modelled
time is at most ``1 - AUTO_BITS_GAIN`` of the same choice at 32 bits: quantization changes the
numbers a run trains, so it is taken only for a large saving (the measured pick applies the same
rule, :func:`pick_measured`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from tessera.graph import Graph
from tessera.graph.csr import rows_of
from tessera.graph.partition.halo import MODES, pair_rows
from tessera.parallel.base import StrategyOptions
from tessera.parallel.hybrid import hybrid_layout
from tessera.parallel.mixed import LayerChoice
from tessera.parallel.tensor import column_bounds
from tessera.planner.calibrate import Rates
from tessera.planner.grouping import Algorithm1Terms, all_to_all_times
from tessera.planner.model import CommModel, exchange_time
from tessera.planner.records import Record
from tessera.planner.volume.common import row_width
from tessera.sparse import LayerSpec


@dataclass
class Context:
    """What every kind's cost function reads: the graph's structure over the row split ``part``
    of ``world`` ranks, the run's options, the bit widths to consider and the measured rates."""

    graph: Graph
    world: int
    part: np.ndarray
    options: StrategyOptions
    rates: Rates
    bits: tuple[int, ...] = (32,)
    auto_bits: bool = False
    ranks: tuple[int, ...] | None = None  # the job rank standing for each part (None: part p is rank p)
    stages: tuple[int, ...] = ()  # pipeline stage counts tensor and hybrid choices come at (): the run's
    shares: tuple[int, ...] | None = None  # per part: same-shaped exchanges through its host link at once
    _memo: dict[str, Any] = field(default_factory=dict)

    def link(self, parts=None) -> CommModel:
        """The link model of an exchange among ``parts`` (default: all of this context's), their
        ranks' hosts included where the rates know them."""
        ranks = self.ranks if self.ranks is not None else tuple(range(self.world))
        chosen = [int(q) for q in (range(self.world) if parts is None else parts)]
        shares = None if self.shares is None else [self.shares[q] for q in chosen]
        return self.rates.comm().among([ranks[q] for q in chosen], shares)

    @property
    def counts(self) -> np.ndarray:
        """Rows per rank."""
        return np.bincount(self.part, minlength=self.world).astype(np.int64)

    def edge_parts(self) -> dict[str, np.ndarray]:
        """Per rank: ``local`` in-edges from its own rows, ``cut_in`` from others', ``cut_out`` to others'."""
        if "edges" not in self._memo:
            ps = self.part[self.graph.indices.numpy()]
            pd = self.part[rows_of(self.graph.indptr.numpy())]
            cut = ps != pd
            count = lambda a: np.bincount(a, minlength=self.world).astype(np.float64)  # noqa: E731
            self._memo["edges"] = {"local": count(pd[~cut]), "cut_in": count(pd[cut]), "cut_out": count(ps[cut])}
        return self._memo["edges"]

    def grouped(self, groups: int) -> Context:
        """The same graph over hybrid(``groups``)'s G-parts (``part // groups``, G = world / groups ranks)."""
        key = f"grouped-{groups}"
        if key not in self._memo:
            g = self.world // groups
            # a column group's G-parts stand for ranks g M + c; column group 0's are the model's, and
            # the column groups whose G-part g is on the same host exchange beside it. Exact where
            # ranks are numbered host by host and M divides the ranks per host (or they divide M);
            # otherwise column groups differ in which pairs cross and this is an approximation
            ranks = self.ranks if self.ranks is not None else tuple(range(self.world))
            hosts = self.rates.hosts
            shares = None
            if hosts:
                shares = tuple(
                    sum(hosts[ranks[q * groups + c]] == hosts[ranks[q * groups]] for c in range(groups))
                    for q in range(g)
                )
            self._memo[key] = Context(
                self.graph, g, self.part // groups, self.options, self.rates, self.bits, self.auto_bits,
                tuple(ranks[q * groups] for q in range(g)), self.stages, shares,
            )  # fmt: skip
        return self._memo[key]

    def pair_rows(self, mode: str) -> np.ndarray:
        """Rows rank ``p`` sends rank ``q`` per exchange under ``mode`` (the runtime's plans' counts)."""
        if "rows" not in self._memo:
            g = self.graph
            self._memo["rows"] = pair_rows(g.indptr.numpy(), g.indices.numpy(), self.part, self.world, MODES)
        return self._memo["rows"][mode]

    def use_pair_rows(self, rows: dict[str, np.ndarray]) -> None:
        """Take ``rows`` (per mode, over this context's row split: the simulator's) as
        :meth:`pair_rows` instead of counting them again."""
        self._memo["rows"] = rows


class KindCost(NamedTuple):
    """The terms of a candidate's modelled step time its kind decides (seconds), and its
    Algorithm 1 terms (None: the kind has none)."""

    aggregate: float
    comm: float
    alg1: Algorithm1Terms | None = None


@dataclass(frozen=True)
class Costs(Record):
    """A candidate's modelled step time of one layer, by term: the dense transform, the
    aggregation, the communication, the writes into fresh tensors, Algorithm 1's padding idle
    and its cache-reuse saving, which the total subtracts (in the unit its holder names)."""

    dense: float
    aggregate: float
    comm: float
    memory: float = 0.0
    idle: float = 0.0
    saved: float = 0.0

    @property
    def total(self) -> float:
        """The sum of the terms, less the saving."""
        return self.dense + self.aggregate + self.comm + self.memory + self.idle - self.saved

    def scaled(self, factor: float) -> Costs:
        """Every term times ``factor`` (a change of unit)."""
        f = factor
        return Costs(f * self.dense, f * self.aggregate, f * self.comm, f * self.memory, f * self.idle, f * self.saved)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Costs:
        """The inverse of :meth:`to_dict`."""
        extra = (float(d.get(k, 0.0)) for k in ("memory", "idle", "saved"))
        return cls(float(d["dense"]), float(d["aggregate"]), float(d["comm"]), *extra)


@dataclass(frozen=True)
class Candidate:
    """One candidate of one layer: its choice and ``--strategy`` entry (``label``), its kind, the
    width it aggregates at, whether it has a backward pass through the aggregation, its
    modelled terms and total, and its Algorithm 1 terms (seconds)."""

    choice: LayerChoice
    label: str
    kind: str
    width: int
    backward: bool
    model_s: Costs
    modelled_s: float
    alg1: Algorithm1Terms | None = None


@dataclass(frozen=True)
class CandidateKind:
    """A family of candidates: ``choices(ctx, spec)`` (empty when it cannot run the layer) and
    ``cost(ctx, choice, spec, backward)`` (its aggregation and communication terms); ``between``
    when its terms lie between other kinds' (hybrid(M): partition at M = 1, tensor at M = P), so
    that :func:`prune` measures those ends first."""

    name: str
    choices: Callable[[Context, LayerSpec], list[LayerChoice]]
    cost: Callable[[Context, LayerChoice, LayerSpec, bool], KindCost]
    between: bool = False


KINDS: dict[str, CandidateKind] = {}


def register_kind(kind: CandidateKind) -> CandidateKind:
    """Make ``kind``'s candidates part of every plan."""
    KINDS[kind.name] = kind
    return kind


# ---------------------------------------------------------------------------------------- Algorithm 1
def algorithm1_terms(ctx: Context, groups: int, edges: float, rows: float, width: int, passes: int) -> Algorithm1Terms:
    """Algorithm 1's terms (seconds) of ``groups`` column groups of ``world / groups`` ranks at
    ``width``, for the rank that aggregates ``edges`` edges into ``rows`` rows at the widest
    slice, over ``passes`` aggregation passes (see the module docstring)."""
    s = int(np.diff(column_bounds(width, groups)).max())
    rates = ctx.rates
    comp = passes * edges * s * rates.value_s
    mem = min(passes * rates.memory_read_s(4.0 * s * (edges + rows)), passes * rates.aggregate_s(edges, s))
    return Algorithm1Terms.of(groups, s, ctx.world // groups, rates.cache_ratio, comp, mem)


# ---------------------------------------------------------------------------------------- bit widths
#: the least share of a layer's modelled (and measured) time a width below 32 bits must save under
#: ``--comm-bits auto`` (it changes the numbers the run trains)
AUTO_BITS_GAIN = 0.2


def bit_overrides(ctx: Context) -> list[tuple[tuple[str, int], ...]]:
    """The ``comm_bits`` (and ``grad_bits``) overrides of each width a choice comes at: each of
    ``ctx.bits``, or with ``auto_bits`` each (forward, backward) pair of them."""
    if not ctx.auto_bits:
        return [(("comm_bits", b),) for b in ctx.bits]
    return [(("comm_bits", f),) + ((("grad_bits", g),) if g != f else ()) for f in ctx.bits for g in ctx.bits]


def _with(bits: tuple[tuple[str, int], ...], *others: tuple[str, Any]) -> tuple[tuple[str, Any], ...]:
    return tuple(sorted(bits + others))


def choice_bits(choice: LayerChoice, base: StrategyOptions) -> tuple[int, int]:
    """``choice``'s (forward, backward) exchange widths over the run's options ``base``."""
    return choice.options(base).exchange_bits()


#: the options that hold a choice's bit widths, and its pipeline stages
BIT_FIELDS = ("comm_bits", "grad_bits")
STAGE_FIELDS = ("pipeline_stages",)


def choice_key(choice: LayerChoice, apart: tuple[str, ...]) -> tuple:
    """What ``choice`` is apart from the options ``apart``: choices with the same key differ only there."""
    return (choice.strategy, tuple(o for o in choice.overrides if o[0] not in apart), choice.aggregate_first)


def worth_its_bits(candidates: list[Candidate], base: StrategyOptions) -> list[Candidate]:
    """``candidates`` without those below 32 bits whose modelled time is above ``1 -
    AUTO_BITS_GAIN`` of their full-width twin's (every candidate at 32 bits stays)."""
    full = {
        choice_key(c.choice, BIT_FIELDS): c.modelled_s for c in candidates if choice_bits(c.choice, base) == (32, 32)
    }
    return [
        c
        for c in candidates
        if choice_bits(c.choice, base) == (32, 32)
        or c.modelled_s <= (1 - AUTO_BITS_GAIN) * full.get(choice_key(c.choice, BIT_FIELDS), float("inf"))
    ]


# ---------------------------------------------------------------------------------------- pipeline stages
#: the stage counts ``--pipeline-stages auto`` considers
AUTO_STAGES = (1, 2, 4, 8)


def stage_overrides(ctx: Context) -> list[tuple[tuple[str, int], ...]]:
    """The ``pipeline_stages`` override of each stage count a tensor or hybrid choice comes at:
    none (the run's) unless the context lists counts (``--pipeline-stages auto``)."""
    return [(("pipeline_stages", s),) for s in ctx.stages] if ctx.stages else [()]


def pipelined_s(aggregate_s: float, back_s: list[float]) -> float:
    """Seconds of one pipelined aggregation pass after its all-to-all into the feature split: the
    ``s = len(back_s)`` row batches aggregated one after another (``aggregate_s / s`` each) while
    batch ``k``'s all-to-all back (``back_s[k]``) runs beside batch ``k + 1``'s aggregation."""
    step = aggregate_s / len(back_s)
    return step + sum(max(step, b) for b in back_s[:-1]) + back_s[-1]


# ---------------------------------------------------------------------------------------- partition
def _partition_choices(ctx: Context, spec: LayerSpec) -> list[LayerChoice]:
    modes = ("post",) if spec.edge_values else MODES  # attention gathers post rows whatever the mode
    return [LayerChoice("partition", _with(b, ("remote_agg", m))) for m in modes for b in bit_overrides(ctx)]


def partition_work(ctx: Context, mode: str) -> np.ndarray:
    """Edges each rank aggregates per pass under ``mode``: its local in-edges, plus its cut
    in-edges (post: remote sources added into owned rows) or its cut out-edges and the partial
    rows it receives (pre), prepost half of each."""
    e = ctx.edge_parts()
    post = e["local"] + e["cut_in"]
    pre = e["local"] + e["cut_out"] + ctx.pair_rows("pre").sum(axis=0)
    return {"post": post, "pre": pre, "prepost": (post + pre) / 2}[mode]


def _partition_cost(ctx: Context, choice: LayerChoice, spec: LayerSpec, backward: bool) -> KindCost:
    o = choice.options(ctx.options)
    w, passes = spec.aggregate_width, 1 + backward
    rows, m, sent = ctx.pair_rows(o.remote_agg), ctx.link(), row_width(spec)
    fwd, bwd = o.exchange_bits()
    comm = exchange_time(rows, sent, fwd, m).time_s
    if backward:
        comm += exchange_time(rows.T, sent, bwd, m).time_s
    work = partition_work(ctx, o.remote_agg)
    busiest = int(np.argmax(work))
    alg1 = algorithm1_terms(ctx, 1, work[busiest], ctx.counts[busiest], w, passes)
    return KindCost(passes * ctx.rates.aggregate_s(work[busiest], w), comm, alg1)


# ---------------------------------------------------------------------------------------- tensor
def _tensor_choices(ctx: Context, spec: LayerSpec) -> list[LayerChoice]:
    if spec.edge_values:
        return []
    return [LayerChoice("tensor", _with(b, *st)) for b in bit_overrides(ctx) for st in stage_overrides(ctx)]


def _tensor_cost(ctx: Context, choice: LayerChoice, spec: LayerSpec, backward: bool) -> KindCost:
    o = choice.options(ctx.options)
    w, passes = spec.aggregate_width, 1 + backward
    widest = -(-w // ctx.world)
    fwd, bwd = o.exchange_bits()
    aggregate = ctx.rates.aggregate_s(ctx.graph.num_edges, widest)
    comm = 0.0
    for bits in (fwd, bwd)[:passes]:
        into, *back = all_to_all_times(ctx.counts, w, bits, ctx.link(), o.pipeline_stages)
        comm += into + pipelined_s(aggregate, back) - aggregate  # the pipeline's overlap shows as less comm
    alg1 = algorithm1_terms(ctx, ctx.world, ctx.graph.num_edges, ctx.graph.num_nodes, w, passes)
    return KindCost(passes * aggregate, comm, alg1)


# ---------------------------------------------------------------------------------------- hybrid
def _hybrid_choices(ctx: Context, spec: LayerSpec) -> list[LayerChoice]:
    if spec.edge_values:
        return []
    groups = [m for m in range(2, ctx.world) if ctx.world % m == 0]
    return [
        LayerChoice("hybrid", _with(b, ("groups", m), ("remote_agg", mode), *st))
        for m in groups
        for mode in MODES
        for b in bit_overrides(ctx)
        for st in stage_overrides(ctx)
    ]


def _hybrid_cost(ctx: Context, choice: LayerChoice, spec: LayerSpec, backward: bool) -> KindCost:
    o = choice.options(ctx.options)
    w, passes = spec.aggregate_width, 1 + backward
    sub = ctx.grouped(o.groups)
    m = sub.link()
    widest = int(np.diff(column_bounds(w, o.groups)).max())
    rows = sub.pair_rows(o.remote_agg)
    fwd, bwd = o.exchange_bits()
    halo = exchange_time(rows, widest, fwd, m).time_s
    if backward:
        halo += exchange_time(rows.T, widest, bwd, m).time_s
    work = partition_work(sub, o.remote_agg)
    busiest = int(np.argmax(work))
    aggregate = ctx.rates.aggregate_s(work[busiest], widest)
    a2a = 0.0
    for bits in (fwd, bwd)[:passes]:
        key = f"all_to_all-{o.groups}-{w}-{bits}-{o.pipeline_stages}"
        if key not in ctx._memo:  # the same for every mode
            # row groups of the same row counts on the same hosts cost the same
            distinct = {(tuple(ctx.counts[g]), ctx.link(g).hosts): g for g in hybrid_layout(ctx.world, o.groups)}
            per = [
                all_to_all_times(list(ctx.counts[g]), w, bits, ctx.link(g), o.pipeline_stages)
                for g in distinct.values()
            ]
            ctx._memo[key] = np.max(per, axis=0).tolist()  # each all-to-all of all row groups at once
        into, *back = ctx._memo[key]
        a2a += into + pipelined_s(aggregate, back) - aggregate
    alg1 = algorithm1_terms(ctx, o.groups, work[busiest], sub.counts[busiest], w, passes)
    return KindCost(passes * aggregate, halo + a2a, alg1)


register_kind(CandidateKind("partition", _partition_choices, _partition_cost))
register_kind(CandidateKind("tensor", _tensor_choices, _tensor_cost))
register_kind(CandidateKind("hybrid", _hybrid_choices, _hybrid_cost, between=True))


# ---------------------------------------------------------------------------------------- a layer
def dense_s(ctx: Context, spec: LayerSpec, input_grad: bool) -> float:
    """The layer's dense transform on the busiest rank's rows: forward, weight gradient and (when
    the input needs one) input gradient."""
    flops = 2.0 * ctx.counts.max() * spec.in_width * spec.out_width * (2 + input_grad)
    return flops / ctx.rates.gemm_flops


FRESH_PER_PASS = 4  # rows x width tensors an aggregation pass allocates (see the module docstring)


def memory_s(ctx: Context, spec: LayerSpec, backward: bool, input_grad: bool) -> float:
    """The busiest rank's writes into freshly allocated row tensors in one step of the layer."""
    per_row = FRESH_PER_PASS * spec.aggregate_width * (1 + backward) + spec.out_width + spec.in_width * input_grad
    return ctx.counts.max() * per_row * ctx.rates.fresh_value_s


def layer_candidates(ctx: Context, specs: dict[bool, LayerSpec], natural: bool, input_grad: bool) -> list[Candidate]:
    """Every candidate of one layer with its modelled terms (seconds), best first. ``specs`` maps
    each placement the layer can run (``aggregates_first``) to its description; ``natural`` is the
    layer's own, which its choices leave unsaid."""
    out = []
    for first, spec in specs.items():
        backward = spec.aggregates_input_grad(input_grad)
        for kind in KINDS.values():
            for choice in kind.choices(ctx, spec):
                if not backward and "grad_bits" in dict(choice.overrides):
                    continue  # no backward exchange: the same candidate as its forward width's
                if first != natural:
                    choice = LayerChoice(choice.strategy, choice.overrides, first)
                dense = dense_s(ctx, spec, input_grad)
                own = kind.cost(ctx, choice, spec, backward)
                idle, saved = (own.alg1.idle, own.alg1.saved) if own.alg1 is not None else (0.0, 0.0)
                memory = memory_s(ctx, spec, backward, input_grad)
                terms = Costs(dense, own.aggregate, own.comm, memory, idle, saved)
                label = choice.label(ctx.options)
                width = spec.aggregate_width
                out.append(Candidate(choice, label, kind.name, width, backward, terms, terms.total, own.alg1))
    if ctx.auto_bits:
        out = worth_its_bits(out, ctx.options)
    return sorted(out, key=lambda c: c.modelled_s)


#: the options a family's members differ in (:func:`prune`); under ``--comm-bits auto`` the bit
#: widths too, so that the measured slots go to strategies, not to widths of one
FAMILY_FREE = ("remote_agg", "pipeline_stages")


def prune(
    candidates: list[Candidate], factor: float, limit: int | None = None, free: tuple[str, ...] = FAMILY_FREE
) -> list[Candidate]:
    """The candidates modelled within ``factor`` of the best; with ``limit``, only the modelled
    best of each family (the same strategy, options and placement but the ``--remote-agg`` mode
    and the pipeline stages, whose exact bytes, work and per-batch all-to-alls the model ranks
    better than a few noisy steps can) and at
    most ``limit`` of them: the best, then the families of kinds at the ends (partition, tensor)
    before those ``between`` them (hybrid), each in modelled order (``candidates`` are sorted).
    ``free`` names the options a family's members differ in.
    Among near-ties, timing only the best-modelled few can miss an end that is the fastest in whole
    epochs; hybrid's terms lie between the ends', so the ends go first
    (docs/design/planner-calibration.md)."""
    best = min(c.modelled_s for c in candidates)
    kept = [c for c in candidates if c.modelled_s <= factor * best]
    if limit is None:
        return kept
    families: dict[tuple, Candidate] = {}
    for c in kept:
        families.setdefault(choice_key(c.choice, free), c)
    first, *rest = families.values()
    rest.sort(key=lambda c: KINDS[c.kind].between)  # stable: modelled order within each group
    return [first, *rest][:limit]
