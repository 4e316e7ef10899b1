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
between the two numberings. :func:`tessera.backends.ordering.choose_order` times one aggregation
under each order and keeps
the fastest only when it beats the original numbering by a margin. Orders are kept per graph in
memory and on disk beside the partition cache (``$TESSERA_CACHE/orders``).

The trainer (``--reorder``) trains in the new numbering and maps everything user-visible back.
Dropout masks are keyed by the caller's vertex ids (``tessera.kernels.dropout``'s ``rows``), so a
renumbered run draws the same masks for the same vertices as an unnumbered one.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import scipy.sparse as sp
import torch

from tessera.digest import digest
from tessera.errors import ConfigError
from tessera.files import kept, save_npy
from tessera.graph.graph import Graph
from tessera.graph.kept import KEEP_EDGES, csr_fits, kept_arrays
from tessera.graph.partition.metis import metis_graph, part_graph
from tessera.graph.sorting import renumbered_csr
from tessera.memo import PlanCache

_MASKS = ("train_mask", "val_mask", "test_mask")
METHODS = ("none", "rcm", "metis", "degree")
CHOICES = ("auto", *METHODS)
AUTO_MIN_NODES = 50_000  # below this, "auto" keeps the original order without measuring
AUTO_MARGIN = 0.10  # a candidate must be at least this much faster than the original order
METIS_PART_BYTES = 2 << 20  # float32 feature bytes per METIS part: one core's L2 here (4096 rows at width 128)
ORDER_VERSION = 1  # bump when an order's algorithm changes, so old cache entries are not reused
_orders = PlanCache()


# ---------------------------------------------------------------------------------------- orders
def _symmetric_pattern(graph: Graph) -> sp.csr_matrix:
    n = graph.num_nodes
    indptr = graph.indptr.numpy().astype(np.int64, copy=False)
    a = sp.csr_matrix((np.ones(graph.num_edges, dtype=np.int8), graph.indices.numpy(), indptr), shape=(n, n))
    return (a + a.T).tocsr()


def rcm_order(graph: Graph) -> np.ndarray:
    """Reverse Cuthill-McKee order of the symmetrised pattern (``perm[new] = old``), computed
    afresh (:func:`vertex_order` caches it)."""
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


def metis_parts(graph: Graph, parts: int, seed: int = 0) -> np.ndarray:
    """Part id of every vertex from METIS recursive bisection of the symmetrised graph into
    ``parts`` parts of about equal vertex counts, minimising the number of CSR entries cut."""
    n = graph.num_nodes
    if parts <= 1 or n <= 1:
        return np.zeros(n, dtype=np.int64)
    xadj, adjncy, ew = metis_graph(graph)
    return part_graph(xadj, adjncy, ew, parts, recursive=True, seed=seed)


def _metis(graph: Graph, parts: int) -> np.ndarray:
    # Parts in METIS's order (recursive bisection numbers neighbouring parts consecutively),
    # reverse Cuthill-McKee order inside each part: consecutive rows then share neighbours too.
    part = metis_parts(graph, parts)
    rank = inverse_permutation(rcm_order(graph))
    return np.lexsort((rank, part)).astype(np.int64)


def _compute(graph: Graph, method: str, parts: int) -> np.ndarray:
    if method == "none" or graph.num_nodes == 0:
        return np.arange(graph.num_nodes, dtype=np.int64)
    if method == "rcm":
        return rcm_order(graph)
    if method == "degree":
        return _degree(graph)
    return _metis(graph, parts)


def check_method(method: str) -> None:
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


def cache_root(cache_dir: str | os.PathLike | None) -> Path:
    from tessera.files import default_cache_dir

    return (Path(cache_dir) if cache_dir is not None else default_cache_dir()) / "orders"


def _order_path(graph: Graph, method: str, parts: int, cache_dir) -> Path:
    text = f"v{ORDER_VERSION}|{graph.fingerprint()}|{method}|{parts if method == 'metis' else 0}"
    return cache_root(cache_dir) / f"{hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}.npy"


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
    check_method(method)
    n = graph.num_nodes
    parts = (int(parts) if parts is not None else metis_parts_for(n, width)) if method == "metis" else 0

    def make() -> np.ndarray:
        if method in ("none", "degree") or n == 0:  # cheap: not worth a file
            return _compute(graph, method, parts)
        path = _order_path(graph, method, parts, cache_dir)

        perm = kept(
            path,
            [path],
            lambda: np.load(path, allow_pickle=False),
            lambda perm: is_permutation(perm, n),
            lambda: _compute(graph, method, parts),
            lambda perm: save_npy(path, perm),
            "vertex order",
        )
        return perm.astype(np.int64, copy=False)

    return _orders.get(graph, (method, parts), make)


# ---------------------------------------------------------------------------------------- permuting
def inverse_permutation(perm: Any) -> np.ndarray:
    """``inv`` with ``inv[perm[i]] = i`` (old id -> new id)."""
    p = np.asarray(perm, dtype=np.int64)
    inv = np.empty_like(p)
    inv[p] = np.arange(p.size, dtype=np.int64)
    return inv


def permute_graph(graph: Graph, perm: Any, features: bool = True, keep: bool = False) -> Graph:
    """The same graph with vertex ``perm[i]`` renamed ``i``: CSR rows, sources (sorted within each
    row, as every Graph), edge weights and types, features, labels and split masks all follow.
    ``features=False`` leaves ``x`` out (for callers that permute their own feature tensor).
    ``keep``: a renumbered structure of :data:`~tessera.graph.kept.KEEP_EDGES` entries or more is
    kept on disk beside the orders (``$TESSERA_CACHE/orders``) and mapped back by the next run
    (renumbering a large graph is a large share of set-up: docs/design/startup-caches.md)."""
    n = graph.num_nodes
    perm = np.asarray(perm, dtype=np.int64)
    if not is_permutation(perm, n):
        raise ValueError(f"perm is not a permutation of [0, {n})")
    edge_data = graph.edge_weight is not None or graph.edge_type is not None
    keep = keep and graph.num_edges >= KEEP_EDGES
    indptr, src, eid = (_kept_renumbering if keep else _renumbering)(graph, perm, edge_data)
    et = None if eid is None else torch.from_numpy(eid)
    pt = torch.from_numpy(perm)
    data: dict[str, Any] = {
        "edge_weight": None if graph.edge_weight is None or et is None else graph.edge_weight.index_select(0, et),
        "edge_type": None if graph.edge_type is None or et is None else graph.edge_type.index_select(0, et),
        "x": graph.x[pt] if features and graph.x is not None else None,
        "y": None if graph.y is None else graph.y[pt],
        "num_classes": graph.num_classes,
        "num_relations": graph.num_relations,
        "name": graph.name,
    }
    for m in _MASKS:
        t = getattr(graph, m)
        data[m] = None if t is None else t[pt]
    return Graph(torch.from_numpy(indptr), torch.from_numpy(src), n, **data)


def _renumbering(graph: Graph, perm: np.ndarray, want_eid: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """:func:`~tessera.graph.sorting.renumbered_csr` of ``graph`` under ``perm``."""
    return renumbered_csr(graph.indptr.numpy(), graph.indices.numpy(), perm, inverse_permutation(perm), want_eid)


def _kept_renumbering(
    graph: Graph, perm: np.ndarray, want_eid: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """:func:`_renumbering`, mapped from the disk cache when a run has kept it there (checked
    against the graph's sizes and dtypes), else computed and kept."""
    text = f"v{ORDER_VERSION}|{graph.fingerprint()}|{digest('perm', [perm])}|{want_eid}"
    stem = cache_root(None) / f"{hashlib.blake2b(text.encode(), digest_size=16).hexdigest()}.csr"
    n, e = graph.num_nodes, graph.num_edges
    index = graph.indices.numpy().dtype
    expected = {"indptr": ((n + 1,), graph.indptr.numpy().dtype), "indices": ((e,), index)}
    if want_eid:
        expected["eid"] = ((e,), index)

    def make() -> dict[str, np.ndarray]:
        indptr, src, eid = _renumbering(graph, perm, want_eid)
        made = {"indptr": indptr, "indices": src}
        if eid is not None:
            made["eid"] = eid
        return made

    def fits(arrays: dict[str, np.ndarray]) -> bool:
        shaped = all((a.shape, a.dtype) == expected[name] for name, a in arrays.items())
        return shaped and csr_fits(arrays["indptr"], arrays["indices"], n)

    arrays = kept_arrays(stem, tuple(expected), make, fits)
    return arrays["indptr"], arrays["indices"], arrays.get("eid")


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
        """``graph`` in the new numbering (see :func:`permute_graph`), its structure kept on disk
        for the next run when large."""
        return permute_graph(graph, self.perm.numpy(), features, keep=True)

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
