"""Hybrid tensor-data parallelism (``--strategy hybrid --groups M``) reproduces one process, and
sends exactly the bytes the simulator sizes: M = 1 partition parallelism's, M = P tensor's."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import each_dataset, single_thread, spawn_groups
from tessera.comm.group import Comm
from tessera.datasets import load
from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.nn import build_model
from tessera.parallel import StrategyOptions, make_strategy
from tessera.planner.volume import hybrid_volumes
from tessera.train.config import TrainConfig
from tessera.train.loop import Trainer

pytestmark = pytest.mark.distributed  # starts worker processes

MODELS = ("gcn", "sage", "gin")
EPOCHS = 3
GROUPS = {4: (1, 2, 4), 3: (3,), 2: (2,)}  # P -> the M trained at P
# (strategy, M, model, bits, stages) per P besides the grid: partition and tensor to compare bytes
# with, and at P = 4, M = 2 a pipelined run (float32: still equal to one process) and a 2-bit run
EXTRA = {
    4: [("partition", 1, "gcn", 32, 1), ("tensor", 1, "gcn", 32, 1), ("hybrid", 2, "gcn", 32, 3)],
    3: [("tensor", 1, "gcn", 32, 1)],
    2: [("tensor", 1, "gcn", 32, 1)],
}
QUANTIZED = ("hybrid", 2, "gcn", 2, 2)  # P = 4, synthetic:small only: bytes with quantization parameters


def _config(dataset, model, out, strategy="hybrid", groups=1, bits=32, stages=1, epochs=EPOCHS):
    return TrainConfig(
        strategy=strategy,
        groups=groups,
        dataset=dataset,
        model=model,
        hidden=16,
        dropout=0.5,
        epochs=epochs,
        patience=0,
        out=str(out),
        progress=False,
        checkpoint_every=1000,
        comm_bits=bits,
        pipeline_stages=stages,
    )


def _runs(world, dataset):
    runs = [("hybrid", m, model, 32, 1) for m in GROUPS[world] for model in MODELS] + EXTRA[world]
    return runs + ([QUANTIZED] if world == 4 and dataset == "synthetic:small" else [])


def _worker(rank, world, port, datasets, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from tessera.comm.group import init_from_env, shutdown
    from tessera.threads import set_num_threads

    set_num_threads(1)  # one thread per rank (see test_dist)
    comm = init_from_env(120)
    results = {}
    try:
        for ds, g in each_dataset(datasets):
            for run in _runs(world, ds):
                strategy, m, model, bits, stages = run
                key = "|".join(map(str, (ds, *run)))
                out = Path(out_dir) / f"{world}-{key.replace('|', '-').replace(':', '_')}"
                t = Trainer(_config(ds, model, out, strategy, m, bits, stages, 2 if bits < 32 else EPOCHS), g, comm)
                t.fit()
                results[key] = {
                    "loss": [h["train_loss"] for h in t.history],
                    "params": {k: v.tolist() for k, v in t.model.state_dict().items()},
                    "bytes": [[h["comm"][k] for k in ("bytes_data", "bytes_params")] for h in t.history],
                }
    finally:
        shutdown()
    if rank == 0:
        (Path(out_dir) / f"hybrid-{world}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def single_process(datasets, tmp_path_factory):
    ref = {}
    with single_thread():
        for ds, g in each_dataset(datasets):
            for model in MODELS:
                t = Trainer(_config(ds, model, tmp_path_factory.mktemp("ref"), "partition"), g)
                t.fit()
                ref[f"{ds}|{model}"] = {"loss": [h["train_loss"] for h in t.history], "params": t.model.state_dict()}
    return ref


@pytest.fixture(scope="module")
def group_runs(datasets, single_process, tmp_path_factory):
    """``{P: {run key: result}}`` for every P in GROUPS, from one spawn (after ``single_process``,
    which leaves the numba kernels in numba's cache for the ranks)."""
    out = tmp_path_factory.mktemp("hybrid")
    spawn_groups(_worker, tuple(GROUPS), (datasets, str(out)))
    return {world: json.loads((out / f"hybrid-{world}.json").read_text()) for world in GROUPS}


@pytest.mark.parametrize("world", sorted(GROUPS))
def test_hybrid_matches_single_process(world, group_runs, datasets, single_process):
    # dropout 0.5, masks keyed by global vertex and column: every M trains one process's model
    checked = 0
    for key, res in group_runs[world].items():
        ds, strategy, m, model, bits, stages = key.split("|")
        if bits != "32":
            continue
        ref = single_process[f"{ds}|{model}"]
        assert len(res["loss"]) == EPOCHS, key
        torch.testing.assert_close(torch.tensor(res["loss"]), torch.tensor(ref["loss"]), rtol=1e-4, atol=0, msg=key)
        for name, value in ref["params"].items():
            torch.testing.assert_close(torch.tensor(res["params"][name]), value, rtol=1e-4, atol=1e-4, msg=key)
        checked += strategy == "hybrid"
    assert checked == len(datasets) * (len(GROUPS[world]) * len(MODELS) + (world == 4))


@pytest.mark.parametrize("world", sorted(GROUPS))
def test_hybrid_bytes_are_the_simulated_bytes(world, group_runs, datasets):
    # every epoch's per-layer, per-direction, per-pair bytes (data and quantization parameters)
    # equal hybrid_volumes's, which `tessera simulate --strategy hybrid` prints
    graphs = dict(each_dataset(datasets))
    checked = 0
    for key, res in group_runs[world].items():
        ds, strategy, m, model, bits, stages = key.split("|")
        if strategy != "hybrid":
            continue
        g = graphs[ds]
        specs = build_model(model, g.num_features, 16, g.num_classes, 2).describe()
        sim = hybrid_volumes(g, world, int(m), specs, bits=(int(bits),), stages=int(stages))
        want = sim.runtime[int(bits)]
        assert res["bytes"][0][0] != np.zeros_like(want["bytes_data"]).tolist(), key
        for epoch in res["bytes"]:
            assert epoch == [want["bytes_data"].tolist(), want["bytes_params"].tolist()], key
        assert sum(map(np.sum, res["bytes"][0])) == sim.bits[int(bits)].bytes, key
        checked += 1
    assert checked == len(datasets) * (len(GROUPS[world]) * len(MODELS) + (world == 4)) + (world == 4)


@pytest.mark.parametrize("world", sorted(GROUPS))
def test_hybrid_extremes_send_partition_and_tensor_bytes(world, group_runs, datasets):
    # M = 1 is partition parallelism and M = P tensor parallelism, pair for pair
    runs = group_runs[world]
    for ds, _ in datasets:
        pairs = {(1, "partition"), (world, "tensor")} if world == 4 else {(world, "tensor")}
        for m, other in pairs:
            mine = runs[f"{ds}|hybrid|{m}|gcn|32|1"]["bytes"]
            assert mine == runs[f"{ds}|{other}|1|gcn|32|1"]["bytes"], (ds, m, other)
    if world == 4:  # and in between it sends other bytes than either
        mid = runs["synthetic:small|hybrid|2|gcn|32|1"]["bytes"]
        assert mid != runs["synthetic:small|hybrid|1|gcn|32|1"]["bytes"]
        assert mid != runs["synthetic:small|hybrid|4|gcn|32|1"]["bytes"]


def test_bad_groups_gat_and_too_many_ranks_are_config_errors():
    g = load("synthetic:tiny")
    specs = build_model("gcn", g.num_features, 16, g.num_classes, 2).describe()
    for groups, message in ((3, "--groups 3 does not divide the 4 ranks; choose one of 1, 2, 4"), (0, "at least 1")):
        s = make_strategy("hybrid", Comm(0, 4, torch.device("cpu")), StrategyOptions(groups=groups))
        with pytest.raises(ConfigError, match=message):
            s.check(specs)
    gat = build_model("gat", g.num_features, 16, g.num_classes, 2).describe()
    with pytest.raises(ConfigError, match="runs gcn, sage and gin, not gat"):
        make_strategy("hybrid", Comm(0, 2, torch.device("cpu")), StrategyOptions(groups=2)).check(gat)
    # more ranks than vertices: every rank refuses before any collective (none is set up here)
    three = Graph.from_edge_index(
        torch.tensor([[0, 1], [1, 2]]),
        3,
        x=torch.ones(3, 2),
        y=torch.zeros(3, dtype=torch.long),
        train_mask=torch.tensor([True, False, False]),
        val_mask=torch.tensor([False, True, False]),
        test_mask=torch.tensor([False, False, True]),
    )
    s = make_strategy("hybrid", Comm(1, 4, torch.device("cpu")), StrategyOptions(groups=2))
    with pytest.raises(ConfigError, match="cannot split 3 vertices over 4 ranks"):
        s.shard(three)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--groups", "3"], "--groups 3 does not divide the 4 ranks"),
        (["--groups", "0"], "--groups must be in [1, 1024]"),
    ],
)
def test_cli_refuses_bad_groups_in_one_line(tmp_path, capsys, monkeypatch, extra, message):
    from tessera.cli.main import main

    def no_launch(argv, nprocs):
        raise AssertionError("reached the launcher")

    monkeypatch.setattr("tessera.cli.launch.launch", no_launch)
    argv = ["train", "--dataset", "synthetic:tiny", "--nprocs", "4", "--strategy", "hybrid", "--out", str(tmp_path)]
    assert main([*argv, *extra]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessera: error: ") and message in lines[0], lines


def test_simulate_prints_hybrid_volumes_and_refuses_bad_groups(capsys):
    from tessera.cli.main import main

    args = [
        "simulate",
        "--dataset",
        "synthetic:tiny",
        "--parts",
        "4",
        "--strategy",
        "hybrid",
        "--remote-agg",
        "prepost",
    ]
    assert main([*args, "--comm-bits", "32"]) == 0
    out = capsys.readouterr().out
    g = load("synthetic:tiny")
    specs = build_model("gcn", g.num_features, 256, g.num_classes, 2).describe()
    rows = [r for r in map(str.split, out.splitlines()) if len(r) > 3 and r[0] == "4" and r[3] == "prepost"]
    assert [int(r[1]) for r in rows] == [1, 2, 4]
    for r in rows:  # the printed MB is hybrid_volumes's
        assert float(r[5]) == pytest.approx(hybrid_volumes(g, 4, int(r[1]), specs).bits[32].bytes / 1e6, abs=1e-3)
    assert main([*args, "--groups", "3"]) == 2
    assert "--groups 3 does not divide the 4 ranks" in capsys.readouterr().err
