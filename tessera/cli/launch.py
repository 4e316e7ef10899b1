"""``tessera train --nprocs N``: start N local workers with torchrun's environment and watch them.

If any worker exits with an error or is killed, the others are stopped at once and the launcher
exits non-zero with one line naming the rank, so a dead worker never leaves the job hanging.
(Workers blocked in a collective on a dead peer would also raise after ``--timeout``.)
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence

from tessera.errors import TesseraError


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _describe(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


PEER_FAILED = 3  # a worker that failed only because a peer did (see tessera.cli.main)


def _error_line(log) -> str | None:
    log.seek(0)
    lines = [s for s in log.read().splitlines() if s.startswith("tessera: error")]
    return lines[-1] if lines else None


def launch(argv: Sequence[str], nprocs: int, poll_s: float = 0.05, grace_s: float = 2.0) -> int:
    """Run ``python -m tessera <argv>`` as ``nprocs`` ranks over gloo/NCCL on 127.0.0.1; returns 0
    when every rank succeeds, else raises :class:`TesseraError` naming the first rank that failed."""
    port = free_port()
    procs: list[subprocess.Popen] = []
    # Each worker gets its share of the cores unless the user chose (as torchrun does).
    share = str(max(1, (os.cpu_count() or 1) // nprocs))
    threads = {k: os.environ.get(k, share) for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}
    # Rank 0 keeps the terminal (progress bar, messages); the others write to files the
    # launcher reads only to name a failure, so a shared error is printed once, not N times.
    logs = [None] + [tempfile.TemporaryFile(mode="w+") for _ in range(1, nprocs)]
    for rank in range(nprocs):
        env = {
            **os.environ,
            **threads,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "TESSERA_LAUNCHER_PID": str(os.getpid()),
        }
        procs.append(subprocess.Popen([sys.executable, "-m", "tessera", *argv], env=env, stderr=logs[rank]))
    failed: tuple[int, int] | None = None
    try:
        while True:
            codes = [p.poll() for p in procs]
            bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
            if bad:
                # Give the first failure's root cause a moment to show: a rank whose peer died
                # exits PEER_FAILED, the dead one by a signal or its own error.
                # Rank 0 prints its own one-line error; let it finish so one message is shown.
                end = time.time() + grace_s
                while time.time() < end and (all(c == PEER_FAILED for _, c in bad) or procs[0].poll() is None):
                    time.sleep(poll_s)
                    bad = [(r, c) for r, p in enumerate(procs) if (c := p.poll()) not in (None, 0)]
                failed = next(((r, c) for r, c in bad if c != PEER_FAILED), bad[0])
                break
            if all(c == 0 for c in codes):
                for log in logs[1:]:
                    log.close()
                return 0
            time.sleep(poll_s)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    rank, code = failed
    codes = {r: p.returncode for r, p in enumerate(procs)}
    errors = {r: _error_line(logs[r]) for r in range(1, nprocs)}
    for log in logs[1:]:
        log.close()
    if codes[0] == 2:  # rank 0 printed its own user error
        return 2
    if code == 2 and errors.get(rank):
        print(errors[rank], file=sys.stderr)
        return 2
    if code == PEER_FAILED:
        raise TesseraError(f"rank {rank} of {nprocs} lost a peer in a collective; the other ranks were stopped")
    if code == 2:  # a user error the worker already printed in one line
        return 2
    raise TesseraError(
        f"rank {rank} of {nprocs} {_describe(code)}; the other ranks were stopped (rerun with --resume to continue from the last checkpoint)"
    )
