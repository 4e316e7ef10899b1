"""Dense products of a full-graph epoch: torch's ``mm`` (MKL) vs ``tessera.sparse.linear`` (oneDNN).

Times, on ``--threads`` threads, the five GEMM shapes of a 2-layer GCN epoch on an arxiv-sized
graph (N x F_in times F_in x F_out forward, the input gradient, the weight gradient), median of
``--repeats`` after a warm-up, each into a fresh output as training does, and prints ms and
GFLOPS for both (run it under the allocator you train with: ``LD_PRELOAD`` jemalloc or not).

    python benchmarks/bench_dense.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tessera import sparse
from tessera.sparse.linear import _usable
from tessera.threads import set_num_threads


def median_s(fn, repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up."""
    fn()
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def layer_rows(rows: int, fi: int, fo: int, repeats: int) -> None:
    """Print the table rows of one ``fi -> fo`` layer."""
    x, w, g = torch.randn(rows, fi), torch.randn(fo, fi), torch.randn(rows, fo)
    wt = w.t().contiguous()
    flops = 2.0 * rows * fi * fo
    cases = {
        f"forward x W^T, {rows}x{fi} . {fi}x{fo}": (lambda: x.mm(w.t()), lambda: sparse.linear(x, w)),
        f"input grad g W, {rows}x{fo} . {fo}x{fi}": (lambda: g.mm(w), lambda: sparse.linear(g, wt)),
    }
    for name, (ref, ours) in cases.items():
        t_ref, t_ours = median_s(ref, repeats), median_s(ours, repeats)
        print(
            f"| {name} | {1e3 * t_ref:.1f} | {flops / t_ref / 1e9:.0f} | {1e3 * t_ours:.1f} "
            f"| {flops / t_ours / 1e9:.0f} | {t_ref / t_ours:.2f}x |"
        )
    t_ref = median_s(lambda: g.t().mm(x), repeats)
    name = f"weight grad g^T x (MKL in both), {fo}x{rows} . {rows}x{fi}"
    print(f"| {name} | {1e3 * t_ref:.1f} | {flops / t_ref / 1e9:.0f} | - | - | - |")


def main(argv: list[str] | None = None) -> None:
    """Print the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=169_343)
    p.add_argument("--dims", type=int, nargs="+", default=[128, 256, 40], help="layer widths")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    set_num_threads(a.threads)
    print(
        f"{a.rows:,} rows, widths {a.dims}, {a.threads} threads, median of {a.repeats}; oneDNN path: {_usable(torch.ones(1, 1))}"
    )
    print()
    print("| product | torch.mm ms | GFLOPS | tessera ms | GFLOPS | speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for fi, fo in zip(a.dims[:-1], a.dims[1:], strict=False):
        layer_rows(a.rows, fi, fo, a.repeats)


if __name__ == "__main__":
    main()
