"""Which library runs a full-graph layer's dense products on this CPU: MKL or oneDNN.

torch 2.13's CPU ``mm`` goes to MKL, which picks its kernels by CPU vendor; oneDNN (behind
``torch.ops.mkldnn._linear_pointwise``) picks them by instruction set. MKL writes into a given
output, so its products land in kept :mod:`~tessera.workspace` blocks; oneDNN's op returns a fresh
tensor, which glibc maps anew and page-faults in on every step. Which costs less depends on the
core: on Intel CPUs MKL is as fast as oneDNN (``synthetic:arxiv`` 169 k x 128 times 128 x 256, 2
threads: 38.9 ms into a kept block against oneDNN's 76.5 ms under glibc), on an AMD EPYC Zen 5
oneDNN ran the same products about twice as fast as MKL, and on an AMD EPYC Zen 4 MKL into a kept
block was as fast as oneDNN's fresh outputs (``benchmarks/RESULTS.md``). So Intel CPUs use MKL
without measuring; elsewhere one product of a training step's size is timed both ways, fresh
output included, and oneDNN is used only when it is clearly faster. The decision is kept on disk
(``$TESSERA_CACHE/gemm.json``) per CPU model, torch version, thread count and preloaded allocator,
so every process on the machine, every rank of a run included, uses the same library and gets the
same arithmetic.
"""

from __future__ import annotations

import json
import os
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Literal

import torch

from tessera import workspace
from tessera.files import default_cache_dir, write_json

GemmPath = Literal["mkl", "onednn"]
_LP = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
_VERSION = 1
# The probe's output (40,000 x 256 float32, 41 MB) is above glibc's largest mmap threshold (32 MiB),
# so a fresh output is mapped and faulted in as a training step's are.
_PROBE = (40_000, 128, 256)
_REPS = 3
# oneDNN must beat MKL by this factor: a near tie goes to the kept blocks, which also keep a
# steady step from mapping new memory.
_MARGIN = 0.9
_lock = threading.Lock()
_chosen: dict[str, GemmPath] = {}
_forced: list[GemmPath] = []
_usable: list[bool] = []


def onednn_usable() -> bool:
    """Whether this torch build has oneDNN's linear op and it computes ``a @ w.T`` (checked once)."""
    if not _usable:
        _usable.append(_probe_onednn())
    return _usable[0]


def _probe_onednn() -> bool:
    if _LP is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        # no random numbers: drawing them would move torch's generator and so every later seed
        a, w = torch.arange(15.0).view(5, 3).sin(), torch.arange(12.0).view(4, 3).cos()
        return bool(torch.allclose(_LP(a, w, None, "none", [], ""), a @ w.t(), rtol=1e-5, atol=1e-6))
    except (RuntimeError, NotImplementedError):
        return False


def onednn_product(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ w.T + b`` on oneDNN, into a fresh tensor."""
    return _LP(a, w, b, "none", [], "")


def cpu_model() -> str:
    """The CPU's vendor and model name from ``/proc/cpuinfo`` (empty where there is none)."""
    vendor = model = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "vendor_id" and not vendor:
                    vendor = value.strip()
                elif key.strip() == "model name" and not model:
                    model = value.strip()
                if vendor and model:
                    break
    except OSError:
        pass
    return f"{vendor} {model}".strip()


def cache_file() -> Path:
    """Where the decision is kept: ``$TESSERA_CACHE/gemm.json``."""
    return default_cache_dir() / "gemm.json"


def _key() -> str:
    # A preloaded allocator that keeps freed memory mapped (jemalloc) removes the fresh output's
    # page faults, which is most of what the measurement weighs, so it is part of the key.
    preload = " ".join(Path(p).name for p in os.environ.get("LD_PRELOAD", "").split())
    return f"v{_VERSION}|{cpu_model()}|torch {torch.__version__}|t{torch.get_num_threads()}|preload {preload}"


def gemm_path() -> GemmPath:
    """``"mkl"`` (products into workspace blocks) or ``"onednn"`` (fresh outputs) for this CPU,
    torch and thread count: forced, remembered, read from disk, or measured and written there."""
    if _forced:
        return _forced[-1]
    if not onednn_usable():
        return "mkl"
    key = _key()
    with _lock:
        if key not in _chosen:
            _chosen[key] = _decide(key)
        return _chosen[key]


def _decide(key: str) -> GemmPath:
    if cpu_model().startswith("GenuineIntel"):
        return "mkl"
    try:
        disk = json.loads(cache_file().read_text())
    except (OSError, ValueError):
        disk = {}
    disk = disk if isinstance(disk, dict) else {}
    if disk.get(key) in ("mkl", "onednn"):
        return disk[key]
    mkl_s, onednn_s = measure()
    choice: GemmPath = "onednn" if onednn_s < _MARGIN * mkl_s else "mkl"
    try:
        write_json(cache_file(), {**disk, key: choice})
    except OSError:
        pass  # a read-only cache: decide again next time
    return choice


def measure(rows: int = _PROBE[0], k: int = _PROBE[1], n: int = _PROBE[2]) -> tuple[float, float]:
    """Median seconds of one ``rows x k`` times ``k x n`` product on MKL into a kept block and on
    oneDNN into a fresh output, alternating, after one untimed call of each."""
    # deterministic operands: no draw from torch's generator
    a = torch.arange(rows * k, dtype=torch.float32).remainder_(7.0).view(rows, k)
    w = torch.arange(n * k, dtype=torch.float32).remainder_(5.0).view(n, k)
    out = workspace.empty((rows, n))

    def run_mkl() -> None:
        torch.mm(a, w.t(), out=out)

    def run_onednn() -> None:
        onednn_product(a, w)  # the output is dropped at once, as a step drops its own

    times: dict[str, list[float]] = {"mkl": [], "onednn": []}
    for rep in range(_REPS + 1):
        for name, fn in (("mkl", run_mkl), ("onednn", run_onednn)):
            t0 = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - t0)
    return statistics.median(times["mkl"]), statistics.median(times["onednn"])


@contextmanager
def forced(path: GemmPath) -> Iterator[None]:
    """Within this block, :func:`gemm_path` answers ``path`` (tests and benchmarks)."""
    if path not in ("mkl", "onednn"):
        raise ValueError(f"unknown GEMM path {path!r}; choose mkl or onednn")
    _forced.append(path)
    try:
        yield
    finally:
        _forced.pop()
