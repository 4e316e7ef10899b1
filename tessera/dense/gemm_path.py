"""Which library runs a full-graph layer's dense products on this CPU, and into what memory.

Three ways to compute ``x W^T`` for an ``N x K`` float32 ``x``:

- ``mkl``: torch's ``mm(out=)``, MKL writing into a kept :mod:`~tessera.workspace` block.
- ``onednn_kept``: oneDNN writing into a kept block, zeroed, through its in-place 1x1
  convolution with an add post-op (``torch.ops.mkldnn._convolution_pointwise_.binary``) over
  channels-last views of the row-major matrices (``N x K`` as a ``1 x K x N x 1`` image whose
  pixels are the rows). ``linear_add_`` adds into its accumulator with no zeroing.
- ``onednn``: oneDNN's linear op (``torch.ops.mkldnn._linear_pointwise``), a fresh output that
  glibc maps anew and page-faults in on every step.

MKL picks its kernels by CPU vendor, oneDNN by instruction set. On Intel CPUs MKL into a kept
block is as fast as oneDNN and is used without measuring. Elsewhere the fastest path depends on the
CPU (oneDNN into a kept block can beat MKL on every product of a step), so two products of a
training step's size are timed all three ways once, fresh output included; a fresh output is taken
only when it is clearly faster than the best kept one. The decision is kept on disk
(``$TESSERA_CACHE/gemm.json``) per CPU (vendor, name, family and model), torch version, thread
count and preloaded allocator, so every process on the machine uses the same library and gets the
same arithmetic. The ranks of a distributed run, which may all start before any decision is on
disk and would then each measure (with each other's load), take rank 0's (:func:`adopt`).

The fused nodes (:mod:`~tessera.dense.linear_act`, :mod:`~tessera.dense.dropout_linear`) multiply
row chunks of a few megabytes, where the libraries rank differently (MKL can win on chunks on an
AVX2-only CPU and oneDNN on an AVX-512 one, whatever the whole products' path). So the library
for chunks (:func:`chunk_library`) is a second decision, measured on a fused layer's chunk shapes and
kept beside the first. Figures: ``docs/design/gemm-library-path.md``.
"""

from __future__ import annotations

import functools
import os
import statistics
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal, TypeVar, cast

import torch

from tessera import workspace
from tessera.files import default_cache_dir, read_json_cache, write_json
from tessera.memo import tuning

GemmPath = Literal["mkl", "onednn_kept", "onednn"]
PATHS: tuple[GemmPath, ...] = ("mkl", "onednn_kept", "onednn")
ChunkLibrary = Literal["mkl", "onednn"]
CHUNK_LIBRARIES: tuple[ChunkLibrary, ...] = ("mkl", "onednn")
_MKLDNN = getattr(torch.ops, "mkldnn", None)
# torch ops, or None where this build lacks them (then onednn_usable() is False)
_LP: Any = getattr(_MKLDNN, "_linear_pointwise", None)
_CONV_: Any = getattr(getattr(_MKLDNN, "_convolution_pointwise_", None), "binary", None)
_BF16_CHECK = getattr(_MKLDNN, "_is_mkldnn_bf16_supported", None)
_VERSION = 2
# The probe: a layer's forward-like and input-gradient-like products, 70,000 rows. Both outputs
# (72 and 36 MB) are above glibc's largest mmap threshold (32 MiB), so a fresh output is mapped
# and faulted in as a training step's are.
_PROBE = ((70_000, 128, 256), (70_000, 256, 128))
_REPS = 3
# The chunk probe: a fused layer's 4 MB chunks (linear_act.CHUNK_BYTES of a 256-wide output): the
# forward (4096 x 128 times 128 x 256) and input-gradient (4096 x 256 times 256 x 128) products, and
# a weight gradient (256 x 128 over 4096 rows)
_CHUNK_PROBE = ((4096, 128, 256), (4096, 256, 128))
_CHUNK_WEIGHT_PROBE = (4096, 256, 128)
_CHUNK_REPS = 9
# A fresh output must beat the best kept one by this factor: a near tie goes to the kept blocks,
# which also keep a steady step from mapping new memory.
_MARGIN = 0.9
_lock = threading.Lock()
_Choice = TypeVar("_Choice", bound=str)


@functools.cache
def onednn_usable() -> bool:
    """Whether this torch build has oneDNN's linear and in-place convolution ops and both compute
    ``a @ w.T + b`` (checked once)."""
    if _LP is None or _CONV_ is None or not torch.backends.mkldnn.is_available():
        return False
    try:
        # no random numbers: drawing them would move torch's generator and so every later seed
        a, w, b = torch.arange(15.0).view(5, 3).sin(), torch.arange(12.0).view(4, 3).cos(), torch.arange(4.0)
        want = a @ w.t() + b
        got = [_LP(a, w, b, "none", [], ""), onednn_add_(torch.zeros(5, 4), a, w, b)]
        pairs = [(t, want) for t in got] + [(onednn_weight_grad(want, a), want.t() @ a)]
        return all(bool(torch.allclose(t, ref, rtol=1e-5, atol=1e-5)) for t, ref in pairs)
    except (RuntimeError, NotImplementedError):
        return False


@functools.cache
def native_bf16_gemm() -> bool:
    """Whether this CPU's oneDNN multiplies bfloat16 at full speed (AVX-512 or AMX), as torch
    decides; True where torch has no such check (its bfloat16 product is then all there is)."""
    return True if _BF16_CHECK is None else bool(_BF16_CHECK())


def onednn_product(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ w.T + b`` on oneDNN, into a fresh tensor."""
    return _LP(a, w, b, "none", [], "")


def _rows_as_pixels(t: torch.Tensor) -> torch.Tensor:
    """A row-major ``N x K`` matrix as the channels-last ``1 x K x N x 1`` image it already is."""
    return t.view(1, t.shape[0], 1, t.shape[1]).permute(0, 3, 1, 2)


def onednn_add_(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``out += a @ w.T + b`` on oneDNN, in ``out`` itself (all contiguous; ``a`` and ``out`` with
    at least 2 rows and 2 columns, so that their channels-last views are unambiguous)."""
    o, k = w.shape
    _CONV_(
        _rows_as_pixels(out), _rows_as_pixels(a), w.view(o, k, 1, 1), b, [0, 0], [1, 1], [1, 1], 1, "add", 1.0,
        None, [], None,
    )  # fmt: skip
    return out


def onednn_weight_grad(d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``d.T @ x`` on oneDNN, into a fresh tensor: the weight gradient of the 1x1 convolution
    :func:`onednn_add_` runs (``d`` and ``x`` contiguous, with the same rows, every dimension above 1)."""
    o, k = d.shape[1], x.shape[1]
    shape_only = torch.zeros((), dtype=x.dtype).expand(o, k, 1, 1)  # the backward reads only its shape
    grads = torch.ops.aten.convolution_backward(
        _rows_as_pixels(d), _rows_as_pixels(x), shape_only, None, [1, 1], [0, 0], [1, 1], False, [0, 0], 1,
        [False, True, False],
    )  # fmt: skip
    return grads[1].view(o, k)


def kept_onednn_fits(a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether :func:`onednn_add_` takes ``a`` and ``w``: contiguous, and every dimension above 1
    (a dimension of 1 makes the channels-last views ambiguous)."""
    return a.is_contiguous() and w.is_contiguous() and min(a.shape[0], a.shape[1], w.shape[0]) > 1


@functools.cache
def cpu_model() -> str:
    """This CPU's :func:`describe_cpu` from ``/proc/cpuinfo`` (empty where there is none; read
    once: every product asks for its path)."""
    try:
        with open("/proc/cpuinfo") as f:
            return describe_cpu(f)
    except OSError:
        return ""


def describe_cpu(cpuinfo: Iterable[str]) -> str:
    """The first processor's vendor, model name, family and model number from ``/proc/cpuinfo``'s lines."""
    # The name alone is not enough: one model name can cover CPUs of different generations (AVX2
    # only or AVX-512), whose fastest GEMM paths differ.
    wanted = {"vendor_id": "", "model name": "", "cpu family": "", "model": ""}
    for line in cpuinfo:
        key, _, value = line.partition(":")
        key = key.strip()
        if key in wanted and not wanted[key]:
            wanted[key] = value.strip()
        if all(wanted.values()):
            break
    name = f"{wanted['vendor_id']} {wanted['model name']}".strip()
    numbers = f"family {wanted['cpu family']} model {wanted['model']}" if wanted["cpu family"] else ""
    return f"{name} {numbers}".strip()


def cache_file() -> Path:
    """Where the decision is kept: ``$TESSERA_CACHE/gemm.json``."""
    return default_cache_dir() / "gemm.json"


def _key() -> str:
    # A preloaded allocator that keeps freed memory mapped (jemalloc) removes the fresh output's
    # page faults, which is most of what the measurement weighs, so it is part of the key.
    preload = " ".join(Path(p).name for p in os.environ.get("LD_PRELOAD", "").split())
    return f"v{_VERSION}|{cpu_model()}|torch {torch.__version__}|t{torch.get_num_threads()}|preload {preload}"


def gemm_path() -> GemmPath:
    """``"mkl"``, ``"onednn_kept"`` (both into workspace blocks) or ``"onednn"`` (fresh outputs) for
    this CPU, torch, thread count and allocator: forced, or :func:`decided`."""
    forced = tuning.forced_gemm_path
    return decided() if forced is None else cast(GemmPath, forced)


def decided() -> GemmPath:
    """This CPU's path whatever :func:`forced` says: remembered, read from disk, or measured and
    written there."""
    return cast(GemmPath, _remembered(tuning.gemm_paths, _decide))


def chunk_library() -> ChunkLibrary:
    """``"mkl"`` or ``"onednn"``: the library for the fused nodes' row-chunk products on this CPU,
    torch, thread count and allocator: forced, or :func:`decided_chunks`."""
    forced = tuning.forced_chunk_library
    return decided_chunks() if forced is None else cast(ChunkLibrary, forced)


def decided_chunks() -> ChunkLibrary:
    """This CPU's chunk library whatever :func:`forced_chunks` says: remembered, read from disk, or
    measured and written there."""
    return cast(ChunkLibrary, _remembered(tuning.chunk_libraries, _decide_chunks))


def _remembered(memo: dict[str, str], decide: Callable[[str], str]) -> str:
    """``memo``'s answer for this CPU, torch, thread count and allocator, from ``decide`` the first
    time (MKL, without deciding, where oneDNN is not usable)."""
    if not onednn_usable():
        return "mkl"
    key = _key()
    with _lock:
        if key not in memo:
            memo[key] = decide(key)
        return memo[key]


def adopt(path: GemmPath, chunks: ChunkLibrary | None = None) -> None:
    """Answer ``path`` (and ``chunks`` for row chunks, when given) from now on for this process's
    CPU, torch, thread count and allocator (a distributed run's ranks adopt rank 0's decisions)."""
    _check(path)
    if chunks is not None:
        _check(chunks, CHUNK_LIBRARIES, "chunk library")
    with _lock:
        tuning.gemm_paths[_key()] = path
        if chunks is not None:
            tuning.chunk_libraries[_key()] = chunks


def _check(value: str, allowed: tuple[str, ...] = PATHS, what: str = "GEMM path") -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; choose {', '.join(allowed)}")


def _decide(key: str) -> GemmPath:
    if cpu_model().startswith("GenuineIntel"):
        return "mkl"
    return _kept_on_disk(key, PATHS, lambda: choose(measure()))


def _decide_chunks(key: str) -> ChunkLibrary:
    if cpu_model().startswith("GenuineIntel"):
        return "mkl"
    return _kept_on_disk(f"{key}|chunks", CHUNK_LIBRARIES, lambda: choose_chunks(measure_chunks()))


def _kept_on_disk(key: str, allowed: tuple[_Choice, ...], decide: Callable[[], _Choice]) -> _Choice:
    """The decision kept on disk under ``key``, else ``decide()``'s, written there."""
    path = cache_file()
    got, ours = read_json_cache(path, lambda obj: obj if isinstance(obj, dict) else None)
    disk = got or {}
    if disk.get(key) in allowed:
        return disk[key]
    choice = decide()
    if ours:
        try:
            write_json(path, {**disk, key: choice})
        except OSError:
            pass  # a read-only cache: decide again next time
    return choice


def choose(seconds: dict[GemmPath, float]) -> GemmPath:
    """The faster kept path, unless the fresh output beats it by more than the margin."""
    kept: GemmPath = min(("mkl", "onednn_kept"), key=lambda p: seconds[p])
    return "onednn" if seconds["onednn"] < _MARGIN * seconds[kept] else kept


def measure(shapes: tuple[tuple[int, int, int], ...] = _PROBE) -> dict[GemmPath, float]:
    """Seconds each way for one ``rows x k`` times ``k x n`` product of each of ``shapes``: the
    median over repetitions, summed over the shapes."""
    total: dict[GemmPath, float] = dict.fromkeys(PATHS, 0.0)
    for shape in shapes:
        for p, t in _time_shape(*shape).items():
            total[p] += t
    return total


def _time_shape(rows: int, k: int, n: int) -> dict[GemmPath, float]:
    """Median seconds of one product each way (the kept oneDNN way zeroing its block first, as a
    product does), the ways in turn, after one untimed round."""
    a, w = _probe_operand(rows, k), _probe_operand(n, k)
    out = workspace.empty((rows, n))
    runs: dict[GemmPath, Callable[[], torch.Tensor]] = {
        "mkl": lambda: torch.mm(a, w.t(), out=out),
        "onednn_kept": lambda: onednn_add_(out.zero_(), a, w),
        "onednn": lambda: onednn_product(a, w),  # dropped at once, as a step drops its own
    }
    return _medians(runs, _REPS)


def _medians(runs: Mapping[_Choice, Callable[[], object]], reps: int) -> dict[_Choice, float]:
    """Median seconds of each of ``runs`` over ``reps`` rounds, the runs in turn within a round
    (so a slow spell of a shared machine falls on all of them), after one untimed round."""
    times: dict[_Choice, list[float]] = {name: [] for name in runs}
    for rep in range(reps + 1):
        for name, fn in runs.items():
            t0 = time.perf_counter()
            fn()
            if rep:
                times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def choose_chunks(seconds: dict[ChunkLibrary, float]) -> ChunkLibrary:
    """The library that ran the chunk probe faster (a tie goes to MKL)."""
    return "onednn" if seconds["onednn"] < seconds["mkl"] else "mkl"


def measure_chunks() -> dict[ChunkLibrary, float]:
    """Seconds each library takes for the chunk probe's products (the oneDNN forward zeroing its
    block first, as a chunk product does): medians over repetitions, summed over the shapes."""
    shapes: list[dict[ChunkLibrary, Callable[[], torch.Tensor]]] = []
    for rows, k, n in _CHUNK_PROBE:
        a, w, out = _probe_operand(rows, k), _probe_operand(n, k), torch.empty((rows, n))

        def mkl(a: torch.Tensor = a, w: torch.Tensor = w, out: torch.Tensor = out) -> torch.Tensor:
            return torch.mm(a, w.t(), out=out)

        def onednn(a: torch.Tensor = a, w: torch.Tensor = w, out: torch.Tensor = out) -> torch.Tensor:
            return onednn_add_(out.zero_(), a, w)

        shapes.append({"mkl": mkl, "onednn": onednn})
    rows, o, k = _CHUNK_WEIGHT_PROBE
    d, x, gw = _probe_operand(rows, o), _probe_operand(rows, k), torch.zeros((o, k))
    shapes.append({"mkl": lambda: gw.addmm_(d.t(), x), "onednn": lambda: gw.add_(onednn_weight_grad(d, x))})
    total: dict[ChunkLibrary, float] = dict.fromkeys(CHUNK_LIBRARIES, 0.0)
    for runs in shapes:
        for lib, t in _medians(runs, _CHUNK_REPS).items():
            total[lib] += t
    return total


def _probe_operand(rows: int, cols: int) -> torch.Tensor:
    # deterministic: no draw from torch's generator
    return torch.arange(rows * cols, dtype=torch.float32).remainder_(7.0).view(rows, cols)


@contextmanager
def forced_chunks(library: ChunkLibrary) -> Iterator[None]:
    """Within this block, :func:`chunk_library` answers ``library`` (tests and benchmarks)."""
    _check(library, CHUNK_LIBRARIES, "chunk library")
    with tuning.forcing("forced_chunk_library", library):
        yield


@contextmanager
def forced(path: GemmPath) -> Iterator[None]:
    """Within this block, :func:`gemm_path` answers ``path`` (tests and benchmarks)."""
    _check(path)
    with tuning.forcing("forced_gemm_path", path):
        yield
