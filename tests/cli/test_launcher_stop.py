"""A stopped launcher leaves no workers: SIGTERM to ``tessera train --nprocs 2`` at any moment stops
both workers at their last complete checkpoint, one line gives the exact ``--resume``, and resuming
ends where an uninterrupted run ends; a SIGKILLed launcher takes its workers down by the parent-death
signal; and a rank that cannot join its job stops after ``--timeout`` in one line."""

import json
import multiprocessing
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tessera.train.loop  # noqa: F401  (imported before forking: a forked launcher imports nothing)
from helpers import forked_main, unserved_port
from tessera.cli.launch import PEER_FAILED
from tessera.train.checkpoint import load_checkpoint

pytestmark = pytest.mark.distributed  # starts worker processes

REPO = Path(__file__).resolve().parents[2]
TIMEOUT = 20  # --timeout of the runs: a worker may outlive its launcher by at most this + 5 s
EPOCHS = 120  # more than the stops can let a loaded machine train between them
RUN = ["train", "--dataset", "synthetic:tiny", "--nprocs", "2", "--strategy", "partition", "--hidden", "16"]
RUN += ["--epochs", str(EPOCHS), "--patience", "0", "--checkpoint-every", "1", "--timeout", str(TIMEOUT)]
RUN += ["--no-progress"]
# SIGTERMs, each at a seeded random moment: 10 in the suite (each starts two workers, seconds of
# imports apiece); TESSERA_LAUNCHER_STOPS=20 (or more) runs the longer campaign
STOPS = int(os.environ.get("TESSERA_LAUNCHER_STOPS", "10"))
HANG_GUARD_S = 120


def _start(argv, err_path, env=None):
    proc = multiprocessing.get_context("fork").Process(target=forked_main, args=(argv, str(err_path), env or {}))
    proc.start()
    return proc


class _Fresh:
    """``python -m tessera ARGV`` in a new interpreter, with the fork's interface. A run that
    trains in this process needs one: a fork of a test worker that already ran numba's OpenMP
    pool aborts when it computes."""

    def __init__(self, argv, err_path):
        env = {**os.environ, "PYTHONPATH": str(REPO)}
        with open(err_path, "w") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tessera", *argv], stdout=subprocess.DEVNULL, stderr=err, env=env, cwd=REPO
            )
        self.pid = self.proc.pid

    def is_alive(self):
        return self.proc.poll() is None

    def join(self, timeout=None):
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def kill(self):
        self.proc.kill()

    @property
    def exitcode(self):
        return self.proc.poll()


def _workers(launcher_pid):
    """Live processes started by this launcher (their environment names it)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and _alive(int(d.name)):
            try:
                env = (d / "environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"TESSERA_LAUNCHER_PID={launcher_pid}".encode() in env:
                pids.append(int(d.name))
    return pids


def _alive(pid):
    """Running, not a zombie (an orphaned worker's zombie may wait for a reaper that never comes)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _epochs(out):
    metrics = out / "metrics.jsonl"
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _losses(out):
    return [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def _kill_and_check(launcher, sig, out, err, argv):
    """Send ``sig`` to the launcher; check that no worker outlives it by more than --timeout + 5 s,
    that stderr is one line giving the --resume command, and that no half-written file is left.
    Returns the argv of that --resume command (``argv`` again if it stopped before it had one)."""
    seen = set(_workers(launcher.pid))
    os.kill(launcher.pid, sig)
    launcher.join(TIMEOUT + 10)
    assert launcher.exitcode is not None, f"launcher still running {TIMEOUT + 10} s after {sig!r}"
    gone_by = time.monotonic() + TIMEOUT + 5
    while (left := [p for p in seen | set(_workers(launcher.pid)) if _alive(p)]) and time.monotonic() < gone_by:
        time.sleep(0.05)
    assert not left, f"workers {left} outlived the launcher by more than --timeout + 5 s"
    text = err.read_text()
    # the run's own messages (a resume that found no checkpoint yet says so), then the one line
    lines = [s for s in text.strip().splitlines() if not s.startswith("tessera: no checkpoint in ")]
    assert len(lines) == 1, text
    if sig == signal.SIGTERM:
        assert launcher.exitcode == 128 + signal.SIGTERM, text
        assert lines[0].startswith("tessera: stopped by SIGTERM; "), text
    else:  # SIGKILL: rank 0 says its launcher is gone
        assert launcher.exitcode == -signal.SIGKILL, text
        assert f"its launcher (pid {launcher.pid}) is gone" in lines[0], text
    if sig == signal.SIGTERM and lines == ["tessera: stopped by SIGTERM"]:
        return argv  # stopped before it had chosen its run directory: the same command again
    checkpoint = (out / "checkpoint.pt").exists()
    said = (
        "the last checkpoint is kept, continue with: "
        if checkpoint
        else "no checkpoint was written yet, start again with: "
    )
    assert said + "tessera train " in lines[0], text
    assert not [p.name for p in out.glob("*.tmp")], "a half-written file was left"
    if checkpoint:
        assert load_checkpoint(out / "checkpoint.pt")["epoch"] <= _epochs(out)
    command = shlex.split(lines[0].split(" with: ", 1)[1])
    assert command[0] == "tessera" and command[-1] == "--resume" and str(out) in command
    return command[1:]


def test_sigterms_and_a_sigkill_to_the_launcher_leave_no_worker_and_resume_exactly(tmp_path):
    ref_out, out = tmp_path / "ref", tmp_path / "run"
    reference = _start([*RUN, "--out", str(ref_out)], tmp_path / "ref.err")  # uninterrupted, meanwhile
    rng = random.Random(20261207)
    # half of the SIGTERMs anywhere in start-up (imports, set-up, rendezvous, first epoch), half a
    # random fraction of an epoch after the run's first new epoch (in a step, evaluation or a
    # checkpoint write); the SIGKILL is after an epoch too
    kinds = ["start-up"] * (STOPS // 2) + ["epoch"] * (STOPS - STOPS // 2)
    rng.shuffle(kinds)
    signals = [signal.SIGTERM] * STOPS
    at = rng.randrange(STOPS // 2, STOPS)
    signals.insert(at, signal.SIGKILL)
    kinds.insert(at, "epoch")
    argv, launchers, moments = [*RUN, "--out", str(out)], [], []
    try:
        for i, sig in enumerate(signals):
            err = tmp_path / f"err{i}"
            start, epochs = time.monotonic(), _epochs(out)
            launcher = _start(argv, err)
            launchers.append(launcher)
            if kinds[i] == "start-up":
                moment = ("start-up", rng.uniform(0.3, 3.0))
                time.sleep(moment[1])
            else:
                moment = ("epoch", rng.uniform(0.0, 0.15))
                deadline = time.monotonic() + HANG_GUARD_S
                while _epochs(out) <= epochs and launcher.is_alive():
                    assert time.monotonic() < deadline, f"no epoch trained:\n{err.read_text()[-2000:]}"
                    time.sleep(0.01)
                time.sleep(moment[1])
            moments.append((sig, moment, round(time.monotonic() - start, 2), _epochs(out)))
            assert launcher.is_alive(), f"the run ended before stop {i} ({moments}):\n{err.read_text()[-2000:]}"
            argv = _kill_and_check(launcher, sig, out, err, argv)
        assert _epochs(out) < EPOCHS
        final = _start(argv, tmp_path / "final.err")  # the exact --resume the last stop printed
        launchers.append(final)
        final.join(HANG_GUARD_S)
        assert final.exitcode == 0, (tmp_path / "final.err").read_text()[-2000:]
        reference.join(HANG_GUARD_S)
        assert reference.exitcode == 0, (tmp_path / "ref.err").read_text()[-2000:]
    finally:
        for p in [reference, *launchers]:
            if p.is_alive():
                for pid in _workers(p.pid):
                    os.kill(pid, signal.SIGKILL)
                p.kill()
            p.join()
    assert sum(m[1][0] == "epoch" for m in moments) >= STOPS // 2, moments
    assert _losses(out) == pytest.approx(_losses(ref_out), abs=1e-4), moments
    got, want = (json.loads((d / "result.json").read_text()) for d in (out, ref_out))
    assert got["best_epoch"] == want["best_epoch"]
    assert got["test_acc"] == pytest.approx(want["test_acc"], abs=1e-4)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_a_one_process_run_stops_on_sigint_sigterm_or_sighup_in_one_line(sig, tmp_path):
    out, err = tmp_path / "run", tmp_path / "err"
    argv = [a for a in RUN if a not in ("--nprocs", "2")] + ["--epochs", "100000", "--out", str(out)]
    run = _Fresh(argv, err)
    try:
        deadline = time.monotonic() + HANG_GUARD_S
        while _epochs(out) < 2:
            assert run.is_alive() and time.monotonic() < deadline, err.read_text()[-2000:]
            time.sleep(0.01)
        os.kill(run.pid, sig)
        run.join(10)
    finally:
        if run.is_alive():
            run.kill()
        run.join()
    text = err.read_text()
    assert run.exitcode == 128 + sig, text
    lines = text.strip().splitlines()
    said = "interrupted" if sig == signal.SIGINT else f"stopped by {signal.Signals(sig).name}"
    assert len(lines) == 1 and lines[0].startswith(f"tessera: {said}; "), text
    assert lines[0].endswith(shlex.join(["tessera", *argv, "--resume"])), text
    assert not list(out.glob("*.tmp"))
    assert load_checkpoint(out / "checkpoint.pt")["epoch"] >= 1


class _Squatter:
    """A port that accepts connections and never answers (what a rank finds when another program
    holds MASTER_PORT)."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]


def test_a_rank_that_cannot_join_stops_after_its_timeout_in_one_line(tmp_path):
    # Rank 1 started by hand (torchrun's variables, no launcher) against a port nobody serves, and
    # against one another program holds: each stops within --timeout + 5 s, one line, status 3.
    timeout = 3
    squatter = _Squatter()
    ports = {"nobody serves": unserved_port(), "another program holds": squatter.port}
    argv = ["train", "--dataset", "synthetic:tiny", "--timeout", str(timeout), "--no-progress"]
    ranks = {}
    start = time.monotonic()
    for name, port in ports.items():
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "1", "WORLD_SIZE": "2"}
        ranks[name] = _start([*argv, "--out", str(tmp_path / str(port))], tmp_path / f"{port}.err", env)
    try:
        for name, proc in ranks.items():
            proc.join(max(0.1, start + timeout + 5 - time.monotonic()))
            err = (tmp_path / f"{ports[name]}.err").read_text()
            assert proc.exitcode == PEER_FAILED, f"{name}: still running or wrong status {proc.exitcode}\n{err}"
            lines = err.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("tessera: error: rank 1 of 2 could not join"), err
            assert f"127.0.0.1:{ports[name]} within --timeout {timeout} s" in lines[0]
    finally:
        for proc in ranks.values():
            if proc.is_alive():
                proc.kill()
            proc.join()
        squatter.sock.close()
