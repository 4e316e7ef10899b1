"""gTasks (WiseGraph §4): a restriction language over edge attributes and the greedy O(E) scan
that cuts a sorted edge table into gTasks.

The paper's definitions, which this module follows:

* *gTask*: "a workload abstraction with a subset of edges partitioned from graph data and an
  operation partition plan"; "edges partitioned to the same gTask satisfy all the restrictions".
* *Graph partition table* (Fig. 6): rows ID / Type / Degree, columns Src / Dst / Edge. Type of the
  source and destination vertex are "unused attributes ... not considered in graph partition"
  (tessera graphs have no vertex types) and an edge has no degree (N/A), so the attributes here are
  ``Src.ID``, ``Src.Degree``, ``Dst.ID``, ``Dst.Degree``, ``Edge.ID`` and ``Edge.Type``.
* *Restriction*: "A restriction is to limit the number of unique values in an edge attribute for
  edges within a gTask. ... The first is to restrict the number of unique values with a specific
  value. For example, a restriction of uniq(dst-id) = 1 means that there can only be one unique
  destination vertex connected by the edges in a gTask; uniq(edge-id) = 32 means there are 32
  edges in a gTask. The second is to restrict the number of unique values to be minimum. For
  example, uniq(src-id) = min means that after satisfying other restrictions, gTasks with a
  smaller number of unique src-id are preferred. The third are the entries with no restriction."
* *Greedy partitioning*: "We first sort the edges of the graph according to edge attributes
  involved in the restrictions. Then we scan these edges in order. If a restriction condition is
  satisfied after including the current edge, we add it to the current gTask's graph data. If any
  restrictions are not satisfied after adding the current edge, we stop the graph partition for the
  current gTask and start a new gTask." (O(E) per plan.)

Syntax. Restrictions are joined by ``&`` (the paper's) or ``,``; each is ``uniq(ATTR)=VALUE`` or,
as the paper also writes (§6.1 ``dst-id=1&edge-id=K``), ``ATTR=VALUE``. ``ATTR`` is the table's
``Src.ID`` form or the paper's ``src-id``, ``dst-degree``, ``edge-type``, ``edge-num`` (=
``edge-id``), case-insensitive; ``VALUE`` is a positive integer ``k`` (at most ``k`` unique
values), ``min``, or ``inf`` (explicitly unrestricted: Fig. 18's ``K = INF``).

Sort order (what "sort according to the attributes involved" means here, :meth:`Restrictions.sort_keys`):
the ``=min`` attributes first, in the order written (a run of equal values can then be cut only by
the other restrictions, which is the fewest unique values the scan can give a gTask: Fig. 7(h)'s
``uniq(dst-degree)=min & uniq(dst-id)=K`` sorts by (dst degree, dst)), then the ``=k`` attributes
by increasing ``k`` (ties: Edge.Type, Dst.Degree, Src.Degree, Dst.ID, Src.ID), so the coarsest
grouping is outermost: ``uniq(src-id)=K & uniq(edge-type)=1`` sorts by (type, src), and a gTask is
K sources of one relation with all their edges. ``Edge.ID`` is never a key: ties keep the edge
table's order, which for a :class:`~tessera.graph.Graph` is destination-major CSR order, so
``uniq(Edge.Type)=1`` sorts by (type, dst, src). ``=min`` never cuts a gTask by itself.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numba
import numpy as np
import torch

from tessera.errors import ConfigError, GraphError
from tessera.graph.graph import Graph

ATTRIBUTES = ("Src.ID", "Src.Degree", "Dst.ID", "Dst.Degree", "Edge.ID", "Edge.Type")
# Tie order among =k keys with equal k: the coarser attribute outermost.
_KEY_RANK = {"Edge.Type": 0, "Dst.Degree": 1, "Src.Degree": 2, "Dst.ID": 3, "Src.ID": 4, "Edge.ID": 5}
_UNUSED = {
    "Src.Type": "vertex types are unused attributes (Fig. 6): tessera graphs have none",
    "Dst.Type": "vertex types are unused attributes (Fig. 6): tessera graphs have none",
    "Edge.Degree": "an edge has no degree (N/A in Fig. 6)",
}
_SIDES = {"src": "Src", "dst": "Dst", "edge": "Edge"}
_KINDS = {"id": "ID", "type": "Type", "degree": "Degree", "num": "ID"}
_ALLOWED = (
    "write restrictions like 'uniq(Edge.Type)=1 & uniq(Src.ID)=32' joined by '&' or ',', over "
    + ", ".join(ATTRIBUTES)
    + " (or the paper's src-id, dst-degree, edge-type, edge-num), each =k (a positive integer), =min or =inf"
)
_TERM = re.compile(
    r"\s*(?:uniq\s*\(\s*(?P<inner>[^()]*?)\s*\)|(?P<bare>[A-Za-z][\w.\-]*))\s*=\s*(?P<value>[^\s&,]+)\s*$",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class Restriction:
    """``uniq(attribute) = limit``: at most ``limit`` unique values per gTask (``None``: unrestricted);
    ``minimize``: the paper's ``=min`` (fewest unique values the other restrictions allow)."""

    attribute: str
    limit: int | None = None
    minimize: bool = False

    def __str__(self) -> str:
        value = "min" if self.minimize else ("inf" if self.limit is None else str(self.limit))
        return f"uniq({self.attribute})={value}"


@dataclass(frozen=True)
class Restrictions:
    """A parsed restriction set: the rules every gTask of a plan satisfies."""

    items: tuple[Restriction, ...]

    def __str__(self) -> str:
        return " & ".join(str(r) for r in self.items)

    def limit(self, attribute: str) -> int | None:
        """The ``=k`` bound on ``attribute`` (``None`` when it has none)."""
        return next((r.limit for r in self.items if r.attribute == attribute and r.limit is not None), None)

    def sort_keys(self) -> tuple[str, ...]:
        """Attributes the edge table is sorted by, outermost first (module docstring)."""
        mins = [r.attribute for r in self.items if r.minimize]
        ks = sorted((r for r in self.items if r.limit is not None), key=lambda r: (r.limit, _KEY_RANK[r.attribute]))
        return tuple(a for a in mins + [r.attribute for r in ks] if a != "Edge.ID")


def _fail(text: str, col: int, what: str) -> ConfigError:
    return ConfigError(f"bad gTask restriction {text!r} at column {col + 1}: {what}; {_ALLOWED}")


def _attribute(name: str, text: str, col: int) -> str:
    norm = re.sub(r"[-_]", ".", name.strip().lower())
    parts = norm.split(".")
    if len(parts) == 1 and parts[0] in ("src", "dst"):
        parts.append("id")
    if (
        len(parts) != 2
        or parts[0] not in _SIDES
        or parts[1] not in _KINDS
        or parts == ["src", "num"]
        or parts == ["dst", "num"]
    ):
        raise _fail(text, col, f"unknown attribute {name.strip()!r}")
    attr = f"{_SIDES[parts[0]]}.{_KINDS[parts[1]]}"
    if attr in _UNUSED:
        raise _fail(text, col, f"{attr}: {_UNUSED[attr]}")
    return attr


def parse_restrictions(text: str | Restrictions) -> Restrictions:
    """Parse ``"uniq(Src.ID)=32 & uniq(Edge.Type)=1"`` (module docstring); ConfigError naming the spot."""
    if isinstance(text, Restrictions):
        return text
    if not isinstance(text, str) or not text.strip():
        raise _fail(str(text), 0, "the restriction string is empty")
    items: list[Restriction] = []
    seen: set[str] = set()
    col = 0
    for term in re.split(r"[&,]", text):
        start = col + len(term) - len(term.lstrip())
        m = _TERM.match(term)
        if m is None:
            what = "expected uniq(ATTR)=VALUE" if term.strip() else "empty restriction between separators"
            raise _fail(text, start, f"{what}, got {term.strip()!r}")
        attr = _attribute(m["inner"] if m["inner"] is not None else m["bare"], text, start)
        value = m["value"].lower()
        if attr in seen:
            raise _fail(text, start, f"{attr} is restricted twice")
        seen.add(attr)
        if value == "min":
            items.append(Restriction(attr, None, True))
        elif value == "inf":
            items.append(Restriction(attr))
        elif value.isdigit() and int(value) > 0:
            items.append(Restriction(attr, int(value)))
        else:
            raise _fail(
                text, start + term.strip().rfind("=") + 1, f"value {m['value']!r} is not a positive integer, min or inf"
            )
        col += len(term) + 1
    return Restrictions(tuple(items))


@numba.njit(cache=True, nogil=True)
def _greedy_cuts(values, limits, offsets):  # pragma: no cover - compiled
    r_count, e_count = values.shape
    stamps = np.full(offsets[-1], -1, np.int64)
    counts = np.zeros(r_count, np.int64)
    starts = np.empty(e_count + 1, np.int64)
    task = -1
    for e in range(e_count):
        cut = task < 0
        if not cut:
            for r in range(r_count):
                if stamps[offsets[r] + values[r, e]] != task and counts[r] + 1 > limits[r]:
                    cut = True
                    break
        if cut:
            task += 1
            starts[task] = e
            counts[:] = 0
        for r in range(r_count):
            s = offsets[r] + values[r, e]
            if stamps[s] != task:
                stamps[s] = task
                counts[r] += 1
    starts[task + 1] = e_count
    return starts[: task + 2].copy()


@numba.njit(cache=True, nogil=True)
def _task_uniques(values, bounds, size):  # pragma: no cover - compiled
    stamp = np.full(size, -1, np.int64)
    local_of = np.empty(size, np.int64)
    local = np.empty(values.shape[0], np.int64)
    out = np.empty(values.shape[0], np.int64)
    tasks = bounds.shape[0] - 1
    ptr = np.empty(tasks + 1, np.int64)
    n = 0
    for t in range(tasks):
        ptr[t] = n
        for e in range(bounds[t], bounds[t + 1]):
            v = values[e]
            if stamp[v] != t:
                stamp[v] = t
                local_of[v] = n - ptr[t]
                out[n] = v
                n += 1
            local[e] = local_of[v]
    ptr[tasks] = n
    return ptr, out[:n].copy(), local


def greedy_cuts(values: list[np.ndarray], limits: list[int], num_edges: int) -> np.ndarray:
    """gTask boundaries (int64, ``[0, ..., E]``) of the greedy scan over already-sorted edges:
    a gTask grows until adding the next edge would give some ``values[r]`` more than ``limits[r]``
    unique values in it. Values must be non-negative integers. ``O(E)`` plus the value ranges."""
    e = int(num_edges)
    if e == 0:
        return np.zeros(1, dtype=np.int64)
    if not values:
        return np.array([0, e], dtype=np.int64)
    vals = np.stack([np.asarray(v, dtype=np.int64) for v in values])
    offsets = np.zeros(len(values) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum(vals.max(axis=1) + 1)
    return _greedy_cuts(vals, np.asarray(limits, dtype=np.int64), offsets)


@dataclass(frozen=True)
class Uniques:
    """Per-gTask unique values of one attribute (unique value extraction, §5.2): gTask ``t`` has
    ``values[ptr[t]:ptr[t+1]]`` in order of first appearance, and sorted edge ``i``'s value is
    ``values[ptr[task(i)] + local[i]]``."""

    ptr: np.ndarray
    values: np.ndarray
    local: np.ndarray

    def counts(self) -> np.ndarray:
        """Unique values per gTask."""
        return np.diff(self.ptr)


@dataclass(frozen=True, eq=False)
class GTaskPlan:
    """A graph partition plan: the edge table sorted by the restrictions' keys (``order[i]`` is the
    original edge id, CSR position for a graph, of sorted edge ``i``) and cut into gTasks
    ``[bounds[t], bounds[t+1])``; ``src``/``dst``/``etype`` are in sorted order."""

    restrictions: Restrictions
    order: np.ndarray
    bounds: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    etype: np.ndarray
    num_src: int
    num_dst: int
    num_types: int
    types: Uniques
    srcs: Uniques
    dsts: Uniques
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_tasks(self) -> int:
        """Number of gTasks."""
        return int(self.bounds.size - 1)

    @property
    def num_edges(self) -> int:
        """Number of edges in the table."""
        return int(self.order.size)

    def task_of_edge(self) -> np.ndarray:
        """The gTask of every sorted edge."""
        return np.repeat(np.arange(self.num_tasks, dtype=np.int64), np.diff(self.bounds))


def edge_attributes(src: np.ndarray, dst: np.ndarray, etype: np.ndarray, num_src: int, num_dst: int) -> dict:
    """Every table attribute's per-edge value (int64, in the given edge order)."""
    out_deg = np.bincount(src, minlength=num_src)
    in_deg = np.bincount(dst, minlength=num_dst)
    return {
        "Src.ID": src,
        "Dst.ID": dst,
        "Edge.ID": np.arange(src.size, dtype=np.int64),
        "Edge.Type": etype,
        "Src.Degree": out_deg[src].astype(np.int64),
        "Dst.Degree": in_deg[dst].astype(np.int64),
    }


def _edge_table(edges: Graph | tuple) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, int]:
    if isinstance(edges, Graph):
        src, dst = edges.src_index().numpy(), edges.dst_index().numpy()
        et = edges.edge_type
        t = np.zeros(src.size, np.int64) if et is None else et.numpy().astype(np.int64)
        return src.astype(np.int64), dst.astype(np.int64), t, edges.num_nodes, edges.num_nodes
    if not isinstance(edges, tuple) or len(edges) not in (3, 4):
        raise TypeError("edges must be a Graph or a tuple (src, dst, edge_type[, num_nodes])")
    src, dst, etype = (np.asarray(a.numpy() if isinstance(a, torch.Tensor) else a).astype(np.int64) for a in edges[:3])
    if not (src.shape == dst.shape == etype.shape) or src.ndim != 1:
        raise GraphError(
            f"src, dst and edge_type must be 1-D of one length, got {src.shape}, {dst.shape}, {etype.shape}"
        )
    n = int(edges[3]) if len(edges) == 4 else (int(max(src.max(), dst.max())) + 1 if src.size else 0)
    if src.size and (min(src.min(), dst.min()) < 0 or max(src.max(), dst.max()) >= n):
        raise GraphError(f"a vertex id is outside [0, {n}): pass num_nodes covering every endpoint")
    if etype.size and etype.min() < 0:
        raise GraphError("edge_type contains negative values")
    return src, dst, etype, n, n


def build_plan(edges: Graph | tuple, restrictions: str | Restrictions) -> GTaskPlan:
    """Sort the edge table by ``restrictions``' keys and cut it into gTasks with the greedy scan.

    ``edges``: a :class:`~tessera.graph.Graph` (its ``edge_type``; none: every edge type 0) or
    ``(src, dst, edge_type[, num_nodes])`` arrays."""
    rs = parse_restrictions(restrictions)
    src, dst, etype, num_src, num_dst = _edge_table(edges)
    attrs = edge_attributes(src, dst, etype, num_src, num_dst)
    keys = rs.sort_keys()
    order = np.lexsort([attrs[k] for k in reversed(keys)]) if keys else np.arange(src.size, dtype=np.int64)
    order = order.astype(np.int64)
    bounded = [(r.attribute, r.limit) for r in rs.items if r.limit is not None]
    bounds = greedy_cuts([attrs[a][order] for a, _ in bounded], [limit for _, limit in bounded], src.size)
    s, d, t = src[order], dst[order], etype[order]
    num_types = int(t.max()) + 1 if t.size else 0
    return GTaskPlan(
        rs,
        order,
        bounds,
        s,
        d,
        t,
        num_src,
        num_dst,
        num_types,
        types=Uniques(*_task_uniques(t, bounds, max(num_types, 1))),
        srcs=Uniques(*_task_uniques(s, bounds, max(num_src, 1))),
        dsts=Uniques(*_task_uniques(d, bounds, max(num_dst, 1))),
    )
