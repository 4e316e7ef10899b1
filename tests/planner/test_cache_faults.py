"""The caches of a distributed run, partitions (``$TESSERA_CACHE/partitions``) and plans
(``$TESSERA_CACHE/plans``), damaged or replaced by something that is not a regular file: a real
2-rank ``--strategy auto`` training trains as on a clean cache, says so once per file, rewrites
what is ours and leaves what is not (a named pipe, a directory) alone, without hanging."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import numpy as np
import pytest

from helpers import PORT, spawn_with_retry

pytestmark = pytest.mark.distributed  # starts worker processes


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name("corrupting")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import logging
    import signal

    import tessera.files as files
    from tessera.comm.group import init_from_env, shutdown
    from tessera.datasets import load
    from tessera.memo import tuning
    from tessera.planner import plan as planner
    from tessera.planner.calibrate import Rates
    from tessera.threads import set_num_threads
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    signal.alarm(240)  # a rank blocked on a named pipe dies instead of hanging the suite
    set_num_threads(1)
    # the plan itself must not depend on timing: fixed rates and candidate times (the first
    # candidate of each layer wins), so a plan made again is the plan made first
    rates = Rates(edge_s=1e-9, value_s=1e-9, gemm_flops=1e10, bandwidth_gbps=1.0, latency_us=10.0)
    planner.calibrate = lambda *a, **k: rates
    planner.measure_candidate = lambda *a, **k: 1e-3
    notes: list[str] = []

    class Notes(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.getMessage().startswith("cache "):
                notes.append(record.getMessage())

    logging.getLogger("tessera").addHandler(Notes())
    comm = init_from_env(120)
    cache = Path(os.environ["TESSERA_CACHE"])
    out = {}

    def train(name: str) -> None:
        tuning.reset()
        notes.clear()
        cfg = TrainConfig(dataset="synthetic:tiny", hidden=8, epochs=2, patience=0, progress=False)
        t = Trainer(cfg, load("synthetic:tiny"), comm)
        t.fit()
        out[name] = {"loss": [h["train_loss"] for h in t.history], "plan": list(t.plan.choices), "notes": list(notes)}
        comm.barrier()

    try:
        train("clean")
        (part,) = (cache / "partitions").glob("*.npy")
        (plan,) = (cache / "plans").glob("plan-*.json")
        out["files"] = [str(part), str(plan)]
        if rank == 0:  # two vertices of different parts swapped: still a partition, not this one
            p = np.load(part)
            a, b = int(np.flatnonzero(p == 0)[0]), int(np.flatnonzero(p == 1)[0])
            p[[a, b]] = p[[b, a]]
            tmp = part.with_name("corrupting.npy")
            np.save(tmp, p)
            os.replace(tmp, part)
            rec = json.loads(plan.read_text())
            _replace(plan, json.dumps({**rec, "layers": "every layer"}).encode())  # the wrong shape
        comm.barrier()
        train("damaged")
        if rank == 0:
            out["rewritten"] = [files.file_digest(part), json.loads(plan.read_text())["layers"] != "every layer"]
            out["vouched"] = json.loads(files.manifest_path(part).read_text())["files"][part.name]
            part.unlink()
            os.mkfifo(part)
            plan.unlink()
            plan.mkdir()
        comm.barrier()
        train("foreign")
        if rank == 0:
            out["left"] = [stat.S_ISFIFO(part.lstat().st_mode), plan.is_dir()]
            out["temps"] = [str(p) for p in cache.rglob("*") if p.name.endswith(".tmp")]
    finally:
        shutdown()
    (Path(out_dir) / f"rank-{rank}.json").write_text(json.dumps(out))


def test_damaged_and_foreign_partition_and_plan_files_train_as_a_clean_cache(tmp_path):
    before = os.environ["TESSERA_CACHE"]
    os.environ["TESSERA_CACHE"] = str(tmp_path / "cache")  # the ranks inherit it
    try:
        spawn_with_retry(_worker, (2, PORT, str(tmp_path)), 2)
    finally:
        os.environ["TESSERA_CACHE"] = before
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in range(2)]
    zero = ranks[0]
    part, plan = zero["files"]
    for got in ranks:
        for run in ("damaged", "foreign"):
            assert got[run]["plan"] == zero["clean"]["plan"], run
            np.testing.assert_allclose(got[run]["loss"], zero["clean"]["loss"], rtol=0, atol=1e-6, err_msg=run)
    assert zero["clean"]["notes"] == []
    assert sorted(zero["damaged"]["notes"]) == sorted(
        [
            f"cache {part} did not match its digest; recomputed",
            f"cache {plan} could not be read or has the wrong shape; recomputed",
        ]
    )
    foreign = "is not a regular file: not read or written; computed without caching"
    assert sorted(zero["foreign"]["notes"]) == sorted([f"cache {part} {foreign}", f"cache {plan} {foreign}"])
    assert ranks[1]["damaged"]["notes"] == ranks[1]["foreign"]["notes"] == []  # rank 0 reads them
    size, sha = zero["rewritten"][0]
    assert zero["vouched"] == {"bytes": size, "sha256": sha} and zero["rewritten"][1]
    assert zero["left"] == [True, True] and zero["temps"] == []
