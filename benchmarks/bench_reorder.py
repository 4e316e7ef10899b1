"""Vertex orders against aggregation time: none / rcm / metis / degree (tessera.graph.order).

For each width and backend, the median wall time of one forward sum aggregation ``A @ x`` on the
graph renumbered by each order, all orders interleaved in every repeat (alternating direction)
so a shared machine's load hits them alike, with the speedup over the original numbering; and
the seconds each order took to compute (uncached: a private cache directory per run).

    python benchmarks/bench_reorder.py --threads 2
    python benchmarks/bench_reorder.py --graph arxiv --widths 128 256 --backends reference csr --repeats 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch

from tessera import sparse
from tessera.graph import order as ro
from tessera.graph.graph import Graph
from tessera.graph.synthetic import generate
from tessera.threads import set_num_threads


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--graph", default="arxiv", help="synthetic preset (default arxiv)")
    p.add_argument("--widths", type=int, nargs="+", default=[128, 256])
    p.add_argument("--backends", nargs="+", default=["reference", "csr"])
    p.add_argument("--orders", nargs="+", default=list(ro.METHODS))
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", help="also write the numbers here")
    args = p.parse_args()
    set_num_threads(args.threads)
    g = generate(args.graph, seed=0)
    base = Graph(g.indptr, g.indices, g.num_nodes, edge_weight=g.edge_weight, name=g.name)  # structure only
    print(f"{g.name}: {g.num_nodes:,} vertices, {g.num_edges:,} edges, {args.threads} threads")
    out: dict = {"graph": g.name, "threads": args.threads, "order_s": {}, "agg_s": {}}
    with tempfile.TemporaryDirectory() as cache:
        for width in args.widths:
            perms, graphs = {}, {}
            for m in args.orders:
                t0 = time.perf_counter()
                perms[m] = torch.from_numpy(ro.vertex_order(g, m, cache_dir=cache, width=width))
                dt = time.perf_counter() - t0
                key = f"metis[{ro.metis_parts_for(g.num_nodes, width)} parts]" if m == "metis" else m
                out["order_s"].setdefault(key, dt)  # the first (uncached) computation
                t0 = time.perf_counter()
                graphs[m] = base if m == "none" else ro.permute_graph(base, perms[m])
                out["order_s"].setdefault(f"permute[{m}]", time.perf_counter() - t0)
            x = torch.rand(g.num_nodes, width, generator=torch.Generator().manual_seed(0))
            xs = {m: x[perms[m]] for m in args.orders}
            for backend in args.backends:
                times: dict[str, list[float]] = {m: [] for m in args.orders}
                for m in args.orders:  # warm-up: compile, work items
                    sparse.aggregate(graphs[m], xs[m], backend=backend)
                for r in range(args.repeats):
                    for m in args.orders if r % 2 == 0 else args.orders[::-1]:
                        t0 = time.perf_counter()
                        sparse.aggregate(graphs[m], xs[m], backend=backend)
                        times[m].append(time.perf_counter() - t0)
                med = {m: statistics.median(v) for m, v in times.items()}
                ref = med.get("none", next(iter(med.values())))
                out["agg_s"][f"{backend}/w{width}"] = med
                row = "  ".join(f"{m} {med[m] * 1e3:7.1f} ms ({ref / med[m]:.2f}x)" for m in args.orders)
                print(f"width {width:4d} {backend:>10}:  {row}", flush=True)
    print("time to compute each order (s, uncached):")
    print("  " + "  ".join(f"{k} {v:.2f}" for k, v in out["order_s"].items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
