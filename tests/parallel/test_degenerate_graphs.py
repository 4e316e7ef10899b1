"""Tiny and degenerate graphs under every strategy train as one process does, or are refused in one
line: two vertices without edges, isolated vertices only, a single edge, a star whose hub owns
every edge; partition (metis, range, random; post, pre, prepost), tensor, hybrid and a per-layer
mix; every model (RGCN on the same graphs with two edge types)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import single_thread, spawn_groups
from tessera import Graph
from tessera.errors import ConfigError
from tessera.train.config import TrainConfig
from tessera.train.loop import Trainer

pytestmark = pytest.mark.distributed  # starts worker processes

REPO = Path(__file__).resolve().parents[2]
EPOCHS = 3
MODELS = ("gcn", "sage", "gin", "gat", "sage-lstm", "rgcn")
# (strategy, partition, remote_agg, groups): what each rank splits, over ranks of the given world.
STRATEGIES = {
    2: [
        ("partition", "metis", "post", 1),
        ("partition", "range", "pre", 1),
        ("partition", "random", "prepost", 1),
        ("tensor", "metis", "prepost", 1),
        ("tensor,partition:post", "range", "prepost", 1),
    ],
    4: [("hybrid", "range", "prepost", 2)],
}


def _graph(name: str, typed: bool = False) -> Graph:
    """A named degenerate graph with 3 features, 2 classes and disjoint splits (train and val not empty)."""
    edges: list[tuple[int, int]]
    if name == "two-no-edges":
        n, edges = 2, []
    elif name == "isolated-8":
        n, edges = 8, []
    elif name == "one-edge":
        n, edges = 4, [(0, 1)]
    else:  # star: every edge touches vertex 0, plus its self loop
        n = 9
        edges = [(0, 0)] + [(0, i) for i in range(1, n)] + [(i, 0) for i in range(1, n)]
    ei = torch.tensor(edges, dtype=torch.int64).reshape(-1, 2).t().contiguous()
    gen = torch.Generator().manual_seed(n)
    ids = torch.arange(n)
    train, val, test = (ids % 3 == k for k in range(3))
    types = {"edge_type": torch.arange(ei.shape[1]) % 2, "num_relations": 2} if typed else {}
    return Graph.from_edge_index(
        ei,
        n,
        **types,
        x=torch.randn(n, 3, generator=gen),
        y=(ids % 2).to(torch.int64),
        train_mask=train,
        val_mask=val,
        test_mask=test,
    )


# What a strategy refuses by design, on any graph (docs/distributed.md): the rest must train.
REFUSED = {("hybrid", "gat"), ("hybrid", "sage-lstm"), ("hybrid", "rgcn")}
REFUSED |= {(s, m) for s in ("tensor", "tensor,partition:post") for m in ("sage-lstm", "rgcn")}
GRAPHS = {2: ("two-no-edges", "isolated-8", "one-edge", "star"), 4: ("isolated-8", "star")}


def _config(model: str, strategy: str, partition: str, remote_agg: str, groups: int, out) -> TrainConfig:
    return TrainConfig(
        dataset="degenerate",
        model=model,
        hidden=8,
        heads=2,
        dropout=0.5,
        epochs=EPOCHS,
        patience=0,
        strategy=strategy,
        partition=partition,
        remote_agg=remote_agg,
        groups=groups,
        out=str(out),
        progress=False,
        checkpoint_every=1000,
    )


def _key(graph: str, model: str, run: tuple[str, str, str, int]) -> str:
    return "|".join([graph, model, *map(str, run)])


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from tessera.comm.group import init_from_env, shutdown
    from tessera.threads import set_num_threads

    set_num_threads(1)
    comm = init_from_env(120)
    results = {}
    try:
        for name in GRAPHS[world]:
            for model in MODELS:
                g = _graph(name, model == "rgcn")
                for run in STRATEGIES[world]:
                    key = _key(name, model, run)
                    out = Path(out_dir) / f"{world}-{key.replace('|', '-').replace(',', '_').replace(':', '_')}"
                    try:
                        t = Trainer(_config(model, *run, out), g, comm)
                    except ConfigError as e:  # every rank refuses at set-up, before any exchange
                        results[key] = str(e)
                        continue
                    t.fit()
                    results[key] = [h["train_loss"] for h in t.history]
    finally:
        shutdown()
    if rank == 0:
        (Path(out_dir) / f"runs-{world}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def single_process(tmp_path_factory):
    ref = {}
    with single_thread():
        for name in {g for gs in GRAPHS.values() for g in gs}:
            for model in MODELS:
                cfg = _config(model, "auto", "metis", "prepost", 1, tmp_path_factory.mktemp("ref"))
                t = Trainer(cfg, _graph(name, model == "rgcn"))
                t.fit()
                ref[f"{name}|{model}"] = [h["train_loss"] for h in t.history]
    return ref


@pytest.fixture(scope="module")
def group_runs(single_process, tmp_path_factory):
    out = tmp_path_factory.mktemp("degenerate")
    spawn_groups(_worker, sorted(STRATEGIES), (str(out),))
    return {world: json.loads((out / f"runs-{world}.json").read_text()) for world in STRATEGIES}


@pytest.mark.parametrize("world", sorted(STRATEGIES))
@pytest.mark.parametrize("model", MODELS)
def test_degenerate_graphs_train_as_one_process_under_every_strategy(world, model, group_runs, single_process):
    runs = group_runs[world]
    for name in GRAPHS[world]:
        want = torch.tensor(single_process[f"{name}|{model}"])
        assert len(want) == EPOCHS and torch.isfinite(want).all()
        for run in STRATEGIES[world]:
            key = _key(name, model, run)
            if (run[0], model) in REFUSED:
                assert isinstance(runs[key], str), (key, runs[key])
                continue
            torch.testing.assert_close(torch.tensor(runs[key]), want, rtol=1e-4, atol=1e-6, msg=key)


def _npz(path: Path, n: int) -> None:
    """``n`` isolated vertices as a gnn-benchmark ``.npz``."""
    np.savez(
        path,
        adj_data=np.zeros(0, np.float32),
        adj_indices=np.zeros(0, np.int64),
        adj_indptr=np.zeros(n + 1, np.int64),
        adj_shape=np.array([n, n]),
        attr_matrix=np.ones((n, 2), np.float32),
        labels=np.arange(n) % 2,
        train_idx=np.array([0]),
        val_idx=np.array([1]),
        test_idx=np.arange(2, n),
    )


@pytest.mark.parametrize("strategy", ["partition", "tensor", "hybrid"])
def test_more_ranks_than_vertices_is_one_line(tmp_path, strategy):
    data = tmp_path / "three.npz"
    _npz(data, 3)
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "tessera", "train", "--dataset", str(data), "--nprocs", "4"]
    cmd += ["--strategy", strategy, "--epochs", "2", "--hidden", "8", "--out", str(out)]
    if strategy == "hybrid":
        cmd += ["--groups", "2"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessera: error: cannot split 3 vertices "), proc.stderr
    assert not out.exists()
