"""A run directory's path checked before anything is loaded or written, one owner per run
directory (an advisory lock), and writes into it that fail in one line, never leaving half a
record behind.

**The lock.** A run writing its directory holds ``fcntl.flock`` on ``<dir>/.lock``, a file holding
its pid and host as text, from the set-up to its end (:func:`acquire`, :meth:`RunLock.release`);
a second run on the directory is refused in one line naming the owner (:func:`owner_of`,
:func:`busy_error`). The kernel drops a flock when its holder dies however it dies, so a lock file
left by a killed run is simply taken over. The owner removes the file when it is done; a run that
opened the file just before that checks, once it holds the lock, that the file it locked is still
the one at the path, so two runs never both hold it. ``flock`` is advisory: tessera runs honour it,
other programs writing the directory do not; on NFS it is as good as the server's lock manager."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import NamedTuple

from tessera.errors import ConfigError, TesseraError

#: the lock file in a run directory
LOCK = ".lock"
#: how long a run retries a lock that is held by no live process it can see (a run that is
#: creating it and has not yet written its pid, or one that checks it for a moment)
_SETTLE_S = 1.0
#: a name longer than this many bytes is refused where the file system cannot say its own limit
NAME_MAX = 255
PATH_MAX = 4096
#: the errors of a full file system: the fix is space, not another setting
_FULL = (errno.ENOSPC, errno.EDQUOT)
#: the errors of a file system that has no locks
_NO_LOCKS = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)

log = logging.getLogger(__name__)


class Owner(NamedTuple):
    """Who holds a run directory's lock, as its lock file says (None where it says nothing)."""

    pid: int | None
    host: str | None

    def described(self) -> str:
        """``pid 123 on host h``, or what of it is known."""
        if self.pid is None:
            return "a process that has not yet said who it is"
        return f"pid {self.pid} on host {self.host or '?'}"

    def alive(self) -> bool:
        """Whether the owner may be running: on this host, whether its pid exists; on another, yes."""
        if self.pid is None:
            return False
        if self.host not in (None, socket.gethostname()):
            return True
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's live process
            return True
        return True


def _parse(text: str) -> Owner:
    fields = dict(line.split(" ", 1) for line in text.splitlines() if " " in line)
    pid = fields.get("pid", "")
    return Owner(int(pid) if pid.isdigit() else None, fields.get("host"))


def _read_owner(fd: int) -> Owner:
    try:
        return _parse(os.pread(fd, 4096, 0).decode("utf-8", "replace"))
    except OSError:
        return Owner(None, None)


def busy_error(directory: Path, owner: Owner) -> ConfigError:
    """The one line refusing a run directory another run holds."""
    return ConfigError(
        f"run directory {directory} is in use by another tessera run ({owner.described()}); "
        "wait for that run to finish, or give this run another --out"
    )


def _open_lock(path: Path, flags: int) -> int:
    """The lock file opened without following a link or blocking, refused unless a regular file."""
    fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ConfigError(f"{path} is not a regular file; remove it (tessera keeps its run lock there)")
    return fd


def owner_of(directory: str | os.PathLike) -> Owner | None:
    """The owner of ``directory``'s lock while a live process holds it, else None (no lock file,
    or one that a dead run left). Creates nothing."""
    path = Path(directory) / LOCK
    try:
        fd = _open_lock(path, os.O_RDONLY)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:  # O_NOFOLLOW on a link
            raise ConfigError(f"{path} is a symbolic link; remove it (tessera keeps its run lock there)") from None
        raise ConfigError(f"cannot read the run lock {path} ({e.strerror or e}); check its permissions") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_owner(fd)
        except OSError as e:
            if e.errno in _NO_LOCKS:
                return None  # nothing to tell: acquire() says so
            raise
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class RunLock:
    """A held run-directory lock; :meth:`release` (or the process's end) gives it up."""

    def __init__(self, directory: Path, fd: int, created: list[Path]) -> None:
        self.directory = directory
        self.path = directory / LOCK
        self._fd: int | None = fd
        #: the directories :func:`acquire` created, innermost last
        self.created = created

    @property
    def held(self) -> bool:
        """Whether this lock is still held."""
        return self._fd is not None

    def release(self, remove_created: bool = False) -> None:
        """Remove the lock file and give the lock up; with ``remove_created``, also remove the
        directories :func:`acquire` created, if nothing else was written into them."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            with contextlib.suppress(OSError):
                mine, there = os.fstat(fd), os.stat(self.path, follow_symlinks=False)
                if (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino):
                    os.unlink(self.path)  # while still held: whoever opened it sees it gone and retries
        finally:
            os.close(fd)
        if remove_created:
            for d in reversed(self.created):
                try:
                    d.rmdir()
                except OSError:
                    break

    def __del__(self) -> None:  # a Trainer dropped without fit() leaves no lock held
        with contextlib.suppress(Exception):
            self.release()


def _make_dirs(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing parents; returns those created, outermost first."""
    missing = []
    d = directory
    while not d.exists() and d != d.parent:
        missing.append(d)
        d = d.parent
    created = []
    try:
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                continue  # another run made it a moment ago
            created.append(d)
    except OSError as e:
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise write_error(directory, e, "run directory") from None
    return created


def acquire(directory: str | os.PathLike) -> RunLock:
    """Create ``directory`` if needed and take its lock, writing this process's pid and host into
    the lock file; a :class:`ConfigError` naming the owner if a live run holds it. A lock a dead
    run left is taken over."""
    directory = Path(directory)
    created = _make_dirs(directory)
    path = directory / LOCK
    text = f"pid {os.getpid()}\nhost {socket.gethostname()}\n".encode()
    deadline = time.monotonic() + _SETTLE_S
    try:
        while True:
            try:
                fd = _open_lock(path, os.O_RDWR | os.O_CREAT)
            except ConfigError:
                raise
            except OSError as e:
                if e.errno == errno.ELOOP:
                    raise ConfigError(
                        f"{path} is a symbolic link; remove it (tessera keeps its run lock there)"
                    ) from None
                raise write_error(path, e, "run lock") from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                owner = _read_owner(fd)
                os.close(fd)
                # a live owner is refused at once; an owner that has not written its pid yet, or
                # another run checking the lock for a moment, gets a second to settle
                if owner.alive() or time.monotonic() > deadline:
                    raise busy_error(directory, owner) from None
                time.sleep(0.02)
                continue
            except OSError as e:
                if e.errno not in _NO_LOCKS:
                    os.close(fd)
                    raise write_error(path, e, "run lock") from None
                # a file system without locks (some network and FUSE mounts): run unguarded, and say so
                log.warning(
                    "%s cannot be locked (%s); a second run on this directory would not be refused", path, e.strerror
                )
            except BaseException:
                os.close(fd)
                raise
            try:
                mine, there = os.fstat(fd), os.stat(path, follow_symlinks=False)
                current = (mine.st_dev, mine.st_ino) == (there.st_dev, there.st_ino)
            except FileNotFoundError:
                current = False
            if not current:  # its owner removed it as we opened it: lock the file that is there now
                os.close(fd)
                continue
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, text, 0)
            except OSError as e:
                os.close(fd)
                raise write_error(path, e, "run lock") from None
            return RunLock(directory, fd, created)
    except BaseException:
        for d in reversed(created):
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


# ------------------------------------------------------------------ paths


def expand_out(given: str, flag: str = "--out") -> Path:
    """``given`` as a path: ``~`` and ``~user`` expanded (a config file's value is not expanded by
    any shell), a NUL byte, an unknown user or an over-long name refused in one line."""
    if "\0" in given:
        raise ConfigError(f"{flag} {given!r} contains a NUL byte, which no file name can hold; name another directory")
    path = given
    if given.startswith("~"):
        path = os.path.expanduser(given)
        if path.startswith("~"):
            user = given[1:].split("/", 1)[0]
            raise ConfigError(
                f"{flag} {given}: there is no user {user!r} whose home ~{user} could be; give the directory's full path"
            )
    encoded = os.fsencode(path)
    if len(encoded) >= PATH_MAX:
        raise ConfigError(
            f"{flag} {given[:60]}... is {len(encoded):,} bytes long, more than the {PATH_MAX - 1:,} a path may have; "
            "name a shorter directory"
        )
    limit = _name_max(Path(path))
    for part in Path(path).parts:
        size = len(os.fsencode(part))
        if size > limit:
            raise ConfigError(
                f"{flag} {given[:60]}...: the name {part[:40]}... is {size} bytes, longer than the {limit} bytes "
                "the file system allows one name; name a shorter directory"
            )
    return Path(path)


def _name_max(path: Path) -> int:
    """The longest name the file system of ``path``'s nearest existing ancestor allows."""
    d = path.absolute()
    while d != d.parent:
        try:
            if d.is_dir():
                break
        except OSError:
            pass
        d = d.parent
    try:
        return int(os.pathconf(d, "PC_NAME_MAX"))
    except (OSError, ValueError):
        return NAME_MAX


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def check_run_path(directory: Path, files: Iterable[str], flag: str = "--out") -> None:
    """Refuse, in one line with the path and the fix, a run directory that cannot hold a run:
    a dangling or looping symbolic link on the way, a file where a directory goes, or one of
    ``files`` (what the run writes there) existing as a directory, FIFO, socket or device."""
    where = f"{flag} {directory}"
    d = directory.absolute()
    ancestors = [*reversed(d.parents), d]
    for p in ancestors[1:]:
        try:
            st = os.lstat(p)
        except FileNotFoundError:
            break  # this and the rest are created
        except OSError as e:
            if e.errno == errno.ENOTDIR:
                raise ConfigError(f"{where} cannot be created: {p.parent} is a file, not a directory") from None
            return  # permissions and the like: the writability check says so
        if stat.S_ISLNK(st.st_mode):
            try:
                st = os.stat(p)
            except FileNotFoundError:
                raise ConfigError(
                    f"{where}: {p} is a symbolic link to {os.readlink(p)}, which does not exist; "
                    "create the link's target or name another directory"
                ) from None
            except OSError as e:
                if e.errno != errno.ELOOP:
                    raise ConfigError(
                        f"{where}: {p} cannot be followed ({e.strerror}); name another directory"
                    ) from None
                raise ConfigError(
                    f"{where}: {p} is a symbolic link that loops ({p} -> {os.readlink(p)}); "
                    "fix the link or name another directory"
                ) from None
        if not stat.S_ISDIR(st.st_mode):
            if p == d:
                raise ConfigError(
                    f"{where} is an existing file, not a directory; name a directory for the run (or remove the file)"
                )
            raise ConfigError(f"{where} cannot be created: {p} is a file, not a directory")
    if not d.is_dir():
        return
    for name in files:
        p = d / name
        try:
            st = os.stat(p)
        except FileNotFoundError:
            continue  # absent, or a dangling link the run's atomic write replaces
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise ConfigError(
                    f"{where}: {p} is a symbolic link that loops; remove it or name another --out"
                ) from None
            raise ConfigError(f"{where}: {p} cannot be read ({e.strerror}); remove it or name another --out") from None
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(
                f"{where}: {p} is {_kind(st.st_mode)}, not a regular file, and the run writes its {name} there; "
                "remove it or name another --out"
            )


# ------------------------------------------------------------------ writes


def write_error(path: str | os.PathLike, e: OSError, what: str) -> TesseraError:
    """The one line for a failed write of ``what`` at ``path``: a full disk says to free space."""
    if e.errno in _FULL:
        return TesseraError(
            f"cannot write the {what} {path}: {e.strerror or 'the disk is full'}; free space on its file system "
            "and continue with --resume (the last checkpoint is kept whole)"
        )
    return TesseraError(f"cannot write the {what} {path} ({e.strerror or e}); check the run directory and its disk")


@contextlib.contextmanager
def writing(path: str | os.PathLike, what: str) -> Iterator[None]:
    """A block writing ``what`` at ``path``: an :class:`OSError` becomes one :class:`TesseraError` line."""
    try:
        yield
    except OSError as e:
        raise write_error(path, e, what) from None


class Appender:
    """Appends whole records to a file: each record goes out in one ``os.write`` (repeated only
    if the kernel takes part of it), and a record the disk cannot take is cut off again, so the
    file only ever holds whole records."""

    def __init__(self, path: Path, what: str) -> None:
        self.path, self.what = path, what
        with writing(path, what):
            self.fd: int | None = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC)

    def write(self, text: str) -> None:
        """Append ``text`` whole, or raise a :class:`TesseraError` leaving the file as it was."""
        assert self.fd is not None
        data = memoryview(text.encode())
        start = os.lseek(self.fd, 0, os.SEEK_END)
        try:
            while data:
                data = data[os.write(self.fd, data) :]
        except OSError as e:
            with contextlib.suppress(OSError):
                os.ftruncate(self.fd, start)
            raise write_error(self.path, e, self.what) from None

    def close(self) -> None:
        """Close the file."""
        fd, self.fd = self.fd, None
        if fd is not None:
            os.close(fd)
