"""OGB node-property-prediction datasets from their raw ``*.csv.gz`` directory layout."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tessera.errors import DatasetError
from tessera.graph.formats._common import MASKS, edges_to_graph, label_data, labels_from_array, split_mask
from tessera.graph.formats._limits import check_vertex_count
from tessera.graph.formats._text import RowCountError, read_csv_gz
from tessera.graph.graph import Graph

_SPLIT_FILES = dict(zip(MASKS, ("train", "valid", "test"), strict=True))


def is_ogb_dir(path: str | Path) -> bool:
    """Whether ``path`` looks like an OGB dataset directory (has ``raw/edge.csv.gz``)."""
    return (Path(path) / "raw" / "edge.csv.gz").is_file()


def _table(path: Path, dtype: type, ncols: int | None = None, rows: int | None = None) -> np.ndarray:
    # parsed a piece at a time into the table: products' node-feat.csv.gz is 2.4 GB of text
    return read_csv_gz(path, dtype, ncols, rows)


def _split_dir(root: Path, split: str | None) -> Path | None:
    base = root / "split"
    subdirs = sorted(p for p in base.iterdir() if p.is_dir()) if base.is_dir() else []
    names = ", ".join(p.name for p in subdirs) or "none"
    if split is not None:
        if split not in {p.name for p in subdirs}:
            raise DatasetError(f"{root} has no split {split!r} under split/ (it has: {names}); choose one with --split")
        return base / split
    if len(subdirs) > 1:
        raise DatasetError(f"{root} has several splits ({names}); choose one with --split (split= in Python)")
    return subdirs[0] if subdirs else None


def load_ogb(
    root: str | Path, *, undirected: bool = True, split: str | None = None, name: str | None = None, seed: int = 0
) -> Graph:
    """Load an OGB node-property directory (``raw/*.csv.gz`` plus ``split/<kind>/*.csv.gz``),
    symmetrised and deduplicated when ``undirected`` (the usual full-graph setting); without a
    split directory, the seeded 20/30-per-class split."""
    root = Path(root)
    raw = root / "raw"
    if not is_ogb_dir(root):
        raise DatasetError(f"{root} is not an OGB dataset directory: {raw / 'edge.csv.gz'} is missing")
    count_file = raw / "num-node-list.csv.gz"
    declared = None
    if count_file.is_file():
        counts = _table(count_file, np.int64, 1)
        if counts.shape[0] != 1:
            raise DatasetError(
                f"{count_file} lists {counts.shape[0]} graphs; only single-graph node datasets are supported"
            )
        declared = int(counts[0, 0])
        if declared < 0:
            raise DatasetError(f"{count_file} says the graph has {declared} nodes")
    edges = _table(raw / "edge.csv.gz", np.int64, 2)
    x = None
    if (raw / "node-feat.csv.gz").is_file():
        try:  # one table of the declared rows, filled as the text is parsed
            x = _table(raw / "node-feat.csv.gz", np.float32, rows=declared)
        except RowCountError as e:
            found = f"more than {e.declared}" if e.found is None else e.found
            raise DatasetError(
                f"{raw / 'node-feat.csv.gz'} has {found} rows but the graph has {e.declared} nodes"
            ) from None
    y = None
    if (raw / "node-label.csv.gz").is_file():
        y = labels_from_array(_table(raw / "node-label.csv.gz", np.float64), str(raw / "node-label.csv.gz"))

    if declared is not None:
        n, bound = declared, f"{count_file.name} says {declared} nodes"
    else:
        n = max(
            int(edges.max()) + 1 if edges.size else 0, len(x) if x is not None else 0, len(y) if y is not None else 0
        )
        bound = ""
    if x is None and y is None:
        check_vertex_count(n, edges.shape[0], str(raw), "add raw/node-feat.csv.gz or raw/node-label.csv.gz")
    for what, arr in (("node-feat.csv.gz", x), ("node-label.csv.gz", y)):
        if arr is not None and arr.shape[0] != n:
            raise DatasetError(f"{raw / what} has {arr.shape[0]} rows but the graph has {n} nodes")

    node_data: dict = {"name": name or root.resolve().name}
    if x is not None:
        node_data["x"] = torch.from_numpy(x)
    if y is not None:
        split_dir = _split_dir(root, split)
        masks = None
        if split_dir is not None:
            masks = {}
            for key, stem in _SPLIT_FILES.items():
                f = split_dir / f"{stem}.csv.gz"
                if f.is_file():
                    masks[key] = split_mask(_table(f, np.int64, 1), n, "the split", str(f), ids_only=True)
        node_data.update(label_data(y, masks, seed, str(raw / "node-label.csv.gz")))
    source = str(raw / "edge.csv.gz")
    return edges_to_graph(edges[:, 0], edges[:, 1], n, source=source, undirected=undirected, bound=bound, **node_data)
