"""Planetoid citation graphs (Cora, CiteSeer, PubMed) from the original ``ind.<name>.*`` files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessera.errors import DatasetError
from tessera.graph.formats._common import edges_to_graph, index_mask, labelled_only
from tessera.graph.formats.safe_pickle import safe_load
from tessera.graph.graph import Graph

PARTS = ("x", "tx", "allx", "y", "ty", "ally", "graph", "test.index")


def planetoid_files(root: str | Path, name: str) -> dict[str, Path]:
    """Paths of the eight ``ind.<name>.*`` files; DatasetError naming the first one missing."""
    root = Path(root)
    files = {part: root / f"ind.{name.lower()}.{part}" for part in PARTS}
    for p in files.values():
        if not p.is_file():
            raise DatasetError(
                f"Planetoid file {p} not found; {root} must hold ind.{name.lower()}.{{{','.join(PARTS)}}}"
            )
    return files


def _matrix(obj: Any, source: Path) -> np.ndarray:
    try:
        a = obj.toarray() if hasattr(obj, "toarray") else np.asarray(obj)
    except Exception as e:  # a well-formed pickle can still hold a broken matrix
        raise DatasetError(f"{source} does not hold a valid matrix ({type(e).__name__}: {e})") from e
    if a.ndim != 2 or a.dtype.kind not in "biuf":
        raise DatasetError(f"{source} holds a {a.dtype} array of shape {a.shape}; expected a 2-D numeric matrix")
    return a


def _test_index(path: Path) -> np.ndarray:
    try:
        idx = np.fromstring(path.read_bytes(), dtype=np.int64, sep=" ")
    except (OSError, ValueError) as e:
        raise DatasetError(f"{path}: expected one integer vertex id per line ({e})") from e
    if idx.size == 0:
        raise DatasetError(f"{path} is empty")
    if np.unique(idx).size != idx.size:
        raise DatasetError(f"{path} lists some vertices more than once")
    return idx


def _edges(graph: Any, source: Path) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(graph, dict):
        raise DatasetError(f"{source} holds a {type(graph).__name__}; expected an adjacency dict")
    try:
        keys = np.fromiter(graph.keys(), dtype=np.int64, count=len(graph))
        nbrs = [np.asarray(v, dtype=np.int64).reshape(-1) for v in graph.values()]
    except (TypeError, ValueError, OverflowError) as e:
        raise DatasetError(f"{source}: adjacency dict must map vertex ids to lists of vertex ids ({e})") from e
    lens = np.array([a.size for a in nbrs], dtype=np.int64)
    dst = np.concatenate(nbrs) if nbrs else np.zeros(0, np.int64)
    return np.repeat(keys, lens), dst


def load_planetoid(root: str | Path, name: str) -> Graph:
    """Load ``ind.<name>.*`` from ``root`` with exactly PyG's ``read_planetoid_data`` semantics
    (isolated CiteSeer test-range vertices get zero features and label -1)."""
    name = name.lower()
    files = planetoid_files(root, name)
    tx, allx, ty, ally = (_matrix(safe_load(files[p]), files[p]) for p in ("tx", "allx", "ty", "ally"))
    y_train = _matrix(safe_load(files["y"]), files["y"])
    graph = safe_load(files["graph"])
    test_index = _test_index(files["test.index"])

    if tx.shape[0] != test_index.size or ty.shape[0] != test_index.size:
        raise DatasetError(
            f"{files['tx'].parent}: tx has {tx.shape[0]} rows and ty {ty.shape[0]}, "
            f"but test.index lists {test_index.size} vertices"
        )
    if allx.shape[1] != tx.shape[1] or ally.shape[1] != ty.shape[1] or allx.shape[0] != ally.shape[0]:
        raise DatasetError(f"{files['allx'].parent}: allx/ally/tx/ty shapes disagree")
    # CiteSeer has isolated vertices inside the test range that test.index skips: PyG widens
    # tx/ty to the whole range min..max with zero rows for them.
    sorted_index = np.sort(test_index)
    lo = int(sorted_index[0])
    span = int(sorted_index[-1]) - lo + 1
    tx_ext = np.zeros((span, tx.shape[1]), dtype=tx.dtype)
    tx_ext[sorted_index - lo] = tx
    ty_ext = np.zeros((span, ty.shape[1]), dtype=ty.dtype)
    ty_ext[sorted_index - lo] = ty

    x = np.concatenate([allx, tx_ext]).astype(np.float32)
    onehot = np.concatenate([ally, ty_ext])
    n = x.shape[0]
    if lo < 0 or int(sorted_index[-1]) >= n:
        raise DatasetError(f"{files['test.index']}: test vertices must lie in [0, {n}), found {lo}..{sorted_index[-1]}")
    x[test_index] = x[sorted_index]
    y = np.where(onehot.any(1), onehot.argmax(1), -1).astype(np.int64)
    y[test_index] = y[sorted_index]

    n_train = y_train.shape[0]
    if n_train + 500 > n:
        raise DatasetError(f"{files['y']}: {n_train} training rows leave no room for 500 validation vertices in {n}")
    yt = torch.from_numpy(y)
    masks, _ = labelled_only(
        {
            "train_mask": index_mask(np.arange(n_train), n, str(files["y"])),
            "val_mask": index_mask(np.arange(n_train, n_train + 500), n, str(files["y"])),
            "test_mask": index_mask(test_index, n, str(files["test.index"])),
        },
        yt,
    )
    src, dst = _edges(graph, files["graph"])
    return edges_to_graph(
        src,
        dst,
        n,
        source=str(files["graph"]),
        coalesce=True,
        drop_self_loops=True,
        x=torch.from_numpy(x),
        y=yt,
        num_classes=int(onehot.shape[1]),
        name=name,
        **masks,
    )
