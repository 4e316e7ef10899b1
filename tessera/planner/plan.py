"""The per-layer planner behind ``--strategy auto`` (WiseGraph §6.3's selection, per layer).

Rank 0 models every candidate of every layer (:mod:`tessera.planner.candidates`, on constants
all ranks measured together: :mod:`tessera.planner.calibrate`), keeps those within ``factor``
of each layer's modelled best (of each family, the strategy with its options but the
``--remote-agg`` mode, only the modelled best, and at most ``MAX_MEASURED`` of them), and
broadcasts them. A layer with one survivor takes it unmeasured; otherwise all ranks shard each
survivor's strategy (one row split for all) and run one untimed and ``STEPS`` timed forward +
backward steps of that layer alone under it, in the same order, each product on its backend cost
model's favourite (``select.modelled_only``: no backend trials for candidates that may be dropped); rank 0 picks each
layer's fastest (the slowest rank's least step) and broadcasts the plan, so every rank trains
the same one. The record's ``timing_s`` splits the planning time into calibration, modelling,
sharding and steps. The plan is cached as JSON by graph
fingerprint, model, world size and the options it was measured with (``$TESSERA_CACHE/plans``),
so a later run reuses it without measuring.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from tessera.backends import select
from tessera.comm.group import Comm
from tessera.files import atomic_write, default_cache_dir, foreign, read_json_cache
from tessera.graph import Graph
from tessera.parallel.base import StrategyOptions, row_split
from tessera.parallel.mixed import LayerChoice, StrategyPool, parse_entry
from tessera.planner.calibrate import Rates, calibrate
from tessera.planner.candidates import (
    AUTO_BITS_GAIN,
    BIT_FIELDS,
    FAMILY_FREE,
    STAGE_FIELDS,
    Candidate,
    Context,
    Costs,
    choice_bits,
    choice_key,
    layer_candidates,
    prune,
)
from tessera.planner.grouping import Algorithm1Terms
from tessera.planner.records import Record, optional
from tessera.sparse import LayerSpec, Operand

PLAN_VERSION = 5
PRUNE_FACTOR = 1.5
# Timed steps per measured candidate (the least counts), after an untimed one. The step after the
# untimed one still pays for memory touched for the first time, unequally across candidates: timed
# alone, it can misrank them (docs/design/planner-calibration.md).
STEPS = 2
MAX_MEASURED = 2  # candidates measured per layer (every one with --measure-all)


@dataclass
class LayerProbe:
    """What the planner knows of the model's layers: per layer, the placements it can run
    (``aggregates_first`` values, its own first), the description under each, and a forward
    of the layer under a placement (on a copy: the model's weights are not touched)."""

    placements: list[tuple[bool, ...]]
    spec: Callable[[int, bool], LayerSpec]
    forward: Callable[[int, bool | None, Operand, torch.Tensor], torch.Tensor]
    input_grad: bool  # whether layer 0's input needs a gradient (LayerNorm or label embedding before it)
    description: dict[str, Any]  # model name and widths, part of the cache key


@dataclass(frozen=True, kw_only=True)
class CandidateRow(Record):
    """A candidate as a plan records it: its ``--strategy`` entry, kind, aggregated width and
    backward pass, its modelled terms and total and its measured step (milliseconds; None:
    not measured), whether it survived pruning, and its Algorithm 1 terms (milliseconds)."""

    label: str
    kind: str
    width: int
    backward: bool
    model_ms: Costs
    modelled_ms: float
    measured_ms: float | None = None
    survived: bool = False
    alg1: Algorithm1Terms | None = optional()

    @classmethod
    def of(cls, c: Candidate, survived: bool) -> CandidateRow:
        """The modelled ``c`` in milliseconds, not measured."""
        return cls(
            label=c.label,
            kind=c.kind,
            width=c.width,
            backward=c.backward,
            model_ms=c.model_s.scaled(1e3),
            modelled_ms=1e3 * c.modelled_s,
            survived=survived,
            alg1=None if c.alg1 is None else c.alg1.scaled(1e3),
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CandidateRow:
        """The inverse of :meth:`to_dict`."""
        return cls(
            label=d["label"],
            kind=d["kind"],
            width=d["width"],
            backward=d["backward"],
            model_ms=Costs.from_dict(d["model_ms"]),
            modelled_ms=d["modelled_ms"],
            measured_ms=d["measured_ms"],
            survived=d["survived"],
            alg1=None if d.get("alg1") is None else Algorithm1Terms(**d["alg1"]),
        )


@dataclass(frozen=True)
class LayerPlan(Record):
    """One layer's choice (a ``--strategy`` entry) and every candidate, modelled best first."""

    layer: int
    choice: str
    candidates: tuple[CandidateRow, ...]

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> LayerPlan:
        """The inverse of :meth:`to_dict`."""
        return cls(d["layer"], d["choice"], tuple(CandidateRow.from_dict(c) for c in d["candidates"]))


@dataclass(frozen=True)
class PlanTiming(Record):
    """Seconds of measured planning: calibration, modelling, sharding candidates, timed steps."""

    calibrate: float
    model: float
    shard: float
    steps: float


@dataclass(frozen=True, kw_only=True)
class Plan(Record):
    """A plan: one ``--strategy`` entry per layer (``choices``) for ``world`` ranks. A measured or
    cached plan also holds its cache key, each layer's candidates, the constants, the pruning
    factor, whether it measured and its planning time's parts; a plan from the model alone its
    layers and constants; ``source`` says where it comes from (measured, model, cache,
    checkpoint) and ``planning_s`` how long it took. Its JSON is the plan cache's record."""

    key: dict[str, Any] | None = optional()
    choices: tuple[str, ...]
    layers: tuple[LayerPlan, ...] | None = optional()
    rates: Rates | None = optional()
    world: int
    factor: float | None = optional()
    measured: bool | None = optional()
    timing_s: PlanTiming | None = optional()
    source: str | None = optional()
    planning_s: float | None = optional()

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Plan:
        """The inverse of :meth:`to_dict`."""
        layers, rates, timing = d.get("layers"), d.get("rates"), d.get("timing_s")
        return cls(
            key=d.get("key"),
            choices=tuple(d["choices"]),
            layers=None if layers is None else tuple(LayerPlan.from_dict(la) for la in layers),
            rates=None if rates is None else Rates(**{**rates, "hosts": tuple(rates.get("hosts", ()))}),
            world=d["world"],
            factor=d.get("factor"),
            measured=d.get("measured"),
            timing_s=None if timing is None else PlanTiming(**timing),
            source=d.get("source"),
            planning_s=d.get("planning_s"),
        )


def aggregate_widths(probe: LayerProbe) -> tuple[int, int]:
    """The narrowest and widest width any layer aggregates at, in any placement (the widths the
    aggregation rates are calibrated at)."""
    widths = [probe.spec(i, p).aggregate_width for i, places in enumerate(probe.placements) for p in places]
    return min(widths), max(widths)


def broadcast_json(comm: Comm, obj: Any) -> Any:
    """Rank 0's ``obj`` on every rank (through a byte tensor)."""
    if comm.world == 1:
        return obj
    data = json.dumps(obj).encode() if comm.rank == 0 else b""
    size = comm.broadcast(torch.tensor([len(data)], dtype=torch.int64))
    buf = torch.zeros(int(size[0]), dtype=torch.uint8)
    if comm.rank == 0:
        buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    comm.broadcast(buf)
    return json.loads(bytes(buf.numpy()).decode())


def cache_key(
    graph: Graph,
    world: int,
    options: StrategyOptions,
    probe: LayerProbe,
    bits,
    factor: float,
    auto_bits: bool = False,
    hosts: list[int] | None = None,
    stages: tuple[int, ...] = (),
) -> dict:
    """Everything a cached plan depends on (``hosts``: each rank's host, where links differ)."""
    return {
        "version": PLAN_VERSION,
        "graph": graph.fingerprint(),
        "world": world,
        "model": probe.description,
        "options": {k: getattr(options, k) for k in ("backend", "partition", "seed", "comm_bits", "pipeline_stages")},
        "bits": list(bits),
        "auto_bits": auto_bits,
        "hosts": list(hosts) if hosts and len(set(hosts)) > 1 else [],
        "stages": list(stages),
        "factor": factor,
        "threads": torch.get_num_threads(),
    }


def cache_path(key: dict) -> Path:
    """The plan file of ``key`` under ``$TESSERA_CACHE/plans``."""
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()
    return default_cache_dir() / "plans" / f"plan-{digest}.json"


def _plan_record(key: dict) -> Callable[[Any], dict | None]:
    """What :func:`_read_cached` accepts of a parsed plan file: a plan record of ``key`` whose
    every field has its type and whose choices name strategies (None for anything else)."""

    def check(rec: Any) -> dict | None:
        if not isinstance(rec, dict) or rec.get("key") != key or not isinstance(rec.get("layers"), list):
            return None
        try:
            plan = Plan.from_dict(rec)
            choices = plan_choices(plan)
        except Exception:  # any malformed field: the plan is made again
            return None
        world = key.get("world")
        if (
            plan.world != world
            or any(not isinstance(c, str) for c in plan.choices)
            or len(choices) != len(plan.layers or ())
        ):
            return None
        return rec

    return check


def _read_cached(key: dict) -> dict | None:
    """The cached plan record of ``key`` as JSON (None: none, not a plan of ``key``, or not a
    regular file: a damaged or wrong-shaped file is said once and planned again; a named pipe or a
    directory in its place is never opened)."""
    rec, _ = read_json_cache(cache_path(key), _plan_record(key))
    return rec


def _write_cached(rec: Plan) -> None:
    assert rec.key is not None
    path = cache_path(rec.key)
    if foreign(path):  # not ours: left alone (said when it was read)
        return
    text = json.dumps(rec.to_dict(), indent=1) + "\n"
    try:
        atomic_write(path, lambda tmp: tmp.write_text(text))
    except OSError as e:  # a read-only cache must not stop training
        warnings.warn(f"could not cache the plan at {path}: {e}", RuntimeWarning, stacklevel=3)


def model_layers(ctx: Context, probe: LayerProbe) -> list[list[Candidate]]:
    """Every layer's candidates with their modelled terms, best first."""
    out = []
    for i, places in enumerate(probe.placements):
        specs = {p: probe.spec(i, p) for p in places}
        out.append(layer_candidates(ctx, specs, places[0], i > 0 or probe.input_grad))
    return out


def one_stage_twins(cands: list[Candidate], labels: set[str], base: StrategyOptions) -> list[Candidate]:
    """The candidates of ``cands`` that are one of ``labels``' pipelined candidates at one stage:
    the model charges each extra stage only its all-to-all's calibrated latency, while a stage also
    costs its own product and its share of cores (measured: docs/distributed.md), so a stage count
    above 1 is taken only where it measures faster than its twin."""

    single = {choice_key(c.choice, STAGE_FIELDS): c for c in cands if c.choice.options(base).pipeline_stages == 1}
    pipelined = [c for c in cands if c.label in labels and c.choice.options(base).pipeline_stages > 1]
    return [single[k] for k in (choice_key(c.choice, STAGE_FIELDS) for c in pipelined) if k in single]


def modelled_layers(
    ctx: Context, probe: LayerProbe, factor: float = PRUNE_FACTOR, measure: bool = True
) -> tuple[list[LayerPlan], list[list[str]]]:
    """Per layer, every candidate (modelled terms, whether it survived pruning) and the labels of
    the survivors (within ``factor`` of the best; only the best when not measuring); each layer's
    ``choice`` is its modelled best until measured."""
    layers, survivors = [], []
    free = FAMILY_FREE + BIT_FIELDS if ctx.auto_bits else FAMILY_FREE
    for i, cands in enumerate(model_layers(ctx, probe)):
        limit = None if factor == float("inf") else MAX_MEASURED
        keep = {c.label for c in (prune(cands, factor, limit, free) if measure else cands[:1])}
        if measure and ctx.auto_bits:  # a narrower width must measure against the best full-width step
            full = next((c for c in cands if choice_bits(c.choice, ctx.options) == (32, 32)), None)
            if full is not None:
                keep.add(full.label)
        if measure and ctx.stages:  # a pipelined survivor measures against its one-stage twin
            keep |= {t.label for t in one_stage_twins(cands, keep, ctx.options)}
        rows = tuple(CandidateRow.of(c, c.label in keep) for c in cands)
        layers.append(LayerPlan(i, rows[0].label, rows))
        survivors.append([r.label for r in rows if r.survived])
    return layers, survivors


def model_plan(ctx: Context, probe: LayerProbe) -> Plan:
    """The plan from the model alone, without processes (``tessera plan --model-only``, the
    simulator): each layer's modelled best."""
    layers, _ = modelled_layers(ctx, probe, measure=False)
    return Plan(
        choices=tuple(la.choice for la in layers),
        layers=tuple(layers),
        rates=ctx.rates,
        world=ctx.world,
        source="model",
    )


def pick_measured(candidates: list[CandidateRow], options: StrategyOptions, auto_bits: bool = False) -> CandidateRow:
    """The measured fastest of ``candidates`` (the modelled best where none was measured); with
    ``auto_bits``, at a width below 32 bits only where it measured at most ``1 - AUTO_BITS_GAIN``
    of the fastest full-width candidate's step (quantization changes the numbers; it must pay)."""
    timed = [c for c in candidates if c.measured_ms is not None]
    if not timed:
        return candidates[0]
    best = min(timed, key=lambda c: c.measured_ms or 0.0)
    if not auto_bits:
        return best
    full = [c for c in timed if parse_entry(c.label).options(options).exchange_bits() == (32, 32)]
    fastest_full = min(full, key=lambda c: c.measured_ms or 0.0) if full else None
    if fastest_full is not None and (best.measured_ms or 0.0) > (1 - AUTO_BITS_GAIN) * (
        fastest_full.measured_ms or 0.0
    ):
        return fastest_full
    return best


def measure_candidate(
    comm: Comm, pool: StrategyPool, graph: Graph, probe: LayerProbe, layer: int, choice: LayerChoice
) -> float:
    """Least of ``STEPS`` steps of the slowest rank's forward + backward of ``layer`` under
    ``choice`` (every rank calls it with the same arguments, in the same order)."""
    shard = pool.shard(choice, graph)
    spec = probe.spec(layer, probe.placements[layer][0] if choice.aggregate_first is None else choice.aggregate_first)
    operand = pool.get(choice).operand(spec, layer)
    log = pool.get(choice).log
    if log is not None:
        log.start_forward("plan")  # not training traffic: the run's log counts training passes only
    gen = torch.Generator().manual_seed(1000 + layer)
    n = shard.ids.numel()
    times = []
    for _ in range(1 + STEPS):  # the untimed first builds what the operand makes on first use
        x = torch.randn(n, spec.in_width, generator=gen).requires_grad_(layer > 0 or probe.input_grad)
        comm.barrier()
        t0 = time.perf_counter()
        out = probe.forward(layer, choice.aggregate_first, operand, x)
        out.backward(torch.ones_like(out))
        times.append(time.perf_counter() - t0)
    times = times[1:]
    t = torch.tensor([min(times)], dtype=torch.float64)
    comm.all_reduce_max(t)
    return float(t[0])


def plan_layers(
    comm: Comm,
    graph: Graph,
    options: StrategyOptions,
    probe: LayerProbe,
    bits: tuple[int, ...] | None = None,
    factor: float = PRUNE_FACTOR,
    measure: bool = True,
    use_cache: bool = True,
    rates: Rates | None = None,
    auto_bits: bool = False,
    stages: tuple[int, ...] = (),
) -> tuple[Plan, StrategyPool]:
    """The plan of every layer (a collective: every rank calls it): ``(record, pool)`` where the
    record holds ``choices`` (one ``--strategy`` entry per layer), each layer's candidates with
    modelled and measured milliseconds, the constants and the planning time, and ``pool`` the
    strategies it sharded (to train with, unsharded again for none). ``bits`` are the exchange
    widths to consider (default: the run's); ``auto_bits`` lets each layer's forward and backward
    exchanges take any of them where it saves enough (``--comm-bits auto``, :func:`pick_measured`);
    ``stages`` lists the pipeline stage counts tensor and hybrid choices come at (``--pipeline-stages
    auto``; empty: the run's); ``measure`` False decides from the model alone; ``rates`` skips
    calibration (for the model alone)."""
    if comm.world > 1:
        comm.barrier()  # peers still loading their data are not planning
    t0 = time.perf_counter()
    bits = tuple(bits or (options.comm_bits,))
    hosts = comm.host_indices() if rates is None else list(rates.hosts)
    key = cache_key(graph, comm.world, options, probe, bits, factor if measure else 0.0, auto_bits, hosts, stages)
    pool = StrategyPool(comm, options)
    cached = broadcast_json(comm, _read_cached(key) if use_cache and comm.rank == 0 else None)
    if cached is not None:
        return replace(Plan.from_dict(cached), source="cache", planning_s=time.perf_counter() - t0), pool
    if rates is None:
        rates = calibrate(graph, comm, options.backend, aggregate_widths(probe), hosts)
    t_cal = time.perf_counter()
    part = row_split(graph, comm, options)
    modelled: list[LayerPlan] = []
    survivors: list[list[str]] = []
    if comm.rank == 0:
        modelled, survivors = modelled_layers(
            Context(graph, comm.world, part, options, rates, bits, auto_bits, None, stages), probe, factor, measure
        )
    sent, survivors = broadcast_json(comm, [[la.to_dict() for la in modelled], survivors])
    layers = [LayerPlan.from_dict(la) for la in sent]
    t_model = time.perf_counter() - t_cal
    shard_s = steps_s = 0.0
    for i, labels in enumerate(survivors):
        candidates = list(layers[i].candidates)
        if measure and len(labels) > 1:
            for j, c in enumerate(candidates):
                if c.label in labels:
                    choice = parse_entry(c.label)
                    t1 = time.perf_counter()
                    pool.shard(choice, graph)
                    t2 = time.perf_counter()
                    with select.modelled_only():
                        ms = 1e3 * measure_candidate(comm, pool, graph, probe, i, choice)
                    candidates[j] = replace(c, measured_ms=ms)
                    shard_s += t2 - t1
                    steps_s += time.perf_counter() - t2
        best = pick_measured(candidates, options, auto_bits)
        layers[i] = LayerPlan(layers[i].layer, best.label, tuple(candidates))
    rec = Plan(
        key=key,
        choices=tuple(la.choice for la in layers),
        layers=tuple(layers),
        rates=rates,
        world=comm.world,
        factor=factor,
        measured=measure,
        timing_s=PlanTiming(t_cal - t0, t_model, shard_s, steps_s),
    )
    rec = Plan.from_dict(broadcast_json(comm, rec.to_dict()))  # rank 0's decision, on every rank
    if comm.rank == 0 and use_cache:
        _write_cached(rec)
    pool.keep(plan_choices(rec))
    return replace(rec, source="measured" if measure else "model", planning_s=time.perf_counter() - t0), pool


def plan_choices(rec: Plan) -> list[LayerChoice]:
    """The plan's layer choices."""
    return [parse_entry(c) for c in rec.choices]
