"""Arrays shared read-only between the ranks of a host: one file, mapped by all, gone after setup."""

import faulthandler
import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import PORT, spawn_with_retry
from tessera.comm.shared_arrays import ENV, map_arrays, write_arrays

pytestmark = pytest.mark.distributed  # starts worker processes


def _arrays() -> dict:
    gen = np.random.default_rng(0)
    return {
        "indptr": np.cumsum(gen.integers(0, 5, 101)).astype(np.int32),
        "ids": gen.integers(-(2**40), 2**40, 77),
        "w": gen.standard_normal((13, 5)).astype(np.float32),
        "empty": np.zeros((0, 3), np.float64),
        "flags": gen.integers(0, 2, 9).astype(bool),
    }


def _mapping_of(ptr: int) -> list[str]:
    """The /proc/self/maps fields of the mapping holding address ``ptr``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(a, 16) for a in fields[0].split("-"))
        if lo <= ptr < hi:
            return fields
    raise AssertionError(f"no mapping holds {ptr:#x}")


def _worker(rank, world, port, out_dir, shared_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    os.environ[ENV] = shared_dir
    from tessera.comm.group import init_from_env, shutdown
    from tessera.comm.shared_arrays import share_arrays
    from tessera.datasets import load
    from tessera.errors import TesseraError
    from tessera.threads import set_num_threads
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    set_num_threads(1)
    comm = init_from_env(60)
    made = []
    got = share_arrays(comm, lambda: made.append(rank) or _arrays(), "test arrays")
    res = {
        "made": list(made),
        "equal": {
            k: bool(np.array_equal(got[k].numpy(), v)) and got[k].numpy().dtype == v.dtype for k, v in _arrays().items()
        },
        "maps": {k: _mapping_of(got[k].data_ptr()) for k in ("indptr", "ids", "w", "flags")},
        "left": sorted(os.listdir(shared_dir)),
    }
    # a directory that cannot be created: every rank gets the same one-line error
    os.environ[ENV] = str(Path(out_dir) / "a-file" / "shm")
    try:
        share_arrays(comm, lambda: made.append(rank) or _arrays(), "test arrays")
    except TesseraError as e:
        res["error"] = str(e)
    res["made_after_error"] = made
    os.environ[ENV] = shared_dir
    # tensor-parallel training on the shared graph, and with a copy per rank: the same losses
    losses = {}
    g = load("synthetic:tiny")
    for mode in (shared_dir, "off"):
        os.environ[ENV] = mode
        cfg = TrainConfig(
            strategy="tensor", dataset="synthetic:tiny", hidden=8, epochs=3, patience=0, progress=False,
            out=str(Path(out_dir) / f"run-{mode != 'off'}"), checkpoint_every=1000,
        )  # fmt: skip
        t = Trainer(cfg, g, comm)
        t.fit()
        losses[mode] = [h["train_loss"] for h in t.history]
        if mode == shared_dir:
            res["graph_map"] = _mapping_of(t.strategy.plan.graph.indices.data_ptr())
    res["losses"] = list(losses.values())
    res["left_after_training"] = sorted(os.listdir(shared_dir))
    shutdown()
    (Path(out_dir) / f"rank{rank}.json").write_text(json.dumps(res))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    out = tmp_path_factory.mktemp("shared")
    (out / "a-file").write_text("not a directory")
    shm = out / "shm"
    shm.mkdir()
    spawn_with_retry(_worker, (2, PORT, str(out), str(shm)), 2)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)], out


def test_arrays_round_trip_exactly_and_are_built_once(ranks):
    res, _ = ranks
    for r in res:
        assert all(r["equal"].values()), r["equal"]
    assert [r["made"] for r in res] == [[0], []]  # only the host's lowest rank ran make()


def test_ranks_map_one_read_only_file_that_is_gone_after_setup(ranks):
    res, out = ranks
    for name in ("indptr", "ids", "w", "flags"):
        maps = [r["maps"][name] for r in res]
        # same device and inode in both ranks: one file; readable, not writable, shared
        assert maps[0][3:5] == maps[1][3:5], maps
        assert all(m[1] == "r--s" for m in maps), maps
        assert all(m[5].endswith("(deleted)") and m[5].startswith(str(out / "shm")) for m in maps), maps
    assert [r["left"] for r in res] == [[], []]
    assert [r["left_after_training"] for r in res] == [[], []]


def test_unwritable_directory_is_one_line_error_on_every_rank(ranks):
    res, out = ranks
    where = str(out / "a-file" / "shm")
    for r in res:
        msg = r["error"]
        assert "\n" not in msg and where in msg and f"set {ENV}" in msg, msg
    assert res[0]["error"] == res[1]["error"]
    assert [r["made_after_error"] for r in res] == [[0, 0], []]


def test_tensor_training_maps_the_shared_graph_with_identical_losses(ranks):
    res, out = ranks
    for r in res:
        shared, own = r["losses"]
        assert shared == own and len(shared) == 3  # bit for bit
        assert r["graph_map"][1] == "r--s" and r["graph_map"][5].endswith("(deleted)")
    assert res[0]["graph_map"][3:5] == res[1]["graph_map"][3:5]


def test_write_to_a_mapped_tensor_kills_the_writer_not_the_data(tmp_path):
    path = tmp_path / "a.arrays"
    write_arrays(path, _arrays())
    t = map_arrays(path)["w"]
    before = t.clone()
    pid = os.fork()
    if pid == 0:  # the child writes into the read-only mapping
        faulthandler.disable()  # no traceback dump: the crash is the expected outcome
        try:
            t.add_(1.0)
        finally:
            os._exit(0)
    _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV
    assert torch.equal(t, before) and torch.equal(map_arrays(path)["w"], before)


def test_two_rank_result_holds_every_ranks_peak_rss(ranks):
    res, out = ranks
    result = json.loads((out / "run-True" / "result.json").read_text())
    per_rank = result["peak_rss_mb_per_rank"]
    assert len(per_rank) == 2 and all(v > 0 for v in per_rank) and result["peak_rss_mb"] == per_rank[0]


def test_summary_line_reports_the_largest_rank(tmp_path, monkeypatch, capsys):
    from tessera.cli.main import main
    from tessera.train import loop

    fake = {"dataset": "d", "test_acc": 0.5, "val_acc": 0.5, "best_epoch": 1, "epoch_time_median_s": 0.01}
    fake |= {"peak_rss_mb": 100.0, "peak_rss_mb_per_rank": [100.0, 250.4, 120.0], "world_size": 3}
    monkeypatch.setattr(loop, "train", lambda cfg: fake)
    assert main(["train", "--dataset", "synthetic:tiny", "--out", str(tmp_path / "o")]) == 0
    assert "peak RSS 250 MiB (largest of 3 ranks)" in capsys.readouterr().out
