"""``tessera train --nprocs N``: start N local workers with torchrun's environment and watch them.

If any worker exits with an error or is killed, the others are stopped and the launcher prints one
line naming the rank that failed first, so a dead worker never leaves the job hanging. (Workers
blocked in a collective on a dead peer would also raise after ``--timeout``.) Exit statuses: 0 when
every rank succeeds, 2 for a user error (printed once), :data:`PEER_FAILED` when a worker died or
lost a peer. The job's store port is bound by the launcher before any worker starts and served by
rank 0 on that same socket (:func:`store_socket`), so no other program can take it in between.

SIGTERM, SIGINT and SIGHUP to the launcher are forwarded to the workers as SIGTERM, which stops
each as Ctrl-C does (its last complete checkpoint stays); the launcher waits for them, bounded,
kills what is left and exits with 128 + the signal's number and one line giving the ``--resume``
command. Each worker also gets SIGTERM from the kernel if the launcher dies, even by SIGKILL
(``tessera.cli.watch``), so a stopped launcher never leaves workers training.
"""

from __future__ import annotations

import contextlib
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from types import FrameType

from tessera.cli.watch import STOP_GRACE_S, STOP_SIGNALS, Stopped, no_stop_watchdog, signal_name
from tessera.comm.group import STORE_FD
from tessera.errors import DistributedError

USER_ERROR = 2
#: Exit status of a worker that failed because a peer did (see ``tessera.cli.main``), and of the
#: launcher and of torchrun workers when a worker died or a collective broke: not the user's input.
PEER_FAILED = 3
_LOG_TAIL = 20  # lines of a failed non-zero rank's stderr shown above the error line
#: seconds a stopped launcher waits for its workers to stop before killing them (each ends itself
#: within STOP_GRACE_S of its SIGTERM, unwinding or not)
STOP_WAIT_S = STOP_GRACE_S + 5.0


def store_socket() -> socket.socket:
    """A listening TCP socket on 127.0.0.1 at a port the kernel picks, for rank 0's store
    (``TESSERA_STORE_FD``): bound before any worker starts and held from then on, so no other
    process can take the port between choosing it and serving it."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1024)  # every rank connects at once; a short backlog drops connections under load
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


def _describe(code: int) -> str:
    if code == PEER_FAILED:
        return "lost a peer in a collective (a connection broke, or a peer hung past --timeout)"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    if code - 128 in STOP_SIGNALS:  # a worker stopped by a signal exits as Ctrl-C's 130 does
        return f"was stopped by {signal_name(code - 128)}"
    return f"exited with status {code}"


def _aftermath(code: int) -> int:
    """How likely a failed rank's exit status is the aftermath of another rank's failure: 0 for a
    cause (a signal from outside, a user error, a crash), 1 for SIGABRT (gloo can abort a rank
    whose peer's socket closed), 2 for PEER_FAILED (the rank caught the broken collective)."""
    if code == PEER_FAILED:
        return 2
    return 1 if code == -signal.SIGABRT else 0


def first_failure(exits: Sequence[tuple[int, int]]) -> tuple[int, int]:
    """The ``(rank, status)`` to blame among failed ranks' exits in the order they were seen: the
    first cause, else the first SIGABRT, else the first PEER_FAILED. Two exits seen together can
    be out of order by a scheduling delay, but a rank that failed because a peer did never exits
    as a cause, so the dead peer is named however close the two were."""
    order = range(len(exits))
    return exits[min(order, key=lambda i: (_aftermath(exits[i][1]), i))]


def _watch(procs: Sequence[subprocess.Popen]) -> queue.Queue:
    """A queue that receives ``(rank, status)`` as each worker exits: one thread per worker blocks
    in ``waitpid`` on it, so exits arrive in the order they happen, not a polling interval's."""
    exits: queue.Queue = queue.Queue()
    for rank, p in enumerate(procs):
        threading.Thread(target=lambda r=rank, q=p: exits.put((r, q.wait())), daemon=True).start()
    return exits


class _StopRequest:
    """The first stop signal the launcher received (``signum``), forwarded to its workers."""

    def __init__(self, procs: list[subprocess.Popen]) -> None:
        self.signum: int | None = None
        self.procs = procs
        # the workers read this pipe's end: a byte before a forwarded signal says "the launcher
        # reports this stop", end of file says the launcher is gone (tessera.cli.watch)
        self.read_fd, self.write_fd = os.pipe()
        self.told = False

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def handler(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is None:
            self.signum = signum
        self.forward()

    def forward(self) -> None:
        """SIGTERM to every worker not known to have exited (each stops as on Ctrl-C)."""
        if self.signum is None:
            return
        if not self.told:
            with contextlib.suppress(OSError):
                os.write(self.write_fd, b"s" * 64)  # one for each worker to read, and more
            self.told = True
        for p in self.procs:
            with contextlib.suppress(OSError):
                p.send_signal(signal.SIGTERM)

    def wait(self, timeout_s: float) -> None:
        """Until every worker has exited (their watch threads reap them) or ``timeout_s`` passed."""
        deadline = time.monotonic() + timeout_s
        while any(p.returncode is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.05)


@contextlib.contextmanager
def _forwarding(stop: _StopRequest) -> Iterator[None]:
    """While inside: stop signals are recorded and forwarded to the workers instead of raising
    (a launcher outside the main thread, as in a library caller's thread, cannot catch them)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    with no_stop_watchdog():
        for s in STOP_SIGNALS:
            signal.signal(s, stop.handler)
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)


def _collect(
    exits: queue.Queue, nprocs: int, grace_s: float, stop: _StopRequest | None = None
) -> list[tuple[int, int]] | None:
    """Wait for the workers: ``None`` when all succeed, else the failed ranks' ``(rank, status)``
    in the order seen. After the first failure the others get ``grace_s`` to fail too, so the
    cause is told from its aftermath, but no longer than until a cause is seen and rank 0 (which
    prints its own user error) has exited. A stop signal ends the wait at once."""
    done: dict[int, int] = {}
    deadline = math.inf
    while len(done) < nprocs:
        if stop is not None and stop.signum is not None:
            break
        failed = [c for c in done.values() if c != 0]
        if failed:
            deadline = min(deadline, time.monotonic() + grace_s)
            if 0 in done and min(map(_aftermath, failed)) == 0:
                break
        left = deadline - time.monotonic()
        if left <= 0:
            break
        try:
            rank, code = exits.get(timeout=min(left, 0.2))  # bounded, so a stop signal is seen soon
        except queue.Empty:
            continue
        done[rank] = code
    return [(r, c) for r, c in done.items() if c != 0] or None


def _log_text(log) -> str:
    log.seek(0)
    return log.read()


def _error_line(text: str) -> str | None:
    lines = [s for s in text.splitlines() if s.startswith("tessera: error")]
    return lines[-1] if lines else None


def launch(argv: Sequence[str], nprocs: int, grace_s: float = 2.0) -> int:
    """Run ``python -m tessera <argv>`` as ``nprocs`` ranks over gloo/NCCL on 127.0.0.1; returns 0
    when every rank succeeds or 2 after a user error printed once; raises
    :class:`DistributedError` naming the rank that failed first when a worker died or broke, or
    :class:`~tessera.cli.watch.Stopped` after a stop signal stopped the workers."""
    store = store_socket()
    procs: list[subprocess.Popen] = []
    # Each worker gets its share of the cores unless the user chose (as torchrun does).
    share = str(max(1, (os.cpu_count() or 1) // nprocs))
    threads = {k: os.environ.get(k, share) for k in ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")}
    # Rank 0 keeps the terminal (progress bar, messages); the others write to files the
    # launcher reads only to name a failure, so a shared error is printed once, not N times.
    worker_logs = [tempfile.TemporaryFile(mode="w+") for _ in range(1, nprocs)]
    logs = [None, *worker_logs]
    # Rank 0's Python output stays on the terminal but what native code writes to its file
    # descriptor 2 (gloo's abort after a peer died, C++ log lines) comes here, shown only if rank 0
    # failed first, or after a successful run, so a failure is still one line.
    native0 = tempfile.TemporaryFile(mode="w+")
    stop = _StopRequest(procs)
    failed = None
    with _forwarding(stop):  # around the clean-up too: a late signal cannot cut it short
        try:
            _start(procs, stop, argv, nprocs, store, threads, logs, native0)
            store.close()  # rank 0 holds its own copy
            failed = _collect(_watch(procs), nprocs, grace_s, stop)
            if stop.signum is not None:
                stop.forward()  # again: a worker started as the signal came may have missed it
                stop.wait(STOP_WAIT_S)
        finally:
            for p in procs:
                if p.returncode is None:
                    p.kill()
            for p in procs:
                p.wait()
            texts = {r: _log_text(log) for r, log in enumerate(logs) if log is not None}
            texts[0] = _log_text(native0)
            for log in [*worker_logs, native0]:
                log.close()
            stop.close()
            store.close()
    if stop.signum is not None and (len(procs) < nprocs or any(p.returncode != 0 for p in procs)):
        raise Stopped(stop.signum)
    if failed is None:
        if texts[0].strip():  # rank 0's native messages (warnings), which the terminal did not get
            print(texts[0].rstrip("\n"), file=sys.stderr)
        return 0
    return _report(first_failure(failed), nprocs, procs[0].returncode, texts)


def _start(
    procs: list[subprocess.Popen],
    stop: _StopRequest,
    argv: Sequence[str],
    nprocs: int,
    store: socket.socket,
    threads: dict[str, str],
    logs: list,
    native0,
) -> None:
    """Start the workers into ``procs``, none after a stop signal."""
    for rank in range(nprocs):
        if stop.signum is not None:
            return
        env = {
            **os.environ,
            **threads,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store.getsockname()[1]),
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": str(nprocs),
            "LOCAL_WORLD_SIZE": str(nprocs),
            "TESSERA_LAUNCHER_PID": str(os.getpid()),
            "TESSERA_LAUNCHER_FD": str(stop.read_fd),
            STORE_FD: str(store.fileno()) if rank == 0 else "rank 0",
        }
        fds = [stop.read_fd]
        if rank == 0:
            env["TESSERA_NATIVE_STDERR_FD"] = str(native0.fileno())
            fds += [native0.fileno(), store.fileno()]
        cmd = [sys.executable, "-m", "tessera", *argv]
        procs.append(subprocess.Popen(cmd, env=env, stderr=logs[rank], pass_fds=fds))
        stop.forward()  # a stop signal that came while this worker was starting


def _report(blamed: tuple[int, int], nprocs: int, rank0_code: int | None, texts: dict[int, str]) -> int:
    """Show the user one line about the failed run and return its exit status, or raise."""
    rank, code = blamed
    if rank0_code == USER_ERROR:  # rank 0 printed its own user error on the terminal
        return USER_ERROR
    if code in (USER_ERROR, -signal.SIGABRT) and (line := _error_line(texts.get(rank, ""))):
        # another rank's user error, relayed once (a worker under the launcher prints only those;
        # gloo can abort a rank in its teardown after it printed one)
        print(line, file=sys.stderr)
        return USER_ERROR
    tail = texts.get(rank, "").strip().splitlines()[-_LOG_TAIL:]
    if tail and code != PEER_FAILED:  # a crash's traceback or gloo's last words, lost with the log else
        print("\n".join([f"rank {rank} stderr:", *tail]), file=sys.stderr)
    raise DistributedError(
        f"rank {rank} of {nprocs} {_describe(code)}; the other ranks were stopped "
        "(rerun with --resume to continue from the last checkpoint)"
    )
