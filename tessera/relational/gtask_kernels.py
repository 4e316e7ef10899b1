"""Batched gTask micro-kernels (WiseGraph §5.3) and differentiated outlier scheduling (§6.1-6.2)
for the typed message sum ``out[d] = sum_{e=(s->d)} x[s] @ W[type_e]`` (RGCN's per-relation
messages before normalisation).

Execution of a :class:`~tessera.relational.gtask.GTaskPlan`. A *unit* is the edges of one gTask with
one relation (the whole gTask under ``uniq(Edge.Type)=1``); its *rows* are its unique sources
(unique value extraction, §5.2: ``W_r x_s`` is computed once per unit and source, and every edge
reads its row). Units are laid out in blocks, and each block is one dense product: ``B`` units
padded to the block's largest (``S`` rows) form ``(B, S, F_in)``, multiplied by their relations'
weights in one ``torch.bmm`` (one GEMM with a shared ``W[r]`` when the block has one relation).
The gather of the rows is one ``index_select`` of the sources' inputs (padded rows set to exact
zeros, which nothing reads: the mask), and the scatter of the edges into their destinations is a
CSR product (:func:`~tessera.sparse.aggregate.aggregate` over the edge-to-row matrix); the products
of a run of adjacent batches of one relation share ``W[r]``, so they run as one GEMM over their
stacked rows (:func:`~tessera.relational.block_matmul.fuse`), written into one buffer
(:func:`~tessera.relational.block_matmul.gather_block_matmul`: the gathered rows exist a chunk at a
time, in the forward and again in the backward, so only ``x`` is kept for the weight gradient, not
every gathered row). The backward is the transposed CSR product,
the GEMMs' own gradients and an ``index_add``: every step is a differentiable torch op, and the
number of torch calls is the number of products, not of gTasks (thousands of small calls, each a
parallel region of both threads, cost far more than their FLOPs on a busy machine).

Outliers, in the paper's words (§6.1), and what is done with them (§6.2, CPU analogue):

* *Underfill*: "Insufficient number for restricted edge attributes ... there is not enough data
  to reach the restriction"; padding them to the batch shape is wasted work. The paper "breaks
  these gTasks into individual edges and performs edge-wise computation on them to eliminate the
  redundancy": here their rows are packed without padding, one GEMM per relation.
* *Overfill*: "Extremely large number of unrestricted edge attributes ... a much larger number of
  edges than other gTasks", i.e. load imbalance. The paper gives them a separate, larger kernel;
  here an overfill unit is split into chunks of the regular shape ``S`` that are batched with the
  regular units (a unit padded to its own size would make its whole batch that size).
* *Frequent values*: "Some values of indexing edge attributes can frequently appear in a large
  number of gTasks"; the paper "extracts common workloads shared by them and computes them in
  advance. After that, the execution of these gTasks only needs to fetch the pre-computed data":
  a (relation, source) pair in at least ``frequent`` units has ``x[s] @ W[r]`` computed once
  (packed, one GEMM per relation) and its edges read that row. A frequent *destination* needs no
  handling: the scatter is one destination-major CSR product, so all of a destination's edges, from
  any number of gTasks, are reduced by one thread into one row (no race, no atomics).

Thresholds (the paper gives none; :class:`OutlierPolicy`), chosen with
``benchmarks/bench_gtask.py --threads 2`` on the synthetic arxiv graph with 16 uniformly random
relations and the plan ``uniq(Dst.ID)=8 & uniq(Edge.Type)=1`` (the plan with all three outlier
kinds: Fig. 19 names frequent values for RGCN); figures in ``docs/design/relation-cost-model.md``:

* ``frequent = 2``: the only threshold with a clear effect. Extracting every (relation, source)
  pair shared by 2 or more gTasks leaves the fewest product rows and ran fastest. On a CPU a
  shared pair costs a recomputation and nothing else, so the paper's "frequent" is "repeated".
* ``overfill = 2.0``: other values were within the noise once frequent values are extracted;
  before that, larger ones were slower, as larger overfill units padded their batches.
* ``underfill = 0.75``: 0 to 1 within the noise, fewer padded rows as it grows.
* ``batch_rows = 1024``: 256 to 65536 within the noise; with fewer values extracted, the largest
  batches were slower.

Handling the outliers (against every gTask padded to its batch's largest, nothing extracted)
multiplies several times fewer rows and makes the forward an order of magnitude faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from tessera.errors import GraphError
from tessera.graph.csr import CSRMatrix
from tessera.relational.block_matmul import Block, fuse, gather_block_matmul, products
from tessera.relational.gtask import GTaskPlan
from tessera.sparse.aggregate import aggregate

REGULAR, UNDERFILL, OVERFILL, FREQUENT = "regular", "underfill", "overfill", "frequent"
CATEGORIES = (REGULAR, UNDERFILL, OVERFILL, FREQUENT)


@dataclass(frozen=True)
class OutlierPolicy:
    """When a unit is an outlier, relative to the plan's regular shape ``S`` (:func:`regular_rows`).

    ``underfill``: rows < ``underfill * S``; ``overfill``: rows > ``overfill * S``; ``frequent``: a
    (relation, source) pair in at least this many units is a frequent value, and a unit at least
    half of whose rows are frequent values is a frequent-value unit (this label wins over the other
    two); ``batch_rows``: rows per batch (``B = max(1, batch_rows // S)`` units; adjacent batches of
    one relation run as one GEMM, so it shapes only the products of batches mixing relations).

    ``handle=False`` is the paper's uniform baseline: every unit, in scan order, batched ``B`` at a
    time and padded to its batch's largest (batches mixing relations run as one ``torch.bmm`` with a
    weight per unit). Categories are laid out separately in both schedules, so each one's time can
    be measured. ``handle=True`` extracts frequent values, splits overfill units into chunks of
    ``S``, packs underfill units (and what is left of frequent-value units, when small) without
    padding, and batches the rest sorted by (relation, rows) within one relation."""

    underfill: float = 0.75
    overfill: float = 2.0
    frequent: int = 2
    batch_rows: int = 1024
    handle: bool = True


def regular_rows(plan: GTaskPlan, unit_rows: np.ndarray) -> int:
    """The regular unit shape ``S``: the bound a restriction puts on a unit's rows (``uniq(Src.ID)=k``
    or ``uniq(Edge.ID)=k``: at most k sources), else the 90th percentile of the units' rows."""
    bounds = [b for b in (plan.restrictions.limit("Src.ID"), plan.restrictions.limit("Edge.ID")) if b is not None]
    if bounds:
        return max(1, min(bounds))
    return max(1, int(np.ceil(np.percentile(unit_rows, 90)))) if unit_rows.size else 1


@dataclass(frozen=True)
class Execution:
    """A plan laid out for :func:`typed_message_sum`: row ``i`` of the layout is source
    ``gather[i]`` (``pad_rows``: the padding rows, zeros); ``blocks`` multiply them (the batches
    of the layout; ``products``: the same with each run of adjacent one-relation batches as one
    GEMM, what runs); ``scatter`` (destinations x rows) sums them into the output;
    ``scatter_edges[i]`` is the input edge id (position in the plan's edge table) of its entry ``i``."""

    gather: torch.Tensor
    pad_rows: torch.Tensor
    blocks: tuple[Block, ...]
    products: tuple[Block, ...]
    scatter: CSRMatrix
    scatter_edges: torch.Tensor
    regular: int
    stats: dict


def _dedupe(group: np.ndarray, src: np.ndarray, num_src: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unique (group, source) rows sorted by group: (row of each edge, row's group, row's source)."""
    key = group * max(num_src, 1) + src
    uniq, inv = np.unique(key, return_inverse=True)
    return inv.astype(np.int64), uniq // max(num_src, 1), uniq % max(num_src, 1)


class _Layout:
    """Accumulates blocks: padded batches of pieces, or pieces packed without padding."""

    def __init__(self) -> None:
        self.blocks: list[Block] = []
        self.offset = 0
        self.piece_pos: list[tuple[np.ndarray, np.ndarray]] = []  # (row ids, positions)
        self.padding = 0

    def padded(self, starts, lens, types, batch_ids, category):
        """Pieces (row ranges ``[starts, starts + lens)``) in batches ``batch_ids`` (consecutive),
        each batch padded to its largest piece."""
        if starts.size == 0:
            return
        cut = np.flatnonzero(np.diff(batch_ids)) + 1
        first = np.concatenate(([0], cut))
        last = np.concatenate((cut, [starts.size]))
        sizes = np.maximum.reduceat(lens, first)
        counts = last - first
        block_off = self.offset + np.concatenate(([0], np.cumsum(sizes * counts)[:-1]))
        slot = np.arange(starts.size) - np.repeat(first, counts)
        piece_base = np.repeat(block_off, counts) + slot * np.repeat(sizes, counts)
        self._place(starts, lens, piece_base)
        for b in range(first.size):
            t = types[first[b] : last[b]]
            one = int(t[0]) if (t == t[0]).all() else None
            self.blocks.append(
                Block(int(block_off[b]), int(counts[b]), int(sizes[b]), torch.from_numpy(t.copy()), one, category)
            )
        total = int((sizes * counts).sum())
        self.padding += total - int(lens.sum())
        self.offset += total

    def packed(self, starts, lens, types, category):
        """Pieces concatenated without padding, one product per relation (pieces sorted by type)."""
        if starts.size == 0:
            return
        base = self.offset + np.concatenate(([0], np.cumsum(lens)[:-1]))
        self._place(starts, lens, base)
        cut = np.flatnonzero(np.diff(types)) + 1
        first = np.concatenate(([0], cut))
        last = np.concatenate((cut, [starts.size]))
        for a, b in zip(first, last, strict=True):
            n = int(lens[a:b].sum())
            if n:
                t = int(types[a])
                self.blocks.append(Block(int(base[a]), 1, n, torch.tensor([t]), t, category))
        self.offset += int(lens.sum())

    def _place(self, starts, lens, base):
        within = np.arange(int(lens.sum())) - np.repeat(np.cumsum(lens) - lens, lens)
        self.piece_pos.append((np.repeat(starts, lens) + within, np.repeat(base, lens) + within))

    def positions(self, num_rows: int) -> np.ndarray:
        """The position of every row in the gathered layout."""
        position = np.zeros(num_rows, np.int64)
        for rows, pos in self.piece_pos:
            position[rows] = pos
        return position


def _pieces(units: np.ndarray, ptr: np.ndarray, split_above: int | None = None, chunk: int = 1):
    """Row ranges (start, length, owning unit) of ``units``; those longer than ``split_above`` are cut
    into chunks of ``chunk`` rows."""
    starts, lens = ptr[units], ptr[units + 1] - ptr[units]
    if split_above is None:
        return starts, lens, units
    pieces = np.where(lens > split_above, -(-lens // chunk), 1)
    owner = np.repeat(np.arange(units.size), pieces)
    k = np.arange(owner.size) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    size = np.where(lens > split_above, chunk, lens)[owner]
    return starts[owner] + k * size, np.minimum(size, lens[owner] - k * size), units[owner]


def build_execution(plan: GTaskPlan, policy: OutlierPolicy = OutlierPolicy()) -> Execution:
    """Lay ``plan`` out in blocks under ``policy`` (cached on the plan)."""
    key = ("execution", policy)
    if key not in plan._cache:
        plan._cache[key] = _build(plan, policy)
    return plan._cache[key]


def _build(plan: GTaskPlan, policy: OutlierPolicy) -> Execution:
    e_count, n_src = plan.num_edges, max(plan.num_src, 1)
    types_n = max(plan.num_types, 1)
    _, unit_of_edge = np.unique(plan.task_of_edge() * types_n + plan.etype, return_inverse=True)
    unit_of_edge = unit_of_edge.astype(np.int64).reshape(-1)
    num_units = int(unit_of_edge.max()) + 1 if e_count else 0
    unit_type = np.zeros(num_units, np.int64)
    unit_type[unit_of_edge] = plan.etype
    # every unit's rows (unique sources), and in how many units each (relation, source) pair is
    unit_row, row_unit, row_src = _dedupe(unit_of_edge, plan.src, n_src)
    unit_rows = np.bincount(row_unit, minlength=num_units)
    pair = unit_type[row_unit] * n_src + row_src
    pairs, pair_units = np.unique(pair, return_counts=True)
    row_frequent = pair_units[np.searchsorted(pairs, pair)] >= policy.frequent
    s = regular_rows(plan, unit_rows)
    label = np.full(num_units, REGULAR, dtype=object)
    label[unit_rows < policy.underfill * s] = UNDERFILL
    label[unit_rows > policy.overfill * s] = OVERFILL
    label[2 * np.bincount(row_unit, weights=row_frequent, minlength=num_units) >= np.maximum(unit_rows, 1)] = FREQUENT
    frequent = row_frequent[unit_row] if policy.handle else np.zeros(e_count, bool)
    # rows of the layout: unique (unit, source) of the other edges, unique (relation, source) of
    # the extracted frequent ones (group num_units + relation)
    edge_row, row_group, row_src = _dedupe(np.where(frequent, num_units + plan.etype, unit_of_edge), plan.src, n_src)
    gptr = np.searchsorted(row_group, np.arange(num_units + types_n + 1)).astype(np.int64)
    rows_left = np.diff(gptr[: num_units + 1])
    batch = max(1, policy.batch_rows // s)
    lay = _Layout()
    for cat in CATEGORIES:
        units = np.flatnonzero(label == cat)
        if not policy.handle:  # uniform: scan order, B units per batch, padded to the batch's largest
            starts, lens, owner = _pieces(units, gptr)
            lay.padded(starts, lens, unit_type[owner], np.arange(units.size) // batch, cat)
            continue
        units = units[rows_left[units] > 0]
        small = rows_left[units] < policy.underfill * s
        # regular shape: overfill split into chunks of S, then sorted by (relation, rows), batched per relation
        starts, lens, owner = _pieces(units[~small], gptr, int(policy.overfill * s), s)
        o = np.lexsort((-lens, unit_type[owner]))
        starts, lens, t = starts[o], lens[o], unit_type[owner[o]]
        rank = np.arange(t.size) - np.searchsorted(t, t, side="left")
        lay.padded(starts, lens, t, t * (e_count + 1) + rank // batch, cat)
        # underfill: packed without padding, one product per relation
        u = units[small][np.argsort(unit_type[units[small]], kind="stable")]
        starts, lens, owner = _pieces(u, gptr)
        lay.packed(starts, lens, unit_type[owner], cat)
        if cat == FREQUENT:  # the extracted (relation, source) pairs, computed once
            ft = np.arange(types_n)
            lay.packed(gptr[num_units + ft], np.diff(gptr[num_units:]), ft, cat)
    position = lay.positions(row_group.size)
    total = lay.offset
    gather = np.full(total, -1, np.int64)
    gather[position] = row_src
    pad_rows = np.flatnonzero(gather < 0)
    gather[pad_rows] = 0
    by_dst = np.argsort(plan.dst, kind="stable")
    scatter_ptr = np.zeros(plan.num_dst + 1, np.int64)
    scatter_ptr[1:] = np.cumsum(np.bincount(plan.dst, minlength=plan.num_dst))
    scatter = CSRMatrix.from_numpy(scatter_ptr, position[edge_row[by_dst]], None, plan.num_dst, total)
    stats = {
        "units": num_units,
        "regular_rows": s,
        "batch_units": batch,
        "rows": int(row_group.size),
        "padded_rows": total,
        "padding": lay.padding,
        "blocks": len(lay.blocks),
        "frequent_pairs": int((pair_units >= policy.frequent).sum()),
        **{f"{c}_units": int((label == c).sum()) for c in CATEGORIES},
    }
    blocks = tuple(lay.blocks)
    fused = fuse(blocks)
    stats["products"] = len(fused)
    return Execution(
        torch.from_numpy(gather),
        torch.from_numpy(pad_rows),
        blocks,
        fused,
        scatter,
        torch.from_numpy(plan.order[by_dst]),
        s,
        stats,
    )


def _check(x: torch.Tensor, weights: torch.Tensor, plan: GTaskPlan) -> None:
    if weights.dim() != 3 or x.dim() != 2 or x.shape[1] != weights.shape[1]:
        raise ValueError(
            f"need x (N, F_in) and weights (R, F_in, F_out), got {tuple(x.shape)} and {tuple(weights.shape)}"
        )
    if x.shape[0] != plan.num_src:
        raise ValueError(f"x has {x.shape[0]} rows but the plan has {plan.num_src} source vertices")
    if plan.num_types > weights.shape[0]:
        raise GraphError(
            f"edge type {plan.num_types - 1} is out of range for {weights.shape[0]} relation weights: "
            "pass one weight matrix per relation (num_relations > the largest edge type)"
        )


def gather_rows(ex: Execution, x: torch.Tensor) -> torch.Tensor:
    """The layout's rows of ``x`` (padding rows zero), differentiable."""
    xs = x.index_select(0, ex.gather)
    if ex.pad_rows.numel():
        # Outside autograd: a padding row's gradient is exactly zero (the scatter reads none of
        # them), so nothing needs masking in the backward, and a differentiable index_fill_ would
        # copy the whole gradient of xs to zero those rows.
        with torch.no_grad():
            xs.index_fill_(0, ex.pad_rows, 0)
    return xs


def run_blocks(ex: Execution, xs: torch.Tensor, weights: torch.Tensor, blocks=None) -> torch.Tensor:
    """The dense products of ``blocks`` (default: all of ``ex.products``; a subset, for profiling)
    on gathered rows ``xs``, without autograd: rows of the result outside ``blocks`` are undefined."""
    out = xs.new_empty(xs.shape[0], weights.shape[2])
    with torch.no_grad():
        products(ex.products if blocks is None else blocks, xs, weights, out)
    return out


def typed_message_sum(
    x: torch.Tensor,
    weights: torch.Tensor,
    plan: GTaskPlan,
    policy: OutlierPolicy = OutlierPolicy(),
    backend: str = "csr",
    edge_weight: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[d] = sum_{e=(s->d)} c_e x[s] @ weights[type_e]`` over the plan's edges, one dense
    product per gTask batch (module docstring); differentiable in ``x``, ``weights`` and
    ``edge_weight`` (``c``, shape ``(E,)`` in the edge table's order, e.g. RGCN's per-relation mean
    ``1 / |N_r(d)|``; None: all ones)."""
    _check(x, weights, plan)
    ex = build_execution(plan, policy)
    if edge_weight is not None and edge_weight.shape != (plan.num_edges,):
        raise ValueError(f"edge_weight has shape {tuple(edge_weight.shape)}, expected ({plan.num_edges},)")
    y = gather_block_matmul(x, ex.gather, weights, ex.products, ex.pad_rows)  # gathered a chunk at a time
    c = None if edge_weight is None else edge_weight.index_select(0, ex.scatter_edges)
    return aggregate(ex.scatter, y, backend=backend, weight=c)


execute = typed_message_sum


def typed_message_sum_reference(
    x: torch.Tensor, weights: torch.Tensor, src, dst, etype, num_dst: int, edge_weight: torch.Tensor | None = None
) -> torch.Tensor:
    """The edge-wise definition, one relation at a time: ``out[dst_e] += c_e x[src_e] @ W[type_e]``."""
    src, dst, etype = (torch.as_tensor(a, dtype=torch.int64) for a in (src, dst, etype))
    out = x.new_zeros(num_dst, weights.shape[2])
    for r in range(weights.shape[0]):
        m = etype == r
        msg = x[src[m]] @ weights[r]
        out = out.index_add(0, dst[m], msg if edge_weight is None else msg * edge_weight[m].unsqueeze(1))
    return out
