"""Typed (relational) edge lists: one ``src rel dst`` line per edge, integer ids, with optional
``.npy`` features and labels beside the file as for plain edge lists."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tessera.errors import DatasetError
from tessera.files import atomic_write
from tessera.graph.formats._text import parse_columns, parse_numbers
from tessera.graph.formats.edgelist import node_data_for, read_bytes
from tessera.graph.graph import Graph

#: file name endings :func:`tessera.datasets.load_path` reads as typed edge lists
SUFFIXES = (".rel", ".rel.txt", ".rel.tsv", ".rel.gz", ".rel.txt.gz")


def is_typed_edgelist(path: str | Path) -> bool:
    """Whether ``path``'s name ends in one of :data:`SUFFIXES`."""
    return str(path).lower().endswith(SUFFIXES)


def read_typed_edges(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """The ``(E, 2)`` int64 (source, destination) ids and ``(E,)`` relation ids of a ``src rel dst``
    file (whitespace or commas between columns, ``#``/``%`` comment lines and blank lines allowed)."""
    path = Path(path)
    text, lines, ncols = parse_columns(read_bytes(path), str(path), (3,))
    if ncols == 0:
        return np.zeros((0, 2), dtype=np.int64), np.zeros(0, dtype=np.int64)
    values = parse_numbers(text, np.int64, str(path)).reshape(-1, 3)
    neg = (values < 0).any(1)
    if neg.any():
        row = int(np.flatnonzero(neg)[0])
        raise DatasetError(
            f"{path}, line {lines[row]}: negative id in 'src rel dst' = {values[row].tolist()}; "
            "vertex and relation ids are integers >= 0"
        )
    return np.ascontiguousarray(values[:, [0, 2]]), np.ascontiguousarray(values[:, 1])


def load_typed_edgelist(
    path: str | Path,
    *,
    features: str | Path | None = None,
    labels: str | Path | None = None,
    num_relations: int | None = None,
    undirected: bool = False,
    seed: int = 0,
    name: str | None = None,
) -> Graph:
    """Load a ``src rel dst`` edge list as a typed graph (edge ``src -> dst`` of relation ``rel``);
    ``num_relations`` defaults to the largest relation id + 1. Features and labels as
    :func:`~tessera.graph.formats.load_edgelist` reads them."""
    path = Path(path)
    ids, rel = read_typed_edges(path)
    if num_relations is not None and rel.size and int(rel.max()) >= num_relations:
        row = int(np.flatnonzero(rel >= num_relations)[0])
        raise DatasetError(
            f"{path}: edge {row} has relation {int(rel[row])}, outside the declared [0, {num_relations})"
        )
    n, node_data = node_data_for(path, ids, features, labels, seed, name)
    g = Graph.from_edge_index(
        torch.from_numpy(np.ascontiguousarray(ids.T)),
        n,
        edge_type=torch.from_numpy(rel),
        num_relations=num_relations,
        **node_data,
    )
    return g.to_undirected() if undirected else g


def write_typed_edgelist(graph: Graph, path: str | Path) -> None:
    """Write ``graph``'s edges as ``src rel dst`` lines (the inverse of :func:`load_typed_edgelist`)."""
    if graph.edge_type is None:
        raise DatasetError(f"graph {graph.name!r} has no edge types to write")
    table = np.stack([graph.src_index().numpy(), graph.edge_type.numpy(), graph.dst_index().numpy()], 1)
    atomic_write(Path(path), lambda tmp: np.savetxt(tmp, table, fmt="%d"))
