"""A host's workers killed mid-run on emulated hosts: torchrun ``--max-restarts 1`` on every host
restarts the job's workers, they resume from the checkpoint in the shared run directory, and the
losses equal an uninterrupted run's (one process's, to 1e-4).

Only the workers are killed (the torchrun agent of the host stays): a host's agent killed too and
started again does not rejoin with torch 2.13's c10d rendezvous (the new agent waits for the
round's ``MASTER_ADDR`` key, which the surviving agent, rank 0 since the first round, does not
write again), so that case is not tested here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hosts import REPO, EmulatedHosts

pytestmark = [pytest.mark.distributed, pytest.mark.multihost]  # starts torchrun on emulated hosts

HOSTS, RANKS_PER_HOST = 2, 2
EPOCHS = 40
KILL_AFTER = 5  # epochs written before host 1's workers are killed
KILLED_HOST = 1
RUN_S = 300


def _args(out: Path) -> list[str]:
    return ["-m", "tessera", "train", "--dataset", "synthetic:small", "--hidden", "16", "--dropout", "0.5",
            "--epochs", str(EPOCHS), "--patience", "0", "--checkpoint-every", "1", "--no-progress",
            "--timeout", "10", "--out", str(out)]  # fmt: skip


def _start(hosts: EmulatedHosts, out: Path, logs: Path) -> list[subprocess.Popen]:
    """Every host's torchrun (one restart allowed) training into ``out``."""
    # one thread each for torch and numba: a run's last bits depend on the thread count
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
           "GLOO_SOCKET_IFNAME": "eth0"}  # fmt: skip
    logs.mkdir(parents=True, exist_ok=True)
    procs = []
    for host in range(hosts.n):
        log = open(logs / f"h{host}.log", "w")
        cmd = hosts.command(host, hosts.torchrun(host, RANKS_PER_HOST, _args(out), max_restarts=1))
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=log, stdin=subprocess.DEVNULL))
        log.close()
    return procs


def _finish(procs: list[subprocess.Popen], logs: Path) -> None:
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=RUN_S))
        except subprocess.TimeoutExpired:
            codes.append(None)
    tails = "\n".join(f"--- {f.name}\n{f.read_text()[-3000:]}" for f in sorted(logs.glob("*.log")))
    assert codes == [0] * len(procs), f"torchrun exits {codes}\n{tails}"


def _losses(out: Path) -> tuple[list[int], list[float]]:
    rows = [json.loads(s) for s in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["epoch"] for r in rows], [r["train_loss"] for r in rows]


def test_killed_workers_of_a_host_resume_from_the_shared_checkpoint(hosts_ready, tmp_path):
    # the uninterrupted run: one process, which 2 x 2 ranks equal (tests/parallel/test_multihost.py)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1"}
    subprocess.run([sys.executable, *_args(tmp_path / "ref")], env=env, cwd=REPO, check=True, capture_output=True)
    with EmulatedHosts(HOSTS) as hosts:
        run = tmp_path / "run"
        procs = _start(hosts, run, tmp_path / "logs")
        metrics, deadline = run / "metrics.jsonl", time.monotonic() + 180
        while not (metrics.exists() and metrics.read_text().count("\n") >= KILL_AFTER):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), "training never got under way"
            time.sleep(0.05)
        agent = procs[KILLED_HOST].pid  # `ip netns exec` and `unshare` exec into torchrun: this is its agent
        pids = subprocess.run(["ip", "netns", "pids", hosts.namespaces[KILLED_HOST]], capture_output=True, text=True)
        killed = [int(p) for p in pids.stdout.split() if int(p) != agent]
        assert killed, "no worker ran on the host"
        for pid in killed:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        _finish(procs, tmp_path / "logs")
    ref_epochs, ref_loss = _losses(tmp_path / "ref")
    epochs, loss = _losses(run)
    assert epochs == ref_epochs == list(range(1, EPOCHS + 1))
    assert loss == pytest.approx(ref_loss, rel=1e-4)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
