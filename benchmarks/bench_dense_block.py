"""Dense-block aggregation (NeutronAscend Alg. 2 chunks as MKL GEMMs) against the CSR kernel and
the torch-sparse reference, on the synthetic arxiv / products / reddit graphs.

For each graph and width it times one forward product ``A @ X`` plus one backward product
``A^T @ G`` (what an aggregation costs in a training step), for every backend in turn within each
repetition (interleaved in a fresh random order, so machine noise hits all alike), and reports
medians after warm-up. It also reports the one-off cost of the chunking (Alg. 2), the column
compression, and what share of the edges landed in dense blocks.

    .venv/bin/python benchmarks/bench_dense_block.py --graphs arxiv products reddit --widths 128 256

``--weighted`` uses GCN-normalised edge weights instead of plain sums. The header records
``OMP_WAIT_POLICY``: on a heavily shared machine OpenMP's default active waiting makes every short
torch parallel region that follows a numba kernel very slow (measured: 47 small GEMMs and
``index_add_`` calls 11 s instead of 15 ms), which punishes the dense-block path's per-batch torch
calls far more than one numba kernel; ``OMP_WAIT_POLICY=passive`` removes that effect.
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from tessera.backends.base import get_backend
from tessera.backends.cpu_dense_block import DenseBlockBackend
from tessera.graph import chunking
from tessera.graph.synthetic import generate
from tessera.threads import set_num_threads

HERE = Path(__file__).resolve().parent


def _timed(f):
    w, c = time.perf_counter(), time.process_time()
    out = f()
    return out, time.perf_counter() - w, time.process_time() - c


def bench_graph(name: str, widths: list[int], reps: int, warmup: int, weighted: bool, seed: int) -> list[dict]:
    t0 = time.perf_counter()
    g = generate(name, seed=seed)
    gen_s = time.perf_counter() - t0
    if weighted:
        g = g.gcn_norm(add_self_loops=True)
    w = g.edge_weight if weighted else None
    _, t_s, _ = _timed(g.transpose)
    rows = chunking.chunk_rows_for_cache()
    _, chunk_s, chunk_cpu = _timed(lambda: chunking.locality_chunking(g, rows))
    db = get_backend("dense_block")
    piped = DenseBlockBackend(db.config.__class__(**{**db.config.__dict__, "pipeline": True}))
    _, plan_s, _ = _timed(lambda: (db.plan(g, False), db.plan(g, True)))
    plan = db.plan(g)
    piped.plan(g), piped.plan(g, True)
    nd = int(plan.dense_eid.numel())
    info = {
        "graph": f"synthetic:{name}",
        "nodes": g.num_nodes,
        "edges": g.num_edges,
        "generate_s": gen_s,
        "transpose_s": t_s,
        "chunk_rows": rows,
        "chunking_s": chunk_s,
        "chunking_cpu_s": chunk_cpu,
        "compress_s": plan_s,
        "symmetric": db.plan(g, True) is plan,
        "chunks": chunking.locality_chunking(g, rows).num_chunks,
        "dense_blocks": plan.num_blocks,
        "dense_edge_share": nd / max(1, g.num_edges),
        "block_density": nd / max(1, plan.blocks.block_values),
        "block_values_mib": plan.blocks.block_values * 4 / 2**20,
        "config": dict(db.config.__dict__),
    }
    print(json.dumps(info), flush=True)
    cands = {
        "csr": get_backend("csr"),
        "reference": get_backend("reference"),
        "dense_block": db,
        "dense_block+pipeline": piped,
    }
    results = []
    for width in widths:
        gen = torch.Generator().manual_seed(width)
        x = torch.randn(g.num_nodes, width, generator=gen)
        gy = torch.randn(g.num_nodes, width, generator=gen)
        ref_y = cands["csr"].spmm(g, x, w)
        for nm, be in cands.items():  # correctness check doubles as the first warm-up
            y = be.spmm(g, x, w)
            err = float((y - ref_y).abs().max() / ref_y.abs().max().clamp(min=1e-30))
            if err > 1e-4:
                raise SystemExit(f"{nm} disagrees with csr on {name} at width {width}: rel err {err:.2e}")
        times = {nm: {"fwd": [], "bwd": [], "cpu": []} for nm in cands}
        names = list(cands)
        shuffle = torch.Generator().manual_seed(1000 + width)
        for rep in range(warmup - 1 + reps):
            # A fresh random order each repetition: who runs first, and after whom, varies (a fixed
            # rotation would always put the same backend right after the slow reference).
            for k in torch.randperm(len(names), generator=shuffle).tolist():
                nm = names[k]
                be = cands[nm]
                _, f_s, f_c = _timed(lambda be=be, x=x: be.spmm(g, x, w))
                _, b_s, b_c = _timed(lambda be=be, gy=gy: be.spmm_t(g, gy, w))
                if rep >= warmup - 1:
                    times[nm]["fwd"].append(f_s)
                    times[nm]["bwd"].append(b_s)
                    times[nm]["cpu"].append(f_c + b_c)
            gc.collect()
        for nm, t in times.items():
            tot = [a + b for a, b in zip(t["fwd"], t["bwd"])]
            results.append(
                {
                    **info,
                    "width": width,
                    "backend": nm,
                    "fwd_ms": 1e3 * statistics.median(t["fwd"]),
                    "bwd_ms": 1e3 * statistics.median(t["bwd"]),
                    "total_ms": 1e3 * statistics.median(tot),
                    "cpu_ms": 1e3 * statistics.median(t["cpu"]),
                    "total_all_ms": [round(1e3 * v, 2) for v in tot],
                    "reps": reps,
                }
            )
            r = results[-1]
            print(
                f"{name} F={width} {nm:22s} fwd {r['fwd_ms']:9.1f} bwd {r['bwd_ms']:9.1f} "
                f"total {r['total_ms']:9.1f} ms (cpu {r['cpu_ms']:9.1f})",
                flush=True,
            )
    return results


def verdict(db: dict, csr: dict) -> tuple[str, str]:
    """Paired comparison over the repetitions (both timed in the same repetition): how often the
    dense-block product was faster, and a sign-test verdict (a clear winner takes all repetitions
    but at most one)."""
    pairs = list(zip(db["total_all_ms"], csr["total_all_ms"]))
    wins = sum(d < c for d, c in pairs)
    n = len(pairs)
    if db["dense_blocks"] == 0:
        return f"{wins}/{n}", "same kernel: no block is dense enough, dense_block runs csr"
    if n >= 5 and wins >= n - 1:
        return f"{wins}/{n}", "dense_block"
    if n >= 5 and wins <= 1:
        return f"{wins}/{n}", "csr"
    return f"{wins}/{n}", "no clear winner"


def markdown(results: list[dict]) -> str:
    """The comparison table (median wall ms of forward + backward; median CPU ms in brackets) and
    the chunking table."""
    lines = [
        "| graph | width | csr ms | reference ms | dense_block ms | dense_block+pipeline ms "
        "| dense_block / csr | dense_block faster in | verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    keys = sorted({(r["graph"], r["width"]) for r in results}, key=lambda k: (k[0], k[1]))
    for graph, width in keys:
        cell = {r["backend"]: r for r in results if r["graph"] == graph and r["width"] == width}

        def ms(nm, cell=cell):
            return f"{cell[nm]['total_ms']:.1f} ({cell[nm]['cpu_ms']:.0f})"

        c, d = cell["csr"]["total_ms"], cell["dense_block"]["total_ms"]
        wins, word = verdict(cell["dense_block"], cell["csr"])
        lines.append(
            f"| {graph} | {width} | {ms('csr')} | {ms('reference')} | {ms('dense_block')} | "
            f"{ms('dense_block+pipeline')} | {d / c:.2f} | {wins} | {word} |"
        )
    lines += [
        "",
        "| graph | vertices | edges | chunk rows | chunks | Alg. 2 s | compress s | dense blocks "
        "| edges in blocks | block density | block values MiB |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    seen = set()
    for r in results:
        if r["graph"] in seen:
            continue
        seen.add(r["graph"])
        lines.append(
            f"| {r['graph']} | {r['nodes']} | {r['edges']} | {r['chunk_rows']} | {r['chunks']} | "
            f"{r['chunking_s']:.2f} | {r['compress_s']:.2f} | {r['dense_blocks']} | "
            f"{100 * r['dense_edge_share']:.1f} % | {r['block_density']:.2f} | {r['block_values_mib']:.1f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--graphs", nargs="+", default=["arxiv", "products", "reddit"])
    p.add_argument("--widths", nargs="+", type=int, default=[128, 256])
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=2, help="warm-up repetitions (the first is the correctness check)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--weighted", action="store_true", help="GCN-normalised edge weights")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON file for the raw results")
    p.add_argument("--from-json", nargs="+", type=Path, help="only print the tables of earlier --out files")
    a = p.parse_args(argv)
    if a.from_json:
        docs = [json.loads(f.read_text()) for f in a.from_json]
        print("\n".join(d["header"] for d in docs) + "\n" + markdown([r for d in docs for r in d["results"]]))
        return
    if a.reps < 1 or a.warmup < 1:
        raise SystemExit("--reps and --warmup must be at least 1")
    set_num_threads(a.threads)
    load0 = os.getloadavg()
    print(f"# {platform.processor() or platform.machine()}, torch {torch.__version__}, threads {a.threads}", flush=True)
    results = []
    for name in a.graphs:
        results += bench_graph(name, a.widths, a.reps, a.warmup, a.weighted, a.seed)
    load1 = os.getloadavg()
    md = markdown(results)
    cmd = "python benchmarks/" + Path(sys.argv[0]).name + " " + " ".join(argv if argv is not None else sys.argv[1:])
    header = (
        f"{dt.date.today()}, {a.threads} threads, median of {a.reps} interleaved repetitions after "
        f"{a.warmup} warm-up, forward + backward product, {'GCN-weighted' if a.weighted else 'unweighted sum'}; "
        f"load average {load0[0]:.1f} at start, {load1[0]:.1f} at end; "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', '(unset)')}\n\n`{cmd}`\n"
    )
    print("\n" + header + "\n" + md)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"header": header, "results": results}, indent=1))
        a.out.with_suffix(".md").write_text(header + "\n" + md + "\n")


if __name__ == "__main__":
    main()
