"""Worker faults under ``tessera train --nprocs``: the rank that failed first is named in one line,
a dead worker or lost peer exits with PEER_FAILED (3, as under torchrun), a user error with 2."""

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tessera.train.loop  # noqa: F401  (imported before forking: a forked launcher imports nothing)
from helpers import forked_main, store_socket_env
from tessera.cli.launch import PEER_FAILED, first_failure
from tessera.comm.group import STORE_FD
from tessera.train.checkpoint import load_checkpoint

pytestmark = pytest.mark.distributed  # starts worker processes

REPO = Path(__file__).resolve().parents[2]
ABRT, KILL, SEGV = -signal.SIGABRT, -signal.SIGKILL, -signal.SIGSEGV
# (nprocs, rank killed): both world sizes, the first, a middle and the last rank, each killed at
# one of four points of an epoch.
KILLS = [(2, 1), (2, 0), (3, 2), (3, 0), (3, 1), (2, 1), (2, 0)]
# and the case: rank 1 killed, rank 0 aborting at once, as gloo can make it do (both seen together)
KILL_AND_ABORT = (2, 1, 0)
HANG_GUARD_S = 240  # far below --timeout: a run that only ends by the timeout fails here


@pytest.mark.parametrize(
    ("seen", "blamed"),
    [
        ([(0, ABRT), (1, KILL)], (1, KILL)),  # rank 0 aborted inside gloo, seen first
        ([(0, PEER_FAILED), (2, SEGV)], (2, SEGV)),
        ([(1, PEER_FAILED), (0, ABRT)], (0, ABRT)),  # no outside cause: the abort over a lost peer
        ([(1, PEER_FAILED), (0, PEER_FAILED)], (1, PEER_FAILED)),
        ([(2, KILL), (0, KILL)], (2, KILL)),  # two causes: the first seen
        ([(0, PEER_FAILED), (1, 2)], (1, 2)),  # a user error, not the rank that lost it as a peer
        ([(1, 1)], (1, 1)),
    ],
)
def test_first_failure_names_the_cause_not_its_aftermath(seen, blamed):
    assert first_failure(seen) == blamed


@pytest.mark.parametrize("code", [2, ABRT])
def test_a_worker_user_error_is_relayed_as_its_one_line_even_if_gloo_aborted_it_after(code, capsys):
    # rank 1 printed its one line (a bad part file, a path the OS refused) and exited 2, or was
    # aborted by gloo in its teardown after printing it; rank 0 lost it as a peer
    from tessera.cli.launch import _report

    texts = {1: "tessera: error: /parts/part-1.npz: Is a directory (it is a directory; give a file's path)\n"}
    assert _report((1, code), 2, PEER_FAILED, texts) == 2
    assert capsys.readouterr().err.splitlines() == [texts[1].strip()]


def _start_launcher(argv, err_path):
    launcher = multiprocessing.get_context("fork").Process(target=forked_main, args=(argv, str(err_path)))
    launcher.start()
    return launcher


def _stop(launcher):
    """Leave nothing running (after a failed assertion)."""
    if launcher.is_alive():
        for pid in _worker_pids(launcher.pid).values():
            os.kill(pid, signal.SIGKILL)
        launcher.kill()
    launcher.join()


def _worker_pids(launcher_pid):
    pids = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"TESSERA_LAUNCHER_PID={launcher_pid}".encode() in env:
            rank = next(int(e.split(b"=")[1]) for e in env if e.startswith(b"RANK="))
            pids[rank] = int(d.name)
    return pids


class _KillRun:
    """A long run of ``nprocs`` ranks whose rank ``victim`` gets SIGKILL after the second epoch
    (epoch 1's checkpoint is written before epoch 2's metrics line), and rank ``abort`` SIGABRT
    right after it when given."""

    def __init__(self, tmp_path, i, nprocs, victim, abort=None):
        self.abort = abort
        self.nprocs, self.victim, self.delay = nprocs, victim, 0.05 * (i % 4)  # at different points of an epoch
        self.out, self.err = tmp_path / f"run{i}", tmp_path / f"err{i}"
        argv = ["train", "--dataset", "synthetic:tiny", "--nprocs", str(nprocs), "--epochs", "100000"]
        argv += ["--patience", "0", "--checkpoint-every", "1", "--timeout", "600", "--out", str(self.out)]
        self.launcher = _start_launcher([*argv, "--no-progress"], self.err)
        self.deadline = time.monotonic() + HANG_GUARD_S
        self.kill_at = None
        self.killed = False

    def step(self):
        """Kill when due; True once the launcher has exited."""
        if not self.launcher.is_alive():
            return True
        assert time.monotonic() < self.deadline, f"hung:\n{self.err.read_text()[-2000:]}"
        metrics = self.out / "metrics.jsonl"
        if self.kill_at is None and metrics.exists() and len(metrics.read_text().splitlines()) >= 2:
            self.kill_at = time.monotonic() + self.delay
        if not self.killed and self.kill_at is not None and time.monotonic() >= self.kill_at:
            pids = _worker_pids(self.launcher.pid)
            assert sorted(pids) == list(range(self.nprocs)), pids
            os.kill(pids[self.victim], signal.SIGKILL)
            if self.abort is not None:
                os.kill(pids[self.abort], signal.SIGABRT)
            self.killed = True
        return False


def test_a_killed_worker_is_named_in_one_line_with_the_peer_failed_status(tmp_path):
    # Four runs at a time hide each one's start-up (two or three Python processes importing torch).
    pending, active, done = list(enumerate([*KILLS, KILL_AND_ABORT])), [], []
    try:
        while pending or active:
            while pending and len(active) < 4:
                i, run = pending.pop(0)
                active.append(_KillRun(tmp_path, i, *run))
            for run in [r for r in active if r.step()]:
                active.remove(run)
                done.append(run)
            time.sleep(0.05)
    finally:
        for run in active:
            _stop(run.launcher)
    assert len(done) == len(KILLS) + 1
    for run in done:
        run.launcher.join()
        err = run.err.read_text()
        lines = err.strip().splitlines()
        where = f"kill rank {run.victim} of {run.nprocs} in {run.out.name}\n{err[-2000:]}"
        assert run.killed, f"the run ended before it was killed: {where}"
        assert run.launcher.exitcode == PEER_FAILED, where
        assert [s for s in lines if s.startswith("tessera: error:")] == lines[-1:], where
        assert f"rank {run.victim} of {run.nprocs} was killed by SIGKILL;" in lines[-1], where
        assert load_checkpoint(run.out / "checkpoint.pt")["epoch"] >= 1
        if run.victim != 0 and run.abort is None:  # rank 0 left by itself: never mid-way through a checkpoint
            assert not [p.name for p in run.out.iterdir() if p.name.endswith(".tmp")]


def test_a_user_error_in_one_worker_exits_2_with_its_one_line(tmp_path):
    from tessera.datasets import load
    from tessera.graph.partition import partition, write_parts

    g = load("synthetic:tiny")
    parts = tmp_path / "parts"
    write_parts(g, partition(g, 2, "range"), parts)
    (parts / "part-1.npz").unlink()  # only rank 1 fails; rank 0 waits for it to join
    argv = ["train", "--parts-dir", str(parts), "--nprocs", "2", "--out", str(tmp_path / "o"), "--no-progress"]
    launcher = _start_launcher(argv, tmp_path / "err")
    try:
        launcher.join(HANG_GUARD_S)
    finally:
        _stop(launcher)
    err = (tmp_path / "err").read_text()
    assert launcher.exitcode == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessera: error:"), err
    assert "part-1.npz is missing" in lines[0]


def _peer_that_dies(env):
    import torch.distributed as dist

    os.environ.update(env)
    store = dist.TCPStore("127.0.0.1", int(env["MASTER_PORT"]), 2, False)  # rank 0 serves it
    dist.init_process_group("gloo", rank=1, world_size=2, store=store)
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_torchrun_worker_that_loses_its_peer_exits_peer_failed_in_one_line(tmp_path):
    # torchrun's environment without tessera's launcher: rank 1 (a fork of this process, no
    # start-up) joins the group and dies; rank 0 says so itself.
    argv = ["train", "--dataset", "synthetic:tiny", "--epochs", "100000", "--timeout", "600"]
    cmd = [sys.executable, "-m", "tessera", *argv, "--out", str(tmp_path / "o"), "--no-progress"]
    with store_socket_env(2) as (env, peer_env):  # rank 0 serves the store on a socket bound here
        peer = multiprocessing.get_context("fork").Process(target=_peer_that_dies, args=(peer_env,))
        peer.start()
        env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **env}
        fd = int(env[STORE_FD])
        r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=HANG_GUARD_S, pass_fds=[fd])
    peer.join()
    assert peer.exitcode == KILL
    assert r.returncode == PEER_FAILED, r.stderr
    lines = r.stderr.strip().splitlines()
    assert [s for s in lines if s.startswith("tessera: error:")] == lines[-1:], r.stderr
    assert "rank 0: a collective failed" in lines[-1] and "a peer died" in lines[-1]
