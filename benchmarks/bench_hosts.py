"""Training over emulated hosts at capped link speeds: each strategy's epoch time, bytes and memory.

Two hosts x two ranks (``--hosts``, ``--ranks-per-host``) are network namespaces on one bridge
(``tests/hosts.py``), each link capped by ``tbf`` at each rate of ``--caps`` (``none``:
uncapped). At each cap, ``python -m tessera train`` runs under one torchrun per host (c10d
rendezvous) with every ``--strategies`` entry in turn, and the table gives per cap and strategy
the median epoch time after the first epoch (``metrics.jsonl``), the data and parameter bytes
exchanged per epoch (``result.json``) and the part of them sent between hosts (the per-pair
counts of ``metrics.jsonl``), and each rank's peak RSS (``result.json``). Under ``auto`` the row
names each layer's planned entry and the planner's modelled and measured step of the chosen
candidates (summed over layers), and every row the measured exchange time per epoch (per layer
and direction the slowest rank's, summed; and the last rank to arrive's, which waits for no peer:
the transfer itself) beside the plan's modelled exchange terms of its chosen candidates; the strategy ``auto+bits`` is ``auto`` with ``--comm-bits auto``
(each layer's exchange widths planned too). Needs root and iproute2.

    python benchmarks/bench_hosts.py --dataset synthetic:small --epochs 3
    python benchmarks/bench_hosts.py --dataset synthetic:arxiv --strategies partition,auto,auto+bits --epochs 4
    python benchmarks/bench_hosts.py --dataset synthetic:small --caps none --strategies partition \\
        --epochs 3 --repeats 20   # do completed runs always exit 0?
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the emulated hosts are the tests' fixture

from hosts import EmulatedHosts, unavailable  # noqa: E402


def train_args(args: argparse.Namespace, strategy: str, out: Path) -> list[str]:
    """torchrun's program and arguments: ``tessera train`` with ``strategy`` into ``out``."""
    argv = ["-m", "tessera", "train", "--dataset", args.dataset, "--model", args.model, "--hidden", str(args.hidden),
            "--epochs", str(args.epochs), "--patience", "0", "--checkpoint-every", "1000", "--no-progress",
            "--strategy", strategy.removesuffix("+bits"), "--out", str(out)]  # fmt: skip
    if strategy.endswith("+bits"):
        argv += ["--comm-bits", "auto"]
    if strategy == "hybrid":
        argv += ["--groups", str(args.ranks_per_host)]
    return argv


def cross_host_bytes(epoch: dict[str, Any], ranks_per_host: int) -> int:
    """Bytes one epoch's record says ranks on different hosts sent each other: torchrun numbers a
    node's ranks contiguously, so ranks i and j share a host when ``i // ranks_per_host`` agree."""
    total = 0
    for key in ("bytes_data", "bytes_params"):
        for layer in (epoch.get("comm") or {}).get(key, []):
            for matrix in layer:  # forward, backward: [source rank][destination rank]
                for i, row in enumerate(matrix):
                    total += sum(b for j, b in enumerate(row) if i // ranks_per_host != j // ranks_per_host)
    return total


def _transfer_ms(epochs: list[dict[str, Any]]) -> float | None:
    """Median over ``epochs`` of the exchange time without waiting for late peers: per layer and
    direction the least of the ranks' times (the last rank to arrive waits for no one), summed."""
    per = [sum(min(ranks) for layer in e["comm"]["exchange_s"] for ranks in layer) for e in epochs if e.get("comm")]
    return 1e3 * statistics.median(per) if per else None


def summarize(out: Path, ranks_per_host: int) -> dict[str, Any]:
    """Median epoch time (after the first), bytes per epoch (all, and between hosts) and per-rank
    peak RSS of the run in ``out``."""
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    times = [e["epoch_time_s"] for e in epochs[1:] or epochs]
    result = json.loads((out / "result.json").read_text())
    comm = result.get("comm") or {}
    sent = sum(sum(layer) for key in ("bytes_data", "bytes_params") for layer in comm.get(key, []))
    plan = result.get("plan") or {}
    chosen = [next(c for c in la["candidates"] if c["label"] == la["choice"]) for la in plan.get("layers", [])]
    return {
        "plan": plan.get("choices"),
        "exchange_ms": 1e3 * sum(map(sum, comm["exchange_s"])) / comm["epochs"] if comm.get("exchange_s") else None,
        "transfer_ms": _transfer_ms(epochs[1:] or epochs),
        "modelled_comm_ms": sum(c["model_ms"]["comm"] for c in chosen) if chosen else None,
        "modelled_ms": sum(c["modelled_ms"] for c in chosen) if chosen else None,
        "measured_ms": sum(c["measured_ms"] for c in chosen)
        if chosen and all(c["measured_ms"] for c in chosen)
        else None,
        "epoch_s": statistics.median(times),
        "mb_per_epoch": sent / max(1, comm.get("epochs", len(epochs))) / 1e6 if comm else None,
        "cross_mb_per_epoch": statistics.mean(cross_host_bytes(e, ranks_per_host) for e in epochs) / 1e6,
        "rss_mb": result.get("peak_rss_mb_per_rank"),
        "test_acc": result.get("test_acc"),
    }


def plan_cache(work: Path, cap: str) -> Path:
    """A cache directory of its own for the runs at ``cap``: plans are cached by graph, model and
    host layout, not by link speed, so each cap plans afresh; every other entry of the real cache
    (generated graphs, partitions, kernel choices) is shared through links."""
    from tessera.files import default_cache_dir

    real = default_cache_dir()
    real.mkdir(parents=True, exist_ok=True)
    cache = work / f"cache-{cap}"
    cache.mkdir()
    for entry in real.iterdir():
        if entry.name != "plans":
            (cache / entry.name).symlink_to(entry)
    return cache


def run_cap(args: argparse.Namespace, cap: str, work: Path) -> list[dict[str, Any]]:
    """Every strategy's row at link cap ``cap`` (``none``: uncapped), each run ``--repeats`` times:
    the row counts the runs whose every host exited 0 and summarizes the last of them."""
    rows = []
    env = {"TESSERA_CACHE": str(plan_cache(work, cap))}
    with EmulatedHosts(args.hosts, None if cap == "none" else cap) as hosts:
        for strategy in args.strategies.split(","):
            row: dict[str, Any] = {"cap": cap, "strategy": strategy, "completed": 0, "runs": args.repeats}
            errors = []
            for i in range(args.repeats):
                out = work / f"{cap}-{strategy}-{i}"
                runs = hosts.run(
                    train_args(args, strategy, out), args.ranks_per_host, args.timeout, env, log_dir=out / "logs"
                )
                if all(r.returncode == 0 for r in runs):
                    row["completed"] += 1
                    row.update(summarize(out, args.ranks_per_host))
                else:
                    errors.append(
                        f"run {i}: "
                        + "; ".join(
                            f"{r.host} exit {r.returncode}: {(r.stderr.strip().splitlines() or [''])[-1][:160]}"
                            for r in runs
                            if r.returncode != 0
                        )
                    )
            if errors:
                row["error"] = " | ".join(errors)
            print(json.dumps(row), file=sys.stderr, flush=True)
            rows.append(row)
    return rows


def markdown(rows: list[dict[str, Any]], args: argparse.Namespace) -> str:
    """The rows as a markdown table, with a line naming the setting."""
    head = (
        f"{args.dataset}, {args.model} hidden {args.hidden}, {args.hosts} hosts x {args.ranks_per_host} ranks, "
        f"{args.epochs} epochs (median epoch after the first)\n\n"
        "| link cap | strategy | runs exit 0 | epoch (ms) | MB sent / epoch (all ranks) | of which between hosts "
        "| peak RSS per rank (MiB) | test acc | exchange ms / epoch: slowest / last to arrive (modelled) | plan "
        "| planner modelled / measured step (ms) |\n"
        "|---|---|---:|---:|---:|---:|---|---:|---|---|---|\n"
    )
    lines = []
    for r in rows:
        done = f"{r['completed']}/{r['runs']}"
        if not r["completed"]:
            lines.append(f"| {r['cap']} | {r['strategy']} | {done} | failed: {r['error']} | | | | | | | |")
            continue
        mb = "n/a" if r["mb_per_epoch"] is None else f"{r['mb_per_epoch']:.2f}"
        rss = "n/a" if not r["rss_mb"] else ", ".join(f"{m:.0f}" for m in r["rss_mb"])
        acc = "n/a" if r["test_acc"] is None else f"{r['test_acc']:.4f}"
        cross = f"{r['cross_mb_per_epoch']:.2f}"
        plan = ", ".join(r["plan"]) if r.get("plan") else ""
        steps = (
            ""
            if r.get("modelled_ms") is None
            else f"{r['modelled_ms']:.1f} / " + ("-" if r.get("measured_ms") is None else f"{r['measured_ms']:.1f}")
        )
        exchange = "" if r.get("exchange_ms") is None else f"{r['exchange_ms']:.0f}"
        if r.get("transfer_ms") is not None:
            exchange += f" / {r['transfer_ms']:.0f}"
        if r.get("modelled_comm_ms") is not None:
            exchange += f" ({r['modelled_comm_ms']:.0f})"
        lines.append(
            f"| {r['cap']} | {r['strategy']} | {done} | {1e3 * r['epoch_s']:.1f} | {mb} | {cross} | {rss} | {acc} "
            f"| {exchange} | {plan} | {steps} |"
        )
    failures = [f"- {r['cap']} {r['strategy']}: {r['error']}" for r in rows if "error" in r]
    return head + "\n".join(lines) + "\n" + ("\nFailed runs:\n" + "\n".join(failures) + "\n" if failures else "")


def main(argv: list[str] | None = None) -> int:
    """Run every cap and strategy; print (or write to --md) the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default="synthetic:arxiv")
    p.add_argument("--model", default="gcn")
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--caps", default="100mbit,1gbit,none", help="tc rates, comma-separated; none = uncapped")
    p.add_argument("--strategies", default="partition,tensor,hybrid,auto")
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--ranks-per-host", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds per run before it is killed")
    p.add_argument(
        "--repeats", type=int, default=1, help="runs per cap and strategy (the table counts those exiting 0)"
    )
    p.add_argument("--md", help="also write the table to this file")
    args = p.parse_args(argv)
    why = unavailable()
    if why is not None:
        print(f"bench_hosts: {why}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-hosts-") as work:
        for cap in args.caps.split(","):
            rows += run_cap(args, cap.strip(), Path(work))
    table = markdown(rows, args)
    print(table)
    if args.md:
        Path(args.md).write_text(table)
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
