"""RGCN and SAGE-LSTM under partition parallelism: losses and weights equal one process, and the
bytes each rank sends equal the simulator's."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import single_thread, spawn_groups
from tessera.cli.main import main
from tessera.datasets import load
from tessera.graph.partition import load_part, partition, write_parts
from tessera.nn.models import build_model
from tessera.planner.volume import runtime_bytes, simulate_volumes
from tessera.train.config import TrainConfig
from tessera.train.loop import Trainer

EPOCHS = 3
WORLDS = (2, 3)
DATASET = "synthetic:tiny-rel"
# (model, extra config, RGCN aggregation): RGCN by mean and by sum with bases; SAGE-LSTM (bytes at P = 2)
RUNS = {
    "rgcn-mean": ("rgcn", {}, "mean"),
    "rgcn-sum-bases": ("rgcn", {"num_bases": 3}, "sum"),
    "sage-lstm": ("sage-lstm", {}, None),
}


def _config(name: str, out, **kw) -> TrainConfig:
    model, extra, _ = RUNS[name]
    base = dict(dataset=DATASET, model=model, hidden=8, dropout=0.5, epochs=EPOCHS, patience=0, remote_agg="prepost")
    return TrainConfig(**{**base, **extra, **kw, "out": str(out), "progress": False, "checkpoint_every": 1000})


def _trainer(name: str, out, graph, comm=None) -> Trainer:
    t = Trainer(_config(name, out), graph, comm)
    if RUNS[name][2] == "sum":  # the trainer's RGCN aggregates by mean; the layer also sums
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
        names = [n for n in RUNS if world == 2 or n != "sage-lstm"]  # SAGE-LSTM's split is tested elsewhere
        res = {n: _run(n, Path(out_dir) / f"{n}-{world}-{rank}", g, comm) for n in names}
        if world == 2:  # each rank from its own part file (tessera partition --out), edge types included
            part = load_part(Path(out_dir) / "parts", rank)
            res["rgcn-mean-parts"] = _run("rgcn-mean", Path(out_dir) / f"parts-{rank}", part, comm)
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
        ref = {n: _run(n, out / f"{n}-one", g) for n in RUNS}
    spawn_groups(_worker, WORLDS, (str(out),))
    return ref, {w: json.loads((out / f"{w}.json").read_text()) for w in WORLDS}


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("name", ["rgcn-mean", "rgcn-sum-bases"])
def test_rgcn_partition_parallel_matches_single_process(runs, name, world):
    """Dropout 0.5 on; every rank receives its remote sources' rows once per layer and runs the
    relational sum over its rows' typed in-edges, so losses and trained weights are one process's."""
    ref, got = runs[0][name], runs[1][world][name]
    key = f"{name} P={world}"
    _assert_same(got, ref, key)
    if name == "rgcn-mean" and world == 2:
        _assert_same(runs[1][2]["rgcn-mean-parts"], ref, "from part files")


def _assert_same(got: dict, ref: dict, key: str) -> None:
    torch.testing.assert_close(torch.tensor(got["loss"]), torch.tensor(ref["loss"]), rtol=1e-4, atol=0, msg=key)
    assert set(got["params"]) == set(ref["params"]), key
    for k, v in ref["params"].items():
        torch.testing.assert_close(torch.tensor(got["params"][k]), torch.tensor(v), rtol=1e-4, atol=1e-4, msg=key)


@pytest.mark.parametrize("name", list(RUNS))
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
    assert vol["widths"] == [g.num_features, 8], vol["widths"]  # each layer's input width
    assert sum(map(sum, expect["bytes_data"][0][0])) > 0
    for epoch, measured in enumerate(runs[1][2][name]["comm"]):
        assert measured == expect, f"{name} epoch {epoch}"
    # tessera simulate reports the same epoch total
    argv = ["simulate", "--model", model, "--dataset", DATASET, "--parts", "2", "--hidden", "8"]
    assert main([*argv, "--remote-agg", "prepost", "--comm-bits", "32", "--json"]) == 0
    epoch = json.loads(capsys.readouterr().out)["runs"][0]["modes"]["prepost"]["bits"]["32"]["epoch"]
    assert epoch["bytes"] == int(torch.tensor(runs[1][2][name]["comm"][0]["bytes_data"]).sum())


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
