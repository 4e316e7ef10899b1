"""Read-only arrays every rank of a host maps from one file instead of each building its own copy.

:func:`share_arrays` runs ``make()`` on the lowest rank of each host only. That rank writes the
arrays into one file (temporary name, then renamed, under :func:`shared_dir`); once it is there
every rank of the host maps it read-only and wraps each array as a tensor over the mapping, with
no copy; when all have mapped it the writer unlinks the file. The mappings stay valid after the
unlink (Linux frees the pages with the last mapping), so nothing is left behind however the job
ends later. The pages are shared: a host holds one copy however many of its ranks use them.

The tensors must never be written: the pages are mapped without write permission, so an
in-place write kills the process (SIGSEGV) instead of changing what the other ranks read.

Host-mates are found by all-gathering each rank's host name and boot id, so this works for local
processes and, unchanged, for torchrun jobs over many nodes. A rank alone on its host just keeps
what ``make()`` returns. ``TESSERA_SHARED_DIR`` names the directory (default ``/dev/shm`` when
it exists and has room, else the temporary directory); ``off`` gives every rank its own copy.
"""

from __future__ import annotations

import json
import mmap
import os
import secrets
import shutil
import socket
import tempfile
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tessera.comm.group import Comm
from tessera.errors import TesseraError
from tessera.files import atomic_write

ENV = "TESSERA_SHARED_DIR"
_MAGIC = b"TESSHM01"
_ALIGN = 64  # every array starts on a cache line
_STATUS_BYTES = 1024  # room for one rank's status line in the string all-gather

Arrays = dict[str, np.ndarray | torch.Tensor]


def sharing_enabled() -> bool:
    """False when ``TESSERA_SHARED_DIR=off``: every rank then builds and keeps its own arrays."""
    return os.environ.get(ENV, "").strip().lower() != "off"


def shared_dir(nbytes: int = 0) -> Path:
    """Where shared files go: ``$TESSERA_SHARED_DIR``, else ``/dev/shm`` when it exists and has
    room for ``nbytes``, else the temporary directory."""
    env = os.environ.get(ENV, "").strip()
    if env:
        return Path(env).expanduser()
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK | os.X_OK) and shutil.disk_usage(shm).free > nbytes:
        return shm
    return Path(tempfile.gettempdir())


def all_gather_strings(comm: Comm, text: str) -> list[str]:
    """Every rank's ``text`` (UTF-8, at most 1024 bytes), in rank order; no pickling."""
    raw = text.encode()[:_STATUS_BYTES]
    if comm.world == 1:
        return [raw.decode(errors="replace")]
    mine = torch.zeros(_STATUS_BYTES + 2, dtype=torch.uint8)
    mine[:2] = torch.tensor([len(raw) >> 8, len(raw) & 255], dtype=torch.uint8)
    mine[2 : 2 + len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
    out = [torch.empty_like(mine, device=comm.device) for _ in range(comm.world)]
    dist.all_gather(out, mine.to(comm.device))
    texts = []
    for t in out:
        b = t.cpu().numpy().tobytes()
        texts.append(b[2 : 2 + (b[0] << 8 | b[1])].decode(errors="replace"))
    return texts


def host_writers(comm: Comm) -> list[int]:
    """For every rank, the lowest rank on its host (ranks on one host share one file)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    key = f"{socket.gethostname()}|{boot.read_text().strip() if boot.exists() else ''}"
    keys = all_gather_strings(comm, key)
    return [keys.index(k) for k in keys]


def write_arrays(path: Path, arrays: Arrays) -> int:
    """Write ``arrays`` into one file at ``path`` (atomically): a JSON header naming each array's
    dtype, shape and offset, then the raw arrays; returns the file's size in bytes."""
    arrs = {k: np.ascontiguousarray(v.numpy() if isinstance(v, torch.Tensor) else v) for k, v in arrays.items()}
    entries: list[list[Any]] = []  # [name, dtype, shape, offset] per array
    offset = 0
    for name, a in arrs.items():
        entries.append([name, a.dtype.str, list(a.shape), offset])
        offset += -(-a.nbytes // _ALIGN) * _ALIGN
    header = json.dumps(entries).encode()
    start = -(-(len(_MAGIC) + 8 + len(header)) // _ALIGN) * _ALIGN

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            f.write(_MAGIC + len(header).to_bytes(8, "little") + header)
            for (_, _, _, off), a in zip(entries, arrs.values()):
                f.seek(start + off)
                f.write(memoryview(a.reshape(-1)).cast("B"))  # type: ignore[arg-type]  # numpy arrays are buffers
            f.truncate(start + offset)

    atomic_write(path, write)
    return start + offset


def map_arrays(path: Path) -> dict[str, torch.Tensor]:
    """The arrays of a :func:`write_arrays` file as tensors over one read-only mapping of it."""
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    if mm[: len(_MAGIC)] != _MAGIC:
        raise TesseraError(f"{path} is not a tessera shared-array file; remove it and run again")
    n = int.from_bytes(mm[len(_MAGIC) : len(_MAGIC) + 8], "little")
    start = -(-(len(_MAGIC) + 8 + n) // _ALIGN) * _ALIGN
    out = {}
    with warnings.catch_warnings():
        # torch has no read-only tensors and warns about the mapping's; writes are refused by
        # the page protection instead (see the module docstring)
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        for name, dtype, shape, off in json.loads(mm[len(_MAGIC) + 8 : len(_MAGIC) + 8 + n]):
            dt = torch.from_numpy(np.empty(0, np.dtype(dtype))).dtype
            count = int(np.prod(shape, dtype=np.int64))
            flat = (
                torch.frombuffer(mm, dtype=dt, count=count, offset=start + off) if count else torch.empty(0, dtype=dt)
            )
            out[name] = flat.view(shape)
    return out


def _fail(what: str, where: Path, e: BaseException) -> str:
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return (
        f"cannot share the {what} through {where} ({reason}); set {ENV} to a writable directory with room "
        f"on a local file system, or {ENV}=off to give every rank its own copy"
    )


def share_arrays(comm: Comm, make: Callable[[], Arrays], what: str = "arrays") -> dict[str, torch.Tensor]:
    """``make()``'s arrays, built once per host and mapped read-only into each of its ranks.
    Every rank of ``comm`` must call this at the same point (it runs collectives); ``make`` runs
    only on each host's lowest rank (on every rank when sharing is off or a host has one rank)."""

    def own() -> dict[str, torch.Tensor]:
        return {k: v if isinstance(v, torch.Tensor) else torch.from_numpy(v) for k, v in make().items()}

    if comm.world == 1 or not sharing_enabled():
        return own()
    writers = host_writers(comm)
    alone = [writers.count(w) == 1 for w in writers]
    if all(alone):
        return own()
    me, writer = comm.rank, writers[comm.rank]
    status = ""
    if alone[me]:
        arrays = own()
    elif writer == me:
        made = make()
        where = shared_dir(sum(int(np.asarray(v).nbytes) for v in made.values()))
        path = where / f"tessera-{os.getpid()}-{secrets.token_hex(6)}.arrays"
        try:
            write_arrays(path, made)
            status = f"ok:{path}"
        except OSError as e:
            status = "error:" + _fail(what, where, e)
        del made
    statuses = all_gather_strings(comm, status)
    failed = next((s[6:] for s in statuses if s.startswith("error:")), None)
    if failed is None and not alone[me]:
        path = Path(statuses[writer][3:])
        try:
            arrays = map_arrays(path)
        except OSError as e:
            failed = _fail(what, path.parent, e)
    # the writer unlinks only when every rank has mapped (or failed to map) the file
    opened = all_gather_strings(comm, "" if failed is None else "error:" + failed)
    if writer == me and status.startswith("ok:"):
        Path(status[3:]).unlink(missing_ok=True)
    comm.barrier()  # so that on return, on any rank, the file is gone
    failed = failed or next((s[6:] for s in opened if s.startswith("error:")), None)
    if failed is not None:
        raise TesseraError(failed)
    return arrays
