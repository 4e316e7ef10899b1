"""MixGCN's fine-grained pipeline timed: tensor parallelism at S = 1..8 stages, through the CLI.

For each ``--nprocs`` P and each stage count S of ``--stages``, ``tessera train --nprocs P
--strategy tensor --pipeline-stages S`` runs ``--epochs`` epochs (``--rounds`` times, the rounds
interleaving the stage counts); the table gives per S the median epoch after each run's first
(over all rounds), the median exchange time of those epochs (per layer and direction the slowest
rank's, summed), each rank's peak RSS, and the planner's modelled step of the tensor candidate at that
S (``tessera plan --model-only --pipeline-stages auto`` on the same graph and P, summed over the
layers' best tensor candidates), with the S the model picks.

    python benchmarks/bench_pipeline_stages.py --dataset synthetic:arxiv --nprocs 2,4 --epochs 4
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any


def train(args: argparse.Namespace, nprocs: int, stages: int, out: Path) -> dict[str, Any]:
    """One run's median epoch (after the first), exchange seconds per epoch and per-rank peak RSS."""
    cmd = [sys.executable, "-m", "tessera", "train", "--dataset", args.dataset, "--model", args.model,
           "--hidden", str(args.hidden), "--epochs", str(args.epochs), "--patience", "0", "--no-progress",
           "--checkpoint-every", "1000", "--nprocs", str(nprocs), "--strategy", "tensor",
           "--pipeline-stages", str(stages), "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        return {"error": (done.stderr.strip().splitlines() or ["?"])[-1][:200]}
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = epochs[1:] or epochs
    result = json.loads((out / "result.json").read_text())
    # an epoch's exchange time: per layer and direction the slowest rank's, summed
    exchange = [sum(max(ranks) for layer in e["comm"]["exchange_s"] for ranks in layer) for e in steady]
    return {
        "epochs": [e["epoch_time_s"] for e in steady],
        "exchange_s": statistics.median(exchange),
        "rss_mb": result.get("peak_rss_mb_per_rank"),
    }


def modelled(args: argparse.Namespace, nprocs: int) -> dict[int, float]:
    """Per stage count, the planner's modelled step (ms) of the best tensor candidate of each layer, summed."""
    cmd = [sys.executable, "-m", "tessera", "plan", "--dataset", args.dataset, "--model", args.model,
           "--hidden", str(args.hidden), "--nprocs", str(nprocs), "--model-only", "--pipeline-stages", "auto",
           "--json"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=True)
    rec = json.loads(done.stdout)
    out: dict[int, float] = {}
    for layer in rec["layers"]:
        best: dict[int, float] = {}
        for c in layer["candidates"]:
            name, *rest = c["label"].split("@")[0].split(":")
            if name == "tensor" and len(rest) == 2:
                s = int(rest[1])
                best[s] = min(best.get(s, float("inf")), c["modelled_ms"])
        for s, ms in best.items():
            out[s] = out.get(s, 0.0) + ms
    return out


def main(argv: list[str] | None = None) -> int:
    """Run every P and S; print (or write to --md) the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="synthetic:arxiv")
    p.add_argument("--model", default="gcn")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--nprocs", default="2,4")
    p.add_argument("--stages", default="1,2,3,4,5,6,7,8")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--md", help="also write the table to this file")
    args = p.parse_args(argv)
    stage_counts = [int(s) for s in args.stages.split(",")]
    lines = [
        f"{args.dataset}, {args.model} hidden {args.hidden}, --strategy tensor, {args.epochs} epochs x "
        f"{args.rounds} rounds (median epoch after each run's first)\n",
        "| P | S | median epoch (ms) | exchange ms / epoch | peak RSS per rank (MiB) | modelled step (ms) |",
        "|---:|---:|---:|---:|---|---:|",
    ]
    for nprocs in (int(n) for n in args.nprocs.split(",")):
        model = modelled(args, nprocs)
        runs: dict[int, list[dict[str, Any]]] = {s: [] for s in stage_counts}
        with tempfile.TemporaryDirectory(prefix="bench-stages-") as work:
            for r in range(args.rounds):
                for s in stage_counts:
                    got = train(args, nprocs, s, Path(work) / f"P{nprocs}-S{s}-r{r}")
                    runs[s].append(got)
                    print(json.dumps({"P": nprocs, "S": s, "round": r, **got}), file=sys.stderr, flush=True)
        for s in stage_counts:
            ok = [g for g in runs[s] if "error" not in g]
            if not ok:
                lines.append(f"| {nprocs} | {s} | failed: {runs[s][0]['error']} | | | |")
                continue
            epoch = statistics.median(t for g in ok for t in g["epochs"])
            exchange = statistics.median(g["exchange_s"] for g in ok if g["exchange_s"] is not None)
            rss = ", ".join(f"{m:.0f}" for m in ok[-1]["rss_mb"] or [])
            ms = f"{model[s]:.1f}" if s in model else "-"
            lines.append(f"| {nprocs} | {s} | {1e3 * epoch:.1f} | {1e3 * exchange:.1f} | {rss} | {ms} |")
        if model:
            lines.append(f"| {nprocs} | auto picks | {min(model, key=lambda s: model[s])} | | | |")
    table = "\n".join(lines) + "\n"
    print(table)
    if args.md:
        Path(args.md).write_text(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
