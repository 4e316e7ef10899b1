"""Vertex partitioning for partition-parallel training (SuperGCN §5.1, §7.2), its on-disk cache,
quality statistics, and per-part file sets a rank can load without the full graph.

``metis`` partitions the symmetrised graph (union with its transpose, no self loops) with three
balance constraints per vertex, as DistDGL does and in the spirit of SuperGCN §7.2 (in-degree and
training mask): 1 (vertex count), its in-degree (aggregation work = in-edges) and its training
mask. Each undirected METIS edge is weighted by the number of stored directed edges it stands
for, so METIS minimises exactly the number of CSR entries cut. Several constraints need the
ctypes path of :mod:`tessera.graph.partition.metis` (pymetis's own wrapper passes one); if it is
unavailable (or fails) we fall back to one weight per vertex, ``1 + in_degree + alpha * train``
with ``alpha`` chosen so the training vertices carry as much total weight as the other two
terms: work is balanced well, training vertices approximately.
"""

from __future__ import annotations

import hashlib
import json
import os
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from tessera.errors import ConfigError, DatasetError
from tessera.files import atomic_write, default_cache_dir, kept, save_npy
from tessera.graph.csr import rows_of
from tessera.graph.graph import Graph
from tessera.graph.partition.halo import row_edges
from tessera.graph.partition.metis import metis_graph, part_graph

METHODS = ("metis", "range", "random")
FORMAT_VERSION = 1
_ALGO_VERSION = 1  # bump when an algorithm's output changes, so old cache entries are not reused
_MASKS = ("train_mask", "val_mask", "test_mask")


# ---------------------------------------------------------------------------------------- helpers
def _structure(graph: Graph) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(indptr, src, dst)`` of the destination-major CSR as int64 numpy arrays."""
    indptr = graph.indptr.numpy().astype(np.int64, copy=False)
    src = graph.indices.numpy().astype(np.int64, copy=False)
    return indptr, src, rows_of(indptr)


def _train(graph: Graph) -> np.ndarray | None:
    return None if graph.train_mask is None else graph.train_mask.numpy()


def _mask_digest(mask: np.ndarray | None) -> str:
    if mask is None:
        return "none"
    return hashlib.blake2b(np.packbits(mask).tobytes(), digest_size=8).hexdigest() + f"-{mask.size}"


def _validate(graph: Graph, parts: int, method: str) -> None:
    if isinstance(parts, bool) or not isinstance(parts, (int, np.integer)):
        raise ConfigError(f"number of parts must be an integer, got {parts!r}")
    if parts < 1:
        raise ConfigError(f"number of parts must be at least 1, got {parts}")
    if parts > graph.num_nodes:
        raise ConfigError(
            f"cannot split {graph.num_nodes} vertices into {parts} parts (more parts than vertices); "
            f"use at most {graph.num_nodes} processes (--nprocs) or parts"
        )
    if method not in METHODS:
        raise ConfigError(f"unknown partition method {method!r}; choose one of: {', '.join(METHODS)}")


# ---------------------------------------------------------------------------------------- METIS
def _vertex_weights(graph: Graph) -> np.ndarray:
    """``(N, 3)`` METIS constraints: 1, in-degree, training mask (zeros without a train split)."""
    n = graph.num_nodes
    train = _train(graph)
    train = np.zeros(n, dtype=np.int64) if train is None else train.astype(np.int64)
    return np.stack([np.ones(n, dtype=np.int64), graph.in_degree().numpy().astype(np.int64), train], axis=1)


def _single_weight(vweights: np.ndarray) -> np.ndarray:
    """The fallback's one weight per vertex, ``1 + deg + alpha * train``, from the three constraints."""
    w = (vweights[:, 0] + vweights[:, 1]).astype(np.float64)
    train = vweights[:, 2]
    w = w + train * (w.sum() / max(int(train.sum()), 1))
    return np.maximum(np.rint(w), 1).astype(np.int64)


def _metis(graph: Graph, parts: int, seed: int) -> np.ndarray:
    xadj, adjncy, ew = metis_graph(graph)
    vw = _vertex_weights(graph)
    try:
        return part_graph(xadj, adjncy, ew, parts, vweights=vw, seed=seed)
    except RuntimeError as e:
        warnings.warn(f"{e}; falling back to single-constraint pymetis", RuntimeWarning, stacklevel=3)
    # recursive bisection up to 8 parts, k-way above: pymetis's default, which this fallback has always used
    return part_graph(xadj, adjncy, ew, parts, vweights=_single_weight(vw), recursive=parts <= 8, seed=seed)


# ---------------------------------------------------------------------------------------- partition
def _compute(graph: Graph, parts: int, method: str, seed: int) -> np.ndarray:
    n = graph.num_nodes
    if method == "range":
        return (np.arange(n, dtype=np.int64) * parts) // n
    if method == "random":
        out = np.empty(n, dtype=np.int64)
        out[np.random.default_rng(seed).permutation(n)] = np.arange(n, dtype=np.int64) % parts
        return out
    return _metis(graph, parts, seed)


def cache_key(graph: Graph, parts: int, method: str, seed: int) -> str:
    """Digest naming a partition's cache file."""
    text = f"v{_ALGO_VERSION}|{graph.fingerprint()}|{parts}|{method}|{seed}|{_mask_digest(_train(graph))}"
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _load_cached(arr: object, n: int, parts: int) -> np.ndarray | None:
    """``arr`` as a partition of ``n`` vertices into ``parts`` parts, or None if it is not one."""
    if not isinstance(arr, np.ndarray) or arr.shape != (n,) or arr.dtype.kind not in "iu":
        return None
    if n and (int(arr.min()) < 0 or int(arr.max()) >= parts):
        return None
    return arr.astype(np.int64, copy=False)


def partition(
    graph: Graph,
    parts: int,
    method: str = "metis",
    seed: int = 0,
    cache_dir: str | os.PathLike | None = None,
) -> np.ndarray:
    """Part id (int64, in ``[0, parts)``) of every vertex, cached on disk under ``cache_dir``."""
    _validate(graph, parts, method)
    parts = int(parts)
    if parts == 1:
        return np.zeros(graph.num_nodes, dtype=np.int64)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = root / "partitions" / f"{cache_key(graph, parts, method, seed)}.npy"
    n = graph.num_nodes
    out = kept(
        path,
        [path],
        lambda: np.load(path, allow_pickle=False),
        lambda arr: _load_cached(arr, n, parts) is not None,
        lambda: _compute(graph, parts, method, seed),
        lambda arr: save_npy(path, arr),
        "partition",
    )
    return out.astype(np.int64, copy=False)


# ---------------------------------------------------------------------------------------- statistics
def _balance(counts: np.ndarray) -> float:
    mean = float(counts.mean()) if counts.size else 0.0
    return float(counts.max()) / mean if mean > 0 else 1.0


def partition_stats(graph: Graph, part: np.ndarray, parts: int | None = None) -> dict[str, Any]:
    """Edge cut, balance (max/mean) of vertices, in-edges and training vertices, and per-part
    counts and halo sizes (distinct remote sources a part reads under pure post-aggregation)."""
    part = np.asarray(part, dtype=np.int64)
    n = graph.num_nodes
    if part.shape != (n,):
        raise ValueError(f"part has shape {part.shape}, expected ({n},)")
    p = int(parts) if parts is not None else (int(part.max()) + 1 if n else 1)
    _, src, dst = _structure(graph)
    ps, pd = part[src], part[dst]
    cut = ps != pd
    vertices = np.bincount(part, minlength=p)
    edges = np.bincount(pd, minlength=p)
    cut_in = np.bincount(pd[cut], minlength=p)
    train = _train(graph)
    trains = np.bincount(part[train], minlength=p) if train is not None else np.zeros(p, dtype=np.int64)
    halo_keys = np.unique(pd[cut] * max(n, 1) + src[cut])
    halo = np.bincount(halo_keys // max(n, 1), minlength=p)
    num_cut = int(cut.sum())
    return {
        "parts": p,
        "num_nodes": n,
        "num_edges": int(src.size),
        "edge_cut": num_cut,
        "edge_cut_fraction": num_cut / src.size if src.size else 0.0,
        "vertex_balance": _balance(vertices),
        "edge_balance": _balance(edges),
        "train_balance": _balance(trains) if train is not None else None,
        "halo_total": int(halo.sum()),
        "vertices": vertices.tolist(),
        "edges": edges.tolist(),
        "cut_in_edges": cut_in.tolist(),
        "train": trains.tolist() if train is not None else None,
        "halo": halo.tolist(),
    }


def format_partition_report(stats: dict[str, Any]) -> str:
    """A human-readable table of :func:`partition_stats`."""
    tb = stats["train_balance"]
    lines = [
        f"partition: {stats['parts']} parts, {stats['num_nodes']} vertices, {stats['num_edges']} edges",
        f"edge cut: {stats['edge_cut']} ({100 * stats['edge_cut_fraction']:.2f}% of edges), "
        f"halo rows (post-aggregation): {stats['halo_total']}",
        f"balance (max/mean): vertices {stats['vertex_balance']:.3f}, edges {stats['edge_balance']:.3f}, "
        f"train {'n/a' if tb is None else f'{tb:.3f}'}",
        f"{'part':>5} {'vertices':>10} {'in-edges':>10} {'cut-in':>10} {'train':>8} {'halo':>9}",
    ]
    train = stats["train"] or [None] * stats["parts"]
    for k in range(stats["parts"]):
        t = "-" if train[k] is None else str(train[k])
        lines.append(
            f"{k:>5} {stats['vertices'][k]:>10} {stats['edges'][k]:>10} {stats['cut_in_edges'][k]:>10} "
            f"{t:>8} {stats['halo'][k]:>9}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- part files
def _part_arrays(graph: Graph, part: np.ndarray, k: int, parts: int, fingerprint: str) -> dict[str, Any]:
    indptr, src, dst = _structure(graph)
    owned = np.flatnonzero(part == k).astype(np.int64)
    deg = np.diff(indptr)[owned]
    eid = row_edges(indptr, owned)  # edge ids of the owned rows, in CSR order
    w = None if graph.edge_weight is None else graph.edge_weight.numpy()
    out_e = np.flatnonzero((part[src] == k) & (part[dst] != k))
    out_src = np.searchsorted(owned, src[out_e])
    ref_ids = np.unique(np.concatenate([src[eid], dst[out_e]]))
    arrays: dict[str, Any] = {  # arrays and numpy scalars, as np.savez takes them
        "rank": np.int64(k),
        "parts": np.int64(parts),
        "num_nodes": np.int64(graph.num_nodes),
        "fingerprint": np.array(fingerprint),
        "owned": owned,
        "indptr": np.concatenate([[0], np.cumsum(deg)]).astype(np.int64),
        "src": src[eid],
        "out_src": out_src.astype(np.int64),
        "out_dst": dst[out_e],
        "ref_ids": ref_ids,
        "ref_part": part[ref_ids],
    }
    if w is not None:
        arrays["weight"] = w[eid]
        arrays["out_weight"] = w[out_e]
    if graph.edge_type is not None:
        t = graph.edge_type.numpy()
        arrays["etype"] = t[eid]
        arrays["out_etype"] = t[out_e]
    if graph.x is not None:
        arrays["x"] = graph.x.numpy()[owned]
    if graph.y is not None:
        arrays["y"] = graph.y.numpy()[owned]
    for name in _MASKS:
        m = getattr(graph, name)
        if m is not None:
            arrays[name] = m.numpy()[owned]
    return arrays


def write_parts(graph: Graph, part: np.ndarray, out_dir: str | os.PathLike, method: str | None = None) -> Path:
    """Write ``meta.json``, ``parts.npy`` and one ``part-<k>.npz`` per part: owned ids, their
    in-edges (CSR over owned destinations, global source ids, weights, relations), the cut edges
    leaving the part (local source, global destination, weight, relation), owners of every
    referenced vertex, node data."""
    part = np.asarray(part, dtype=np.int64)
    n = graph.num_nodes
    if part.shape != (n,):
        raise ValueError(f"part has shape {part.shape}, expected ({n},)")
    if n and int(part.min()) < 0:
        raise ValueError("part ids must be non-negative")
    parts = int(part.max()) + 1 if n else 1
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    fp = graph.fingerprint()
    for k in range(parts):
        arrays = _part_arrays(graph, part, k, parts, fp)

        def write(tmp: Path, arrays: dict[str, Any] = arrays) -> None:
            with open(tmp, "wb") as f:
                np.savez(f, **arrays)

        atomic_write(out / f"part-{k}.npz", write)
    save_npy(out / "parts.npy", part)
    meta = {
        "format_version": FORMAT_VERSION,
        "fingerprint": fp,
        "name": graph.name,
        "num_nodes": n,
        "num_edges": graph.num_edges,
        "num_features": graph.num_features,
        "num_classes": graph.num_classes,
        "weighted": graph.edge_weight is not None,
        "num_relations": graph.num_relations,
        "parts": parts,
        "method": method,
    }
    atomic_write(out / "meta.json", lambda tmp: tmp.write_text(json.dumps(meta, indent=1) + "\n"))
    return out


def load_meta(out_dir: str | os.PathLike) -> dict[str, Any]:
    """The ``meta.json`` of a part directory, validated."""
    path = Path(out_dir) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise DatasetError(f"{path} not found: {out_dir} is not a partition directory (run write_parts)") from None
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path} is unreadable or corrupt: {e}") from None
    if not isinstance(meta, dict) or meta.get("format_version") != FORMAT_VERSION:
        got = meta.get("format_version") if isinstance(meta, dict) else None
        raise DatasetError(f"{path} has format version {got!r}, expected {FORMAT_VERSION}")
    return meta


def _ints(path: Path, data: dict[str, Any], name: str, hi: int, what: str) -> np.ndarray:
    """Array ``name`` of a part file, checked to hold integers in ``[0, hi)`` (``what``: the bound)."""
    a = data[name]
    if a.dtype.kind not in "iu":
        raise DatasetError(f"{path} is corrupt: {name} is a {a.dtype} array, expected integers")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= hi):
        bad = int(a.ravel()[(a.ravel() < 0) | (a.ravel() >= hi)][0])
        raise DatasetError(
            f"{path} is corrupt: {name} holds {bad}, outside [0, {hi}) ({what}); rewrite the partition directory"
        )
    return a


def _check_ownership(out_dir: Path, path: Path, data: dict[str, Any], k: int, parts: int) -> None:
    """Refuse part ``k`` unless its vertex ids are in range and it owns exactly the vertices that
    the directory's ``parts.npy`` (the one assignment every part was cut from) gives part ``k``:
    so no vertex is owned twice or by no part, whichever rank reads which file."""
    n = int(data["num_nodes"])
    if n < 0:
        raise DatasetError(f"{path} is corrupt: num_nodes is {n}")
    owned = _ints(path, data, "owned", n, f"the graph's {n} vertices")
    if owned.ndim != 1 or (owned.size > 1 and bool((np.diff(owned) <= 0).any())):
        raise DatasetError(
            f"{path} is corrupt: owned is not a sorted list of distinct vertex ids; rewrite the partition directory"
        )
    _ints(path, data, "src", n, f"the graph's {n} vertices")
    _ints(path, data, "out_dst", n, f"the graph's {n} vertices")
    _ints(path, data, "ref_ids", n, f"the graph's {n} vertices")
    _ints(path, data, "out_src", owned.size, f"the part's {owned.size} owned vertices")
    _ints(path, data, "ref_part", parts, f"the {parts} parts")
    if bool((np.diff(data["indptr"]) < 0).any()):
        raise DatasetError(f"{path} is corrupt: indptr decreases; rewrite the partition directory")
    assignment = out_dir / "parts.npy"
    if not assignment.is_file():
        raise DatasetError(
            f"{assignment} is missing, so the ownership of {path.name} cannot be checked; rewrite the partition directory"
        )
    from tessera.graph.formats._common import load_npy

    every = load_npy(assignment, "the partition vector")
    if every.shape != (n,) or every.dtype.kind not in "iu":
        raise DatasetError(
            f"{assignment} is corrupt: a {every.dtype} array of shape {every.shape}, expected {n} part ids"
        )
    if n and (int(every.min()) < 0 or int(every.max()) >= parts):
        raise DatasetError(f"{assignment} is corrupt: a part id outside [0, {parts})")
    if not np.array_equal(owned, np.flatnonzero(every == k)):
        mine = np.zeros(n, dtype=bool)
        mine[owned] = True
        other = np.flatnonzero(mine & (every != k))
        if other.size:
            v = int(other[0])
            why = f"vertex {v}, which parts.npy gives part {int(every[v])} (a vertex shared between parts)"
        else:
            v = int(np.flatnonzero(~mine & (every == k))[0])
            why = f"no entry for vertex {v}, which parts.npy gives this part (a vertex no part trains)"
        raise DatasetError(f"{path} owns {why}; rewrite the partition directory with tessera partition")


_REQUIRED = (
    "rank",
    "parts",
    "num_nodes",
    "fingerprint",
    "owned",
    "indptr",
    "src",
    "out_src",
    "out_dst",
    "ref_ids",
    "ref_part",
)


def load_part(
    out_dir: str | os.PathLike,
    k: int,
    expect_fingerprint: str | None = None,
    expect_parts: int | None = None,
) -> dict[str, Any]:
    """Arrays of part ``k`` written by :func:`write_parts` (plus ``meta``); raises DatasetError on
    a missing or corrupt file, a different graph (fingerprint) or a different part count."""
    meta = load_meta(out_dir)
    parts, fp = int(meta["parts"]), str(meta["fingerprint"])
    if expect_fingerprint is not None and fp != expect_fingerprint:
        raise DatasetError(
            f"partition in {out_dir} was written for a different graph (fingerprint {fp}, expected {expect_fingerprint})"
        )
    if expect_parts is not None and parts != int(expect_parts):
        raise DatasetError(f"partition in {out_dir} has {parts} parts, expected {expect_parts}")
    if not 0 <= int(k) < parts:
        raise DatasetError(f"part {k} out of range: {out_dir} holds parts 0..{parts - 1}")
    path = Path(out_dir) / f"part-{int(k)}.npz"
    try:
        with np.load(path, allow_pickle=False) as z:
            data = {name: z[name] for name in z.files}
    except FileNotFoundError:
        raise DatasetError(f"{path} is missing; rewrite the partition directory") from None
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as e:
        raise DatasetError(f"{path} is unreadable or corrupt: {e}") from None
    missing = [name for name in _REQUIRED if name not in data]
    if missing:
        raise DatasetError(f"{path} is corrupt: missing arrays {', '.join(missing)}")
    if str(data["fingerprint"]) != fp or int(data["parts"]) != parts or int(data["rank"]) != int(k):
        raise DatasetError(
            f"{path} does not belong to this partition (rank {int(data['rank'])} of {int(data['parts'])} parts, "
            f"fingerprint {data['fingerprint']}); meta.json says part {k} of {parts}, fingerprint {fp}"
        )
    n_owned, n_in = data["owned"].size, data["src"].size
    ip = data["indptr"]
    ok = ip.shape == (n_owned + 1,) and ip[0] == 0 and ip[-1] == n_in
    ok = ok and data["out_src"].shape == data["out_dst"].shape and data["ref_ids"].shape == data["ref_part"].shape
    if "weight" in data:
        ok = ok and data["weight"].shape == (n_in,) and "out_weight" in data
        ok = ok and data["out_weight"].shape == data["out_dst"].shape
    if "etype" in data:
        ok = ok and data["etype"].shape == (n_in,) and "out_etype" in data
        ok = ok and data["out_etype"].shape == data["out_dst"].shape
    if "x" in data:
        ok = ok and data["x"].shape[:1] == (n_owned,)
    if not ok:
        raise DatasetError(f"{path} is corrupt: inconsistent array shapes")
    _check_ownership(Path(out_dir), path, data, int(k), parts)
    for name in ("x", "weight", "out_weight"):  # as a whole graph's loaders refuse them
        a = data.get(name)
        if a is not None and np.issubdtype(a.dtype, np.floating) and not np.isfinite(a).all():
            raise DatasetError(f"{path} holds a NaN or infinite {name}; rewrite the partition from a clean graph")
    for name in ("weight", "out_weight", "etype", "out_etype"):
        data.setdefault(name, None)
    data["rank"], data["parts"], data["num_nodes"] = int(k), parts, int(data["num_nodes"])
    data["fingerprint"] = fp
    data["meta"] = meta
    return data
