"""Files every layer writes: atomic replacement (a reader sees the old file or the new one, never
half) and the cache folder for partitions, orders and measured choices."""

from __future__ import annotations

import json
import os
import re
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _temp_pattern(path: Path) -> re.Pattern[str]:
    # the names atomic_write gives its temporaries: ".<name>." + 8 of [a-z0-9_] + ".tmp" (8 hex
    # digits now; mkstemp's alphabet, which earlier versions used, still matches)
    return re.compile(re.escape(f".{path.name}.") + r"[a-z0-9_]{8}" + re.escape(".tmp"))


def _new_temp(path: Path) -> Path:
    """Create an empty temporary file beside ``path``, named for :func:`_temp_pattern`."""
    while True:
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        try:
            # 0o666 and O_EXCL, as open() would create it: the process umask decides the mode
            # (mkstemp's 0600 would leave every output readable by its owner only)
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return tmp


def atomic_write(path: str | Path, write: Callable[[Path], object]) -> None:
    """Call ``write(tmp)`` on a temporary file beside ``path``, fsync it, rename it onto ``path``,
    then fsync the directory so the rename itself survives a crash. The file's mode follows the
    umask, as a plain ``open()``'s does."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = _new_temp(path)
    try:
        write(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def remove_stale_temps(path: str | Path) -> list[Path]:
    """Delete the temporary files a killed :func:`atomic_write` of ``path`` left beside it (only
    names of exactly its pattern); returns them. Call it only while nothing else writes ``path``."""
    path = Path(path)
    if not path.parent.is_dir():
        return []
    pattern = _temp_pattern(path)
    stale = [p for p in path.parent.iterdir() if pattern.fullmatch(p.name) and not p.is_dir()]
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
