"""Stop signals and the launcher watch: how a ``tessera`` process stops when told to.

SIGTERM and SIGHUP (what ``timeout``, a scheduler or a closed terminal send) stop a command as
Ctrl-C does: :class:`Stopped`, a :class:`KeyboardInterrupt`, is raised in the main thread, so
every ``finally`` and every atomic write unwinds (a half-written temporary is deleted, the last
complete checkpoint stays), and the command exits with 128 + the signal's number. Only the first
stop signal raises: a second one (a launcher forwarding the Ctrl-C its worker already got) cannot
interrupt the unwinding. A main thread blocked in native code (a collective waiting on a peer)
runs no Python handler, so a process that is still alive ``grace_s`` seconds after the first stop
signal ends at once with that status.

A worker of ``tessera train --nprocs`` (``TESSERA_LAUNCHER_PID`` in its environment) also asks the
kernel for SIGTERM when its launcher dies (``prctl(PR_SET_PDEATHSIG)``; elsewhere than Linux a
thread polls the parent), so a launcher killed by SIGKILL takes its workers down with it.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import shlex
import signal
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from types import FrameType

#: the signals that stop a command as Ctrl-C does
STOP_SIGNALS = tuple(signal.Signals[n] for n in ("SIGINT", "SIGTERM", "SIGHUP") if n in signal.Signals.__members__)
#: seconds a stopped process may take to unwind before it ends without unwinding
STOP_GRACE_S = 5.0
_PR_SET_PDEATHSIG = 1


class Stopped(KeyboardInterrupt):
    """A stop signal arrived: SIGINT, SIGTERM or SIGHUP (``signum``)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal_name(signum))
        self.signum = signum

    @property
    def status(self) -> int:
        """The exit status a process stopped by this signal reports: 128 + its number."""
        return 128 + self.signum


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def interrupt_status(e: KeyboardInterrupt) -> int:
    """130 for Ctrl-C, else 128 + the stop signal's number."""
    return e.status if isinstance(e, Stopped) else 128 + signal.SIGINT


def resume_command(argv: Sequence[str]) -> str:
    """The shell command that continues a stopped ``tessera train`` run of ``argv`` (which must
    name its ``--out``) from its last checkpoint."""
    args = list(argv)
    if "--resume" not in args:
        args.append("--resume")
    return shlex.join(["tessera", *args])


@contextlib.contextmanager
def no_stop_watchdog() -> Iterator[None]:
    """Inside :func:`stop_signals`: a stop signal starts no watchdog (a launcher, which waits for
    its workers itself, bounded, must not be ended before they are)."""
    try:
        old = signal.set_wakeup_fd(-1)
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        signal.set_wakeup_fd(old, warn_on_full_buffer=False)


@contextlib.contextmanager
def stop_signals(grace_s: float = STOP_GRACE_S) -> Iterator[None]:
    """While inside: the first of :data:`STOP_SIGNALS` raises :class:`Stopped` in the main thread
    and later ones are ignored; a process still alive ``grace_s`` after the first ends with
    128 + its number. The previous handlers are restored on leaving. Outside the main thread
    (where Python cannot set handlers) nothing changes. After a stop the grace still bounds the
    rest of the process's life, its exit included."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    fired: list[int] = []

    def handler(signum: int, frame: FrameType | None) -> None:
        if fired:
            return
        fired.append(signum)
        raise Stopped(signum)

    previous = {s: signal.getsignal(s) for s in STOP_SIGNALS}
    read_fd, write_fd = os.pipe()
    os.set_blocking(write_fd, False)
    done = threading.Event()
    try:
        old_wakeup = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
    except ValueError:  # not the main interpreter
        old_wakeup = None
    # The wakeup fd receives a byte from the C-level handler even while the main thread is stuck
    # in native code: a watchdog thread reading it bounds how long a stop may take.
    threading.Thread(target=_watchdog, args=(read_fd, done, grace_s), daemon=True, name="tessera-stop").start()
    for s in STOP_SIGNALS:
        signal.signal(s, handler)
    try:
        yield
    finally:
        if not fired:  # after a stop the handler stays, ignoring more (a dying launcher's threads each send one)
            for s, h in previous.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
        if old_wakeup is not None:
            signal.set_wakeup_fd(old_wakeup)
        if not fired:  # after a stop the watchdog stays armed: the exit itself must not hang either
            done.set()
        os.close(write_fd)  # a watchdog still reading sees EOF and returns


def _watchdog(read_fd: int, done: threading.Event, grace_s: float) -> None:
    try:
        while True:
            data = os.read(read_fd, 64)
            if not data or done.is_set():
                return
            stops = [b for b in data if b in STOP_SIGNALS]
            if stops:
                break
        signum = stops[0]
        if done.wait(grace_s):
            return
        try:  # a last word flushed where possible; the status says the rest
            sys.stderr.flush()
        except Exception:  # noqa: BLE001 (ending anyway)
            pass
        os._exit(128 + signum)
    finally:
        os.close(read_fd)


def launcher_pid() -> int | None:
    """The pid of the ``tessera train --nprocs`` launcher that started this worker, else None."""
    pid = os.environ.get("TESSERA_LAUNCHER_PID", "")
    return int(pid) if pid.isdigit() else None


def launcher_reports(wait_s: float = 2.0) -> bool:
    """In a stopped worker: True when its launcher is alive and reports the stop itself. The
    launcher writes a byte to the pipe it passed (``TESSERA_LAUNCHER_FD``) before it forwards a
    stop signal; a launcher that died closed the pipe (end of file). Nothing within ``wait_s``:
    the signal came from elsewhere and the launcher, alive, names this rank's exit."""
    fd = os.environ.get("TESSERA_LAUNCHER_FD", "")
    if not fd.isdigit():
        return os.getppid() == launcher_pid()
    try:
        ready, _, _ = select.select([int(fd)], [], [], wait_s)
        return not ready or os.read(int(fd), 1) != b""
    except OSError:  # the pipe is not there (a worker started otherwise)
        return os.getppid() == launcher_pid()


def watch_launcher() -> None:
    """In a launcher's worker: receive SIGTERM when the launcher dies, and stop now if it already
    has (then the worker was re-parented before it could ask). A no-op elsewhere."""
    pid = launcher_pid()
    if pid is None:
        return
    if not _parent_death_signal(signal.SIGTERM):
        threading.Thread(target=_poll_parent, args=(pid,), daemon=True, name="tessera-launcher").start()
    if os.getppid() != pid:
        os.kill(os.getpid(), signal.SIGTERM)


def _parent_death_signal(signum: int) -> bool:
    """Ask Linux to send ``signum`` when the parent dies; False where that cannot be asked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def _poll_parent(pid: int) -> None:
    while os.getppid() == pid:
        time.sleep(0.5)
    os.kill(os.getpid(), signal.SIGTERM)


def native_stderr_apart() -> None:
    """In rank 0 of a launcher's job (``TESSERA_NATIVE_STDERR_FD`` names a file the launcher
    reads): Python's ``sys.stderr`` keeps the terminal (progress, messages, the one error line),
    while file descriptor 2, where torch, gloo and the C runtime write (an abort's "terminate
    called ...", C++ log lines), goes to that file; the launcher shows it only where it tells
    something (rank 0 failed first, or after a successful run)."""
    fd = os.environ.pop("TESSERA_NATIVE_STDERR_FD", "")
    if not fd.isdigit():
        return
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    try:
        terminal = os.dup(2)
        os.dup2(int(fd), 2)
        os.close(int(fd))
    except OSError:
        return
    encoding = sys.stderr.encoding if sys.stderr is not None else "utf-8"
    sys.stderr = os.fdopen(terminal, "w", buffering=1, encoding=encoding, errors="backslashreplace")
