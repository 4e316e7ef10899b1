"""Plain-text edge lists (``src dst [weight]`` per line) with optional ``.npy`` features and labels."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tessera.errors import DatasetError
from tessera.graph.formats._common import label_data, labels_from_array, load_npy
from tessera.graph.formats._limits import check_vertex_count
from tessera.graph.formats._text import parse_columns, parse_numbers, read_gzip
from tessera.graph.graph import Graph


def _sibling(path: Path, kind: str) -> Path | None:
    for stem in (path.stem, path.name):
        p = path.with_name(f"{stem}.{kind}.npy")
        if p.is_file():
            return p
    return None


def read_bytes(path: Path) -> bytes:
    """The bytes of a text file (``.gz`` decompressed), or a DatasetError naming why not."""
    if path.suffix == ".gz":
        return read_gzip(path)
    try:
        return path.read_bytes()
    except OSError as e:
        raise DatasetError(f"cannot read {path}: {e.strerror or e}") from e


def read_edges(path: str | Path) -> tuple[np.ndarray, np.ndarray | None]:
    """The ``(E, 2)`` int64 vertex ids and optional ``(E,)`` weights of an edge-list file."""
    path = Path(path)
    data = read_bytes(path)
    text, lines, ncols = parse_columns(data, str(path), (2, 3))
    if ncols == 0:
        return np.zeros((0, 2), dtype=np.int64), None
    values = parse_numbers(text, np.int64 if ncols == 2 else np.float64, str(path)).reshape(-1, ncols)
    ids = values[:, :2]
    if ncols == 3:
        frac = (ids != np.floor(ids)).any(1)
        if frac.any():
            row = int(np.flatnonzero(frac)[0])
            raise DatasetError(f"{path}, line {lines[row]}: vertex ids must be integers, got {ids[row].tolist()}")
        ids = ids.astype(np.int64)
    _check_ids(ids, lines, path)
    if ncols == 2:
        return ids, None
    weight = values[:, 2]
    # Aggregations normalise by weighted degree, which needs finite non-negative weights.
    bad = ~np.isfinite(weight) | (weight < 0) | (weight > np.finfo(np.float32).max)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        raise DatasetError(
            f"{path}, line {lines[row]}: edge weight {float(values[row, 2])!r} must be finite, non-negative "
            "and within float32 range"
        )
    return ids, weight.astype(np.float32)


def _check_ids(ids: np.ndarray, lines: np.ndarray, path: Path) -> None:
    neg = (ids < 0).any(1)
    if neg.any():
        row = int(np.flatnonzero(neg)[0])
        raise DatasetError(f"{path}, line {lines[row]}: negative vertex id in {ids[row].tolist()}")


def node_data_for(
    path: Path,
    ids: np.ndarray,
    features: str | Path | None,
    labels: str | Path | None,
    seed: int,
    name: str | None,
) -> tuple[int, dict]:
    """The vertex count and node data (features, labels, seeded split) of an edge file whose
    endpoints are ``ids``, from ``.npy`` files (default: the siblings ``<stem>.features.npy`` /
    ``<stem>.labels.npy``)."""
    feat_path = Path(features) if features is not None else _sibling(path, "features")
    label_path = Path(labels) if labels is not None else _sibling(path, "labels")
    x = load_npy(feat_path, "features") if feat_path is not None else None
    y = None
    if label_path is not None:
        y = labels_from_array(load_npy(label_path, "labels"), str(label_path))
    if x is not None and (x.ndim != 2 or x.dtype.kind not in "biuf"):
        raise DatasetError(f"{feat_path}: features must be a numeric 2-D array, got {x.dtype} of shape {x.shape}")

    n = int(ids.max()) + 1 if ids.size else 0
    if x is None and y is None:
        fix = f"put features or labels in {path.stem}.features.npy / {path.stem}.labels.npy beside it to declare more"
        check_vertex_count(n, ids.shape[0], str(path), fix)
    if x is not None:
        if ids.size and n > x.shape[0]:
            row = int(np.flatnonzero((ids >= x.shape[0]).any(1))[0])
            raise DatasetError(
                f"{path}: edge {ids[row].tolist()} references vertex {int(ids[row].max())}, "
                f"but {feat_path} has features for only {x.shape[0]} vertices"
            )
        n = x.shape[0]
    if y is not None:
        if x is None and y.shape[0] >= n:
            n = y.shape[0]
        if y.shape[0] != n:
            raise DatasetError(f"{label_path} has {y.shape[0]} labels but the graph has {n} vertices")

    node_data: dict = {"name": name or path.stem}
    if x is not None:
        node_data["x"] = torch.from_numpy(x.astype(np.float32))
    if y is not None:
        node_data.update(label_data(y, None, seed, str(label_path)))
    return n, node_data


def load_edgelist(
    path: str | Path,
    *,
    features: str | Path | None = None,
    labels: str | Path | None = None,
    undirected: bool = False,
    seed: int = 0,
    name: str | None = None,
) -> Graph:
    """Load a text edge list; features/labels from ``.npy`` files (default: the sibling files
    ``<stem>.features.npy`` / ``<stem>.labels.npy``), seeded 20/30-per-class split with labels."""
    path = Path(path)
    ids, weight = read_edges(path)
    n, node_data = node_data_for(path, ids, features, labels, seed, name)
    g = Graph.from_edge_index(
        torch.from_numpy(np.ascontiguousarray(ids.T)),
        n,
        edge_weight=None if weight is None else torch.from_numpy(weight),
        **node_data,
    )
    return g.to_undirected() if undirected else g
