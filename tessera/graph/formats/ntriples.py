"""N-Triples knowledge graphs (``<s> <p> <o> .`` lines) as typed graphs, with vertex classes from a
label file.

Every IRI or blank node that appears as a subject or an object is a vertex; each triple whose
object is one is an edge ``s -> o`` of relation ``p``. Triples whose object is a literal carry no
edge and are skipped. Ids are given in first-seen order, reading the file top to bottom:
vertices in the order their subject or object first appears (subject before object within a
line), relations in the order their predicate first appears. The label file has one
``<iri> class`` line per labelled vertex (``#`` comments and blank lines allowed); classes that
are all integers are used as class ids, otherwise class names are numbered in first-seen order.
Vertices without a line are unlabelled. Features come from a ``.npy`` file with one row per
vertex in id order, when given.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from tessera.errors import DatasetError
from tessera.graph.formats._common import label_data, load_npy
from tessera.graph.formats.edgelist import read_bytes
from tessera.graph.graph import Graph

#: file name endings :func:`tessera.datasets.load_path` reads as N-Triples
SUFFIXES = (".nt", ".nt.gz")
_TERM = r'<[^<>"{}|^`\\\s]*>|_:\S+'
_LITERAL = r'"(?:[^"\\]|\\.)*"(?:@[A-Za-z0-9-]+|\^\^<[^>\s]*>)?'
_TRIPLE = re.compile(rf"\s*({_TERM})\s+(<[^>\s]*>)\s+({_TERM}|{_LITERAL})\s*\.\s*(?:#.*)?$")
_LABEL = re.compile(rf"\s*({_TERM})\s+(\S+)\s*$")


def is_ntriples(path: str | Path) -> bool:
    """Whether ``path``'s name ends in one of :data:`SUFFIXES`."""
    return str(path).lower().endswith(SUFFIXES)


def _lines(path: Path) -> list[str]:
    try:
        return read_bytes(path).decode("utf-8").splitlines()
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path} is not UTF-8 text (N-Triples is UTF-8): {e}") from None


def read_triples(path: str | Path) -> tuple[np.ndarray, np.ndarray, dict[str, int], dict[str, int]]:
    """``(E, 2)`` (subject, object) vertex ids, ``(E,)`` relation ids, and the vertex and relation
    id of every IRI (first-seen order) of an N-Triples file; DatasetError naming a malformed line."""
    path = Path(path)
    vertices: dict[str, int] = {}
    relations: dict[str, int] = {}
    edges: list[tuple[int, int, int]] = []
    for lineno, line in enumerate(_lines(path), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _TRIPLE.match(line)
        if m is None:
            raise DatasetError(
                f"{path}, line {lineno}: not an N-Triples statement '<subject> <predicate> <object> .': {line[:80]!r}"
            )
        s, p, o = m.groups()
        sid = vertices.setdefault(s, len(vertices))
        if o.startswith('"'):
            continue  # a literal: an attribute, not an edge
        edges.append((sid, relations.setdefault(p, len(relations)), vertices.setdefault(o, len(vertices))))
    table = np.array(edges, dtype=np.int64).reshape(-1, 3)
    return np.ascontiguousarray(table[:, [0, 2]]), np.ascontiguousarray(table[:, 1]), vertices, relations


def read_labels(path: str | Path, vertices: dict[str, int]) -> np.ndarray:
    """The class of every vertex (-1: unlabelled) from a ``<iri> class`` label file."""
    path = Path(path)
    pairs: list[tuple[int, str]] = []
    for lineno, line in enumerate(_lines(path), 1):
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        m = _LABEL.match(line)
        if m is None:
            raise DatasetError(f"{path}, line {lineno}: expected '<iri> class', got {line[:80]!r}")
        iri, cls = m.groups()
        if iri not in vertices:
            raise DatasetError(f"{path}, line {lineno}: {iri} does not occur in the triples")
        pairs.append((vertices[iri], cls))
    y = np.full(len(vertices), -1, dtype=np.int64)
    if all(re.fullmatch(r"\d+", c) for _, c in pairs):
        for v, c in pairs:
            y[v] = int(c)
    else:
        names: dict[str, int] = {}
        for v, c in pairs:
            y[v] = names.setdefault(c, len(names))
    return y


def load_ntriples(
    path: str | Path,
    labels: str | Path | None = None,
    *,
    features: str | Path | None = None,
    seed: int = 0,
    name: str | None = None,
) -> Graph:
    """A typed graph from an N-Triples file (see the module docstring for the id order); labels
    from ``labels`` (default: ``<stem>.labels`` beside it, when present) with a seeded 20/30 per
    class split, features from a ``.npy`` file."""
    path = Path(path)
    ids, rel, vertices, relations = read_triples(path)
    n = len(vertices)
    stem = re.sub(r"\.nt(\.gz)?$", "", path.name, flags=re.IGNORECASE)
    if labels is None and (path.parent / f"{stem}.labels").is_file():
        labels = path.parent / f"{stem}.labels"
    node: dict = {"name": name or stem}
    if labels is not None:
        node.update(label_data(read_labels(labels, vertices), None, seed, str(labels)))
    if features is not None:
        x = load_npy(Path(features), "features")
        if x.ndim != 2 or x.shape[0] != n or x.dtype.kind not in "biuf":
            raise DatasetError(f"{features}: features must be numeric of shape ({n}, F), got {x.dtype} {x.shape}")
        node["x"] = torch.from_numpy(x.astype(np.float32))
    return Graph.from_edge_index(
        torch.from_numpy(np.ascontiguousarray(ids.T)),
        n,
        edge_type=torch.from_numpy(rel),
        num_relations=len(relations),
        **node,
    )
