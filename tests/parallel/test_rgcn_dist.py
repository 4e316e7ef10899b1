"""RGCN and SAGE-LSTM under partition parallelism: losses and weights equal one process, and the
bytes each rank sends equal the simulator's. RGCN runs in both placements: gathering its remote
sources' input rows, and transforming first (the owners send ``W_r x_j`` per remote (relation,
source) pair); forced by ``--strategy partition@...`` or chosen per layer by bytes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import single_thread, spawn_groups
from tessera.cli.main import main
from tessera.datasets import load
from tessera.graph.partition import load_part, partition, write_parts
from tessera.graph.partition.relation_halo import build_pair_plan, pair_plan_from_part
from tessera.nn.models import build_model
from tessera.planner.volume import layer_exchanges, runtime_bytes, simulate_volumes
from tessera.train.config import TrainConfig
from tessera.train.loop import Trainer

pytestmark = pytest.mark.distributed  # starts worker processes

EPOCHS = 3
WORLDS = (2, 3)
DATASET = "synthetic:tiny-rel"  # 16 features, 4 classes, 8 relations
TF = "partition@transform-first"
# (model, extra config, RGCN aggregation): RGCN by mean and by sum with bases, placed by bytes (hidden
# 8: both layers gather; hidden 64: layer 1, 64 -> 4, transforms first) or forced to transform first
# (``strategy``, distributed runs only); SAGE-LSTM (bytes at P = 2)
RUNS = {
    "rgcn-mean": ("rgcn", {}, "mean"),
    "rgcn-sum-bases": ("rgcn", {"num_bases": 3}, "sum"),
    "sage-lstm": ("sage-lstm", {}, None),
    "rgcn-mean-tf": ("rgcn", {"strategy": TF}, "mean"),
    "rgcn-sum-bases-tf": ("rgcn", {"num_bases": 3, "strategy": TF}, "sum"),
    "rgcn-wide-mean": ("rgcn", {"hidden": 64}, "mean"),
    "rgcn-wide-sum-bases": ("rgcn", {"hidden": 64, "num_bases": 3}, "sum"),
}
QUANTIZED = {"rgcn-wide-2bit": ("rgcn", {"hidden": 64, "comm_bits": 2}, "mean")}  # bytes only
TF_RUNS = [n for n, (_, extra, _) in RUNS.items() if "strategy" in extra or extra.get("hidden") == 64]


def _spec(name: str) -> tuple:
    return {**RUNS, **QUANTIZED}[name]


def _reference(name: str) -> tuple:
    """What one process runs for ``name``: the placement does not change the model."""
    model, extra, aggr = _spec(name)
    return model, tuple(sorted((k, v) for k, v in extra.items() if k not in ("strategy", "comm_bits"))), aggr


def _config(name: str, out, distributed: bool = True, **kw) -> TrainConfig:
    model, extra, _ = _spec(name)
    extra = extra if distributed else dict(_reference(name)[1])
    base = dict(dataset=DATASET, model=model, hidden=8, dropout=0.5, epochs=EPOCHS, patience=0, remote_agg="prepost")
    return TrainConfig(**{**base, **extra, **kw, "out": str(out), "progress": False, "checkpoint_every": 1000})


def _trainer(name: str, out, graph, comm=None) -> Trainer:
    t = Trainer(_config(name, out, comm is not None), graph, comm)
    if _spec(name)[2] == "sum":  # the trainer's RGCN aggregates by mean; the layer also sums
        for conv in t.model.convs:
            conv.aggr = "sum"
    return t


def _run(name: str, out, graph, comm=None) -> dict:
    t = _trainer(name, out, graph, comm)
    t.fit()
    res = {
        "loss": [h["train_loss"] for h in t.history],
        "params": {k: v.tolist() for k, v in t.model.state_dict().items()},
    }
    if comm is not None:
        res["comm"] = [{k: h["comm"][k] for k in ("bytes_data", "bytes_params")} for h in t.history]
    return res


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from tessera.comm.group import init_from_env, shutdown
    from tessera.threads import set_num_threads

    set_num_threads(1)
    comm = init_from_env(120)
    g = load(DATASET)
    try:
        names = [n for n in {**RUNS, **QUANTIZED} if world == 2 or n != "sage-lstm"]  # SAGE-LSTM's split: elsewhere
        res = {n: _run(n, Path(out_dir) / f"{n}-{world}-{rank}", g, comm) for n in names}
        if world == 2:  # each rank from its own part file (tessera partition --out), edge types included
            part = load_part(Path(out_dir) / "parts", rank)
            for n in ("rgcn-mean", "rgcn-mean-tf"):
                res[f"{n}-parts"] = _run(n, Path(out_dir) / f"{n}-parts-{rank}", part, comm)
    finally:
        shutdown()
    if rank == 0:
        (Path(out_dir) / f"{world}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """``(one process, {P: rank 0's results})`` for every run of RUNS."""
    out = tmp_path_factory.mktemp("rgcn-dist")
    g = load(DATASET)
    write_parts(g, partition(g, 2, "metis", seed=0), out / "parts")  # the split --nprocs 2 makes
    with single_thread():
        one = {}
        for n in RUNS:
            if _reference(n) not in one:
                one[_reference(n)] = _run(n, out / f"{n}-one", g)
    spawn_groups(_worker, WORLDS, (str(out),))
    return {n: one[_reference(n)] for n in RUNS}, {w: json.loads((out / f"{w}.json").read_text()) for w in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [n for n in RUNS if n != "sage-lstm"])
def test_rgcn_partition_parallel_matches_single_process(runs, name, world):
    """Dropout 0.5 on; every rank receives its remote sources' input rows once per layer, or their
    owners' transformed pair rows, and runs the relational sum over its rows' typed in-edges, so
    losses and trained weights (relation weights, bases, coefficients) are one process's."""
    ref, got = runs[0][name], runs[1][world][name]
    key = f"{name} P={world}"
    _assert_same(got, ref, key)
    if name in ("rgcn-mean", "rgcn-mean-tf") and world == 2:
        _assert_same(runs[1][2][f"{name}-parts"], ref, f"{name} from part files")


def _assert_same(got: dict, ref: dict, key: str) -> None:
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(ref["loss"]), rtol=1e-4, atol=0, msg=key)
    assert set(got["params"]) == set(ref["params"]), key
    for k, v in ref["params"].items():
        torch.testing.assert_close(torch.tensor(got["params"][k]), torch.tensor(v), rtol=1e-4, atol=1e-4, msg=key)


@pytest.mark.parametrize("name", ["rgcn-mean", "rgcn-sum-bases", "sage-lstm"])
def test_measured_bytes_equal_simulated(runs, name, capsys):
    """Every epoch, every layer, direction and ordered pair of ranks: the bytes the runtime logged
    at P = 2 are the simulator's (post-mode source rows of the layer's input width, whatever
    --remote-agg says; layer 0 sends no gradients back)."""
    model, extra, _ = RUNS[name]
    g = load(DATASET)
    specs = build_model(
        model, g.num_features, 8, g.num_classes, 2, num_relations=g.num_relations or 0, **extra
    ).describe()
    vol = simulate_volumes(g, 2, specs, ("prepost",), (32,), model=model)
    expect = runtime_bytes(vol, "prepost", 32)
    assert vol.widths == (g.num_features, 8), vol.widths  # each layer's input width
    assert sum(map(sum, expect["bytes_data"][0][0])) > 0
    for epoch, measured in enumerate(runs[1][2][name]["comm"]):
        assert measured == expect, f"{name} epoch {epoch}"
    # tessera simulate reports the same epoch total
    argv = ["simulate", "--model", model, "--dataset", DATASET, "--parts", "2", "--hidden", "8"]
    assert main([*argv, "--remote-agg", "prepost", "--comm-bits", "32", "--json"]) == 0
    epoch = json.loads(capsys.readouterr().out)["runs"][0]["modes"]["prepost"]["bits"]["32"]["epoch"]
    assert epoch["bytes"] == int(torch.tensor(runs[1][2][name]["comm"][0]["bytes_data"]).sum())


def _placed_specs(g, name: str) -> list:
    model, extra, _ = _spec(name)
    net = build_model(
        model,
        g.num_features,
        extra.get("hidden", 8),
        g.num_classes,
        2,
        num_relations=g.num_relations,
        num_bases=extra.get("num_bases"),
    )
    for conv in net.convs:
        conv.place(False if "strategy" in extra else None)  # TF fixes transform first; else by bytes
    return net.describe()


def _brute_force_pairs(g, part, world: int) -> np.ndarray:
    """Distinct (relation, source) pairs of the edges from each rank's sources into each other
    rank's rows, counted edge by edge."""
    seen = [[set() for _ in range(world)] for _ in range(world)]
    for j, i, r in zip(g.src_index().tolist(), g.dst_index().tolist(), g.edge_type.tolist()):
        if part[j] != part[i]:
            seen[part[j]][part[i]].add((r, j))
    return np.array([[len(s) for s in row] for row in seen])


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", [*TF_RUNS, *QUANTIZED])
def test_transform_first_bytes_equal_simulated(runs, name, world):
    """Forced transform first, and placed by bytes, at 32 and 2 bits: every epoch, layer, direction
    and ordered pair of ranks logs the simulator's bytes. A transform-first layer sends one
    out-wide row per remote (relation, source) pair (counted here edge by edge), forward and back,
    layer 0 included (its weights need the gradients)."""
    g = load(DATASET)
    specs = _placed_specs(g, name)
    bits = _spec(name)[1].get("comm_bits", 32)
    vol = simulate_volumes(g, world, specs, ("prepost",), (bits,), model="rgcn")
    ex = vol.exchanges["prepost"][bits]
    pairs = _brute_force_pairs(g, partition(g, world, "metis", seed=0), world)
    assert any(la.placement == "transform-first" for la in ex)
    for la, s in zip(ex, specs):
        if la.placement == "transform-first":
            assert (la.width, la.backward) == (s.out_width, True)
            np.testing.assert_array_equal(la.rows, pairs)
    expect = runtime_bytes(vol, "prepost", bits)
    for epoch, measured in enumerate(runs[1][world][name]["comm"]):
        assert measured == expect, f"{name} P={world} epoch {epoch}"


@pytest.mark.parametrize("world", WORLDS)
def test_placement_by_bytes(runs, world, capsys):
    """With no placement fixed each layer takes the one whose forward exchange moves fewer bytes:
    hidden 64 gathers its 16-wide input rows at layer 0 and transforms first at layer 1 (4 wide
    per pair against 64 per source), which moves fewer bytes than gathering (as the fixed
    placements' runs and the simulator, ``tessera simulate --placement``, say)."""
    place = {}
    for flag in ("auto", "aggregate-first", "transform-first"):
        argv = ["simulate", "--model", "rgcn", "--dataset", DATASET, "--parts", str(world), "--hidden", "64"]
        assert main([*argv, "--remote-agg", "prepost", "--comm-bits", "32", "--placement", flag, "--json"]) == 0
        doc = json.loads(capsys.readouterr().out)["runs"][0]
        place[flag] = (doc["placements"]["32"], doc["modes"]["prepost"]["bits"]["32"]["layers"])
    auto, layers = place["auto"]
    assert [la["placement"] for la in auto] == ["gather", "transform-first"]
    assert auto[0]["gather_bytes"] < auto[0]["transform_first_bytes"]
    assert auto[1]["transform_first_bytes"] < auto[1]["gather_bytes"] / 4
    measured = runs[1][world]["rgcn-wide-mean"]["comm"][0]["bytes_data"]
    for i, la in enumerate(auto):  # the forward bytes logged per layer are the placement's
        taken = la["gather_bytes"] if la["placement"] == "gather" else la["transform_first_bytes"]
        assert int(np.sum(measured[i][0])) == taken == layers[i]["forward"]["bytes"]
    gather, first = place["aggregate-first"][1], place["transform-first"][1]
    assert layers[1]["forward"]["bytes"] == first[1]["forward"]["bytes"] < gather[1]["forward"]["bytes"]
    assert layers[0]["forward"]["bytes"] == gather[0]["forward"]["bytes"] < first[0]["forward"]["bytes"]


def test_placement_tie_gathers():
    """Equal forward bytes keep the gather (it computes no transforms for other ranks)."""
    spec = build_model("rgcn", 4, 8, 2, 1, num_relations=2).describe()
    rows = np.array([[0, 2], [2, 0]])
    pairs = np.array([[0, 4], [4, 0]])  # 8 pair rows of 2 values = 4 source rows of 4 values
    assert layer_exchanges([(4, False)], rows, 32, spec, pairs)[0].placement == "gather"
    assert layer_exchanges([(4, False)], rows, 32, spec, pairs - np.eye(2, dtype=int)[::-1])[0].placement == (
        "transform-first"
    )


def test_pair_plan_from_part_files_equals_graphs(tmp_path):
    """Each rank's transform-first plan is the same from its part file as from the whole graph."""
    g = load(DATASET)
    part = partition(g, 3, "metis", seed=0)
    write_parts(g, part, tmp_path)
    for rank in range(3):
        a = build_pair_plan(g.indptr.numpy(), g.indices.numpy(), g.edge_type.numpy(), g.num_relations, part, rank, 3)
        b = pair_plan_from_part(load_part(tmp_path, rank), g.num_relations)
        for field in ("owned", "send_src", "send_rel", "send_counts", "recv_counts"):
            np.testing.assert_array_equal(getattr(a, field), getattr(b, field), err_msg=field)
        for side in ("local", "remote"):
            for x, y in zip(getattr(a, side), getattr(b, side)):
                np.testing.assert_array_equal(x, y, err_msg=side)
        assert a.send_counts.sum() > 0 and a.recv_counts.sum() > 0


def test_tensor_strategy_refuses_rgcn_in_one_line(tmp_path):
    argv = "-m tessera train --dataset synthetic:tiny-rel --model rgcn --strategy tensor --nprocs 2 --epochs 1"
    proc = subprocess.run([sys.executable, *argv.split(), "--out", str(tmp_path)], capture_output=True, text=True)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("tessera: error: the tensor strategy does not run rgcn"), proc.stderr


def test_simulator_refuses_rgcn_for_tensor_and_hybrid(capsys):
    for strategy in ("tensor", "hybrid"):
        argv = ["simulate", "--model", "rgcn", "--dataset", DATASET, "--parts", "2", "--strategy", strategy]
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"tessera: error: the {strategy} strategy does not run rgcn"), (
            err
        )
