"""Files every layer writes: atomic replacement (a reader sees the old file or the new one, never
half) and the cache folder for partitions, orders and measured choices."""

from __future__ import annotations

import json
import logging
import mmap
import os
import re
import secrets
import stat
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import numpy as np


def _temp_pattern(path: Path) -> re.Pattern[str]:
    # the names atomic_write gives its temporaries: ".<name>." + 8 of [a-z0-9_] + ".tmp" (8 hex
    # digits now; mkstemp's alphabet, which earlier versions used, still matches)
    return re.compile(re.escape(f".{path.name}.") + r"[a-z0-9_]{8}" + re.escape(".tmp"))


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync it, rename it onto ``path``,
    then fsync the directory so the rename itself survives a crash. The file's mode follows the
    umask, as a plain ``open()``'s does. A stop signal at any moment leaves no temporary behind."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp: Path | None = None
    # One try from before the temporary exists: a Stopped raised between its creation and the
    # first statement after it (the signal handler runs at the next bytecode) must remove it too.
    try:
        while True:
            tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
            try:
                # 0o666 and O_EXCL, as open() would create it: the process umask decides the mode
                # (mkstemp's 0600 would leave every output readable by its owner only)
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
                break
            except FileExistsError:
                tmp = None  # another writer's: never ours to remove
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None:
            tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_stale_temps(path: str | Path, min_age_s: float = 0.0) -> list[Path]:
    """Delete the temporary files a killed :func:`atomic_write` of ``path`` left beside it (only
    regular files named by exactly its pattern); returns them. Call it only while nothing else
    writes ``path``, or with ``min_age_s`` longer than any write takes (then only temporaries last
    changed that long ago go: a cache another process may be writing at the same moment)."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    pattern = _temp_pattern(path)
    now = time.time()

    def stale_file(p: Path) -> bool:
        try:
            st = p.lstat()
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode) and now - st.st_mtime >= min_age_s

    stale = [p for p in path.parent.iterdir() if pattern.fullmatch(p.name) and stale_file(p)]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def write_json(path: str | Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON atomically (a NaN or infinity is refused: JSON has none)."""
    atomic_write(path, lambda tmp: tmp.write_text(json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"))


def save_npy(path: str | Path, arr: Any) -> None:
    """Write one array as ``.npy`` atomically (no pickles)."""

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object, so numpy does not append ".npy"
            np.save(f, arr, allow_pickle=False)

    atomic_write(path, write)


def default_cache_dir() -> Path:
    """``$TESSERA_CACHE`` or ``~/.cache/tessera``."""
    env = os.environ.get("TESSERA_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "tessera"


# ------------------------------------------------------------------------------ kept caches
# Every cache file tessera keeps (derived arrays, vertex orders, partitions, generated graphs,
# chunkings) is one entry: its data files, each written atomically, then a small manifest written
# last (atomically too) that names what they were derived from (the entry's key, as its file name
# does) and each file's size and SHA-256. A reader trusts an entry only when the manifest is there,
# names the same key and every file still has its bytes; anything else is computed again, said in
# one line when a file was there but did not hold what it should, and rewritten. Something that is
# not a regular file where a cache file belongs (a named pipe, a directory, a device) is never
# opened, written over or deleted: the run computes without that cache and says so once.

log = logging.getLogger("tessera")
MANIFEST_SUFFIX = ".digest.json"
STALE_TEMP_S = 3600.0  # a cache's temporary this old was left by a killed writer
_said: set[tuple[str, str]] = set()
_said_lock = threading.Lock()

T = TypeVar("T")


def say_once(path: str | Path, message: str) -> None:
    """Log ``cache <path> <message>`` as a warning of the ``tessera`` logger, once per path and
    message in this process (the CLI prints it as one ``tessera: ...`` line on stderr)."""
    key = (str(path), message)
    with _said_lock:
        if key in _said:
            return
        _said.add(key)
    log.warning("cache %s %s", path, message)


def foreign(path: str | Path) -> bool:
    """Whether something other than a regular file is at ``path`` (a named pipe, a directory, a
    device, a socket, or a path through something that is not a directory); False when nothing is
    there. Only ``stat``: never opens it (opening a named pipe waits for a writer)."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return False
    except OSError:  # not a directory on the way, a symlink loop, no permission: not ours to use
        return True
    return not stat.S_ISREG(st.st_mode)


def _open_regular(path: Path) -> int:
    """A read-only descriptor of the regular file ``path``; OSError if it is anything else (opened
    without blocking, so a named pipe swapped in after a check cannot hang the reader)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # not inherited by children (PEP 446)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(f"{path} is not a regular file")
    return fd


def file_digest(path: str | Path) -> tuple[int, str]:
    """``(size, SHA-256 hex)`` of the regular file ``path``'s bytes, read through a read-only map
    and hashed in fixed chunks on every thread (:func:`tessera.digest.digest`): the pages read are
    the page cache's, the same ones a later ``np.load(mmap_mode=...)`` maps."""
    from tessera.digest import digest

    fd = _open_regular(Path(path))
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return 0, digest("file", [np.empty(0, np.uint8)], size=32)
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm:
            view = np.frombuffer(mm, np.uint8)
            try:
                return size, digest("file", [view], size=32)
            finally:
                del view  # the map closes only once no array looks at it
    finally:
        os.close(fd)


def manifest_path(entry: str | Path) -> Path:
    """The manifest of the cache entry named ``entry`` (its stem or its single file)."""
    entry = Path(entry)
    return entry.with_name(entry.name + MANIFEST_SUFFIX)


def _read_manifest(manifest: Path, entry: Path, files: list[Path]) -> dict[str, tuple[int, str]] | None:
    """The manifest's ``{file name: (size, digest)}`` when it is a manifest of ``entry`` naming
    exactly ``files``; None otherwise."""
    fd = _open_regular(manifest)
    with os.fdopen(fd, "rb") as f:
        rec = json.loads(f.read(1 << 20).decode())
    if not isinstance(rec, dict) or rec.get("entry") != entry.name or not isinstance(rec.get("files"), dict):
        return None
    out: dict[str, tuple[int, str]] = {}
    for p in files:
        item = rec["files"].get(p.name)
        if not isinstance(item, dict):
            return None
        size, sha = item.get("bytes"), item.get("sha256")
        if isinstance(size, bool) or not isinstance(size, int) or not isinstance(sha, str):
            return None
        out[p.name] = (size, sha)
    return out if len(rec["files"]) == len(files) else None


def write_manifest(entry: Path, files: list[Path]) -> None:
    """Write the manifest of ``entry`` (the digests of ``files`` as they are now), atomically."""
    items = {}
    for p in files:
        size, sha = file_digest(p)
        items[p.name] = {"bytes": size, "sha256": sha}
    write_json(manifest_path(entry), {"entry": entry.name, "files": items})


def kept(
    entry: Path,
    files: list[Path],
    load: Callable[[], T],
    fits: Callable[[T], bool],
    make: Callable[[], T],
    write: Callable[[T], object],
    what: str = "cache",
) -> T:
    """The value kept in the cache entry ``entry`` (data ``files`` and their manifest): ``load()``'s
    when the manifest vouches for every file's bytes and ``fits`` accepts what was loaded, else
    ``make()``'s, then kept by ``write(value)`` (which writes ``files``, each atomically, or returns
    False to keep nothing) and a new manifest. ``entry``'s name must say what the value is derived from (a digest of its inputs).
    A file that was there but damaged (its bytes changed, truncated, of the wrong shape) is said
    once; a non-regular file where an entry file belongs makes this compute without caching."""
    manifest = manifest_path(entry)
    names = [*files, manifest]
    if any(foreign(p) for p in names):
        for p in names:
            if foreign(p):
                say_once(p, "is not a regular file: not read or written; computed without caching")
        return make()
    state = _check_entry(entry, files, manifest)
    if state is None:
        try:
            value = load()
            if fits(value):
                return value
            state = (files[0], "did not fit what it was derived from; recomputed")
        except Exception:  # a damaged file of any kind is computed again, never a traceback
            state = (files[0], "could not be read; recomputed")
    if state[1]:
        say_once(*state)
    value = make()
    try:
        for p in names:  # what a writer killed mid-write left (older than any write takes)
            remove_stale_temps(p, STALE_TEMP_S)
        manifest.unlink(missing_ok=True)  # a reader meanwhile sees no manifest: computes, quietly
        if write(value) is not False:  # False: not worth keeping (a small graph)
            write_manifest(entry, files)
    except OSError as err:
        warnings.warn(f"could not keep the {what} at {entry}: {err}", RuntimeWarning, stacklevel=3)
    return value


def _check_entry(entry: Path, files: list[Path], manifest: Path) -> tuple[Path, str] | None:
    """None when the entry's manifest vouches for every file; else the file at fault and what to
    say ("" to say nothing: no entry yet, or one a run left without its manifest)."""
    if not manifest.exists() or not all(p.exists() for p in files):
        return files[0], ""
    try:
        sums = _read_manifest(manifest, entry, files)
    except (OSError, ValueError):
        sums = None
    if sums is None:
        return manifest, "could not be read; recomputed"
    for p in files:
        try:
            ok = file_digest(p) == sums[p.name]
        except OSError:
            ok = False
        if not ok:
            return p, "did not match its digest; recomputed"
    return None


def read_json_cache(path: Path, valid: Callable[[Any], Any]) -> tuple[Any, bool]:
    """``(valid(obj), True)`` for the JSON file at ``path``: ``valid`` returns what to use of the
    parsed object, or None to reject all of it (a note, once). ``(None, False)`` when something
    other than a regular file is there: then write nothing (said once). ``(None, True)`` when the
    file is absent or rejected: compute, and write the file anew."""
    if foreign(path):
        say_once(path, "is not a regular file: not read or written; computed without caching")
        return None, False
    if not path.exists():
        return None, True
    try:
        with os.fdopen(_open_regular(path), "rb") as f:
            obj = json.loads(f.read().decode())
        got = valid(obj)
    except (OSError, ValueError):
        got = None
    if got is None:
        say_once(path, "could not be read or has the wrong shape; recomputed")
    return got, True
