"""The measured vertex order: time one aggregation under each locality order
(:mod:`tessera.graph.order`) on this process's backends and keep the fastest when it beats the
original numbering by a margin. Decisions are kept per graph in memory and on disk beside the
orders (``$TESSERA_CACHE/orders``), so an ``auto`` choice, once made, sticks for that graph,
widths, backend and thread count."""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessera.backends import select
from tessera.backends.local import local_operand
from tessera.errors import ConfigError
from tessera.files import atomic_write, read_json_cache
from tessera.graph import Graph
from tessera.graph.order import (
    AUTO_MARGIN,
    AUTO_MIN_NODES,
    CHOICES,
    METHODS,
    ORDER_VERSION,
    cache_root,
    check_method,
    permute_graph,
    vertex_order,
)
from tessera.memo import PlanCache
from tessera.sparse import aggregate

_choices = PlanCache()
ORDER_TRIAL_BUDGET_S = 4.0


def _structure_only(graph: Graph) -> Graph:
    return Graph(graph.indptr, graph.indices, graph.num_nodes, edge_weight=graph.edge_weight, name=graph.name)


def _concrete_backend(graph: Graph, x: torch.Tensor, backend: str) -> str:
    """``auto`` resolved once, on the original numbering, so the orders are timed with one kernel
    (resolving it per renumbered graph would run the backend trial, and build each backend's
    per-graph plans, once per candidate order)."""
    if backend != "auto":
        return backend
    return select.choose(graph, x, None, "forward")


def order_widths(width: int | Sequence[int]) -> tuple[int, ...]:
    """``width`` as a tuple of positive feature widths, sorted (an int is one width)."""
    ws = (width,) if isinstance(width, (int, np.integer)) else tuple(width)
    if not ws or any(int(w) != w or w < 1 for w in ws):
        raise ConfigError(f"feature widths must be positive integers, got {width!r}")
    return tuple(sorted(int(w) for w in ws))


def _time_aggregate(graph: Graph, x: torch.Tensor, backend: str, backward: bool) -> float:
    xm = x.detach().requires_grad_(backward)
    t0 = time.perf_counter()
    out = aggregate(local_operand(graph, backend), xm)
    if backward:
        out.backward(torch.ones_like(out))
    return time.perf_counter() - t0


def time_orders(
    graph: Graph,
    width: int | Sequence[int],
    methods: tuple[str, ...] = METHODS,
    backend: str = "auto",
    reps: int = 5,
    cache_dir: str | os.PathLike | None = None,
    backward: bool = False,
) -> dict[str, dict[str, Any]]:
    """Per method: ``order_s`` (seconds to compute the order; ~0 when cached), ``agg_by_width``
    (median seconds of one sum aggregation at each distinct width, forward, plus backward when
    ``backward``) and ``agg_s``, their sum over ``width`` (a width listed twice counts twice, as a
    model aggregating twice at it would). The order is computed once, for the widest rows
    (:func:`vertex_order`). Candidates are interleaved within every rep so machine noise hits all
    alike. ``backend="auto"`` picks the backend once, for the original numbering, and times every
    order with it. No pair of rounds starts once the timed ones have taken
    :data:`ORDER_TRIAL_BUDGET_S` per width (on a large graph one round takes seconds)."""
    ws = order_widths(width)
    base = _structure_only(graph)
    graphs: dict[str, Graph] = {}
    res: dict[str, dict[str, Any]] = {}
    for m in methods:
        t0 = time.perf_counter()
        perm = vertex_order(graph, m, cache_dir, width=max(ws))
        res[m] = {"order_s": time.perf_counter() - t0, "agg_by_width": {}}
        graphs[m] = base if m == "none" else permute_graph(base, perm)
    for w in sorted(set(ws)):
        gen = torch.Generator().manual_seed(0)
        # Every order aggregates the same random rows: values do not change a kernel's speed (the
        # order's access pattern does), and renumbered copies would hold one N x w tensor each.
        x = torch.rand(graph.num_nodes, w, generator=gen)
        chosen = _concrete_backend(base, x, backend)
        times: dict[str, list[float]] = {m: [] for m in methods}
        for m in methods:  # warm-up: compiles kernels, builds transposes and work items
            _time_aggregate(graphs[m], x, chosen, backward)
        spent = 0.0
        for r in range(reps):
            for m in methods if r % 2 == 0 else methods[::-1]:
                times[m].append(_time_aggregate(graphs[m], x, chosen, backward))
                spent += times[m][-1]
            if r % 2 == 1 and spent >= ORDER_TRIAL_BUDGET_S:  # after a forward-and-reverse pair
                break
        for m in methods:
            res[m]["agg_by_width"][w] = statistics.median(times[m])
        del x
    for m in methods:
        res[m]["agg_s"] = sum(res[m]["agg_by_width"][w] for w in ws)
    return res


def _decision_path(graph: Graph, widths: tuple[int, ...], backend: str, cache_dir) -> Path:
    threads = torch.get_num_threads()
    text = f"v{ORDER_VERSION}|{graph.fingerprint()}|{','.join(map(str, widths))}|{backend}|{threads}"
    return cache_root(cache_dir) / f"choice-{hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}.json"


def choose_order(
    graph: Graph,
    width: int | Sequence[int],
    backend: str = "auto",
    candidates: tuple[str, ...] = ("rcm", "metis", "degree"),
    margin: float = AUTO_MARGIN,
    reps: int = 5,
    cache_dir: str | os.PathLike | None = None,
) -> str:
    """The candidate whose order makes the aggregations at ``width`` fastest in total, or
    ``"none"`` unless it beats the original numbering by more than ``margin`` (a fraction).
    ``width`` is one feature width or the widths a model aggregates at. One numbering serves a
    whole run, so the total is what counts (``benchmarks/bench_kernels.py --order auto``;
    docs/design/backend-selection.md). The decision is
    cached in memory and on disk (per fingerprint, widths, backend and thread count), so it is
    measured once and later runs on the same graph train in the same numbering."""
    ws = order_widths(width)
    candidates = tuple(m for m in candidates if m != "none")
    for m in candidates:
        check_method(m)

    def make() -> str:
        path = _decision_path(graph, ws, backend, cache_dir)

        def well_formed(rec: object) -> dict | None:
            if not isinstance(rec, dict) or not isinstance(rec.get("choice"), str):
                return None
            return rec if isinstance(rec.get("candidates"), list) else None

        kept, ours = read_json_cache(path, well_formed)
        if kept is not None and kept["choice"] in ("none", *candidates) and kept["candidates"] == list(candidates):
            return kept["choice"]
        res = time_orders(graph, ws, ("none", *candidates), backend, reps, cache_dir)
        choice = "none"
        if candidates:
            best = min(candidates, key=lambda m: res[m]["agg_s"])
            if res[best]["agg_s"] < (1.0 - margin) * res["none"]["agg_s"]:
                choice = best
        rec = {"choice": choice, "candidates": list(candidates), "widths": list(ws), "backend": backend, "times": res}
        try:
            if ours:
                atomic_write(path, lambda tmp: tmp.write_text(json.dumps(rec, indent=1) + "\n"))
        except OSError as e:
            warnings.warn(f"could not cache vertex order choice at {path}: {e}", RuntimeWarning, stacklevel=3)
        return choice

    return _choices.get(graph, (ws, backend, torch.get_num_threads(), candidates), make)


def resolve(graph: Graph, setting: str, width: int | Sequence[int], backend: str = "auto") -> str:
    """The order a run uses for ``setting``: itself unless ``auto``, which keeps the original
    numbering for graphs under :data:`AUTO_MIN_NODES` vertices and measures larger ones at the
    run's aggregation widths (:func:`choose_order`)."""
    if setting not in CHOICES:
        raise ConfigError(f"unknown vertex order {setting!r}; choose one of: {', '.join(CHOICES)}")
    if setting != "auto":
        return setting
    if graph.num_nodes < AUTO_MIN_NODES:
        return "none"
    return choose_order(graph, width, backend)
