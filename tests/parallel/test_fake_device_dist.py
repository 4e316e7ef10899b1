"""Distributed training with every rank's tensors on a device, checked on the stand-in device of
:mod:`fake_device`: each strategy's exchanges, index tensors and collectives keep the step on the
device (a host tensor mixed into a device op fails the run), and every rank's losses and metrics
equal bitwise those of the same portable code with CPU tensors, in one process group (gloo carries
the stand-in's CPU values; on GPUs it is NCCL). A steady step reads one value back (its loss) and,
but for label propagation's draw, waits on no data-sized op."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

from helpers import PORT, spawn_with_retry

pytestmark = pytest.mark.distributed

# (strategy, model, extra settings)
RUNS = [
    ("partition", "gcn", {}),
    ("partition", "sage", {"remote_agg": "pre", "label_prop": 0.5}),
    ("partition", "gat", {"heads": 2}),
    ("partition", "rgcn", {}),
    ("partition", "sage-lstm", {}),
    ("tensor", "gin", {"pipeline_stages": 2}),
    ("hybrid", "sage", {"norm": "layer"}),
    ("tensor,partition", "gcn", {"remote_agg": "post"}),
    ("partition", "gcn", {"comm_bits": 8}),
    ("tensor", "sage", {"comm_bits": 4}),
]


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from fake_device import FAKE, fake_gpu

    from tessera.comm.group import init_from_env, shutdown
    from tessera.datasets import load
    from tessera.threads import set_num_threads
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    set_num_threads(1)
    comm = init_from_env(120)
    results = {}
    mode = None

    def run(strategy, model, extra, device, out):
        dataset = "synthetic:tiny-rel" if model == "rgcn" else "synthetic:tiny"
        cfg = TrainConfig(
            dataset=dataset, model=model, hidden=16, epochs=3, out=str(out), progress=False, reorder="none",
            strategy=strategy, nprocs=world, backend="torch" if device is None else "auto", **extra,
        ).validate()  # fmt: skip
        t = Trainer(cfg, load(dataset), comm if device is None else dataclasses.replace(comm, device=device))
        losses = [t.train_step() for _ in range(2)]
        reads, syncs = (mode.host_reads, mode.syncs) if device is not None else (0, 0)
        losses.append(t.train_step())
        step = (mode.host_reads - reads, mode.syncs - syncs) if device is not None else None
        out = {"losses": losses, "metrics": t.evaluate()}
        if step is not None:  # what the steady step read back and waited for
            out["step_reads"], out["step_syncs"] = step
        return out

    try:
        for i, (strategy, model, extra) in enumerate(RUNS):
            key = f"{i}|{strategy}|{model}"
            on_cpu = run(strategy, model, extra, None, Path(out_dir) / f"{key}-cpu".replace("|", "-"))
            with fake_gpu() as mode:
                on_device = run(strategy, model, extra, FAKE, Path(out_dir) / f"{key}-device".replace("|", "-"))
            results[key] = {"cpu": on_cpu, "device": on_device}
    finally:
        shutdown()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(results))


def test_every_strategy_keeps_the_step_on_the_device_and_trains_as_on_the_cpu(tmp_path):
    spawn_with_retry(_worker, (2, PORT, tmp_path), 2)
    for rank in range(2):
        results = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert sorted(results) == sorted(f"{i}|{s}|{m}" for i, (s, m, _) in enumerate(RUNS))
        for key, res in results.items():
            # one value read back (the loss); label propagation draws its rows by a device mask and
            # sums their count over the ranks
            lp = "label_prop" in RUNS[int(key.split("|")[0])][2]
            step = (res["device"].pop("step_reads"), res["device"].pop("step_syncs"))
            assert step == ((2, 2) if lp else (1, 0)), key
            assert res["device"] == res["cpu"], (rank, key)
