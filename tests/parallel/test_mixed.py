"""Per-layer strategies (``--strategy tensor,partition:post``): each layer under its own strategy on
one row split reproduces single-process training, and sends exactly its own strategy's bytes."""

import functools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import single_thread, spawn_groups
from tessera.cli.main import main
from tessera.datasets import load
from tessera.train.config import TrainConfig
from tessera.train.loop import Trainer

pytestmark = pytest.mark.distributed  # starts worker processes

EPOCHS = 2
WORLDS = (2, 3, 4)
# Mixed strategies, mixed remote-aggregation modes, explicit bits, and both operation placements
# flipped against the layers' own (GCN 1433 -> 16 -> 7 on Cora, 16 -> 16 -> 4 on synthetic:tiny); at
# P = 4 also a hybrid layer before a tensor one.
ASSIGNMENTS = (
    "tensor,partition:prepost",
    "partition:pre:32,partition:post",
    "partition:post@aggregate-first,tensor@aggregate-first",
)
# hybrid:2 needs an even P above 2
EXTRA = {4: ("hybrid:2:pre,tensor",)}


def _assignments(world):
    return ASSIGNMENTS + EXTRA.get(world, ())


def _config(dataset, strategy, out):
    return TrainConfig(
        strategy=strategy,
        dataset=dataset,
        hidden=16,
        dropout=0.5,
        epochs=EPOCHS,
        patience=0,
        out=str(out),
        progress=False,
        checkpoint_every=1000,
    )


def _worker(rank, world, port, datasets, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from tessera.comm.group import init_from_env, shutdown
    from tessera.threads import set_num_threads

    set_num_threads(1)
    comm = init_from_env(120)
    results = {}
    try:
        for ds, root in datasets:
            if root:
                os.environ["TESSERA_DATA"] = root
            g = load(ds)
            for assignment in _assignments(world):
                t = Trainer(_config(ds, assignment, Path(out_dir) / f"{world}-{ds}-{assignment}"), g, comm)
                t.fit()
                specs = t.model.describe()
                results[f"{ds}|{assignment}"] = {
                    "loss": [h["train_loss"] for h in t.history],
                    "bytes": t.comm_totals["bytes_data"],
                    "widths": [s.aggregate_width for s in specs],
                    "backward": [i > 0 or s.aggregates_input_grad(False) for i, s in enumerate(specs)],
                    "ids": t.global_ids.tolist(),
                }
    finally:
        shutdown()
    (Path(out_dir) / f"runs-{world}-{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def datasets(planetoid_root):
    return [("cora", str(planetoid_root.parent)), ("synthetic:tiny", "")]


@pytest.fixture(scope="module")
def single_process(datasets, tmp_path_factory):
    ref = {}
    with single_thread():
        for ds, root in datasets:
            if root:
                os.environ["TESSERA_DATA"] = root
            t = Trainer(_config(ds, "auto", tmp_path_factory.mktemp("ref")), load(ds))
            t.fit()
            ref[ds] = [h["train_loss"] for h in t.history]
    return ref


@pytest.fixture(scope="module")
def group_runs(datasets, single_process, tmp_path_factory):
    out = tmp_path_factory.mktemp("mixed")
    spawn_groups(_worker, WORLDS, (datasets, str(out)))
    return {(w, r): json.loads((out / f"runs-{w}-{r}.json").read_text()) for w in WORLDS for r in range(w)}


@functools.cache
def _split(ds, world, groups=1):
    """Pair rows of every mode among the G-parts of ``groups`` consecutive parts, and rows per rank."""
    from tessera.graph.partition import partition
    from tessera.graph.partition.halo import pair_rows

    g = load(ds)
    part = partition(g, world, "metis", 0)
    rows = pair_rows(g.indptr.numpy(), g.indices.numpy(), part // groups, world // groups)
    return rows, np.bincount(part, minlength=world).tolist()


def _expected_bytes(ds, assignment, world, res):
    """Bytes per layer and direction the layer's own strategy sends (the simulator's functions)."""
    from tessera.parallel.mixed import parse_strategy
    from tessera.planner.volume import hybrid_pair_bytes, tensor_pair_bytes

    rows, counts = _split(ds, world)
    out = []
    for choice, width, back in zip(parse_strategy(assignment, 2), res["widths"], res["backward"]):
        o = dict(choice.overrides)
        if choice.strategy == "tensor":
            one = int(tensor_pair_bytes(counts, width, 32)[0].sum())
        elif choice.strategy == "hybrid":
            halo = _split(ds, world, o["groups"])[0][o["remote_agg"]]
            one = int(hybrid_pair_bytes(counts, halo, o["groups"], width, 32)[0].sum())
        else:
            one = int(rows[dict(choice.overrides).get("remote_agg", "prepost")].sum()) * width * 4
        out.append([EPOCHS * one, EPOCHS * one if back else 0])
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_mixed_assignments_match_single_process_and_send_their_strategies_bytes(
    world, group_runs, datasets, single_process
):
    runs = group_runs[(world, 0)]
    assert len(runs) == len(datasets) * len(_assignments(world))
    for key, res in runs.items():
        ds, assignment = key.split("|")
        got, want = torch.tensor(res["loss"]), torch.tensor(single_process[ds])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=0, msg=key)
        assert res["bytes"] == _expected_bytes(ds, assignment, world, res), key
    # every rank trained its own rows, together all vertices once
    for ds, _ in datasets:
        ids = sorted(i for r in range(world) for i in group_runs[(world, r)][f"{ds}|{ASSIGNMENTS[0]}"]["ids"])
        assert ids == list(range(sum(_split(ds, world)[1])))


@pytest.mark.parametrize(
    "strategy, needle",
    [
        ("tensor,partition,tensor", "--strategy lists 3 entries for a model of 2 layers"),
        ("partition:sideways", "--strategy entry 'partition:sideways'"),
        ("tensor,mystery", "unknown --strategy entry 'mystery'"),
        ("tensor@middle", "must be aggregate-first or transform-first"),
        ("partition:post:7", "bits in --strategy entry"),
        ("partition:post:8/16", "or forward/backward bits such as 8/32"),
        ("tensor,", "empty entry"),
    ],
)
def test_bad_per_layer_list_is_a_one_line_error(strategy, needle, tmp_path, capsys):
    argv = ["train", "--dataset", "synthetic:tiny", "--nprocs", "2", "--strategy", strategy, "--out", str(tmp_path)]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tessera: error: ") and needle in err[0], err


def test_layer_choice_labels_round_trip():
    from tessera.parallel.base import StrategyOptions
    from tessera.parallel.mixed import parse_entry, parse_strategy

    base = StrategyOptions(remote_agg="pre", comm_bits=8)
    for text in ("partition", "partition:post", "partition:pre:8", "tensor:4@transform-first", "tensor", "tensor:8/32"):
        choice = parse_entry(text)
        assert parse_entry(choice.label(base)).options(base) == choice.options(base), text
    assert parse_entry("partition").label(base) == "partition"
    assert parse_entry("partition:post:2").options(base).comm_bits == 2
    assert [c.strategy for c in parse_strategy("tensor", 3)] == ["tensor"] * 3
    assert parse_strategy("auto", 2) is None
