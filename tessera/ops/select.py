"""``backend="auto"``: pick the aggregation backend per (graph, width, reduce, direction).

A cost model ranks the registered backends from the bytes each would move; when the problem is
big enough for the choice to matter, a short measured trial on the first real input confirms
the winner. Decisions are kept in memory on the graph and on disk (``$TESSERA_CACHE`` or
``~/.cache/tessera``, file ``kernels.json``), keyed by the graph's fingerprint, so a later run on
the same graph and thread count reuses them without measuring.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from tessera.graph import Graph

_CACHE_VERSION = 1
_TRIAL_REPS = 3
# Below this many gathered floats (nnz x width) a measured trial costs more than any choice can
# save over a whole run, so the cost model alone decides.
_TRIAL_MIN_WORK = 4_000_000
_DIRECTIONS = ("forward", "backward")
_lock = threading.Lock()


def traffic_bytes(graph: Graph, width: int, weighted: bool, transposed: bool = False) -> int:
    """Bytes a row-wise SpMM moves when every gathered row comes from memory: the CSR arrays,
    one ``width``-float row per non-zero, and each output row written once (float32)."""
    rows = graph.num_cols if transposed else graph.num_rows
    nnz = graph.num_edges
    index = graph.indices.element_size()
    return (rows + 1) * graph.indptr.element_size() + nnz * (index + (4 if weighted else 0)) + 4 * width * (nnz + rows)


def cache_file() -> Path:
    """Where measured decisions are kept: ``$TESSERA_CACHE/kernels.json`` (default ``~/.cache/tessera``)."""
    from tessera.graph.partition import default_cache_dir

    return default_cache_dir() / "kernels.json"


def decision_key(graph: Graph, width: int, reduce: str, weighted: bool, heads: int, direction: str) -> str:
    """The cache key of one decision (the thread count is part of it: the best kernel depends on it)."""
    return (
        f"v{_CACHE_VERSION}|{graph.fingerprint()}|w{width}|h{heads}|{reduce}|"
        f"{'weighted' if weighted else 'plain'}|{direction}|t{torch.get_num_threads()}"
    )


def _read_disk() -> dict[str, Any]:
    try:
        data = json.loads(cache_file().read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_disk(key: str, entry: dict[str, Any]) -> None:
    from tessera.checkpoint import atomic_write

    with _lock:
        data = _read_disk()
        data[key] = entry
        try:
            atomic_write(cache_file(), lambda tmp: tmp.write_text(json.dumps(data, indent=1, sort_keys=True)))
        except OSError as e:  # a read-only home must not stop training
            warnings.warn(f"could not store the kernel choice in {cache_file()}: {e}", RuntimeWarning, stacklevel=3)


def candidates(x: torch.Tensor) -> list[str]:
    """Backends able to run this input (all handle 2-D and 3-D float inputs on CPU)."""
    from tessera.ops.registry import available_backends, get_backend

    names = []
    for name in available_backends():
        supports = getattr(get_backend(name), "supports", None)
        if supports is None or supports(x):
            names.append(name)
    return names


def model_cost(name: str, graph: Graph, width: int, weighted: bool, transposed: bool) -> float:
    """Cost-model estimate (relative seconds): bytes moved over the backend's efficiency, which a
    backend may refine with its own ``cost(graph, width, transposed)``."""
    from tessera.ops.registry import get_backend

    own = getattr(get_backend(name), "cost", None)
    if own is not None:
        return float(own(graph, width, transposed))
    return traffic_bytes(graph, width, weighted, transposed) / _EFFICIENCY.get(name, 0.5)


# Relative effective bandwidth of the backends without their own cost function (measured on
# synthetic:arxiv, width 128, 2 threads: benchmarks/bench_kernels.py).
_EFFICIENCY = {"csr": 1.0, "reference": 0.6}


def choose(
    graph: Graph,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    reduce: str,
    direction: str,
) -> str:
    """Name of the backend to use for this aggregation (``direction`` "forward" multiplies by A,
    "backward" by A^T), from memory, the disk cache, the cost model, or a measured trial."""
    if direction not in _DIRECTIONS:
        raise ValueError(f"direction must be one of {_DIRECTIONS}, got {direction!r}")
    width = int(torch.Size(x.shape[1:]).numel())
    heads = int(x.shape[1]) if x.dim() == 3 else 1
    key = decision_key(graph, width, reduce, weight is not None, heads, direction)
    memo = graph.cached("backend_choices", dict)
    if key in memo:
        return memo[key]
    names = candidates(x)
    entry = _read_disk().get(key)
    if entry is not None and entry.get("choice") in names:
        memo[key] = entry["choice"]
        return memo[key]
    transposed = direction == "backward"
    trial = trial_candidates(graph, width, weight is not None, transposed, names)
    if len(trial) > 1:
        return record(graph, key, measure(graph, x, weight, trial, transposed))
    memo[key] = trial[0]
    return trial[0]


def trial_candidates(graph: Graph, width: int, weighted: bool, transposed: bool, names: list[str]) -> list[str]:
    """The backends worth a measured trial, best model cost first: only the model's favourite when
    the problem is too small for a trial to pay, else those within 3x of its cost."""
    costs = {n: model_cost(n, graph, width, weighted, transposed) for n in names}
    ranked = sorted(names, key=lambda n: costs[n])
    if graph.num_edges * width < _TRIAL_MIN_WORK:
        return ranked[:1]
    return [n for n in ranked if costs[n] <= 3 * costs[ranked[0]]]


def record(graph: Graph, key: str, seconds: dict[str, float]) -> str:
    """Store the fastest of ``seconds`` (measured backend times) as the decision for ``key``, in
    memory and on disk, and return it."""
    choice = min(seconds, key=seconds.get)
    _write_disk(key, {"choice": choice, "seconds": seconds})
    graph.cached("backend_choices", dict)[key] = choice
    return choice


def measure(
    graph: Graph,
    x: torch.Tensor,
    weight: torch.Tensor | None,
    names: list[str],
    transposed: bool,
    reps: int = _TRIAL_REPS,
) -> dict[str, float]:
    """Median seconds of one SpMM (or transposed SpMM) per backend on this input. The backends'
    runs alternate (after one warm-up call each), so a slow spell of a shared machine falls on
    all of them rather than on one."""
    from tessera.ops.registry import get_backend

    x = x.detach()
    w = None if weight is None else weight.detach()
    calls = {}
    for name in names:
        b = get_backend(name)
        fn = b.spmm_t if transposed else b.spmm
        calls[name] = lambda fn=fn: fn(graph, x, w)
        calls[name]()
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(reps):
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def clear_memo(graph: Graph) -> None:
    """Forget this process's decisions for ``graph`` (the disk cache is untouched)."""
    graph.cached("backend_choices", dict).clear()
