"""Test accuracy of ``--precision bf16`` against float32, per model, dataset and seed.

Trains each model with ``tessera.train`` as ``tessera train`` does (best-validation epoch's test
accuracy) at float32 and bfloat16 storage for every seed, and prints a markdown table of the mean
test accuracy of each precision and their difference in points::

    python benchmarks/bench_precision.py --datasets cora citeseer synthetic:arxiv --models gcn sage gin \\
        --seeds 5 --threads 2 --json results/bench_precision.json

``--epochs`` caps every run (200 by default); ``--large-epochs`` caps the synthetic graphs' runs
(a full-graph epoch there takes seconds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tessera.datasets import load
from tessera.threads import set_num_threads
from tessera.train.config import TrainConfig
from tessera.train.loop import train

PRECISIONS = ("fp32", "bf16")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datasets", nargs="+", default=["cora", "citeseer", "synthetic:arxiv"])
    p.add_argument("--models", nargs="+", default=["gcn", "sage", "gin"])
    p.add_argument("--seeds", type=int, default=5)
    p.add_argument("--epochs", type=int, default=200)
    p.add_argument("--large-epochs", type=int, default=50, help="epochs on synthetic graphs")
    p.add_argument(
        "--hidden",
        type=int,
        default=None,
        help="hidden width (default: 16 for GCN on Planetoid, else 256 on synthetic, 64)",
    )
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args(argv)


def hidden_of(a: argparse.Namespace, model: str, dataset: str) -> int:
    """The hidden width of one run: the given one, else Kipf & Welling's 16 for GCN on Planetoid,
    256 on synthetic graphs (bench_train's width) and 64 otherwise."""
    if a.hidden is not None:
        return a.hidden
    if dataset.startswith("synthetic:"):
        return 256
    return 16 if model == "gcn" else 64


def main(argv: list[str] | None = None) -> int:
    """Run every (dataset, model, precision, seed) and print the table."""
    a = parse_args(argv)
    set_num_threads(a.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for dataset in a.datasets:
            graph = load(dataset)
            epochs = a.large_epochs if dataset.startswith("synthetic:") else a.epochs
            for model in a.models:
                accs: dict[str, list[float]] = {p: [] for p in PRECISIONS}
                secs: dict[str, list[float]] = {p: [] for p in PRECISIONS}
                for seed in range(a.seeds):
                    for precision in PRECISIONS:
                        cfg = TrainConfig(
                            model=model, dataset=dataset, hidden=hidden_of(a, model, dataset), epochs=epochs,
                            seed=seed, progress=False, precision=precision, threads=a.threads,
                            out=str(Path(tmp) / f"{model}-{precision}-{seed}"),
                        )  # fmt: skip
                        t0 = time.perf_counter()
                        res = train(cfg, graph)
                        secs[precision].append(time.perf_counter() - t0)
                        accs[precision].append(res["test_acc"])
                        print(f"{dataset} {model} {precision} seed {seed}: {res['test_acc']:.4f}", file=sys.stderr)
                rows.append({"dataset": dataset, "model": model, "epochs": epochs, "accs": accs, "seconds": secs})
    print("| dataset | model | epochs | fp32 test acc (mean ± sd) | bf16 | bf16 − fp32 (points) |")
    print("|---|---|---:|---:|---:|---:|")
    for r in rows:
        m = {p: statistics.mean(r["accs"][p]) for p in PRECISIONS}
        sd = {p: statistics.stdev(r["accs"][p]) if len(r["accs"][p]) > 1 else 0.0 for p in PRECISIONS}
        print(
            f"| {r['dataset']} | {r['model']} | {r['epochs']} | {100 * m['fp32']:.2f} ± {100 * sd['fp32']:.2f} | "
            f"{100 * m['bf16']:.2f} ± {100 * sd['bf16']:.2f} | {100 * (m['bf16'] - m['fp32']):+.2f} |"
        )
    if a.json is not None:
        a.json.write_text(json.dumps({"argv": sys.argv, "seeds": a.seeds, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
