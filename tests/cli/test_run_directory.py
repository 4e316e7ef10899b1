"""One owner per run directory (issue "Reliability round 2", item 1): a run holds an advisory lock
(``<dir>/.lock``, its pid and host) from its set-up to its end; a second run on the directory is
refused in one ``tessera: error:`` line naming the owner and the fix, exit status 2, before it
trains, on every rank; a lock a killed run left is taken over; and default directories of runs
that train different numbers (here: only ``--lr`` differs) are different directories."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessera.cli.main import main
from tessera.train.rundir import LOCK, acquire, owner_of

pytestmark = pytest.mark.distributed  # starts worker processes

REPO = Path(__file__).resolve().parents[2]
EPOCHS = 6
RUN = ["train", "--dataset", "synthetic:tiny", "--hidden", "8", "--no-progress", "--threads", "1"]
RUN += ["--epochs", str(EPOCHS), "--checkpoint-every", "1"]


def _losses(d: Path) -> list[float]:
    return [json.loads(line)["train_loss"] for line in (d / "metrics.jsonl").read_text().splitlines()]


def _result(d: Path) -> tuple:
    r = json.loads((d / "result.json").read_text())
    return r["test_acc"], r["val_acc"], r["best_epoch"], r["epochs_run"]


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def clean(tmp_path_factory) -> Path:
    """The run every test's runs must equal, trained once, alone."""
    d = tmp_path_factory.mktemp("clean") / "run"
    assert main([*RUN, "--out", str(d)]) == 0
    return d


def _start(out: Path) -> subprocess.Popen:
    """``tessera train`` (RUN) on ``out`` in its own process; returns once it holds the lock."""
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "tessera", *RUN, "--out", str(out)], env=env, stderr=subprocess.PIPE, text=True
    )
    deadline = time.monotonic() + 60
    while owner_of(out) is None if out.is_dir() else True:
        if proc.poll() is not None:
            pytest.fail(f"the first run ended before it took the lock: {proc.stderr.read() if proc.stderr else ''}")
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail("the first run never took the lock")
        time.sleep(0.01)
    return proc


def _refused(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("tessera: error: "), err
    return err[0]


def test_two_concurrent_runs_on_one_directory_the_second_refuses_and_the_first_completes_untouched(
    clean, tmp_path, capsys
):
    out = tmp_path / "run"
    first = _start(out)
    try:
        # paused while it holds the lock, so the second run certainly meets it mid-run
        first.send_signal(signal.SIGSTOP)
        before = _files(out)
        line = _refused(capsys, [*RUN, "--out", str(out)])
        assert f"pid {first.pid} on host {socket.gethostname()}" in line, line
        assert str(out) in line and "another --out" in line and "wait" in line, line
        # --resume and --overwrite are refused the same way: neither may write under a live run
        assert f"pid {first.pid}" in _refused(capsys, [*RUN, "--out", str(out), "--resume"])
        assert f"pid {first.pid}" in _refused(capsys, [*RUN, "--lr", "0.05", "--out", str(out), "--overwrite"])
        assert _files(out) == before  # the refused runs wrote nothing
    finally:
        first.send_signal(signal.SIGCONT)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert _losses(out) == _losses(clean)  # the first run's numbers, whole
    assert _result(out) == _result(clean)
    assert not (out / LOCK).exists()  # released at its end


def test_a_lock_left_by_a_killed_run_is_taken_over(clean, tmp_path, capsys):
    out = tmp_path / "run"
    killed = _start(out)
    killed.kill()
    killed.communicate()
    assert (out / LOCK).read_text().startswith(f"pid {killed.pid}\n")  # left behind, its owner dead
    assert owner_of(out) is None
    code = main([*RUN, "--out", str(out), "--resume"])
    err = capsys.readouterr().err
    assert code == 0, err
    assert _losses(out) == _losses(clean) and _result(out) == _result(clean)
    assert not (out / LOCK).exists()


def test_a_held_lock_refuses_every_way_into_the_directory_and_writes_nothing(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "held"
    lock = acquire(out)  # this process holds it, as another run would
    try:
        line = _refused(capsys, [*RUN, "--out", str(out)])
        assert f"run directory {out} is in use by another tessera run (pid {os.getpid()} on host" in line, line
        assert sorted(p.name for p in out.iterdir()) == [LOCK]
        # a default directory held by a live run is refused too (never shared)
        assert main([*RUN, "--lr", "0.03"]) == 0
        default = next(Path("runs").iterdir())
        held = acquire(default)
        try:
            before = _files(default)
            line = _refused(capsys, [*RUN, "--lr", "0.03"])
            assert f"{default} is in use" in line, line
            assert _files(default) == before
        finally:
            held.release()
    finally:
        lock.release()
    assert not out.exists() or sorted(out.iterdir()) == []


def _distributed_worker(rank: int, world: int, port: int, out: str, report: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from tessera.comm.group import init_from_env, shutdown
    from tessera.datasets import load
    from tessera.errors import ConfigError
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    comm = init_from_env(60)
    cfg = TrainConfig(dataset="synthetic:tiny", hidden=8, epochs=2, progress=False, out=out, threads=1)
    try:
        Trainer(cfg, load("synthetic:tiny"), comm).fit()
        outcome = "trained"
    except ConfigError as e:
        outcome = f"refused: {e}"
    finally:
        shutdown()
    Path(report, f"rank{rank}").write_text(outcome)


def test_every_rank_of_a_distributed_run_stops_when_rank_0_is_refused(tmp_path):
    # rank 0 alone writes the run directory and so checks its lock; the others stop with it
    # (a flag broadcast before any other work), none waits on a peer that stopped
    from tests.helpers import PORT, spawn_with_retry

    out, report = tmp_path / "run", tmp_path / "report"
    report.mkdir()
    lock = acquire(out)
    try:
        t0 = time.monotonic()
        spawn_with_retry(_distributed_worker, (2, PORT, str(out), str(report)), 2)
        assert time.monotonic() - t0 < 60
    finally:
        lock.release()
    rank0, rank1 = ((report / f"rank{r}").read_text() for r in (0, 1))
    assert rank0.startswith("refused: ") and f"pid {os.getpid()}" in rank0, rank0
    assert rank1.startswith("refused: ") and "rank 0 refused the run directory" in rank1, rank1


def test_default_directories_of_runs_differing_only_in_lr_differ(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    short = ["train", "--dataset", "synthetic:tiny", "--hidden", "8", "--epochs", "2", "--no-progress"]
    for lr in ("0.01", "0.02", "0.01"):
        assert main([*short, "--lr", lr]) == 0
    err = capsys.readouterr().err
    dirs = sorted(p.name for p in Path("runs").iterdir())
    # the default lr keeps the plain name; another lr is in the name; the same command reuses its own
    assert dirs == ["gcn-synthetic-tiny-s0-h8", "gcn-synthetic-tiny-s0-h8-lr0.02"], dirs
    assert err == ""
    lrs = {d: json.loads((Path("runs") / d / "result.json").read_text())["config"]["lr"] for d in dirs}
    assert lrs == {"gcn-synthetic-tiny-s0-h8": 0.01, "gcn-synthetic-tiny-s0-h8-lr0.02": 0.02}
    # every setting that changes the numbers is named (or, when many, a digest of them stands in)
    from tessera.train.config import TrainConfig
    from tessera.train.loop import default_out_dir

    base = TrainConfig(dataset="synthetic:tiny")
    names = {
        default_out_dir(TrainConfig(dataset="synthetic:tiny", **kw)).name
        for kw in (
            {},
            {"lr": 0.02},
            {"weight_decay": 0.0},
            {"dropout": 0.1},
            {"seed": 1},
            {"label_prop": 0.3},
            {"precision": "bf16"},
            {"comm_bits": 8},
            {"norm": "layer"},
        )
    }
    assert len(names) == 9, names
    many = TrainConfig(dataset="synthetic:tiny", lr=0.02, dropout=0.1, weight_decay=0.0, hidden=16, layers=3)
    many.label_prop, many.norm, many.patience, many.feature_norm, many.comm_bits = 0.3, "layer", 7, "none", 8
    name = default_out_dir(many).name
    assert name.startswith("gcn-synthetic-tiny-s0-x") and len(name) < 40, name
    # epochs and how the work is run are not in the name: --resume --epochs extends the run there
    assert default_out_dir(TrainConfig(dataset="synthetic:tiny", epochs=7, threads=2)) == default_out_dir(base)


def test_a_file_system_without_locks_trains_unguarded_and_says_so(tmp_path, monkeypatch, capsys):
    import errno

    from tessera.train import rundir

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))

    monkeypatch.setattr(rundir.fcntl, "flock", no_locks)  # as on an NFS mount without a lock manager
    out = tmp_path / "run"
    assert main([*RUN, "--epochs", "1", "--out", str(out)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"tessera: {out / LOCK} cannot be locked (No locks available); a second run on this directory "
                   "would not be refused"], err  # fmt: skip
    assert not (out / LOCK).exists() and (out / "result.json").is_file()
