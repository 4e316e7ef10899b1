"""gTask typed message sum (``out[d] = sum_e x[s] @ W[type_e]``, RGCN's messages) on a power-law
graph with random relations: WiseGraph Fig. 18 and Fig. 19 analogues and the outlier thresholds.

Tables (median process CPU time of ``--repeats`` forward passes, and the minimum wall time, all interleaved so a shared machine's load hits
every configuration alike):

1. plan building: the sort and the O(E) greedy scan, per restriction;
2. throughput vs K (Fig. 18a): ``uniq(Src.ID)=K & uniq(Edge.Type)=1`` for K = 1 .. inf, with the
   per-relation (tensor-centric) baseline, the rows multiplied and the padding;
3. differentiated outlier execution (Fig. 19): time of the products of each gTask category,
   uniform (every gTask batched in scan order, padded to its batch's largest) vs handled;
4. threshold sweeps: one OutlierPolicy field varied at a time from the defaults.

    python benchmarks/bench_gtask.py --threads 2
    python benchmarks/bench_gtask.py --graph small --relations 8 --width 64 --repeats 3
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch starts OpenMP: idle threads sleep

import argparse
import dataclasses
import statistics
import time

import numpy as np
import torch

from tessera.graph.synthetic import generate
from tessera.relational.block_matmul import block_matmul
from tessera.relational.gtask import build_plan, edge_attributes, greedy_cuts
from tessera.relational.gtask_kernels import (
    CATEGORIES,
    REGULAR,
    OutlierPolicy,
    build_execution,
    gather_rows,
    run_blocks,
    typed_message_sum,
    typed_message_sum_reference,
)
from tessera.sparse.aggregate import aggregate
from tessera.threads import set_num_threads

WALL: dict = {}  # minimum wall seconds of the last median_times call, by key
WALL_MEDIAN: dict = {}  # median wall seconds of the last median_times call, by key
THROUGHPUT_HEADER = ["plan", "CPU ms", "min wall ms", "M edges per CPU s", "rows", "padded rows", "batches", "products"]
K_PLAN = "uniq(Src.ID)={k} & uniq(Edge.Type)=1"  # WiseGraph Fig. 18a
OUTLIER_HEADER = [
    "schedule",
    *CATEGORIES,
    "outliers",
    "gather",
    "scatter",
    "total",
    "total min wall",
    "rows",
    "padded rows",
]


def median_times(fns: dict, repeats: int) -> dict:
    """Median process CPU seconds of each callable (all threads; with OMP_WAIT_POLICY=PASSIVE an
    idle thread does not count), run round-robin ``repeats`` times after one warm-up. CPU time,
    not wall time: on a shared machine wall time measures the other jobs; the minimum and median
    wall times are kept beside it in :data:`WALL` and :data:`WALL_MEDIAN`."""
    for f in fns.values():
        f()
    cpu, wall = {k: [] for k in fns}, {k: [] for k in fns}
    for r in range(repeats):
        for k in list(fns)[:: 1 if r % 2 == 0 else -1]:
            c0, t0 = time.process_time(), time.perf_counter()
            fns[k]()
            wall[k].append(time.perf_counter() - t0)
            cpu[k].append(time.process_time() - c0)
    WALL.update({k: min(v) for k, v in wall.items()})
    WALL_MEDIAN.update({k: statistics.median(v) for k, v in wall.items()})
    return {k: statistics.median(v) for k, v in cpu.items()}


def table(title: str, header: list[str], rows: list[list]) -> None:
    """Print a markdown table under a ``###`` title (floats to 3 significant digits)."""
    print(f"\n### {title}\n")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(f"{v:.3g}" if isinstance(v, float) else str(v) for v in r) + " |")


def k_plans(edges, ks: list[int]) -> dict:
    """``"K=k" -> plan`` of :data:`K_PLAN` for every ``k`` (0 means inf: one gTask per relation)."""
    out = {}
    for k in ks:
        label = "inf" if k == 0 else str(k)
        out[f"K={label}"] = build_plan(edges, K_PLAN.format(k=label))
    return out


def throughput_rows(t: dict, info: dict, num_edges: int) -> list[list]:
    """Rows of :data:`THROUGHPUT_HEADER` from :func:`median_times`' result and each key's execution
    stats (keys without stats, e.g. a baseline, leave those columns empty)."""
    return [
        [k, t[k] * 1e3, WALL[k] * 1e3, num_edges / t[k] / 1e6]
        + ([info[k][s] for s in ("rows", "padded_rows", "blocks", "products")] if k in info else [""] * 4)
        for k in t
    ]


def with_backward(fn):
    """``fn`` followed by the backward pass of its output, with an all-ones output gradient, when
    the output needs a gradient."""

    def step() -> None:
        out = fn()
        if out.requires_grad:
            out.backward(torch.ones_like(out))

    return step


def _category_rows(ex, xs, category: str):
    """The gathered rows of ``category``'s products packed in order (a leaf, needing a gradient
    when ``xs`` does) and those products re-offset onto them: timing one category then costs its
    own rows, not an output and a gradient as large as the whole layout."""
    rows, blocks, at = [], [], 0
    for b in ex.products:
        if b.category == category:
            rows.append(xs[b.offset : b.offset + b.rows])
            blocks.append(dataclasses.replace(b, offset=at))
            at += b.rows
    packed = torch.cat(rows) if rows else xs[:0]
    return packed.detach().requires_grad_(xs.requires_grad), blocks


def outlier_rows(
    plan, x, w, repeats: int, *, edge_weight=None, backward: bool = False, total=None, handles=(False, True)
) -> list[list]:
    """Rows of :data:`OUTLIER_HEADER`, one per schedule of ``plan`` (``handles``: False is uniform,
    True handled): CPU time of each category's products (the fused products that run, on the
    category's rows packed apart: :func:`_category_rows`), of the gather, the scatter and the
    ``total`` (default: the whole typed message sum; else ``total(policy)`` gives the forward
    callable to time), each with its backward pass when ``backward`` (the products then
    differentiate in ``w`` and, when ``x`` needs a gradient, their gathered rows; the scatter in
    its rows)."""
    rows = []
    for handle in handles:
        pol = OutlierPolicy(handle=handle)
        ex = build_execution(plan, pol)
        xs = gather_rows(ex, x).detach().requires_grad_(backward and x.requires_grad)
        ys = run_blocks(ex, xs, w).requires_grad_(backward)
        c = None if edge_weight is None else edge_weight.index_select(0, ex.scatter_edges)
        fns = {}
        for cat in CATEGORIES:
            rows_c, blocks_c = _category_rows(ex, xs, cat)
            if backward:
                fns[cat] = lambda r=rows_c, bl=blocks_c: block_matmul(r, w, bl)
            else:
                fns[cat] = lambda r=rows_c, bl=blocks_c, ex=ex: run_blocks(ex, r, w, bl)
        fns["gather"] = lambda ex=ex: gather_rows(ex, x)
        fns["scatter"] = lambda ex=ex, ys=ys, c=c: aggregate(ex.scatter, ys, backend="csr", weight=c)
        fns["total"] = (
            (lambda pol=pol: typed_message_sum(x, w, plan, pol, edge_weight=edge_weight))
            if total is None
            else total(pol)
        )
        if backward:
            fns = {k: with_backward(f) for k, f in fns.items()}
        t = median_times(fns, repeats)
        st = ex.stats
        rows.append(
            ["handled" if handle else "uniform"]
            + [f"{t[c] * 1e3:.1f} ({st[c + '_units']})" for c in CATEGORIES]
            + [sum(t[c] for c in CATEGORIES if c != REGULAR) * 1e3, t["gather"] * 1e3, t["scatter"] * 1e3]
            + [t["total"] * 1e3, WALL["total"] * 1e3, st["rows"], st["padded_rows"]]
        )
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph", default="arxiv", help="synthetic preset (default arxiv: 169 k vertices, 2.3 M edges)")
    p.add_argument("--relations", type=int, default=16)
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 0], help="0 means inf")
    p.add_argument("--outlier-plan", default="uniq(Dst.ID)=8 & uniq(Edge.Type)=1")
    p.add_argument("--skip", nargs="*", default=[], help="tables to skip: plan k outliers sweep")
    args = p.parse_args()
    set_num_threads(args.threads)
    g = generate(args.graph, seed=0)
    rng = np.random.default_rng(0)
    etype = rng.integers(0, args.relations, g.num_edges)
    g = g.replace(edge_type=torch.from_numpy(etype))
    src, dst = g.src_index(), g.dst_index()
    n, f = g.num_nodes, args.width
    x = torch.randn(n, f)
    w = torch.randn(args.relations, f, f) / f**0.5
    print(
        f"graph {args.graph}: {n} vertices, {g.num_edges} edges, {args.relations} relations, F={f}, {args.threads} threads"
    )
    ref = typed_message_sum_reference(x, w, src, dst, etype, n)

    build_plan((np.zeros(1, np.int64),) * 3, "uniq(Edge.Type)=1 & uniq(Src.Degree)=1")  # compile the scan
    if "plan" not in args.skip:
        rows = []
        attrs = edge_attributes(src.numpy(), dst.numpy(), etype, n, n)
        for text in (
            "uniq(Edge.Type)=1",
            "uniq(Src.ID)=64 & uniq(Edge.Type)=1",
            args.outlier_plan,
            "uniq(Dst.ID)=1 & uniq(Edge.ID)=32",
        ):
            t0 = time.perf_counter()
            plan = build_plan(g, text)
            t1 = time.perf_counter()
            build_execution(plan, OutlierPolicy())
            t2 = time.perf_counter()
            bounded = [r for r in plan.restrictions.items if r.limit is not None]
            greedy_cuts([attrs[r.attribute][plan.order] for r in bounded], [r.limit for r in bounded], plan.num_edges)
            rows.append([text, plan.num_tasks, time.perf_counter() - t2, t1 - t0, t2 - t1])
        table(
            "plan building (wall s)",
            ["restrictions", "gTasks", "greedy scan alone", "build_plan (sort, scan, metadata)", "layout"],
            rows,
        )

    if "k" not in args.skip:
        fns, info = {"per-relation (tensor-centric)": lambda: typed_message_sum_reference(x, w, src, dst, etype, n)}, {}
        for label, plan in k_plans(g, args.ks).items():
            for handle in (False, True):
                pol = OutlierPolicy(handle=handle)
                out = typed_message_sum(x, w, plan, pol)
                assert torch.allclose(out, ref, rtol=1e-4, atol=1e-3), label
                key = f"{label}, {'handled' if handle else 'uniform'}"
                fns[key] = lambda plan=plan, pol=pol: typed_message_sum(x, w, plan, pol)
                info[key] = build_execution(plan, pol).stats
        t = median_times(fns, args.repeats)
        table(
            f"throughput vs K, {K_PLAN.format(k='K')} (forward)",
            THROUGHPUT_HEADER,
            throughput_rows(t, info, g.num_edges),
        )

    if "outliers" not in args.skip:
        rows = outlier_rows(build_plan(g, args.outlier_plan), x, w, args.repeats)
        table(
            f"differentiated outlier execution, {args.outlier_plan}: product CPU ms per category (units)",
            OUTLIER_HEADER,
            rows,
        )

    if "sweep" not in args.skip:
        plan = build_plan(g, args.outlier_plan)
        base = OutlierPolicy()
        sweeps = {
            "underfill": [0.0, 0.25, 0.5, 0.75, 1.0],
            "overfill": [1.5, 2.0, 4.0, 8.0, 1e9],
            "frequent": [2, 3, 4, 8, 10**9],
            "batch_rows": [256, 1024, 4096, 16384, 65536],
        }
        fns, info = {}, {}
        for field, values in sweeps.items():
            for v in values:
                pol = dataclasses.replace(base, **{field: v})
                fns[(field, v)] = lambda pol=pol: typed_message_sum(x, w, plan, pol)
                info[(field, v)] = build_execution(plan, pol).stats
        t = median_times(fns, args.repeats)
        rows = [
            [fld, v, t[(fld, v)] * 1e3, WALL[(fld, v)] * 1e3, info[(fld, v)]["rows"], info[(fld, v)]["padded_rows"]]
            for fld, v in fns
        ]
        table(
            f"threshold sweeps from {base}, {args.outlier_plan} (forward)",
            ["field", "value", "CPU ms", "min wall ms", "rows", "padded rows"],
            rows,
        )


if __name__ == "__main__":
    main()
