"""Exception types: every user-facing problem is a ``TesseraError`` with a message that names it;
and the one line an ``OSError`` becomes."""

from __future__ import annotations

import errno
import os


class TesseraError(Exception):
    """Base class for errors caused by input the user can fix (the CLI prints one line, exits 2)."""


class GraphError(TesseraError, ValueError):
    """A graph's structure, features, labels or masks are inconsistent."""


class DatasetError(TesseraError):
    """A dataset spec, file or directory could not be read."""


class UnsafePickleError(DatasetError):
    """A pickle tried to load a type outside the allow-list."""


class ConfigError(TesseraError):
    """A command-line flag or config-file value is invalid."""


class DistributedError(TesseraError):
    """A distributed job lost a rank or timed out in a collective (the CLI exits 3, not 2: the
    input may be fine). Bad partition files are a :class:`DatasetError`."""


#: what to check or change for an OSError of each errno (the clause after the path and reason)
_OS_HINTS = {
    errno.ENOENT: "check that the path exists",
    errno.EACCES: "check its permissions, or choose another path",
    errno.EPERM: "check its permissions, or choose another path",
    errno.EROFS: "the filesystem is read-only; choose another path",
    errno.ENOSPC: "the disk is full; free some space or choose another path",
    errno.EDQUOT: "the disk quota is used up; free some space or choose another path",
    errno.ENOTDIR: "a part of the path is a file, not a directory; choose another path",
    errno.EISDIR: "it is a directory; give a file's path",
    errno.ENAMETOOLONG: "a name in it is too long; choose a shorter path",
    errno.ELOOP: "too many symbolic links (a link loop?); fix the link or choose another path",
    errno.EEXIST: "it exists already; remove it or choose another path",
    errno.ENOTEMPTY: "the directory is not empty; empty it or choose another path",
    errno.EMFILE: "too many open files; raise the limit (ulimit -n)",
    errno.ENFILE: "too many open files on this system; close some or raise the limit",
    errno.EIO: "the device reported an I/O error; check the disk",
    errno.EXDEV: "the two paths are on different filesystems; choose paths on one",
}


def os_error_line(e: OSError) -> str:
    """One line for an operating-system error: the path(s) it names, the reason and what to do."""
    reason = e.strerror or str(e) or type(e).__name__
    paths = [os.fsdecode(p) for p in (e.filename, e.filename2) if p is not None and not isinstance(p, int)]
    if len(paths) == 2 and _is_temporary_of(paths[0], paths[1]):
        paths = paths[1:]  # an atomic write's rename: the path the user named is the destination
    where = " -> ".join(paths)
    code = e.errno or 0
    if code == errno.EEXIST and len(paths) == 1 and os.path.lexists(paths[0]) and not os.path.isdir(paths[0]):
        # makedirs through an existing file: the file is in the way, not "exists already"
        reason, code = "is a file, not a directory", errno.ENOTDIR
    hint = _OS_HINTS.get(code, "check the path, its permissions and the disk")
    return f"{where}: {reason} ({hint})" if where else f"{reason} ({hint})"


def _is_temporary_of(tmp: str, path: str) -> bool:
    """Whether ``tmp`` is named as tessera's atomic writes name a temporary beside ``path``."""
    name = os.path.basename(tmp)
    return os.path.dirname(tmp) == os.path.dirname(path) and name.startswith(f".{os.path.basename(path)}.")
