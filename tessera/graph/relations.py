"""Per-relation structure of a typed CSR: the matrices the relational (RGCN) primitives multiply with.

Every edge ``j -> i`` of relation ``r`` contributes ``norm_e W_r x_j`` to row ``i``; ``norm_e`` is
1 for ``sum`` and ``1 / |N_r(i)|`` (the in-degree of ``i`` within relation ``r``) for ``mean``. The
same sum is laid out four ways (WiseGraph §5.2, Fig. 9), each built here once per graph:

* :func:`all_pairs`: an ``N x (R N)`` matrix whose entry for edge ``e`` is column ``r N + j``, to
  multiply with every relation's transform of every vertex;
* :func:`source_pairs`: the distinct (relation, source) pairs, ordered by relation, and an
  ``N x P`` matrix whose entry for edge ``e`` is its pair (unique-value extraction: ``W_r x_j``
  is computed once per pair, not per edge);
* :func:`destination_pairs`: the distinct (relation, destination) pairs and a ``P x N`` matrix
  aggregating each pair's in-edges (aggregate first, transform per pair, then scatter);
* :func:`edges_by_relation`: the edges sorted by relation (a transform per edge).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.sparse as sp
import torch

from tessera.errors import GraphError
from tessera.graph.csr import CSRMatrix, CSRStructure, rows_of
from tessera.graph.graph import Graph

REDUCES = ("sum", "mean")


@dataclass(frozen=True)
class RelationPairs:
    """Distinct (relation, vertex) pairs ordered by relation then vertex: ``vertex[p]`` is pair
    ``p``'s vertex, pairs of relation ``r`` are ``ptr[r]:ptr[r + 1]``; ``matrix`` connects the pairs
    with the vertices (see :func:`source_pairs` and :func:`destination_pairs`)."""

    vertex: torch.Tensor
    ptr: torch.Tensor
    matrix: CSRMatrix


@dataclass(frozen=True)
class RelationEdges:
    """The edges sorted by relation (stable): sources, destinations, ``norm`` (None: all ones),
    and ``ptr`` (edges of relation ``r`` at ``ptr[r]:ptr[r + 1]``)."""

    src: torch.Tensor
    dst: torch.Tensor
    norm: torch.Tensor | None
    ptr: torch.Tensor


def require_types(graph: CSRStructure) -> torch.Tensor:
    """The relation of every edge (CSR order); GraphError when the graph is untyped."""
    t = graph.edge_type if isinstance(graph, (Graph, CSRMatrix)) else None
    if t is None:
        raise GraphError(
            f"{graph!r} has no edge types: relational layers (RGCN) need a typed graph "
            "(a 'src rel dst' edge list, N-Triples, PyG data with edge_type, or synthetic:<preset>-rel)"
        )
    return t


def edge_types(graph: CSRStructure) -> tuple[np.ndarray, int]:
    """The relation of every edge (int64, CSR order) and the relation count; GraphError when untyped."""
    t = require_types(graph)
    assert graph.num_relations is not None  # set with edge_type
    return t.numpy(), int(graph.num_relations)


def _check_reduce(reduce: str) -> None:
    if reduce not in REDUCES:
        raise ValueError(f"reduce must be one of {REDUCES}, got {reduce!r}")


def edge_norm(graph: CSRStructure, reduce: str) -> np.ndarray | None:
    """``1 / |N_r(i)|`` per edge for ``mean`` (float32, CSR order), None for ``sum``; the counts
    are the matrix's ``relation_degree`` where it gives them (:class:`~tessera.graph.csr.CSRMatrix`)."""
    _check_reduce(reduce)
    if reduce == "sum":
        return None
    t, r = edge_types(graph)
    degree = graph.relation_degree if isinstance(graph, CSRMatrix) else None
    if degree is not None:
        return (1.0 / degree.numpy()).astype(np.float32)
    key = rows_of(graph.indptr.numpy()) * max(r, 1) + t
    _, inverse, counts = np.unique(key, return_inverse=True, return_counts=True)
    return (1.0 / counts[inverse]).astype(np.float32)


def _pairs(vertex: np.ndarray, t: np.ndarray, n: int, r: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Distinct ``(t, vertex)`` pairs sorted by relation then vertex: their vertices, relation
    pointer, and the pair id of every input position."""
    uniq, inverse = np.unique(t * max(n, 1) + vertex, return_inverse=True)
    ptr = np.searchsorted(uniq // max(n, 1), np.arange(r + 1), side="left").astype(np.int64)
    return (uniq % max(n, 1)).astype(np.int64), ptr, inverse.astype(np.int64)


def _sorted_rows(indptr: np.ndarray, cols: np.ndarray, vals: np.ndarray | None, shape: tuple[int, int]):
    """Sort each row's entries by column (gathers then walk memory forward)."""
    data = np.arange(cols.size, dtype=np.int64)
    m = sp.csr_matrix((data, cols, indptr), shape=shape)
    m.has_sorted_indices = False
    m.sort_indices()
    order = m.data
    return m.indices, None if vals is None else vals[order]


def all_pairs(graph: CSRStructure, reduce: str) -> CSRMatrix:
    """``N x (R N)``: edge ``j -> i`` of relation ``r`` is entry ``(i, r N + j)`` with value ``norm``."""
    t, r = edge_types(graph)
    n = graph.num_cols
    indptr = graph.indptr.numpy().astype(np.int64)
    cols, vals = _sorted_rows(indptr, t * n + graph.indices.numpy(), edge_norm(graph, reduce), (graph.num_rows, r * n))
    return CSRMatrix.from_numpy(indptr, cols, vals, graph.num_rows, r * n)


def source_pairs(graph: CSRStructure, reduce: str) -> RelationPairs:
    """The distinct (relation, source) pairs and the ``N x P`` matrix whose entry for edge
    ``j -> i`` of relation ``r`` is ``(i, pair(r, j))`` with value ``norm``."""
    t, r = edge_types(graph)
    vertex, ptr, pair = _pairs(graph.indices.numpy().astype(np.int64), t, graph.num_cols, r)
    indptr = graph.indptr.numpy().astype(np.int64)
    cols, vals = _sorted_rows(indptr, pair, edge_norm(graph, reduce), (graph.num_rows, vertex.size))
    matrix = CSRMatrix.from_numpy(indptr, cols, vals, graph.num_rows, vertex.size)
    return RelationPairs(torch.from_numpy(vertex), torch.from_numpy(ptr), matrix)


def destination_pairs(graph: CSRStructure, reduce: str) -> RelationPairs:
    """The distinct (relation, destination) pairs and the ``P x N`` matrix whose row ``pair(r, i)``
    lists the sources of ``i``'s in-edges of relation ``r`` with value ``norm``."""
    t, r = edge_types(graph)
    dst = rows_of(graph.indptr.numpy())
    vertex, ptr, pair = _pairs(dst, t, graph.num_rows, r)
    # Pairs are ordered by (relation, destination); a stable sort of the edges by pair keeps each
    # row's sources in CSR order.
    order = np.argsort(pair, kind="stable")
    indptr = np.zeros(vertex.size + 1, dtype=np.int64)
    np.cumsum(np.bincount(pair, minlength=vertex.size), out=indptr[1:])
    norm = edge_norm(graph, reduce)
    matrix = CSRMatrix.from_numpy(
        indptr, graph.indices.numpy()[order], None if norm is None else norm[order], vertex.size, graph.num_cols
    )
    return RelationPairs(torch.from_numpy(vertex), torch.from_numpy(ptr), matrix)


def edges_by_relation(graph: CSRStructure, reduce: str) -> RelationEdges:
    """Every edge, sorted by relation (stable, so CSR order within a relation)."""
    t, r = edge_types(graph)
    order = np.argsort(t, kind="stable")
    ptr = np.searchsorted(t[order], np.arange(r + 1), side="left").astype(np.int64)
    norm = edge_norm(graph, reduce)
    return RelationEdges(
        torch.from_numpy(graph.indices.numpy().astype(np.int64)[order]),
        torch.from_numpy(rows_of(graph.indptr.numpy())[order]),
        None if norm is None else torch.from_numpy(norm[order]),
        torch.from_numpy(ptr),
    )


def pair_counts(graph: CSRStructure) -> tuple[int, int]:
    """How many distinct (relation, source) and (relation, destination) pairs the graph has."""
    t, r = edge_types(graph)
    n = max(graph.num_rows, graph.num_cols, 1)
    src = np.unique(t * n + graph.indices.numpy()).size
    dst = np.unique(t * n + rows_of(graph.indptr.numpy())).size
    return int(src), int(dst)
