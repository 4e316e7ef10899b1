"""``backend="auto"``: pick the aggregation backend per (matrix, width, direction).

A cost model ranks the registered backends (:meth:`Backend.cost`: bytes moved over the backend's
efficiency, plus its fixed cost per call); when the problem is big enough for the choice to
matter, a short measured trial on the first real input confirms the winner. Decisions are kept in
memory per matrix and, for matrices with a fingerprint (whole graphs), on disk (``$TESSERA_CACHE``
or ``~/.cache/tessera``, file ``kernels.json``), so a later run on the same graph and thread count
reuses them without measuring. The choice does not depend on ``reduce``: mean is a row scaling
applied after the summing kernel.
"""

from __future__ import annotations

import json
import math
import statistics
import threading
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from tessera import workspace
from tessera.backends.base import available_backends, get_backend
from tessera.errors import ConfigError
from tessera.files import atomic_write, default_cache_dir, foreign, read_json_cache
from tessera.graph.csr import CSRStructure
from tessera.memo import PlanCache, tuning

_CACHE_VERSION = 2
_TRIAL_REPS = 3
# Below this many gathered floats (nnz x width) a measured trial costs more than any choice can
# save over a whole run, so the cost model alone decides.
_TRIAL_MIN_WORK = 4_000_000
# A backend this many times slower than the fastest in a timed round runs no more rounds, and no
# round starts once the timed rounds have taken the budget (seconds): a choice between backends
# this far apart, or on calls this long, is settled by the rounds already run.
_TRIAL_OUT = 2.0
_TRIAL_BUDGET_S = 2.0
# A backend that keeps a plan of the matrix's entries is chosen only when it beats the fastest
# one that keeps none by more than this share: a trial's times leave out the plan's memory and
# its build on the first product (for a large graph, most of a second and hundreds of megabytes),
# and differences under it are a shared machine's noise (docs/design/backend-selection.md).
_PLAN_MARGIN = 0.05
_DIRECTIONS = ("forward", "backward")
_lock = threading.Lock()
_memo = PlanCache()  # per matrix: decision key -> backend name


class _State(threading.local):
    modelled_only = False  # decide undecided products by the model, unrecorded


_state = _State()


@contextmanager
def modelled_only() -> Iterator[None]:
    """Within this block, a product with no decision yet runs the cost model's favourite without a
    measured trial and without recording it (the planner's trial steps: a backend trial on a
    candidate that may be discarded would be time spent on nothing; a later product outside the
    block decides as usual)."""
    before = _state.modelled_only
    _state.modelled_only = True
    try:
        yield
    finally:
        _state.modelled_only = before


@contextmanager
def forced(name: str) -> Iterator[None]:
    """Within this block, :func:`choose` answers backend ``name`` for every product (tests and
    benchmarks)."""
    get_backend(name)  # an unknown name is refused here
    with tuning.forcing("forced_backend", name):
        yield


def cache_file() -> Path:
    """Where measured decisions are kept: ``$TESSERA_CACHE/kernels.json`` (default ``~/.cache/tessera``)."""
    return default_cache_dir() / "kernels.json"


def decision_key(
    matrix: CSRStructure, width: int, weighted: bool, heads: int, direction: str, dtype: torch.dtype = torch.float32
) -> str:
    """The cache key of one decision (the thread count is part of it: the best kernel depends on it;
    so is a storage dtype other than float32, which moves another number of bytes)."""
    stored = "" if dtype in (torch.float32, torch.float64) else f"|{str(dtype).removeprefix('torch.')}"
    return (
        f"v{_CACHE_VERSION}|{matrix.fingerprint()}|w{width}|h{heads}|"
        f"{'weighted' if weighted else 'plain'}|{direction}|t{torch.get_num_threads()}{stored}"
    )


def _valid_entry(entry: Any) -> bool:
    """Whether ``entry`` is a decision as :func:`record` writes it: a dict whose ``choice`` is a
    name and whose ``seconds`` map names to finite non-negative numbers (other notes are free)."""
    if not isinstance(entry, dict) or not isinstance(entry.get("choice"), str):
        return False
    seconds = entry.get("seconds")
    return isinstance(seconds, dict) and all(
        isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t) and t >= 0
        for t in seconds.values()
    )


def _decisions(data: Any) -> dict[str, Any] | None:
    """``data`` when it is a kernels.json of decisions (a dict of valid entries), else None."""
    if not isinstance(data, dict) or not all(_valid_entry(e) for e in data.values()):
        return None
    return data


def _read_disk() -> dict[str, Any]:
    """The decisions in :func:`cache_file`: a file that is not JSON, or JSON of another shape (a
    list, entries of the wrong types), is said once and rewritten empty; something other than a
    regular file there (a named pipe, a directory) is never opened (:func:`tessera.files.read_json_cache`)."""
    path = cache_file()
    data, writable = read_json_cache(path, _decisions)
    if data is None and writable and path.exists():
        _store({})
    return data if data is not None else {}


def _store(data: dict[str, Any]) -> None:
    if foreign(cache_file()):  # not ours: left alone (said when it was read)
        return
    try:
        atomic_write(cache_file(), lambda tmp: tmp.write_text(json.dumps(data, indent=1, sort_keys=True)))
    except OSError as e:  # a read-only home must not stop training
        warnings.warn(f"could not store the kernel choice in {cache_file()}: {e}", RuntimeWarning, stacklevel=4)


def _write_disk(key: str, entry: dict[str, Any]) -> None:
    with _lock:
        data = _read_disk()
        data[key] = entry
        _store(data)


def candidates(x: torch.Tensor) -> list[str]:
    """Backends able to run this input."""
    return [name for name in available_backends() if get_backend(name).supports(x)]


def auto_candidates(x: torch.Tensor) -> list[str]:
    """The backends ``auto`` chooses among for this input: those able to run it that take part in
    the choice on its device (:attr:`~tessera.backends.base.Backend.auto_devices`): one that runs
    on the CPU only when named keeps the CPU's choices, and their trials, as they are."""
    device = x.device.type

    def takes_part(name: str) -> bool:
        devices = get_backend(name).auto_devices
        return devices is None or device in devices

    return [n for n in candidates(x) if takes_part(n)]


def model_cost(name: str, matrix: CSRStructure, width: int, weighted: bool, transposed: bool) -> float:
    """Cost-model estimate of one product on backend ``name`` (relative seconds)."""
    return float(get_backend(name).cost(matrix, width, transposed, weighted))


def choose(matrix: CSRStructure, x: torch.Tensor, weight: torch.Tensor | None, direction: str) -> str:
    """Name of the backend to use for this product (``direction`` "forward" multiplies by A,
    "backward" by A^T): forced, or from memory, the disk cache, the cost model, or a measured trial."""
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction must be one of {_DIRECTIONS}, got {direction!r}")
    if tuning.forced_backend is not None:
        return tuning.forced_backend
    width = int(torch.Size(x.shape[1:]).numel())
    heads = int(x.shape[1]) if x.dim() == 3 else 1
    key = decision_key(matrix, width, weight is not None, heads, direction, x.dtype)
    names = auto_candidates(x)
    if not names:
        raise ConfigError(f"no aggregation backend multiplies {x.dtype} {x.device.type} tensors")
    known = lookup(matrix, key, names)
    if known is not None:
        return known
    transposed = direction == "backward"
    trial = trial_candidates(matrix, width, weight is not None, transposed, names)
    if _state.modelled_only:
        return trial[0]
    if len(trial) > 1:
        choice = record(matrix, key, measure(matrix, x, weight, trial, transposed))
        drop_unchosen_plans(matrix, trial)
        return choice
    return remember(matrix, key, trial[0])


def drop_unchosen_plans(matrix: CSRStructure, names: list[str]) -> None:
    """Drop the entry plans that a trial made ``names`` build for ``matrix`` on backends that no
    decision for it has chosen: a losing dense_block's plans of a products-sized graph would
    otherwise stay for the rest of the run."""
    chosen = set(_memo.entries(matrix).values())
    for name in names:
        backend = get_backend(name)
        if backend.keeps_entry_plan and name not in chosen:
            backend.plans.drop(matrix)


def remember(matrix: CSRStructure, key: str, choice: str) -> str:
    """Keep ``choice`` for ``key`` in this process's memory only (a modelled, unmeasured decision)."""
    _memo.entries(matrix)[key] = choice
    return choice


def decisions(matrix: CSRStructure) -> set[str]:
    """The choices this process has made or loaded for ``matrix`` so far (any key)."""
    return set(_memo.entries(matrix).values())


def lookup(matrix: CSRStructure, key: str, names: list[str]) -> str | None:
    """The decision already made for ``key`` among ``names``, from memory or (for a matrix with a
    fingerprint) the disk cache; None when there is none yet."""
    memo = _memo.entries(matrix)
    if key in memo:
        return memo[key]
    entry = _read_disk().get(key) if matrix.fingerprint() is not None else None
    if entry is None:
        return None
    seconds = {n: t for n, t in entry.get("seconds", {}).items() if n in names}
    choice = pick(seconds) if seconds else entry.get("choice")
    if choice in names:
        memo[key] = choice
        return choice
    return None


def trial_candidates(matrix: CSRStructure, width: int, weighted: bool, transposed: bool, names: list[str]) -> list[str]:
    """The backends worth a measured trial, best model cost first: only the model's favourite when
    the problem is too small for a trial to pay, else those within 3x of its cost."""
    costs = {n: model_cost(n, matrix, width, weighted, transposed) for n in names}
    ranked = sorted(names, key=lambda n: costs[n])
    if matrix.num_edges * width < _TRIAL_MIN_WORK:
        return ranked[:1]
    return [n for n in ranked if costs[n] <= 3 * costs[ranked[0]]]


def pick(seconds: dict[str, float]) -> str:
    """The backend to use given measured ``seconds`` per backend: the fastest, unless it keeps an
    entry plan and one that keeps none is within :data:`_PLAN_MARGIN` of it."""
    registered = available_backends()  # other choices recorded here (relational variants) keep no plans

    def keeps(name: str) -> bool:
        return name in registered and get_backend(name).keeps_entry_plan

    fastest = min(seconds, key=seconds.__getitem__)
    plain = [n for n in seconds if not keeps(n)]
    if not keeps(fastest) or not plain:
        return fastest
    other = min(plain, key=seconds.__getitem__)
    return other if seconds[other] <= seconds[fastest] * (1 + _PLAN_MARGIN) else fastest


def record(matrix: CSRStructure, key: str, seconds: dict[str, float], **notes: Any) -> str:
    """Store :func:`pick`'s choice from ``seconds`` (measured backend times) as the decision for ``key``, in
    memory and (for a matrix with a fingerprint) on disk with ``notes`` beside it, and return it."""
    choice = pick(seconds)
    if matrix.fingerprint() is not None:
        _write_disk(key, {"choice": choice, "seconds": seconds, **notes})
    _memo.entries(matrix)[key] = choice
    return choice


def measure(
    matrix: CSRStructure,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    names: list[str],
    transposed: bool,
    reps: int = _TRIAL_REPS,
) -> dict[str, float]:
    """Median seconds of one SpMM (or transposed SpMM) per backend on this input. The backends'
    runs alternate (after one warm-up call each), so a slow spell of a shared machine falls on
    all of them rather than on one. After each round a backend over :data:`_TRIAL_OUT` times
    the fastest is out, and no round starts once one backend is left or the timed rounds have
    taken :data:`_TRIAL_BUDGET_S`: on a large graph one call can take seconds, and a fixed number of
    calls of every backend per product made a cold first step mostly trials
    (docs/design/backend-selection.md)."""
    # The inputs themselves, not detached copies: a backend treats a weight that requires grad
    # as changing every step, as it will in training, and keeps nothing derived from it.
    calls = {}
    # a GPU runs kernels asynchronously: a call is timed to its kernels' end, not its launches'
    wait = torch.cuda.synchronize if x.device.type == "cuda" else (lambda: None)
    with torch.no_grad(), workspace.transient():
        for name in names:
            b = get_backend(name)
            fn = b.spmm_t if transposed else b.spmm
            calls[name] = lambda fn=fn: (fn(matrix, x, weight), wait())
            calls[name]()
        times: dict[str, list[float]] = {name: [] for name in names}
        racing, spent = list(names), 0.0
        for _ in range(reps):
            for name in racing:
                t0 = time.perf_counter()
                calls[name]()
                times[name].append(time.perf_counter() - t0)
                spent += times[name][-1]
            best = min(times[n][-1] for n in racing)
            racing = [n for n in racing if times[n][-1] <= _TRIAL_OUT * best]
            if spent >= _TRIAL_BUDGET_S or len(racing) == 1:
                break
    return {name: statistics.median(t) for name, t in times.items()}


def clear_memo(matrix: CSRStructure) -> None:
    """Forget this process's decisions for ``matrix`` (the disk cache is untouched)."""
    _memo.entries(matrix).clear()
