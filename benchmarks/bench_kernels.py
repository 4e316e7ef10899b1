"""Aggregation kernels side by side, against STREAM bandwidth measured in the same run.

For each graph, width and backend: the median wall time of the forward product ``A @ x``
(``spmm``) and of the backward product ``A^T @ g`` (``spmm_t``, over the cached transposed CSR),
with all backends and directions interleaved in every repeat so a shared machine's load hits
them alike. Effective bandwidth counts the bytes a kernel without any cache reuse moves::

    bytes = nnz * (4 index [+ 4 weight]) + nnz * F * 4 (gathered rows) + N * F * 4 (written rows)

and the compulsory bound (every input row read once) is printed beside it::

    compulsory = nnz * (4 [+ 4]) + num_cols * F * 4 + N * F * 4

STREAM triad (float32, 3 x 200 MB) is measured two ways in the same run: best of 5 just before
and just after the kernels (McCalpin's convention; the better of the two is "best"), and once in
every repeat, interleaved with the kernels, so that a shared machine's load hits it alike ("med",
the median). "% triad" is effective GB/s over the interleaved median, "% best" over the best.
``csr+out`` is the csr backend writing into a reused output buffer (no page faults for fresh
memory); ``masked`` the csr S-SpMM (``tessera.sparse.masked``; backward row: ``masked_spmm_t``, the
ReLU-mask case) with an element-wise keep-half mask, ``spmm*mask`` the unfused product and
masking multiply it replaces, ``masked-rows`` S-SpMM with half the rows dropped whole (its GB/s
still counts every row, so it reads as the speed-up from skipping); ``drop-agg`` is
``tessera.sparse.masked.dropout_aggregate`` (p = 0.5), the fused form of ``drop(spmm)``, tessera's
dropout after the csr product (bitwise the same result). S-SpMM rows count the same bytes as a
full product.

    python benchmarks/bench_kernels.py --threads 2
    python benchmarks/bench_kernels.py --graphs arxiv products --widths 128 256 --weighted both
    python benchmarks/bench_kernels.py --order metis        # renumber vertices first (tessera.graph.order)
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch
from stream import _init, _triad, measure_bandwidth

from tessera.backends import get_backend
from tessera.graph.synthetic import generate
from tessera.threads import set_num_threads


def _bytes(nnz: int, rows: int, cols: int, width: int, weighted: bool) -> tuple[float, float]:
    idx = nnz * (4 + (4 if weighted else 0))
    moved = idx + nnz * width * 4 + rows * width * 4
    compulsory = idx + cols * width * 4 + rows * width * 4
    return float(moved), float(compulsory)


def _best_triad(threads: int) -> float:
    bw = measure_bandwidth(threads, 2e8, 5, "float32")["triad"]
    set_num_threads(threads)
    return bw


class Triad:
    """One STREAM triad pass over persistent float32 arrays; call it to get GB/s."""

    def __init__(self, array_bytes: float = 2e8):
        n = int(array_bytes) // 4
        self.a, self.b, self.c = np.empty(n, np.float32), np.empty(n, np.float32), np.empty(n, np.float32)
        _init(self.a, self.b, self.c)
        _triad(self.a, self.b, self.c, np.float32(3.0))

    def __call__(self) -> float:
        t0 = time.perf_counter()
        _triad(self.a, self.b, self.c, np.float32(3.0))
        return 3 * self.a.nbytes / (time.perf_counter() - t0) / 1e9


def _load_graph(name: str, order: str, width: int, widths: list[int]):
    """The graph in ``order``; ``auto`` is ``choose_order`` over all of ``widths`` (one numbering
    for every width, as a training run aggregating at those widths gets). Returns the graph and
    the order used."""
    g = generate(name, seed=0)
    if order == "auto":
        from tessera.backends.ordering import choose_order

        order, width = choose_order(g, widths), max(widths)
    if order != "none":
        from tessera.graph.order import permute_graph, vertex_order

        g = permute_graph(g, vertex_order(g, order, width=width), features=False)
    return g, order


def _candidates(g, x, gy, w, backends: list[str], masked: bool) -> dict[str, tuple[Callable, Callable | None]]:
    """name -> (forward, backward) callables."""
    c: dict[str, tuple[Callable, Callable | None]] = {}
    for b in backends:
        be = get_backend(b)
        c[b] = (lambda be=be: be.spmm(g, x, w), lambda be=be: be.spmm_t(g, gy, w))
        if b == "csr":
            of, ob = torch.empty_like(x), torch.empty_like(gy)
            c["csr+out"] = (
                lambda be=be, of=of: be.spmm(g, x, w, out=of),
                lambda be=be, ob=ob: be.spmm_t(g, gy, w, out=ob),
            )
    if masked and "csr" in backends:
        from tessera.sparse.masked import masked_aggregate, masked_spmm_t

        gen = torch.Generator().manual_seed(1)
        keep = torch.rand(x.shape, generator=gen) < 0.5
        rows = (torch.rand(x.shape[0], 1, generator=gen) < 0.5).expand(x.shape).contiguous()
        be = get_backend("csr")
        c["masked"] = (lambda: masked_aggregate(g, x, keep, "sum", w), lambda: masked_spmm_t(g, gy, keep, w))
        c["spmm*mask"] = (lambda: be.spmm(g, x, w) * keep, lambda: be.spmm_t(g, gy, w) * keep)
        c["masked-rows"] = (lambda: masked_aggregate(g, x, rows, "sum", w), lambda: masked_spmm_t(g, gy, rows, w))
        from tessera.kernels.dropout import dropout
        from tessera.sparse.masked import dropout_aggregate

        c["drop(spmm)"] = (lambda: dropout(be.spmm(g, x, w), 0.5), None)
        c["drop-agg"] = (lambda: dropout_aggregate(g, x, 0.5, "sum", w), None)
    return c


def run(args: argparse.Namespace) -> list[dict]:
    set_num_threads(args.threads)
    triad_pass = Triad()
    rows = []
    for gname in args.graphs:
        for width in args.widths:
            g, order = _load_graph(gname, args.order, width, args.widths)
            n, nnz = g.num_nodes, g.num_edges
            print(
                f"\n{g.name} ({order} order{' (auto)' if args.order == 'auto' else ''}): {n:,} vertices, {nnz:,} edges, width {width}, {args.threads} threads"
            )
            for weighted in {"none": [False], "gcn": [True], "both": [False, True]}[args.weighted]:
                w = g.gcn_norm(add_self_loops=False).edge_weight if weighted else None
                gen = torch.Generator().manual_seed(0)
                x = torch.randn(n, width, generator=gen)
                gy = torch.randn(n, width, generator=gen)
                cands = _candidates(g, x, gy, w, args.backends, args.masked)
                for fwd, bwd in cands.values():  # warm-up: compile, caches, transposed CSR
                    fwd()
                    if bwd is not None:
                        bwd()
                bw_before = _best_triad(args.threads)
                times: dict[tuple[str, str], list[float]] = {}
                triads = []
                for _ in range(args.repeats):
                    triads.append(triad_pass())
                    for name, (fwd, bwd) in cands.items():
                        for d, fn in (("fwd", fwd), ("bwd", bwd)):
                            if fn is None:
                                continue
                            t0 = time.perf_counter()
                            fn()
                            times.setdefault((name, d), []).append(time.perf_counter() - t0)
                bw_after = _best_triad(args.threads)
                best = max(bw_before, bw_after)
                triad = statistics.median(triads)
                moved, comp = _bytes(nnz, n, n, width, weighted)
                print(
                    f"  weights={'gcn' if weighted else 'none'}  STREAM triad: median {triad:.1f} GB/s interleaved, "
                    f"best {bw_before:.1f} / {bw_after:.1f} GB/s before/after; bytes moved {moved / 1e9:.3f} GB, "
                    f"compulsory {comp / 1e9:.3f} GB; bound at median triad {moved / triad / 1e9 * 1e3:.1f} ms"
                )
                ref = {d: statistics.median(times[(args.backends[0], d)]) for d in ("fwd", "bwd")}
                print(
                    f"  {'kernel':<10} {'dir':<4} {'median ms':>10} {'min ms':>8} {'GB/s':>7} {'% triad':>8} {'% best':>7} {'vs ' + args.backends[0]:>12}"
                )
                for (name, d), ts in times.items():
                    med = statistics.median(ts)
                    gbs = moved / med / 1e9
                    print(
                        f"  {name:<10} {d:<4} {med * 1e3:10.1f} {min(ts) * 1e3:8.1f} {gbs:7.1f} "
                        f"{100 * gbs / triad:7.0f}% {100 * gbs / best:6.0f}% {ref[d] / med:11.2f}x"
                    )
                    rows.append(
                        {
                            "graph": gname, "order": order, "order_setting": args.order, "width": width, "weighted": weighted,
                            "kernel": name, "direction": d, "median_ms": med * 1e3, "min_ms": min(ts) * 1e3,
                            "gb_s": gbs, "triad_median": triad, "triad_best": best, "triad_before": bw_before,
                            "triad_after": bw_after,
                            "bytes_moved": moved, "bytes_compulsory": comp, "threads": args.threads,
                        }
                    )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    """Command-line entry."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graphs", nargs="+", default=["arxiv"], help="synthetic presets (arxiv, products, reddit, ...)")
    p.add_argument("--widths", nargs="+", type=int, default=[128, 256])
    p.add_argument("--backends", nargs="+", default=["reference", "csr"], help="first one is the baseline")
    p.add_argument("--weighted", choices=("none", "gcn", "both"), default="both")
    p.add_argument(
        "--order",
        default="none",
        help="vertex order from tessera.graph.order (none, rcm, metis, degree, or auto: choose_order over --widths)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--no-masked", dest="masked", action="store_false", help="skip the S-SpMM rows")
    p.add_argument("--json", help="also write the rows to this JSON file")
    a = p.parse_args(argv)
    t0 = time.time()
    rows = run(a)
    print(f"\n({time.time() - t0:.0f} s)")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
