"""On a simulated sweep of P the planner's model-only choice is the modelled optimum: every
candidate's communication term is SuperGCN's model over the simulator's blocks (the bytes the
runtime logs), and each layer's choice, and so the whole model's assignment, is the least
modelled total over every candidate of every kind and placement (fixed rates, nothing timed)."""

import functools
import itertools
import json
import math
import re
from dataclasses import replace

import numpy as np
import pytest

from tessera.datasets import load
from tessera.graph.partition import partition
from tessera.graph.partition.halo import MODES
from tessera.nn import build_model
from tessera.parallel.base import StrategyOptions
from tessera.planner.calibrate import Rates
from tessera.planner.candidates import Context
from tessera.planner.model import blocks_time, project, project_tensor
from tessera.planner.optimum import check_choices, optimum_layers
from tessera.planner.plan import PRUNE_FACTOR, model_plan, modelled_layers
from tessera.planner.volume.common import blocks_bytes
from tessera.planner.volume.hybrid import group_halo_rows, hybrid_blocks, hybrid_volumes
from tessera.planner.volume.partition import simulate_volumes
from tessera.planner.volume.tensor import tensor_volumes
from tessera.train.config import TrainConfig
from tessera.train.planning import model_probe

SWEEP = (2, 3, 4, 8, 16, 64, 256, 1024, 8192)
GRAPH = "synthetic:tiny"  # 200 vertices: P up to 64 of the sweep
HIDDEN = 24  # uneven column slices for M = 16, and the 4 classes leave ranks without columns at P >= 8
BITS = (32, 2)
# A slow link against fast compute: partition wins at small P, hybrid at P = 16 and 64 (checked below)
RATES = Rates(edge_s=2e-9, value_s=5e-10, gemm_flops=2e10, bandwidth_gbps=2.0, latency_us=20.0, fresh_value_s=1e-10)
REL = 1e-9


@functools.cache
def _setup(model: str):
    g = load(GRAPH)
    cfg = TrainConfig(model=model, hidden=HIDDEN)
    probe = model_probe(build_model(model, g.num_features, HIDDEN, g.num_classes, 2, heads=4), cfg)
    return g, probe, [p for p in SWEEP if p <= g.num_nodes]


def _variant(probe, layer, placement):
    """The model's layer descriptions with ``layer`` in ``placement``, the others in their own."""
    specs = [probe.spec(i, places[0]) for i, places in enumerate(probe.placements)]
    specs[layer] = probe.spec(layer, placement)
    return specs


def _labels(probe, layer, world, attention):
    """Every candidate a layer has, enumerated here: partition in every mode, tensor, hybrid of every
    M strictly between 1 and P dividing P in every mode, at every bit width and placement."""
    places = probe.placements[layer]
    groups = [m for m in range(2, world) if world % m == 0]
    out = set()
    for p in places:
        suffix = "" if p == places[0] else ("@aggregate-first" if p else "@transform-first")
        modes = ("post",) if attention else MODES
        out |= {f"partition:{mode}:{b}{suffix}" for mode in modes for b in BITS}
        if not attention:
            out |= {f"tensor:{b}{suffix}" for b in BITS}
            out |= {f"hybrid:{m}:{mode}:{b}{suffix}" for m in groups for mode in MODES for b in BITS}
    return out


def _simulated_comm_s(g, probe, world, layer, label, cache):
    """A candidate's communication seconds from the simulator's own results: partition through
    ``project``, tensor through ``project_tensor`` (one layer's share), hybrid through
    ``blocks_time`` over its blocks over all P ranks, whose bytes are ``hybrid_volumes``'."""
    entry, _, place = label.partition("@")
    placement = probe.placements[layer][0] if not place else place == "aggregate-first"
    specs = _variant(probe, layer, placement)
    name, *args = entry.split(":")
    bits = int(args[-1])
    link = RATES.comm()

    def once(key, make):  # each simulator result serves every bit width (and mode)
        if key not in cache:
            cache[key] = make()
        return cache[key]

    if name == "partition":
        proj = once(("vol", layer, placement), lambda: project(simulate_volumes(g, world, specs, MODES, BITS), link))
        one = proj[args[0]][bits].layers[layer]
        return sum(d.time_s for d in (one.forward, one.backward) if d is not None)
    if name == "tensor":
        tv = once(("tensor", layer, placement), lambda: tensor_volumes(g, world, specs, bits=BITS))
        only = replace(tv, widths=tuple(w if i == layer else 0 for i, w in enumerate(tv.widths)))
        return project_tensor(only, link)[bits]
    groups, mode = int(args[0]), args[1]
    hv = once(
        ("hybrid", layer, placement, groups, mode), lambda: hybrid_volumes(g, world, groups, specs, mode, bits=BITS)
    )
    width, back = hv.widths[layer], hv.backward[layer]
    part = once("part", lambda: partition(g, world, "metis", 0))
    halo = once(("halo", groups), lambda: group_halo_rows(g, part, world, groups))[mode]
    total = 0.0
    for direction, rows in enumerate((halo, halo.T) if back else (halo,)):
        blocks = hybrid_blocks(np.bincount(part, minlength=world), rows, groups, width, 1)
        sent = sum(sum(blocks_bytes(r, w, bits)[:2]) for r, w in blocks)
        logged = hv.runtime[bits]
        assert np.array_equal(sent, logged["bytes_data"][layer, direction] + logged["bytes_params"][layer, direction])
        total += blocks_time(blocks, bits, link)
    return total


@pytest.mark.parametrize("model", ["gcn", "sage", "gat"])
def test_model_only_choice_is_the_modelled_optimum_over_the_sweep(model):
    g, probe, sweep = _setup(model)
    assert sweep == [2, 3, 4, 8, 16, 64]
    attention = model == "gat"
    kinds = set()
    for world in sweep:
        part = partition(g, world, "metis", 0)
        ctx = Context(g, world, part, StrategyOptions(), RATES, BITS)
        plan = model_plan(ctx, probe)
        _, survivors = modelled_layers(Context(g, world, part, StrategyOptions(), RATES, BITS), probe, PRUNE_FACTOR)
        cache: dict = {}
        totals = []
        for i, layer in enumerate(plan.layers):
            cands = {c.label: c for c in layer.candidates}
            assert set(cands) == _labels(probe, i, world, attention), (world, i)
            total = {}
            for label, c in cands.items():
                comm = _simulated_comm_s(g, probe, world, i, label, cache)
                # (a) the planner's communication term is the simulator's, to rounding
                assert math.isclose(c.model_ms.comm, 1e3 * comm, rel_tol=REL, abs_tol=1e-12), (world, i, label)
                # the other terms (dense, aggregate, memory) are the candidate's own, from the same rates
                total[label] = c.modelled_ms - c.model_ms.comm + 1e3 * comm
            best = min(total.values())
            # (b) the choice is the least total over every candidate of every kind and placement,
            # and measuring (after pruning to each family's best) starts from it
            assert total[plan.choices[i]] <= best * (1 + REL), (world, i, plan.choices[i])
            assert total[survivors[i][0]] <= best * (1 + REL) and len(survivors[i]) <= 3
            kinds.add(plan.choices[i].split(":")[0])
            totals.append(total)
        # the whole model's assignment is the best of every assignment of candidates to layers
        chosen = sum(t[c] for t, c in zip(totals, plan.choices))
        assert chosen <= min(map(sum, itertools.product(*(t.values() for t in totals)))) * (1 + REL)
        # the library's own check (what `tessera simulate --plan` prints) agrees
        vol = simulate_volumes(g, world, _variant(probe, 0, probe.placements[0][0]), MODES, BITS)
        check = check_choices(plan, optimum_layers(ctx, probe, vol))
        assert all(check.matches) and check.comm_rel_diff < REL
    assert kinds == ({"partition"} if attention else {"partition", "hybrid"})


def test_simulate_plan_prints_that_each_choice_is_the_modelled_optimum(capsys):
    from tessera.cli.main import main

    argv = ["simulate", "--dataset", GRAPH, "--parts", "2,3,4,8,16,64", "--plan", "--hidden", str(HIDDEN)]
    assert main([*argv, "--remote-agg", "post", "--model", "sage"]) == 0  # one mode: the check simulates all
    out = capsys.readouterr().out
    found = re.findall(
        r"P=\s*(\d+) choice = modelled optimum \(communication from the simulator's blocks\): (\S+); "
        r"candidates' modelled communication within (\S+) of it",
        out,
    )
    assert [(p, ok) for p, ok, _ in found] == [(str(p), "yes") for p in (2, 3, 4, 8, 16, 64)], out
    assert all(float(diff) < REL for _, _, diff in found), found
    assert main(["simulate", "--dataset", GRAPH, "--parts", "4,16", "--plan", "--hidden", str(HIDDEN), "--json"]) == 0
    runs = json.loads(capsys.readouterr().out)["runs"]
    assert [r["plan"]["check"]["matches"] for r in runs] == [[True, True]] * 2


def test_the_simulators_check_agrees_with_the_planner_at_pipeline_stages():
    # tensor and hybrid candidates at 4 stages: both sides take the pipeline's overlap off the
    # communication term (planner/candidates.pipelined_s)
    g, probe, _ = _setup("gcn")
    for world in (4, 8):
        part = partition(g, world, "metis", 0)
        ctx = Context(g, world, part, StrategyOptions(pipeline_stages=4), RATES, BITS)
        plan = model_plan(ctx, probe)
        vol = simulate_volumes(g, world, _variant(probe, 0, probe.placements[0][0]), MODES, BITS)
        layers = optimum_layers(ctx, probe, vol)
        for layer in layers:
            for c in layer.candidates:
                if c.kind in ("tensor", "hybrid"):
                    assert math.isclose(c.comm_ms, c.simulated_comm_ms, rel_tol=1e-9), (world, c.label)
        assert all(check_choices(plan, layers).matches), world
