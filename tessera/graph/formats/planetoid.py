"""Planetoid citation graphs (Cora, CiteSeer, PubMed) from the original ``ind.<name>.*`` files."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessera.errors import DatasetError
from tessera.graph.formats._common import edges_to_graph, index_mask, labelled_only
from tessera.graph.formats._limits import require_memory
from tessera.graph.formats._text import parse_numbers
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


def _shape(obj: Any, source: Path) -> tuple[int, int]:
    """Shape of a pickled numpy array or scipy CSR matrix, read without densifying it."""
    import scipy.sparse as sp

    if not isinstance(obj, (np.ndarray, sp.csr_matrix)):
        raise DatasetError(f"{source} holds a {type(obj).__name__}; expected a numpy array or a scipy CSR matrix")
    try:
        shape, kind = tuple(int(s) for s in obj.shape), obj.dtype.kind
    except Exception as e:  # a crafted CSR object can lack or garble its fields
        raise DatasetError(f"{source} does not hold a valid matrix ({type(e).__name__}: {e})") from e
    if len(shape) != 2 or min(shape) < 0 or kind not in "biuf":
        raise DatasetError(f"{source} holds a {obj.dtype} matrix of shape {shape}; expected a 2-D numeric matrix")
    return shape[0], shape[1]


def _dense(obj: Any, source: Path) -> np.ndarray:
    try:
        return obj.toarray() if not isinstance(obj, np.ndarray) else obj
    except Exception as e:  # a well-formed pickle can still hold a broken matrix
        raise DatasetError(f"{source} does not hold a valid matrix ({type(e).__name__}: {e})") from e


def _test_index(path: Path) -> np.ndarray:
    try:
        text = path.read_bytes()
    except OSError as e:
        raise DatasetError(f"cannot read {path}: {e.strerror or e}") from e
    idx = parse_numbers(text, np.int64, str(path))
    if idx.size == 0:
        raise DatasetError(f"{path} is empty")
    if np.unique(idx).size != idx.size:
        raise DatasetError(f"{path} lists some vertices more than once")
    return idx


def _check_shapes(shapes: dict[str, tuple[int, int]], test_index: np.ndarray, files: dict[str, Path]) -> None:
    """Every size the eight files declare must agree, before anything is densified."""
    folder, k = files["tx"].parent, test_index.size
    if shapes["tx"][0] != k or shapes["ty"][0] != k:
        raise DatasetError(
            f"{folder}: tx has {shapes['tx'][0]} rows and ty {shapes['ty'][0]}, but test.index lists {k} vertices"
        )
    same = (
        shapes["allx"][1] == shapes["tx"][1] == shapes["x"][1]
        and shapes["ally"][1] == shapes["ty"][1] == shapes["y"][1]
        and shapes["allx"][0] == shapes["ally"][0]
        and shapes["x"][0] == shapes["y"][0]
    )
    if not same:
        listed = ", ".join(f"{p} {shapes[p][0]}x{shapes[p][1]}" for p in ("x", "y", "allx", "ally", "tx", "ty"))
        raise DatasetError(f"{folder}: the matrix shapes disagree ({listed})")
    lo, hi, first = int(test_index.min()), int(test_index.max()), shapes["allx"][0]
    # PyG widens tx to the ids lo..hi after allx's rows; real files start right there (CiteSeer's
    # 1,000 test rows span 1,015 ids, skipping isolated vertices).
    if lo < 0 or lo > first or hi - lo + 1 > 2 * k:
        raise DatasetError(
            f"{files['test.index']}: test ids run {lo}..{hi}, but they must start at most at {first} (after allx's "
            f"rows) and span at most twice the {k} test rows"
        )


def _edges(graph: Any, source: Path) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(graph, dict):
        raise DatasetError(f"{source} holds a {type(graph).__name__}; expected an adjacency dict")
    try:
        lens = np.fromiter((len(v) for v in graph.values()), dtype=np.int64, count=len(graph))
        # A list referenced by many vertices costs the pickle a few bytes per reference; stored
        # lists cost at least a byte per entry.
        if int(lens.sum()) > source.stat().st_size:
            raise DatasetError(
                f"{source}: its adjacency lists hold {int(lens.sum()):,} entries, more than the file's "
                f"{source.stat().st_size:,} bytes can store; lists shared between vertices are refused"
            )
        keys = np.fromiter(graph.keys(), dtype=np.int64, count=len(graph))
        nbrs = [np.asarray(v, dtype=np.int64).reshape(-1) for v in graph.values()]
    except (TypeError, ValueError, OverflowError) as e:
        raise DatasetError(f"{source}: adjacency dict must map vertex ids to lists of vertex ids ({e})") from e
    dst = np.concatenate(nbrs) if nbrs else np.zeros(0, np.int64)
    return np.repeat(keys, lens), dst


def load_planetoid(root: str | Path, name: str) -> Graph:
    """Load ``ind.<name>.*`` from ``root`` with exactly PyG's ``read_planetoid_data`` semantics
    (isolated CiteSeer test-range vertices get zero features and label -1)."""
    name = name.lower()
    files = planetoid_files(root, name)
    # ind.<name>.x (the training rows of allx) is unused, as in PyG, but read so its payload is vetted.
    mats = {p: safe_load(files[p]) for p in ("x", "y", "tx", "allx", "ty", "ally")}
    shapes = {p: _shape(m, files[p]) for p, m in mats.items()}
    graph = safe_load(files["graph"])
    test_index = _test_index(files["test.index"])
    _check_shapes(shapes, test_index, files)
    # CiteSeer has isolated vertices inside the test range that test.index skips: PyG widens
    # tx/ty to the whole range min..max with zero rows for them.
    sorted_index = np.sort(test_index)
    lo = int(sorted_index[0])
    span = int(sorted_index[-1]) - lo + 1
    rows, cols = shapes["allx"][0] + span, shapes["allx"][1] + shapes["ally"][1]
    require_memory(rows * cols * 12, f"the dense {rows:,} x {cols:,} features and one-hot labels", str(files["allx"]))
    tx, allx, ty, ally = (_dense(mats[p], files[p]) for p in ("tx", "allx", "ty", "ally"))
    tx_ext = np.zeros((span, tx.shape[1]), dtype=tx.dtype)
    tx_ext[sorted_index - lo] = tx
    ty_ext = np.zeros((span, ty.shape[1]), dtype=ty.dtype)
    ty_ext[sorted_index - lo] = ty

    x = np.concatenate([allx, tx_ext]).astype(np.float32)
    onehot = np.concatenate([ally, ty_ext])
    n = x.shape[0]
    x[test_index] = x[sorted_index]
    y = np.where(onehot.any(1), onehot.argmax(1), -1).astype(np.int64)
    y[test_index] = y[sorted_index]

    n_train = shapes["y"][0]
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
        train_mask=masks["train_mask"],
        val_mask=masks["val_mask"],
        test_mask=masks["test_mask"],
    )
