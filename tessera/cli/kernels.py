"""``tessera kernels``: each aggregation backend's measured time and effective bandwidth on a
dataset, and the backend ``auto`` chooses (which is then stored in the decision cache)."""

from __future__ import annotations

import argparse
import json
from typing import Any

import torch

from tessera.errors import ConfigError


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``kernels`` subcommand."""
    k = subparsers.add_parser("kernels", help="time every aggregation backend on a dataset and show auto's choice")
    k.add_argument("--dataset", help="cora | citeseer | ogbn-* | a path | synthetic:<preset> (default synthetic:small)")
    k.add_argument("--name", help="which dataset, when a directory holds several (e.g. cora)")
    k.add_argument("--width", default="128", help="feature width(s), comma separated (default 128)")
    k.add_argument(
        "--reduce",
        default="sum",
        help="sum | mean (default sum; the kernels sum either way, mean scales the rows after)",
    )
    k.add_argument("--threads", type=int, help="CPU threads (default: torch's)")
    k.add_argument("--reps", type=int, default=5, help="timed repetitions per backend, median reported (default 5)")
    k.add_argument("--json", action="store_true", help="print the numbers as JSON")
    return k


def _widths(text: str) -> list[int]:
    try:
        widths = [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        widths = []
    if not widths or min(widths) < 1:
        raise ConfigError(f"--width must be positive integers separated by commas, got {text!r}")
    return widths


def kernel_table(graph, widths: list[int], reduce: str = "sum", reps: int = 5) -> list[dict[str, Any]]:
    """Per width and direction: each backend's median seconds and GB/s, and ``auto``'s choice."""
    from tessera.backends import select
    from tessera.backends.base import get_backend, traffic_bytes

    rows = []
    gen = torch.Generator().manual_seed(0)
    for width in widths:
        for direction in ("forward", "backward"):
            transposed = direction == "backward"
            n = graph.num_rows if transposed else graph.num_cols
            x = torch.randn(n, width, generator=gen)
            names = select.candidates(x)
            seconds = select.measure(graph, x, None, names, transposed, reps)
            # auto's decision from this very measurement when the problem is big enough for
            # auto to measure at all (else the cost model's pick), stored as a training run's
            # trial would store it.
            trial = select.trial_candidates(graph, width, False, transposed, select.auto_candidates(x))
            key = select.decision_key(graph, width, False, 1, direction)
            if len(trial) > 1:
                choice = select.record(graph, key, {k: seconds[k] for k in trial})
            else:
                select.clear_memo(graph)
                choice = select.choose(graph, x, None, direction)
            nbytes = traffic_bytes(graph, width, False, transposed)
            rows.append(
                {
                    "width": width,
                    "direction": direction,
                    "seconds": seconds,
                    "gbps": {k: nbytes / v / 1e9 for k, v in seconds.items()},
                    "bytes": nbytes,
                    "choice": choice,
                }
            )
            del x
            get_backend(choice)  # the choice is a registered backend
    return rows


def run(args: argparse.Namespace) -> int:
    """Run ``tessera kernels``; returns the exit status."""
    from tessera.backends import select
    from tessera.datasets import load
    from tessera.threads import set_num_threads
    from tessera.train.config import check_range

    if args.reduce not in ("sum", "mean"):
        raise ConfigError(f"--reduce must be sum or mean, got {args.reduce!r}")
    check_range("reps", args.reps, (1, 10_000, ""))
    widths = [check_range("width", w, (1, 65_536, " (as train --hidden)")) for w in _widths(args.width)]
    if args.threads is not None:
        set_num_threads(check_range("threads", args.threads))
    graph = load(args.dataset or "synthetic:small", name=args.name)
    rows = kernel_table(graph, widths, args.reduce, args.reps)
    if args.json:
        print(
            json.dumps({"dataset": args.dataset or "synthetic:small", "threads": torch.get_num_threads(), "rows": rows})
        )
        return 0
    print(
        f"{args.dataset or 'synthetic:small'}: {graph.num_nodes:,} vertices, {graph.num_edges:,} edges, "
        f"{torch.get_num_threads()} threads; GB/s counts every gathered row from memory"
    )
    names = sorted(rows[0]["seconds"]) if rows else []
    print(f"{'width':>6} {'dir':>9} " + " ".join(f"{n + ' ms':>16} {'GB/s':>6}" for n in names) + "  choice")
    for r in rows:
        cells = " ".join(f"{r['seconds'][n] * 1e3:>16.2f} {r['gbps'][n]:>6.1f}" for n in names)
        print(f"{r['width']:>6} {r['direction']:>9} {cells}  {r['choice']}")
    print(f"choices stored in {select.cache_file()} (set TESSERA_CACHE to move it)")
    return 0
