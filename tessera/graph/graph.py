"""The validated, destination-major CSR graph that every tessera component consumes."""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from tessera.digest import digest
from tessera.errors import GraphError
from tessera.files import default_cache_dir
from tessera.graph.csr import CSRStructure, index_dtype
from tessera.graph.kept import KEEP_EDGES, csr_fits, kept_arrays
from tessera.graph.normalize import gcn_values, mark_mirrored
from tessera.graph.sorting import with_self_loops

_MASKS = ("train_mask", "val_mask", "test_mask")


def _as_tensor(a: Any, dtype: torch.dtype | None = None) -> torch.Tensor:
    if isinstance(a, torch.Tensor):
        t = a.detach()
    else:
        t = torch.as_tensor(np.asarray(a))
    if dtype is not None and t.dtype != dtype:
        t = t.to(dtype)
    return t.contiguous()


def all_finite(t: torch.Tensor) -> bool:
    """Whether no element of the floating tensor ``t`` is NaN or infinite."""
    # A sum is finite only if every term is (inf and NaN never cancel back to a finite value), and
    # it reads the tensor once without a boolean copy; only a sum that overflowed needs the full test.
    return math.isfinite(float(t.sum())) or bool(torch.isfinite(t).all())


@dataclass(eq=False)
class Graph(CSRStructure):
    """A graph as destination-major CSR plus optional node and edge data.

    ``indices[indptr[i]:indptr[i+1]]`` are the in-neighbours (message sources) of vertex ``i``,
    so aggregation over a row is a reduction into one output vertex. In PyG terms an edge
    ``(edge_index[0, e], edge_index[1, e]) = (j, i)`` is stored in row ``i``.
    Every construction validates its inputs and raises :class:`GraphError` naming the problem.

    A typed (relational) graph has ``edge_type``: one relation id per edge, each in
    ``[0, num_relations)``; ``num_relations`` defaults to the largest id + 1 and may be declared
    larger (relations without edges). An untyped graph has neither.

    Labels ``y`` are one class id per vertex (-1: unlabelled), or multi-label targets of shape
    ``(N, C)`` with C > 1 (:attr:`multilabel`): each 0 or 1, NaN or -1 unlabelled, stored int64
    with -1, and ``num_classes`` is C, the number of binary tasks.
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    num_nodes: int
    edge_weight: torch.Tensor | None = None
    edge_type: torch.Tensor | None = None
    x: torch.Tensor | None = None
    y: torch.Tensor | None = None
    train_mask: torch.Tensor | None = None
    val_mask: torch.Tensor | None = None
    test_mask: torch.Tensor | None = None
    num_classes: int | None = None
    name: str = "graph"
    num_relations: int | None = None
    _structure: dict = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.num_nodes = int(self.num_nodes)
        n = self.num_nodes
        if n < 0:
            raise GraphError(f"num_nodes must be non-negative, got {n}")
        indptr = _as_tensor(self.indptr)
        indices = _as_tensor(self.indices)
        if indptr.dim() != 1 or indices.dim() != 1:
            raise GraphError("indptr and indices must be one-dimensional")
        if indptr.dtype.is_floating_point or indices.dtype.is_floating_point or indptr.dtype == torch.bool:
            raise GraphError(f"indptr and indices must be integer arrays, got {indptr.dtype} and {indices.dtype}")
        if indptr.numel() != n + 1:
            raise GraphError(f"indptr has length {indptr.numel()}, expected num_nodes + 1 = {n + 1}")
        e = indices.numel()
        ip64 = indptr.to(torch.int64)
        if int(ip64[0]) != 0:
            raise GraphError(f"indptr must start at 0, starts at {int(ip64[0])}")
        if n > 0 and bool((ip64[1:] < ip64[:-1]).any()):
            bad = int(torch.nonzero(ip64[1:] < ip64[:-1])[0])
            raise GraphError(f"indptr is not monotone: indptr[{bad + 1}] < indptr[{bad}]")
        if int(ip64[-1]) != e:
            raise GraphError(f"indptr ends at {int(ip64[-1])} but indices has length {e}")
        if e:
            lo, hi = int(indices.min()), int(indices.max())
            if lo < 0 or hi >= n:
                bad = lo if lo < 0 else hi
                raise GraphError(f"edge source index {bad} out of range [0, {n})")
        idt = index_dtype(n, e)
        self.indptr = indptr.to(idt)
        self.indices = indices.to(idt)
        if self.edge_weight is not None:
            w = _as_tensor(self.edge_weight, torch.float32)
            if w.shape != (e,):
                raise GraphError(f"edge_weight has shape {tuple(w.shape)}, expected ({e},)")
            if not all_finite(w):
                raise GraphError("edge_weight contains NaN or inf")
            self.edge_weight = w
        self._validate_edge_type()
        self._validate_node_data()

    def _validate_edge_type(self) -> None:
        e = self.num_edges
        if self.edge_type is None:
            if self.num_relations is not None:
                raise GraphError(
                    f"num_relations={self.num_relations} given without edge_type; pass one relation id per edge"
                )
            return
        t = _as_tensor(self.edge_type)
        if t.dtype.is_floating_point or t.dtype == torch.bool or t.dtype.is_complex or t.shape != (e,):
            raise GraphError(
                f"edge_type must be an integer array of shape ({e},), got {t.dtype} of shape {tuple(t.shape)}"
            )
        t = t.to(torch.int64)
        r = self.num_relations
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, np.integer)) or r < 0):
            raise GraphError(f"num_relations must be a non-negative integer, got {r!r}")
        r = (int(t.max()) + 1 if e else 0) if r is None else int(r)
        bad = (t < 0) | (t >= r)
        if e and bool(bad.any()):
            i = int(torch.nonzero(bad)[0])
            dst = int(torch.searchsorted(self.indptr.to(torch.int64), torch.tensor(i), right=True)) - 1
            raise GraphError(
                f"edge type {int(t[i])} of edge {int(self.indices[i])} -> {dst} is outside [0, {r}); relation ids "
                f"must be 0..num_relations-1 (declare num_relations larger, or renumber the relations)"
            )
        self.edge_type, self.num_relations = t, r

    def _validate_node_data(self) -> None:
        n = self.num_nodes
        if self.x is not None:
            x = _as_tensor(self.x)
            if not x.dtype.is_floating_point:
                raise GraphError(f"features must be floating point, got {x.dtype}")
            x = x.to(torch.float32)
            if x.dim() != 2 or x.shape[0] != n:
                raise GraphError(f"features have shape {tuple(x.shape)}, expected ({n}, F)")
            if not all_finite(x):
                row = int(torch.nonzero(~torch.isfinite(x).all(1))[0])
                raise GraphError(f"features contain NaN or inf (first at vertex {row})")
            self.x = x
        for name in _MASKS:
            m = getattr(self, name)
            if m is None:
                continue
            m = _as_tensor(m)
            if m.dtype != torch.bool:
                raise GraphError(f"{name} must be boolean, got {m.dtype}")
            if m.shape != (n,):
                raise GraphError(f"{name} has shape {tuple(m.shape)}, expected ({n},)")
            setattr(self, name, m)
        masks = [(k, getattr(self, k)) for k in _MASKS if getattr(self, k) is not None]
        for a in range(len(masks)):
            for b in range(a + 1, len(masks)):
                both = masks[a][1] & masks[b][1]
                if bool(both.any()):
                    raise GraphError(
                        f"{masks[a][0]} and {masks[b][0]} overlap ({int(both.sum())} vertices, first {int(both.nonzero()[0])})"
                    )
        if self.train_mask is not None and not bool(self.train_mask.any()):
            raise GraphError("train split is empty")
        if self.y is not None and _as_tensor(self.y).dim() == 2 and _as_tensor(self.y).shape[1] > 1:
            self._validate_multilabel(masks)
        elif self.y is not None:
            y = _as_tensor(self.y)
            if y.dtype.is_floating_point or y.dtype == torch.bool:
                raise GraphError(f"labels must be integers, got {y.dtype}")
            y = y.to(torch.int64)
            if y.shape != (n,):
                raise GraphError(f"labels have shape {tuple(y.shape)}, expected ({n},)")
            labelled = y[y >= 0]
            c = (
                self.num_classes
                if self.num_classes is not None
                else (int(labelled.max()) + 1 if labelled.numel() else 0)
            )
            if bool((y < -1).any()) or (labelled.numel() and int(labelled.max()) >= c):
                bad = int(y[(y < -1) | (y >= c)][0])
                raise GraphError(f"label {bad} outside [0, {c}) (-1 marks an unlabelled vertex)")
            for name, m in masks:
                if bool((y[m] < 0).any()):
                    raise GraphError(f"{name} contains unlabelled vertices (label -1)")
            self.y = y
            self.num_classes = int(c)

    def _validate_multilabel(self, masks: list[tuple[str, torch.Tensor]]) -> None:
        """Multi-label targets ``y`` of shape ``(N, C)``: each 0 or 1, an unlabelled entry NaN (or
        -1), stored as int64 with -1 for unlabelled; ``num_classes`` is C, the number of tasks."""
        n, y = self.num_nodes, _as_tensor(self.y)
        if y.shape[0] != n:
            raise GraphError(f"multi-label targets have shape {tuple(y.shape)}, expected ({n}, C)")
        if y.dtype == torch.bool:
            y = y.to(torch.int64)
        elif y.dtype.is_floating_point:
            y = torch.where(torch.isnan(y), torch.full_like(y, -1.0), y)
        elif y.dtype.is_complex:
            raise GraphError(f"multi-label targets must be 0/1 numbers or booleans, got {y.dtype}")
        bad = (y != 0) & (y != 1) & (y != -1)
        if bool(bad.any()):
            i, j = (int(v) for v in bad.nonzero()[0])
            raise GraphError(
                f"multi-label target of vertex {i}, task {j} is {_as_tensor(self.y)[i, j].item()!r}; "
                "each target must be 0 or 1 (NaN: unlabelled)"
            )
        y = y.to(torch.int64).contiguous()
        c = int(y.shape[1])
        if self.num_classes is not None and int(self.num_classes) != c:
            raise GraphError(f"num_classes={self.num_classes} but the multi-label targets have {c} tasks (columns)")
        unlabelled = (y < 0).all(1)
        for name, m in masks:
            if bool((m & unlabelled).any()):
                raise GraphError(f"{name} contains unlabelled vertices (every target NaN)")
        self.y, self.num_classes = y, c

    @property
    def multilabel(self) -> bool:
        """Whether the labels are multi-label targets (``y`` of shape ``(N, C)``: C binary tasks)."""
        return self.y is not None and self.y.dim() == 2

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_edge_index(
        cls,
        edge_index: Any,
        num_nodes: int | None = None,
        edge_weight: Any = None,
        edge_type: Any = None,
        **node_data: Any,
    ) -> Graph:
        """Build from a COO ``(2, E)`` edge index whose row 0 holds sources and row 1 destinations."""
        ei = _as_tensor(edge_index)
        if ei.dim() != 2 or ei.shape[0] != 2:
            raise GraphError(f"edge_index must have shape (2, E), got {tuple(ei.shape)}")
        if ei.dtype.is_floating_point or ei.dtype == torch.bool:
            raise GraphError(f"edge_index must be integer, got {ei.dtype}")
        ei = ei.to(torch.int64)
        if num_nodes is None:
            x = node_data.get("x")
            num_nodes = int(ei.max()) + 1 if ei.numel() else (0 if x is None else len(x))
        n = int(num_nodes)
        if ei.numel():
            lo, hi = int(ei.min()), int(ei.max())
            if lo < 0 or hi >= n:
                raise GraphError(f"edge index {lo if lo < 0 else hi} out of range [0, {n})")
        src, dst = ei[0], ei[1]
        e = src.numel()
        if edge_weight is not None and _as_tensor(edge_weight).numel() != e:
            raise GraphError(f"edge_weight has {_as_tensor(edge_weight).numel()} entries for {e} edges")
        if edge_type is not None and _as_tensor(edge_type).numel() != e:
            raise GraphError(f"edge_type has {_as_tensor(edge_type).numel()} entries for {e} edges")
        order = torch.argsort(dst * max(n, 1) + src, stable=True)
        indptr = torch.zeros(n + 1, dtype=torch.int64)
        indptr[1:] = torch.cumsum(torch.bincount(dst, minlength=n), 0)
        return cls(
            indptr,
            src[order],
            n,
            edge_weight=None if edge_weight is None else _as_tensor(edge_weight)[order],
            edge_type=None if edge_type is None else _as_tensor(edge_type)[order],
            **node_data,
        )

    @classmethod
    def from_csr(cls, indptr: Any, indices: Any, num_nodes: int | None = None, **data: Any) -> Graph:
        """Build from destination-major CSR arrays (row ``i`` lists the sources of ``i``'s in-edges)."""
        indptr = _as_tensor(indptr)
        return cls(indptr, indices, indptr.numel() - 1 if num_nodes is None else num_nodes, **data)

    def replace(self, **changes: Any) -> Graph:
        """A validated copy with some fields replaced (derived caches are not carried over)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "_structure"}
        fields.update(changes)
        return Graph(**fields)

    # ------------------------------------------------------------------ properties
    @property
    def num_rows(self) -> int:  # type: ignore[override]  # a graph's rows are its vertices, never set
        """Rows of the adjacency (destinations): ``num_nodes``."""
        return self.num_nodes

    @property
    def num_cols(self) -> int:  # type: ignore[override]  # a graph's columns are its vertices, never set
        """Columns of the adjacency (sources): ``num_nodes``."""
        return self.num_nodes

    @property
    def num_features(self) -> int:
        """Width of the node features (0 without features)."""
        return 0 if self.x is None else int(self.x.shape[1])

    def edge_index(self) -> torch.Tensor:
        """COO ``(2, E)`` int64 edge index in PyG's (source, destination) convention."""
        return torch.stack([self.src_index(), self.dst_index()])

    def fingerprint(self) -> str:
        """Stable hex digest of structure, edge data and node-data shapes, for on-disk caches. The
        index arrays are hashed as stored: their dtype follows from the sizes (:func:`index_dtype`)."""

        def make() -> str:
            head = f"n={self.num_nodes};e={self.num_edges};f={self.num_features};c={self.num_classes}"
            if self.num_relations is not None:
                head += f";r={self.num_relations}"
            return digest(head, (self.indptr, self.indices, self.edge_weight, self.edge_type))

        return self._derived("fingerprint", make)

    def legacy_fingerprint(self) -> str:
        """The fingerprint as tessera computed it before :mod:`tessera.digest` (blake2b of the arrays
        widened to int64): checkpoints written then name their graph by it."""
        h = hashlib.blake2b(digest_size=16)
        h.update(f"n={self.num_nodes};e={self.num_edges};f={self.num_features};c={self.num_classes}".encode())
        if self.num_relations is not None:
            h.update(f";r={self.num_relations}".encode())
        for t in (self.indptr, self.indices, self.edge_weight, self.edge_type):
            h.update(b"|" if t is None else t.to(torch.int64 if not t.is_floating_point() else t.dtype).numpy())  # type: ignore[arg-type]
        return h.hexdigest()

    # ------------------------------------------------------------------ transformations
    def _rebuild(self, src: torch.Tensor, dst: torch.Tensor, weight, etype) -> Graph:
        node = {k: getattr(self, k) for k in ("x", "y", *_MASKS, "num_classes", "name")}
        if etype is not None:
            node["num_relations"] = self.num_relations
        return Graph.from_edge_index(
            torch.stack([src, dst]), self.num_nodes, edge_weight=weight, edge_type=etype, **node
        )

    def remove_self_loops(self) -> Graph:
        """Drop every edge ``i -> i``."""
        keep = self.src_index() != self.dst_index()
        return self._rebuild(
            self.src_index()[keep],
            self.dst_index()[keep],
            None if self.edge_weight is None else self.edge_weight[keep],
            None if self.edge_type is None else self.edge_type[keep],
        )

    def add_self_loops(self, fill_value: float = 1.0, loop_type: int = 0) -> Graph:
        """Give every vertex exactly one self loop (PyG's ``add_remaining_self_loops``): existing
        loops keep their weight (and relation), duplicate loops collapse into their last one,
        missing ones get ``fill_value`` (and, on a typed graph, relation ``loop_type``)."""
        n = self.num_nodes
        weighted = self.edge_weight is not None or fill_value != 1.0
        indptr, indices, taken = with_self_loops(
            self.indptr.numpy(), self.indices.numpy(), weighted or self.edge_type is not None
        )
        take = None if taken is None else torch.from_numpy(taken)
        weight = None
        if weighted:
            assert take is not None
            base = self.edge_weight if self.edge_weight is not None else torch.ones(self.num_edges)
            weight = torch.cat([base, torch.full((n,), float(fill_value))]).index_select(0, take)
        etype = None
        if self.edge_type is not None:
            assert take is not None
            loops = torch.full((n,), int(loop_type), dtype=torch.int64)
            etype = torch.cat([self.edge_type, loops]).index_select(0, take)
        node = {k: getattr(self, k) for k in ("x", "y", *_MASKS, "num_classes", "name", "num_relations")}
        return Graph(
            torch.from_numpy(indptr), torch.from_numpy(indices), n, edge_weight=weight, edge_type=etype, **node
        )

    def coalesce(self, reduce: str = "sum") -> Graph:
        """Remove duplicate edges (same source, destination and type); weights are combined by
        ``reduce`` (``"sum"`` or ``"first"``)."""
        src, dst = self.src_index(), self.dst_index()
        n = max(self.num_nodes, 1)
        key = dst * n + src
        if self.edge_type is not None:
            assert self.num_relations is not None
            key = key * max(int(self.num_relations), 1) + self.edge_type
        uniq, inverse = torch.unique(key, return_inverse=True)
        first = torch.full((uniq.numel(),), self.num_edges, dtype=torch.int64)
        first.scatter_reduce_(0, inverse, torch.arange(self.num_edges), reduce="amin")
        weight = None
        if self.edge_weight is not None:
            if reduce == "sum":
                weight = torch.zeros(uniq.numel()).index_add_(0, inverse, self.edge_weight)
            elif reduce == "first":
                weight = self.edge_weight[first]
            else:
                raise GraphError(f"unknown coalesce reduce {reduce!r}; use 'sum' or 'first'")
        etype = None if self.edge_type is None else self.edge_type[first]
        return self._rebuild(src[first], dst[first], weight, etype)

    def to_undirected(self) -> Graph:
        """Add the reverse of every edge (same weight and relation), then remove duplicates
        (weights of duplicates: first)."""
        src, dst = self.src_index(), self.dst_index()
        w = None if self.edge_weight is None else torch.cat([self.edge_weight, self.edge_weight])
        t = None if self.edge_type is None else torch.cat([self.edge_type, self.edge_type])
        return self._rebuild(torch.cat([src, dst]), torch.cat([dst, src]), w, t).coalesce("first")

    def is_undirected(self) -> bool:
        """Whether every edge ``j -> i`` has its reverse ``i -> j``."""
        n = max(self.num_nodes, 1)
        a = torch.unique(self.dst_index() * n + self.src_index())
        b = torch.unique(self.src_index() * n + self.dst_index())
        return a.numel() == b.numel() and bool((a == b).all())

    def gcn_norm(self, add_self_loops: bool = True, improved: bool = False) -> Graph:
        """Symmetric GCN normalisation as PyG's ``gcn_norm``: optional remaining self loops (fill 1,
        or 2 when ``improved``), then ``w_ji / sqrt(deg_i * deg_j)`` with ``deg`` the weighted
        in-degree at the destination. Of a graph with :data:`~tessera.graph.kept.KEEP_EDGES` entries
        or more, the normalised structure is kept on disk (``$TESSERA_CACHE/norms``) for the next run."""
        if self.edge_type is None and self.num_edges >= KEEP_EDGES:
            out = self._kept_gcn_norm(add_self_loops, improved)
        else:
            g, values = self._gcn_values(add_self_loops, improved)
            out = g.replace(edge_weight=torch.from_numpy(values))
        if self.edge_weight is None:  # every weight 1 but the loops': the values are 1 / sqrt(d_i d_j) both ways
            assert out.edge_weight is not None
            mark_mirrored(out.edge_weight)
        return out

    def _kept_gcn_norm(self, add_self_loops: bool, improved: bool) -> Graph:
        """:meth:`gcn_norm` of an untyped graph, its arrays mapped from the disk cache when a run has
        kept them there (checked against the graph's size), else computed and kept. Without self
        loops the structure is the graph's own: only the values are kept."""
        text = f"gcn_norm|v1|{self.fingerprint()}|{add_self_loops}|{improved}"
        stem = default_cache_dir() / "norms" / hashlib.blake2b(text.encode(), digest_size=16).hexdigest()
        names = ("indptr", "indices", "values") if add_self_loops else ("values",)

        def make() -> dict[str, np.ndarray]:
            g, values = self._gcn_values(add_self_loops, improved)
            return {"indptr": g.indptr.numpy(), "indices": g.indices.numpy(), "values": values}

        def fits(a: dict[str, np.ndarray]) -> bool:
            values = a["values"]
            if not add_self_loops:  # the graph's own structure, checked when it was made
                return (
                    values.shape == (self.num_edges,) and values.dtype == np.float32 and bool(np.isfinite(values).all())
                )
            indptr, indices = a["indptr"], a["indices"]
            return bool(
                indptr.dtype == indices.dtype in (np.int32, np.int64)
                and indices.shape == values.shape
                and values.dtype == np.float32
                and indices.size <= self.num_edges + self.num_nodes
                and csr_fits(indptr, indices, self.num_nodes)
                and np.isfinite(values).all()
            )

        a = kept_arrays(stem, names, make, fits)
        structure = {}
        if add_self_loops:
            structure = {"indptr": torch.from_numpy(a["indptr"]), "indices": torch.from_numpy(a["indices"])}
        return self.replace(**structure, edge_weight=torch.from_numpy(a["values"]))

    def _gcn_values(self, add_self_loops: bool, improved: bool) -> tuple[Graph, np.ndarray]:
        """The graph :meth:`gcn_norm` normalises (self loops added when asked for) and its values."""
        g = self.add_self_loops(2.0 if improved else 1.0) if add_self_loops else self
        w = None if g.edge_weight is None else g.edge_weight.numpy()
        return g, gcn_values(g.indptr.numpy(), g.indices.numpy(), w)

    def relation_counts(self) -> torch.Tensor:
        """Edges per relation (int64, length ``num_relations``); GraphError on an untyped graph."""
        edge_type, relations = self.edge_type, self.num_relations
        if edge_type is None or relations is None:
            raise GraphError(f"graph {self.name!r} has no edge types (relations)")
        return self._derived("relcount", lambda: torch.bincount(edge_type, minlength=relations))

    def degree_stats(self) -> dict[str, float]:
        """In-degree mean, max and percentiles (50/90/99)."""
        d = self.in_degree().to(torch.float64)
        if d.numel() == 0:
            return {"mean": 0.0, "max": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
        q = torch.quantile(d, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)) if d.numel() < 2**24 else None
        if q is None:
            q = torch.from_numpy(np.percentile(d.numpy(), [50, 90, 99]))
        return {
            "mean": float(d.mean()),
            "max": float(d.max()),
            "p50": float(q[0]),
            "p90": float(q[1]),
            "p99": float(q[2]),
        }

    def require(self, *names: str) -> None:
        """Raise :class:`GraphError` unless each named field (``x``, ``y``, a mask) is present."""
        for nm in names:
            if getattr(self, nm) is None:
                what = {"x": "node features", "y": "labels"}.get(nm, nm.replace("_mask", " split"))
                raise GraphError(f"graph {self.name!r} has no {what}; this task needs it")

    def __repr__(self) -> str:
        return (
            f"Graph(name={self.name!r}, num_nodes={self.num_nodes}, num_edges={self.num_edges}, "
            f"num_features={self.num_features}, num_classes={self.num_classes})"
        )


def stratified_split(
    y: torch.Tensor,
    num_classes: int,
    train_per_class: int = 20,
    val_per_class: int = 30,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Seeded split: ``train_per_class`` and ``val_per_class`` labelled vertices of each class
    (fewer when a class is small), every other labelled vertex in test."""
    y = torch.as_tensor(y)
    n = y.numel()
    rng = np.random.default_rng(seed)
    train = torch.zeros(n, dtype=torch.bool)
    val = torch.zeros(n, dtype=torch.bool)
    yn = y.numpy()
    # One stable sort groups each class's vertices in ascending order: O(n log n) however many
    # classes there are. Classes without vertices are skipped, which draws nothing from rng.
    order = np.argsort(yn, kind="stable")
    classes, starts = np.unique(yn[order], return_index=True)
    ends = np.append(starts[1:], n)
    for c, a, b in zip(classes.tolist(), starts.tolist(), ends.tolist(), strict=True):
        if not 0 <= c < num_classes:
            continue
        idx = order[a:b].copy()
        rng.shuffle(idx)
        train[torch.from_numpy(idx[:train_per_class])] = True
        val[torch.from_numpy(idx[train_per_class : train_per_class + val_per_class])] = True
    test = (y >= 0) & ~train & ~val
    return train, val, test
