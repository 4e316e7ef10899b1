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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.backends import select
from tessera.comm.group import Comm
from tessera.files import atomic_write, default_cache_dir
from tessera.graph import Graph
from tessera.parallel.base import StrategyOptions, row_split
from tessera.parallel.mixed import LayerChoice, StrategyPool, parse_entry
from tessera.planner.calibrate import Rates, calibrate
from tessera.planner.candidates import Context, layer_candidates, prune
from tessera.sparse import LayerSpec, Operand

PLAN_VERSION = 4
PRUNE_FACTOR = 1.5
# Timed steps per measured candidate (the least counts), after an untimed one. The step after the
# untimed one still pays for memory touched for the first time (arxiv GCN layer 0 at P = 2,
# partition: 1389, 518, 212, 213 ms; tensor: 1148, 394, 326, 326 ms): timed alone, it would rank
# tensor ahead of partition on that layer.
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


def cache_key(graph: Graph, world: int, options: StrategyOptions, probe: LayerProbe, bits, factor: float) -> dict:
    """Everything a cached plan depends on."""
    return {
        "version": PLAN_VERSION,
        "graph": graph.fingerprint(),
        "world": world,
        "model": probe.description,
        "options": {k: getattr(options, k) for k in ("backend", "partition", "seed", "comm_bits", "pipeline_stages")},
        "bits": list(bits),
        "factor": factor,
        "threads": torch.get_num_threads(),
    }


def cache_path(key: dict) -> Path:
    """The plan file of ``key`` under ``$TESSERA_CACHE/plans``."""
    digest = hashlib.blake2b(json.dumps(key, sort_keys=True).encode(), digest_size=16).hexdigest()
    return default_cache_dir() / "plans" / f"plan-{digest}.json"


def _read_cached(key: dict) -> dict | None:
    try:
        rec = json.loads(cache_path(key).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(rec, dict) or rec.get("key") != key or not isinstance(rec.get("layers"), list):
        return None
    return rec


def _write_cached(rec: dict) -> None:
    path = cache_path(rec["key"])
    try:
        atomic_write(path, lambda tmp: tmp.write_text(json.dumps(rec, indent=1) + "\n"))
    except OSError as e:  # a read-only cache must not stop training
        warnings.warn(f"could not cache the plan at {path}: {e}", RuntimeWarning, stacklevel=3)


def model_layers(ctx: Context, probe: LayerProbe) -> list[list[dict[str, Any]]]:
    """Every layer's candidates with their modelled terms, best first."""
    out = []
    for i, places in enumerate(probe.placements):
        specs = {p: probe.spec(i, p) for p in places}
        out.append(layer_candidates(ctx, specs, places[0], i > 0 or probe.input_grad))
    return out


def modelled_layers(
    ctx: Context, probe: LayerProbe, factor: float = PRUNE_FACTOR, measure: bool = True
) -> tuple[list[dict[str, Any]], list[list[str]]]:
    """Per layer, every candidate as JSON (modelled terms, whether it survived pruning) and the
    labels of the survivors (within ``factor`` of the best; only the best when not measuring);
    each layer's ``choice`` is its modelled best until measured."""
    layers, survivors = [], []
    for i, cands in enumerate(model_layers(ctx, probe)):
        limit = None if factor == float("inf") else MAX_MEASURED
        keep = {c["label"] for c in (prune(cands, factor, limit) if measure else cands[:1])}
        rows = [_public(c) for c in cands]
        for r in rows:
            r["survived"] = r["label"] in keep
        layers.append({"layer": i, "choice": rows[0]["label"], "candidates": rows})
        survivors.append([r["label"] for r in rows if r["survived"]])
    return layers, survivors


def model_plan(ctx: Context, probe: LayerProbe) -> dict[str, Any]:
    """The plan from the model alone, without processes (``tessera plan --model-only``, the
    simulator): each layer's modelled best."""
    layers, _ = modelled_layers(ctx, probe, measure=False)
    return {
        "choices": [la["choice"] for la in layers],
        "layers": layers,
        "rates": ctx.rates.to_dict(),
        "world": ctx.world,
        "source": "model",
    }


def _public(c: dict[str, Any]) -> dict[str, Any]:
    """A candidate as JSON: its label, kind, width and times in milliseconds."""
    return {
        "label": c["label"],
        "kind": c["kind"],
        "width": c["width"],
        "backward": c["backward"],
        "model_ms": {k.removesuffix("_s"): 1e3 * v for k, v in c["model"].items()},
        "modelled_ms": 1e3 * c["modelled_s"],
        "measured_ms": None,
        "survived": False,
    }


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
) -> tuple[dict[str, Any], StrategyPool]:
    """The plan of every layer (a collective: every rank calls it): ``(record, pool)`` where the
    record holds ``choices`` (one ``--strategy`` entry per layer), each layer's candidates with
    modelled and measured milliseconds, the constants and the planning time, and ``pool`` the
    strategies it sharded (to train with, unsharded again for none). ``bits`` are the exchange
    widths to consider (default: the run's); ``measure`` False decides from the model alone;
    ``rates`` skips calibration (for the model alone)."""
    if comm.world > 1:
        comm.barrier()  # peers still loading their data are not planning
    t0 = time.perf_counter()
    bits = tuple(bits or (options.comm_bits,))
    key = cache_key(graph, comm.world, options, probe, bits, factor if measure else 0.0)
    pool = StrategyPool(comm, options)
    cached = broadcast_json(comm, _read_cached(key) if use_cache and comm.rank == 0 else None)
    if cached is not None:
        cached["source"] = "cache"
        cached["planning_s"] = time.perf_counter() - t0
        return cached, pool
    if rates is None:
        rates = calibrate(graph, comm, options.backend, aggregate_widths(probe))
    t_cal = time.perf_counter()
    part = row_split(graph, comm, options)
    layers: list[dict[str, Any]] = []
    survivors: list[list[str]] = []
    if comm.rank == 0:
        layers, survivors = modelled_layers(
            Context(graph, comm.world, part, options, rates, bits), probe, factor, measure
        )
    layers, survivors = broadcast_json(comm, [layers, survivors])
    timing = {"calibrate": t_cal - t0, "model": time.perf_counter() - t_cal, "shard": 0.0, "steps": 0.0}
    for i, labels in enumerate(survivors):
        if measure and len(labels) > 1:
            for c in layers[i]["candidates"]:
                if c["label"] in labels:
                    choice = parse_entry(c["label"])
                    t1 = time.perf_counter()
                    pool.shard(choice, graph)
                    t2 = time.perf_counter()
                    with select.modelled_only():
                        c["measured_ms"] = 1e3 * measure_candidate(comm, pool, graph, probe, i, choice)
                    timing["shard"] += t2 - t1
                    timing["steps"] += time.perf_counter() - t2
        timed = [c for c in layers[i]["candidates"] if c["measured_ms"] is not None]
        best = min(timed, key=lambda c: c["measured_ms"]) if timed else layers[i]["candidates"][0]
        layers[i]["choice"] = best["label"]
    rec = {
        "key": key,
        "choices": [la["choice"] for la in layers],
        "layers": layers,
        "rates": rates.to_dict(),
        "world": comm.world,
        "factor": factor,
        "measured": measure,
        "timing_s": timing,
    }
    rec = broadcast_json(comm, rec)  # rank 0's decision, on every rank
    if comm.rank == 0 and use_cache:
        _write_cached(rec)
    pool.keep([parse_entry(c) for c in rec["choices"]])
    rec["source"] = "measured" if measure else "model"
    rec["planning_s"] = time.perf_counter() - t0
    return rec, pool


def plan_choices(rec: dict[str, Any]) -> list[LayerChoice]:
    """The plan's layer choices."""
    return [parse_entry(c) for c in rec["choices"]]
