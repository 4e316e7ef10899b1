"""The per-layer planner: NeutronAscend's Algorithm 1, the cost model's choice on constructed
graphs, and the measured plan's agreement across ranks and its cache."""

import json
import math
import os
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import single_thread, spawn_groups
from tessera import Graph
from tessera.datasets import load
from tessera.parallel.base import StrategyOptions
from tessera.planner.calibrate import Rates
from tessera.planner.candidates import Context
from tessera.planner.grouping import algorithm1, group_counts, rank_grouping
from tessera.planner.plan import LayerProbe, model_plan
from tessera.sparse import LayerSpec

pytestmark = pytest.mark.distributed  # starts worker processes

# NeutronAscend Table 1: feature widths, label counts and the hidden width 256; Fig. 12 runs 10,
# 20 and 30 AI Cores (the 910B has 30); §5.3: L2 has up to 20x HBM's bandwidth (r). The paper
# prints no T_comp or T_mem, so they are 1 (and, below, hand-chosen functions of M).
PAPER_WIDTHS = (3703, 1433, 500, 602, 100, 256, 6, 7, 3, 41, 47)
PAPER_CORES = (10, 20, 30)
PAPER_R = 20


def test_algorithm1_on_the_papers_widths_and_hand_computed_cases():
    assert group_counts(30) == [1, 2, 30] and group_counts(20) == [1, 2, 4, 20] and group_counts(16) == [1, 2, 4, 8, 16]
    # With T_comp and T_mem the same for every M the printed cost always picks M = 1.
    for n in PAPER_CORES:
        for d in PAPER_WIDTHS:
            assert algorithm1(n, d, PAPER_R, 1.0, 1.0)[0] == 1, (n, d)
    # Reddit's 602 features on 30 cores, by hand: S = 602 (pad 6), 301 (pad 3), 602/30 (pad 16 - 4.0667).
    best, rows = algorithm1(30, 602, 20, 1.0, 1.0)
    assert [r.M for r in rows] == [1, 2, 30]
    assert rows[0].pad == 6 and rows[1].pad == 3 and math.isclose(rows[2].pad, 16 - (602 / 30 - 16))
    assert math.isclose(rows[0].cost, 6 / 602 - (1 - 1 / (1 + 29 * 19)))
    assert math.isclose(rows[1].cost, 3 / 301 - (1 - 1 / (1 + 14 * 19)))
    assert math.isclose(rows[2].cost, rows[2].pad / (602 / 30))  # G = 1 saves nothing
    # T_mem growing with M (less reuse per group): M = 2 saves 2 (1 - 1/2) = 1 > 0.75 at M = 1.
    best, rows = algorithm1(4, 96, 2, 1.0, lambda m: float(m))
    assert best == 2 and [r.cost for r in rows] == [-0.75, -1.0, 8 / 24]
    # Padding: D = 40 on 2 cores, r = 3: M = 1 idles 8/40 and saves 2/3; M = 2 idles 12/20, saves 0.
    best, rows = algorithm1(2, 40, 3, 1.0, 1.0)
    assert best == 1 and math.isclose(rows[0].cost, 0.2 - 2 / 3) and math.isclose(rows[1].cost, 0.6)


def _complete(n: int, cliques: int = 1) -> Graph:
    """``cliques`` disjoint complete graphs of ``n`` vertices each (no self loops)."""
    src, dst = [], []
    for c in range(cliques):
        ids = torch.arange(c * n, (c + 1) * n)
        s, d = torch.meshgrid(ids, ids, indexing="ij")
        keep = s != d
        src.append(s[keep])
        dst.append(d[keep])
    return Graph.from_edge_index(torch.stack([torch.cat(src), torch.cat(dst)]), n * cliques)


def _probe(widths):
    specs = [LayerSpec(i, o, o, aggregates_first=False) for i, o in widths]
    return LayerProbe([(False,)] * len(specs), lambda layer, first: specs[layer], None, False, {})


# Aggregation by value only, fast GEMMs, a slow link without latency: communication decides.
SLOW_LINK = Rates(edge_s=0.0, value_s=1e-9, gemm_flops=1e15, bandwidth_gbps=1e-3, latency_us=0.0)


def test_model_picks_tensor_when_every_neighbour_is_remote_and_partition_when_none_is():
    world, width = 4, 8
    # K_40 in 4 ranges: every in-neighbour of a vertex is remote, so each rank receives all 30
    # other rows (post), while tensor moves its 10 rows' 6 other columns out and back.
    g = _complete(40)
    part = np.repeat(np.arange(world), 10)
    plan = model_plan(Context(g, world, part, StrategyOptions(), SLOW_LINK), _probe([(16, width)]))
    cands = {c.label: c for c in plan.layers[0].candidates}
    assert plan.choices == ("tensor:32",)
    assert plan.choices[0] == min(cands, key=lambda k: cands[k].modelled_ms)
    bw = SLOW_LINK.bandwidth_gbps * 1e9
    # post: each rank sends its 10 rows to 3 peers, forward and (transposed) backward
    assert math.isclose(cands["partition:post:32"].model_ms.comm, 1e3 * 2 * 3 * 10 * width * 4 / bw)
    # tensor: 10 rows x 2 columns to each of 3 peers, to the feature split and back, both passes
    assert math.isclose(cands["tensor:32"].model_ms.comm, 1e3 * 2 * 2 * 3 * 10 * 2 * 4 / bw)
    # Four disjoint cliques, one per rank: nothing crosses, partition sends nothing.
    plan = model_plan(Context(_complete(10, 4), world, part, StrategyOptions(), SLOW_LINK), _probe([(16, width)]))
    assert plan.choices[0].startswith("partition:") and plan.layers[0].candidates[0].model_ms.comm == 0


def test_model_picks_hybrid_when_row_groups_save_the_latency_tensor_pays_and_the_bytes_partition_does():
    world, width = 4, 8
    # K_40 in 4 ranges, 1 ms per message: partition sends 30 rows to 3 peers, tensor 6 messages
    # per pass; hybrid:2 one message each way inside its row group (10 rows x 4 columns) and one
    # halo message between the two G-parts (20 rows x 4 columns).
    rates = Rates(edge_s=0.0, value_s=1e-9, gemm_flops=1e15, bandwidth_gbps=1e-3, latency_us=1000.0)
    part = np.repeat(np.arange(world), 10)
    plan = model_plan(Context(_complete(40), world, part, StrategyOptions(), rates), _probe([(16, width)]))
    cands = {c.label: c for c in plan.layers[0].candidates}
    assert {k for k in cands if k.startswith("hybrid")} == {f"hybrid:2:{m}:32" for m in ("post", "pre", "prepost")}
    assert plan.choices[0].startswith("hybrid:2:")
    assert plan.choices[0] == min(cands, key=lambda k: cands[k].modelled_ms)
    bw, lat, passes = rates.bandwidth_gbps * 1e9, 1e-3, 1 + cands["tensor:32"].backward
    a2a = 2 * (10 * 4 * 4 / bw + lat)  # to the column split and back, one peer
    halo = 20 * 4 * 4 / bw + lat  # post: the other G-part's 20 rows at width 4
    got = cands["hybrid:2:post:32"].model_ms
    assert math.isclose(got.comm, 1e3 * passes * (a2a + halo))
    # a G-part aggregates its 20 rows' 39 in-edges each, at the column slice's width
    assert math.isclose(got.aggregate, 1e3 * passes * 20 * 39 * 4 * rates.value_s)
    # the modelled bytes are the simulator's (and so the runtime's): hybrid_pair_bytes
    from tessera.graph.partition.halo import pair_rows
    from tessera.planner.volume.hybrid import hybrid_pair_bytes

    halo_rows = pair_rows(_complete(40).indptr.numpy(), _complete(40).indices.numpy(), part // 2, 2, ("post",))["post"]
    data, _ = hybrid_pair_bytes(np.full(world, 10), halo_rows, 2, width, 32)
    assert data.sum(axis=1).max() == 2 * 10 * 4 * 4 + 20 * 4 * 4
    # P = 2 and 3 have no M strictly between 1 and P
    for p in (2, 3):
        small = model_plan(
            Context(_complete(12), p, np.arange(12) * p // 12, StrategyOptions(), rates), _probe([(16, width)])
        )
        assert not any(c.kind == "hybrid" for c in small.layers[0].candidates)


def test_prune_keeps_each_familys_modelled_best_up_to_the_limit():
    from tessera.planner.candidates import layer_candidates, prune

    rates = Rates(edge_s=0.0, value_s=1e-9, gemm_flops=1e15, bandwidth_gbps=1e-3, latency_us=1000.0)
    ctx = Context(_complete(40), 4, np.repeat(np.arange(4), 10), StrategyOptions(), rates)
    cands = layer_candidates(ctx, {False: LayerSpec(16, 8, 8, aggregates_first=False)}, False, False)
    assert len(prune(cands, float("inf"))) == len(cands) == 7  # 3 partition modes, tensor, 3 hybrid:2 modes
    kept = prune(cands, float("inf"), 3)
    firsts = {}
    for c in cands:  # sorted: the first of each kind is its family's best
        firsts.setdefault(c.kind, c.label)
    best, *rest = firsts.items()
    ends_first = [best[1]] + [lab for k, lab in rest if k != "hybrid"] + [lab for k, lab in rest if k == "hybrid"]
    assert [c.label for c in kept] == ends_first
    assert [c.label for c in prune(cands, float("inf"), 2)] == ends_first[:2]
    # hybrid modelled second of three: partition and tensor, the ends, are measured first
    order = {"tensor": 1.0, "hybrid": 1.01, "partition": 1.02}
    ranked = sorted((replace(c, modelled_s=order[c.kind]) for c in cands), key=lambda c: c.modelled_s)
    assert [c.kind for c in prune(ranked, 1.5, 2)] == ["tensor", "partition"]
    assert prune(cands, 1.0, 3)[0] is cands[0]  # factor 1: the best (and only its exact ties)


def test_plan_model_only_lists_hybrid_candidates(capsys):
    from tessera.cli.main import main

    argv = ["plan", "--dataset", "synthetic:tiny", "--nprocs", "4", "--model-only", "--hidden", "16", "--json"]
    assert main(argv) == 0
    rec = json.loads(capsys.readouterr().out)
    for layer in rec["layers"]:
        labels = {c["label"] for c in layer["candidates"]}
        assert {"hybrid:2:post:32", "hybrid:2:pre:32", "hybrid:2:prepost:32"} <= labels


def test_plan_of_an_attention_model_names_the_strategies_that_run_it(capsys):
    from tessera.cli.main import main

    assert main(["plan", "--dataset", "synthetic:tiny", "--model", "gat", "--nprocs", "2", "--model-only"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "planner does not model" in err[0] and "--strategy partition or tensor" in err[0], err


def test_rank_grouping_terms_and_memory_limit():
    g = load("synthetic:tiny")
    indptr, indices = g.indptr.numpy(), g.indices.numpy()

    def parts_of(k):
        return np.arange(g.num_nodes) * k // g.num_nodes

    best, rows = rank_grouping(indptr, indices, parts_of, 4, 40, 1e9, SLOW_LINK.comm())
    assert [r.M for r in rows] == [1, 2, 4]
    assert rows[0].all_to_all_s == 0 and rows[-1].halo_s == 0  # M = 1 is partition, M = P tensor
    r = rows[1]
    compute = r.cost_s - (r.idle_s + r.imbalance_s + r.halo_s + r.all_to_all_s)  # the balanced aggregation itself
    assert r.S == 20 and math.isclose(r.idle_s, 12 / 20 * compute)  # 20 columns pad to 32
    assert best == min(rows, key=lambda r: r.cost_s).M
    assert rank_grouping(indptr, indices, parts_of, 4, 40, 1e9, SLOW_LINK.comm(), memory_limit=1.0)[0] is None


# ---------------------------------------------------------------------------------------- measured
def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from tessera.comm.group import init_from_env, shutdown
    from tessera.nn import build_model
    from tessera.planner import plan as planner
    from tessera.threads import set_num_threads
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer
    from tessera.train.planning import model_probe

    set_num_threads(1)
    comm = init_from_env(120)
    measured = []
    real = planner.measure_candidate
    planner.measure_candidate = lambda *a: measured.append(a[4:]) or real(*a)
    out = {}
    try:
        g = load("synthetic:tiny")
        cfg = TrainConfig(dataset="synthetic:tiny", hidden=8, epochs=3, patience=0, progress=False)
        probe = model_probe(build_model("gcn", g.num_features, 8, g.num_classes, 2), cfg)
        for run in ("first", "again"):
            before = len(measured)
            rec, pool = planner.plan_layers(comm, g, StrategyOptions(), probe, factor=float("inf"))
            log = pool.get(planner.plan_choices(rec)[0]).log  # None: nothing sharded (a cached plan)
            logged = log.gather(comm)["bytes_data"] if log is not None else 0
            out[run] = {
                "source": rec.source,
                "measured": len(measured) - before,
                "layers": [la.to_dict() for la in rec.layers],
                "logged": int(torch.tensor(logged).sum()),
            }
        cfg.out = str(Path(out_dir) / f"train-{world}")
        t = Trainer(cfg, g, comm)
        t.fit()
        out["train"] = {"plan": list(t.plan.choices), "loss": [h["train_loss"] for h in t.history]}
    finally:
        shutdown()
    (Path(out_dir) / f"plan-{world}-{rank}.json").write_text(json.dumps(out))


@pytest.fixture(scope="module")
def plan_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("plans")
    before = os.environ["TESSERA_CACHE"]
    os.environ["TESSERA_CACHE"] = str(out / "cache")  # a fresh plan cache, which the spawned ranks inherit
    try:
        spawn_groups(_worker, (2, 3), (str(out),))
    finally:
        os.environ["TESSERA_CACHE"] = before
    return {(w, r): json.loads((out / f"plan-{w}-{r}.json").read_text()) for w in (2, 3) for r in range(w)}


@pytest.mark.parametrize("world", (2, 3))
def test_measured_plan_agrees_on_all_ranks_is_cached_per_world_and_trains_exactly(world, plan_runs, tmp_path):
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    first = plan_runs[(world, 0)]["first"]
    # every candidate measured (no pruning), on every rank, in the same order
    n_cands = sum(len(la["candidates"]) for la in first["layers"])
    assert first["source"] == "measured" and first["measured"] == n_cands
    assert first["logged"] == 0  # the measured steps' traffic is not counted as the run's
    assert all(c["measured_ms"] > 0 for la in first["layers"] for c in la["candidates"])
    for la in first["layers"]:
        assert la["choice"] == min(la["candidates"], key=lambda c: c["measured_ms"])["label"]
    for rank in range(world):
        got = plan_runs[(world, rank)]
        assert got["first"]["layers"] == first["layers"], rank  # rank 0's decision everywhere
        assert got["again"]["source"] == "cache" and got["again"]["measured"] == 0
        assert got["again"]["layers"] == first["layers"]
        assert got["train"]["plan"] == plan_runs[(world, 0)]["train"]["plan"]
    # the trainer's auto plan (its own key: the run's model) reproduces one process
    with single_thread():
        cfg = TrainConfig(dataset="synthetic:tiny", hidden=8, epochs=3, patience=0, progress=False)
        cfg.out = str(tmp_path)
        t = Trainer(cfg, load("synthetic:tiny"))
        t.fit()
    ref = torch.tensor([h["train_loss"] for h in t.history])
    torch.testing.assert_close(torch.tensor(plan_runs[(world, 0)]["train"]["loss"]), ref, rtol=1e-4, atol=0)
