"""Locality orderings: renumber vertices so aggregation reads feature rows from cache more often.

A row-parallel aggregation reads ``x[j]`` for every in-neighbour ``j`` of every row; when the
rows a thread works on share their neighbours, and the neighbours' ids are close to each other,
those reads hit L2/L3 instead of DRAM. Three orders are offered (MixGCN §3.3 uses RCM):

* ``rcm``: reverse Cuthill–McKee on the symmetrised pattern (bandwidth-reducing);
* ``metis``: METIS recursive bisection into parts whose float32 feature rows fill about one
  core's L2 (2 MiB: 4096 vertices at width 128), concatenated in METIS's part order, each part in
  RCM order
  (measured on the arxiv-sized synthetic graph: recursive bisection cost about half of k-way's
  time for as fast an aggregation, and RCM inside the parts beat the original id order);
* ``degree``: descending in-degree, ties by original id (hubs first, so their rows stay hot).

An order is a permutation ``perm`` with ``perm[new] = old``. :func:`permute_graph` relabels
edges, edge data, features, labels and split masks; :class:`VertexOrder` maps per-vertex tensors
between the two numberings. :func:`choose_order` times one aggregation under each order and keeps
the fastest only when it beats the original numbering by a margin. Orders are cached per graph
fingerprint in memory (``graph.cached``) and on disk beside the partition cache
(``$TESSERA_CACHE/orders``), and so are ``choose_order`` decisions, so an ``auto`` choice, once
made, sticks for that graph, width, backend and thread count.

The trainer (``--reorder``) trains in the new numbering and maps everything user-visible back.
tessera's dropout hashes the element position, so a renumbered run drops different vertices than
an unnumbered one with the same seed: an equally distributed, but different, random stream.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import statistics
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from tessera.checkpoint import atomic_write
from tessera.errors import ConfigError
from tessera.graph.graph import Graph

_MASKS = ("train_mask", "val_mask", "test_mask")
METHODS = ("none", "rcm", "metis", "degree")
CHOICES = ("auto", *METHODS)
AUTO_MIN_NODES = 50_000  # below this, "auto" keeps the original order without measuring
AUTO_MARGIN = 0.10  # a candidate must be at least this much faster than the original order
METIS_PART_BYTES = 2 << 20  # float32 feature bytes per METIS part: one core's L2 here (4096 rows at width 128)
_ORDER_VERSION = 1  # bump when an order's algorithm changes, so old cache entries are not reused


# ---------------------------------------------------------------------------------------- orders
def _symmetric_pattern(graph: Graph) -> sp.csr_matrix:
    n = graph.num_nodes
    indptr = graph.indptr.numpy().astype(np.int64, copy=False)
    a = sp.csr_matrix((np.ones(graph.num_edges, dtype=np.int8), graph.indices.numpy(), indptr), shape=(n, n))
    return (a + a.T).tocsr()


def _rcm(graph: Graph) -> np.ndarray:
    from scipy.sparse.csgraph import reverse_cuthill_mckee

    return np.asarray(reverse_cuthill_mckee(_symmetric_pattern(graph), symmetric_mode=True), dtype=np.int64)


def _degree(graph: Graph) -> np.ndarray:
    deg = graph.in_degree().numpy()
    return np.argsort(-deg, kind="stable").astype(np.int64)


def metis_parts_for(num_nodes: int, width: int = 128, part_bytes: int = METIS_PART_BYTES) -> int:
    """Number of METIS parts whose float32 feature rows of ``width`` take about ``part_bytes``
    each (parts of at least 64 vertices; at least one part)."""
    rows = max(64, part_bytes // (4 * max(1, int(width))))
    return int(max(1, min(num_nodes, -(-num_nodes // rows))))


def _metis_recursive_ctypes(lib: Any, xadj, adjncy, eweights, parts: int, seed: int) -> np.ndarray:
    """``METIS_PartGraphRecursive`` with unit vertex weights (balanced vertex counts)."""
    import pymetis._internal as internal

    def ptr(a: np.ndarray):
        return a.ctypes.data_as(ctypes.POINTER(ctypes.c_int64))

    n = xadj.size - 1
    xadj = np.ascontiguousarray(xadj, dtype=np.int64)
    adjncy = np.ascontiguousarray(adjncy, dtype=np.int64) if adjncy.size else np.zeros(1, dtype=np.int64)
    ew = np.ascontiguousarray(eweights, dtype=np.int64) if eweights.size else np.ones(1, dtype=np.int64)
    vw = np.ones(n, dtype=np.int64)
    options = np.full(128, -1, dtype=np.int64)  # METIS_NOPTIONS is 40; room to spare
    lib.METIS_SetDefaultOptions(ptr(options))
    options[int(internal.OptionKey.SEED)] = int(seed)
    options[int(internal.OptionKey.NUMBERING)] = 0
    nv, nc, npart, objval = (ctypes.c_int64(v) for v in (n, 1, parts, 0))
    out = np.zeros(max(n, 1), dtype=np.int64)
    fn = lib.METIS_PartGraphRecursive
    fn.restype = ctypes.c_int
    status = fn(
        ctypes.byref(nv), ctypes.byref(nc), ptr(xadj), ptr(adjncy), ptr(vw), None, ptr(ew),
        ctypes.byref(npart), None, None, ptr(options), ctypes.byref(objval), ptr(out),
    )  # fmt: skip
    if status != 1:  # METIS_OK
        raise RuntimeError(f"METIS_PartGraphRecursive failed with status {status}")
    return out[:n]


def metis_parts(graph: Graph, parts: int, seed: int = 0) -> np.ndarray:
    """Part id of every vertex from METIS recursive bisection of the symmetrised graph into
    ``parts`` parts of about equal vertex counts, minimising the number of CSR entries cut."""
    from tessera.graph import partition as pt

    n = graph.num_nodes
    if parts <= 1 or n <= 1:
        return np.zeros(n, dtype=np.int64)
    xadj, adjncy, ew = pt._metis_graph(graph)
    lib = pt._metis_lib()
    if lib is not None:
        try:
            return _metis_recursive_ctypes(lib, xadj, adjncy, ew, parts, seed)
        except (RuntimeError, AttributeError) as e:
            warnings.warn(f"{e}; falling back to pymetis", RuntimeWarning, stacklevel=3)
    import pymetis

    res = pymetis.part_graph(
        parts, pymetis.CSRAdjacency(xadj, adjncy), eweights=ew, recursive=True, options=pymetis.Options(seed=int(seed))
    )
    return np.asarray(res.vertex_part, dtype=np.int64)


def _metis(graph: Graph, parts: int) -> np.ndarray:
    # Parts in METIS's order (recursive bisection numbers neighbouring parts consecutively),
    # reverse Cuthill-McKee order inside each part: consecutive rows then share neighbours too.
    part = metis_parts(graph, parts)
    rank = inverse_permutation(_rcm(graph))
    return np.lexsort((rank, part)).astype(np.int64)


def _compute(graph: Graph, method: str, parts: int) -> np.ndarray:
    if method == "none" or graph.num_nodes == 0:
        return np.arange(graph.num_nodes, dtype=np.int64)
    if method == "rcm":
        return _rcm(graph)
    if method == "degree":
        return _degree(graph)
    return _metis(graph, parts)


def _check_method(method: str) -> None:
    if method not in METHODS:
        raise ConfigError(f"unknown vertex order {method!r}; choose one of: {', '.join(METHODS)}")


def is_permutation(perm: Any, n: int) -> bool:
    """Whether ``perm`` holds every integer of ``[0, n)`` exactly once."""
    p = np.asarray(perm)
    if p.shape != (n,) or p.dtype.kind not in "iu":
        return False
    if n == 0:
        return True
    if int(p.min()) < 0 or int(p.max()) >= n:
        return False
    seen = np.zeros(n, dtype=bool)
    seen[p] = True
    return bool(seen.all())


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    from tessera.graph.partition import default_cache_dir

    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "orders"


def _order_path(graph: Graph, method: str, parts: int, cache_dir) -> Path:
    text = f"v{_ORDER_VERSION}|{graph.fingerprint()}|{method}|{parts if method == 'metis' else 0}"
    return _cache_root(cache_dir) / f"{hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}.npy"


def vertex_order(
    graph: Graph,
    method: str,
    cache_dir: str | os.PathLike | None = None,
    parts: int | None = None,
    width: int = 128,
) -> np.ndarray:
    """The permutation (int64, ``perm[new] = old``) of ``method`` for ``graph``.

    ``parts`` is the METIS part count, by default sized for feature rows of ``width``
    (:func:`metis_parts_for`); the other orders do not depend on the width. Results are cached in
    memory on the graph and, for ``rcm`` and ``metis``, on disk under ``cache_dir`` (default
    ``$TESSERA_CACHE`` or ``~/.cache/tessera``, subfolder ``orders``), keyed by the fingerprint."""
    _check_method(method)
    n = graph.num_nodes
    parts = (int(parts) if parts is not None else metis_parts_for(n, width)) if method == "metis" else 0

    def make() -> np.ndarray:
        if method in ("none", "degree") or n == 0:  # cheap: not worth a file
            return _compute(graph, method, parts)
        path = _order_path(graph, method, parts, cache_dir)
        if path.is_file():
            try:
                arr = np.load(path, allow_pickle=False)
                if is_permutation(arr, n):
                    return arr.astype(np.int64, copy=False)
            except (OSError, ValueError, EOFError):
                pass
        perm = _compute(graph, method, parts)
        try:
            from tessera.graph.partition import _save_npy

            _save_npy(path, perm)
        except OSError as e:
            warnings.warn(f"could not cache vertex order at {path}: {e}", RuntimeWarning, stacklevel=3)
        return perm

    return graph.cached(("vertex_order", method, parts), make)


# ---------------------------------------------------------------------------------------- permuting
def inverse_permutation(perm: Any) -> np.ndarray:
    """``inv`` with ``inv[perm[i]] = i`` (old id -> new id)."""
    p = np.asarray(perm, dtype=np.int64)
    inv = np.empty_like(p)
    inv[p] = np.arange(p.size, dtype=np.int64)
    return inv


def _permuted_structure(graph: Graph, perm: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(indptr, indices, eid)`` of the renumbered CSR; ``eid`` is each entry's old edge id.
    Sources are sorted within each row, duplicates in their old relative order."""
    n = graph.num_nodes
    inv = inverse_permutation(perm)
    indptr = graph.indptr.numpy().astype(np.int64, copy=False)
    new_deg = np.diff(indptr)[perm]
    new_indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(new_deg, out=new_indptr[1:])
    # old edge id of every new CSR position: rows in new order, each row's edges as stored
    eid = np.repeat(indptr[:-1][perm] - new_indptr[:-1], new_deg) + np.arange(graph.num_edges, dtype=np.int64)
    src = inv[graph.indices.numpy()[eid]]
    # scipy sorts each row's (source, edge id) pairs in C++; ~6x faster than one global argsort
    m = sp.csr_matrix((eid, src, new_indptr), shape=(n, n))
    m.has_sorted_indices = False
    m.sort_indices()
    src = m.indices.astype(np.int64, copy=False)
    eid = m.data
    if src.size > 1:
        row = np.repeat(np.arange(n, dtype=np.int64), new_deg)
        same = (src[1:] == src[:-1]) & (row[1:] == row[:-1])
        if same.any():  # duplicate edges: scipy's sort is not stable, restore the stored order
            order = np.lexsort((eid, src, row))
            src, eid = src[order], eid[order]
    return new_indptr, src, eid


def permute_graph(graph: Graph, perm: Any, features: bool = True) -> Graph:
    """The same graph with vertex ``perm[i]`` renamed ``i``: CSR rows, sources (sorted within each
    row, as every Graph), edge weights and types, features, labels and split masks all follow.
    ``features=False`` leaves ``x`` out (for callers that permute their own feature tensor)."""
    n = graph.num_nodes
    perm = np.asarray(perm, dtype=np.int64)
    if not is_permutation(perm, n):
        raise ValueError(f"perm is not a permutation of [0, {n})")
    indptr, src, eid = _permuted_structure(graph, perm)
    et = torch.from_numpy(eid)
    pt = torch.from_numpy(perm)
    data: dict[str, Any] = {
        "edge_weight": None if graph.edge_weight is None else graph.edge_weight[et],
        "edge_type": None if graph.edge_type is None else graph.edge_type[et],
        "x": graph.x[pt] if features and graph.x is not None else None,
        "y": None if graph.y is None else graph.y[pt],
        "num_classes": graph.num_classes,
        "name": graph.name,
    }
    for m in _MASKS:
        t = getattr(graph, m)
        data[m] = None if t is None else t[pt]
    return Graph(torch.from_numpy(indptr), torch.from_numpy(src), n, **data)


@dataclass(frozen=True)
class VertexOrder:
    """A renumbering: ``perm[new] = old`` and ``inv[old] = new`` (int64 tensors)."""

    method: str
    perm: torch.Tensor
    inv: torch.Tensor

    @classmethod
    def from_perm(cls, perm: Any, method: str = "custom") -> VertexOrder:
        """Wrap a permutation ``perm[new] = old`` (validated)."""
        p = np.asarray(perm, dtype=np.int64)
        if not is_permutation(p, p.size):
            raise ValueError("perm is not a permutation")
        return cls(method, torch.from_numpy(p.copy()), torch.from_numpy(inverse_permutation(p)))

    @classmethod
    def of(cls, graph: Graph, method: str, width: int = 128, cache_dir: str | os.PathLike | None = None) -> VertexOrder:
        """The order ``method`` computes for ``graph`` (see :func:`vertex_order`)."""
        return cls.from_perm(vertex_order(graph, method, cache_dir, width=width), method)

    def permute(self, graph: Graph, features: bool = True) -> Graph:
        """``graph`` in the new numbering (see :func:`permute_graph`)."""
        return permute_graph(graph, self.perm.numpy(), features)

    def to_new(self, t: torch.Tensor) -> torch.Tensor:
        """Rows of a per-vertex tensor in original order -> new order."""
        return t.index_select(0, self.perm.to(t.device))

    def to_original(self, t: torch.Tensor) -> torch.Tensor:
        """Rows of a per-vertex tensor in new order -> original order."""
        return t.index_select(0, self.inv.to(t.device))

    def ids_to_new(self, ids: torch.Tensor) -> torch.Tensor:
        """Original vertex ids -> their new ids."""
        return self.inv[ids]

    def ids_to_original(self, ids: torch.Tensor) -> torch.Tensor:
        """New vertex ids -> their original ids."""
        return self.perm[ids]


# ---------------------------------------------------------------------------------------- choosing
def _structure_only(graph: Graph) -> Graph:
    return Graph(graph.indptr, graph.indices, graph.num_nodes, edge_weight=graph.edge_weight, name=graph.name)


def _concrete_backend(graph: Graph, x: torch.Tensor, backend: str) -> str:
    """``auto`` resolved once, on the original numbering, so the orders are timed with one kernel
    (resolving it per renumbered graph would run the backend trial, and build each backend's
    per-graph plans, once per candidate order)."""
    if backend != "auto":
        return backend
    try:
        from tessera.ops.select import choose
    except ImportError:  # no measured backend selection: "auto" is a fixed backend
        return backend
    return choose(graph, x, None, "sum", "forward")


def order_widths(width: int | Sequence[int]) -> tuple[int, ...]:
    """``width`` as a tuple of positive feature widths, sorted (an int is one width)."""
    ws = (width,) if isinstance(width, (int, np.integer)) else tuple(width)
    if not ws or any(int(w) != w or w < 1 for w in ws):
        raise ConfigError(f"feature widths must be positive integers, got {width!r}")
    return tuple(sorted(int(w) for w in ws))


def _time_aggregate(graph: Graph, x: torch.Tensor, backend: str, backward: bool) -> float:
    from tessera import ops

    xm = x.detach().requires_grad_(backward)
    t0 = time.perf_counter()
    out = ops.aggregate(graph, xm, backend=backend)
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
    order with it."""
    ws = order_widths(width)
    base = _structure_only(graph)
    perms: dict[str, torch.Tensor] = {}
    graphs: dict[str, Graph] = {}
    res: dict[str, dict[str, Any]] = {}
    for m in methods:
        t0 = time.perf_counter()
        perm = vertex_order(graph, m, cache_dir, width=max(ws))
        res[m] = {"order_s": time.perf_counter() - t0, "agg_by_width": {}}
        graphs[m] = base if m == "none" else permute_graph(base, perm)
        perms[m] = torch.from_numpy(perm)
    for w in sorted(set(ws)):
        gen = torch.Generator().manual_seed(0)
        x = torch.rand(graph.num_nodes, w, generator=gen)
        xs = {m: x if m == "none" else x[perms[m]] for m in methods}
        chosen = _concrete_backend(base, x, backend)
        times: dict[str, list[float]] = {m: [] for m in methods}
        for m in methods:  # warm-up: compiles kernels, builds transposes and work items
            _time_aggregate(graphs[m], xs[m], chosen, backward)
        for r in range(reps):
            for m in methods if r % 2 == 0 else methods[::-1]:
                times[m].append(_time_aggregate(graphs[m], xs[m], chosen, backward))
        for m in methods:
            res[m]["agg_by_width"][w] = statistics.median(times[m])
        del x, xs
    for m in methods:
        res[m]["agg_s"] = sum(res[m]["agg_by_width"][w] for w in ws)
    return res


def _decision_path(graph: Graph, widths: tuple[int, ...], backend: str, cache_dir) -> Path:
    threads = torch.get_num_threads()
    text = f"v{_ORDER_VERSION}|{graph.fingerprint()}|{','.join(map(str, widths))}|{backend}|{threads}"
    return _cache_root(cache_dir) / f"choice-{hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}.json"


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
    whole run, so the total is what counts: on ``synthetic:arxiv`` at widths 128 and 256 this
    trial measured 94 ms for the original numbering and 78 ms for METIS
    (``benchmarks/bench_kernels.py --order auto``, ``benchmarks/RESULTS.md``). The decision is
    cached in memory and on disk (per fingerprint, widths, backend and thread count), so it is
    measured once and later runs on the same graph train in the same numbering."""
    ws = order_widths(width)
    candidates = tuple(m for m in candidates if m != "none")
    for m in candidates:
        _check_method(m)

    def make() -> str:
        path = _decision_path(graph, ws, backend, cache_dir)
        try:
            rec = json.loads(path.read_text())
            if rec.get("choice") in ("none", *candidates) and rec.get("candidates") == list(candidates):
                return rec["choice"]
        except (OSError, ValueError, AttributeError):
            pass
        res = time_orders(graph, ws, ("none", *candidates), backend, reps, cache_dir)
        choice = "none"
        if candidates:
            best = min(candidates, key=lambda m: res[m]["agg_s"])
            if res[best]["agg_s"] < (1.0 - margin) * res["none"]["agg_s"]:
                choice = best
        rec = {"choice": choice, "candidates": list(candidates), "widths": list(ws), "backend": backend, "times": res}
        try:
            atomic_write(path, lambda tmp: tmp.write_text(json.dumps(rec, indent=1) + "\n"))
        except OSError as e:
            warnings.warn(f"could not cache vertex order choice at {path}: {e}", RuntimeWarning, stacklevel=3)
        return choice

    return graph.cached(("order_choice", ws, backend, torch.get_num_threads(), candidates), make)


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
