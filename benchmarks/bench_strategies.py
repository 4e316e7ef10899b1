"""Wall time per training epoch of one process vs tensor, partition and planned parallelism, with
the bytes each moves and where a distributed epoch's time goes.

Each (strategy, P) is one ``tessera train --nprocs P --strategy S`` run in its own process group
on this machine (P local ranks over gloo, each with its share of the cores; with more ranks than
cores they share the cores, as the numbers then show). Runs are interleaved per repeat; the table
quotes the median over repeats of each run's median epoch time, and the bytes per training epoch
from the run's own log. The breakdown is per epoch after the first, on the rank whose logged
time is largest: aggregation compute (local products and building sent rows), waiting on the
exchange, quantizing, and the rest of the epoch (dense layers, loss, optimizer, gradient
all-reduce), medians over the run's epochs.

    python benchmarks/bench_strategies.py --dataset synthetic:arxiv --model gcn --hidden 256 \\
        --procs 2 4 --strategies partition tensor auto --reorder auto --epochs 10 --repeats 2 --md out.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_once(args: argparse.Namespace, strategy: str, procs: int, out: Path) -> dict:
    """One training run; its result.json plus the bytes per epoch from its log."""
    cmd = [
        sys.executable, "-m", "tessera", "train", "--dataset", args.dataset, "--model", args.model,
        "--hidden", str(args.hidden), "--layers", str(args.layers), "--epochs", str(args.epochs),
        "--patience", "0", "--checkpoint-every", "100000", "--no-progress", "--out", str(out),
        "--nprocs", str(procs), "--reorder", args.reorder,
    ]  # fmt: skip
    if procs > 1:
        cmd += ["--strategy", strategy]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    res = json.loads((out / "result.json").read_text())
    comm = res.get("comm")
    res["bytes_per_epoch"] = (
        (sum(map(sum, comm["bytes_data"])) + sum(map(sum, comm["bytes_params"]))) / comm["epochs"] if comm else 0
    )
    res["breakdown_ms"] = breakdown(out / "metrics.jsonl") if comm else None
    return res


def _rank_sums(per_layer: list) -> list[float]:
    """Seconds per rank of one logged quantity of one epoch (``[layer][direction][rank]``), summed."""
    ranks = len(per_layer[0][0])
    return [sum(d[r] for layer in per_layer for d in layer) for r in range(ranks)]


def breakdown(metrics: Path) -> dict[str, float]:
    """Median milliseconds per epoch (after the first) of aggregation compute, exchange, quantize
    and the rest, on each epoch's rank with the most logged time."""
    parts: dict[str, list[float]] = {"compute": [], "exchange": [], "quantize": [], "rest": []}
    for line in metrics.read_text().splitlines()[1:]:
        rec = json.loads(line)
        logged = {k: _rank_sums(rec["comm"][f"{k}_s"]) for k in ("compute", "exchange", "quantize")}
        rank = max(range(len(logged["compute"])), key=lambda r: sum(v[r] for v in logged.values()))
        for k, v in logged.items():
            parts[k].append(1e3 * v[rank])
        parts["rest"].append(1e3 * rec["epoch_time_s"] - sum(1e3 * v[rank] for v in logged.values()))
    return {k: statistics.median(v) for k, v in parts.items()}


def run_parser(doc: str, epochs: int) -> argparse.ArgumentParser:
    """The options every training run of a benchmark takes (:func:`run_once`), ``--procs`` and ``--md``."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--dataset", default="synthetic:arxiv")
    p.add_argument("--model", default="gcn")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--procs", type=int, nargs="+", default=[2, 4])
    p.add_argument("--epochs", type=int, default=epochs)
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument("--md", default=None, help="also write the tables here")
    p.add_argument("--reorder", default="none", help="tessera train --reorder (distributed runs ignore it)")
    return p


def main(argv: list[str] | None = None) -> int:
    """Run the grid and print (and optionally write) the markdown table."""
    p = run_parser(__doc__, epochs=10)
    p.add_argument("--strategies", nargs="+", default=["partition", "tensor"])
    p.add_argument("--repeats", type=int, default=2)
    args = p.parse_args(argv)
    cells = [("single", 1)] + [(s, n) for n in args.procs for s in args.strategies]
    results: dict[tuple[str, int], list[dict]] = {c: [] for c in cells}
    with tempfile.TemporaryDirectory() as tmp:
        for rep in range(args.repeats):
            for strategy, procs in cells if rep % 2 == 0 else cells[::-1]:
                out = Path(tmp) / f"{strategy}-{procs}-{rep}"
                results[(strategy, procs)].append(run_once(args, strategy, procs, out))
                print(f"done {strategy} P={procs} repeat {rep}", file=sys.stderr)
    lines = [
        f"`{args.dataset}`, {args.model}, {args.layers} layers, hidden {args.hidden}; {args.epochs} epochs per run, "
        f"{args.repeats} runs per cell (interleaved), {os.cpu_count()} cores",
        "",
        "| strategy | P | median epoch ms | runs (ms) | aggregation ms | exchange ms | quantize ms | rest ms "
        "| MB per training epoch | test acc | peak RSS MiB (largest rank) | plan |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for strategy, procs in cells:
        rs = results[(strategy, procs)]
        ms = [r["epoch_time_median_s"] * 1e3 for r in rs]
        parts = [r["breakdown_ms"] for r in rs if r["breakdown_ms"]]
        split = [
            f"{statistics.median(b[k] for b in parts):.0f}" if parts else "–"
            for k in ("compute", "exchange", "quantize", "rest")
        ]
        plan = ",".join(rs[0]["plan"]["choices"]) if rs[0].get("plan") else ""
        lines.append(
            f"| {strategy} | {procs} | {statistics.median(ms):.0f} | {', '.join(f'{m:.0f}' for m in ms)} | "
            f"{' | '.join(split)} | {rs[0]['bytes_per_epoch'] / 1e6:.2f} | {rs[0]['test_acc']:.4f} | "
            f"{max(r['peak_rss_mb'] for r in rs):.0f} | {plan} |"
        )
    text = "\n".join(lines)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
