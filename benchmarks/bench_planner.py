"""The planner's regret: every fixed per-layer assignment of a small, sensible set vs ``--strategy auto``.

In one script run, per P: each assignment (partition in its three modes, tensor, hybrid:2 where
2 divides P and 1 < 2 < P, and the mixed pairs ``tensor,partition:prepost`` and
``partition:prepost,tensor``) trains for a few epochs (``tessera train --nprocs P``), then
``--strategy auto`` plans afresh (an empty plan cache; the partitions are reused) and trains.
The tables give each run's median training-step time and bytes per training epoch, the
planner's pick and its regret (its run's median step over the best fixed assignment's), the
planning time against 100 of the auto run's steps (a lower bound on a 100-epoch run's time:
evaluation, loading and start-up left out, so the fraction is an upper bound), and per P the
modelled vs measured time of every candidate of every layer (``tessera plan --measure-all``).

    python benchmarks/bench_planner.py --dataset synthetic:arxiv --procs 2 4 --epochs 5 --md out.md
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_strategies import ROOT, run_once, run_parser

MIXED = ("tensor,partition:prepost", "partition:prepost,tensor")


def assignments(procs: int) -> list[str]:
    """The fixed assignments measured at ``procs`` ranks."""
    fixed = [f"partition:{m}" for m in ("post", "pre", "prepost")] + ["tensor"]
    if procs > 2 and procs % 2 == 0:
        fixed.append("hybrid:2")
    return fixed + list(MIXED)


def plan_all(args: argparse.Namespace, procs: int) -> dict:
    """``tessera plan --measure-all --no-cache`` at ``procs`` ranks: every candidate modelled and measured."""
    cmd = [
        sys.executable, "-m", "tessera", "plan", "--dataset", args.dataset, "--model", args.model,
        "--hidden", str(args.hidden), "--layers", str(args.layers), "--nprocs", str(procs),
        "--measure-all", "--no-cache", "--json",
    ]  # fmt: skip
    r = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-2000:]}")
    return json.loads(r.stdout)


def fresh_plan_cache(tmp: Path) -> Path:
    """A cache directory with no plans that shares the real cache's partitions (no METIS rerun)."""
    from tessera.files import default_cache_dir

    cache = tmp / "cache"
    cache.mkdir()
    parts = default_cache_dir() / "partitions"
    parts.mkdir(parents=True, exist_ok=True)
    (cache / "partitions").symlink_to(parts)
    return cache


def mb(res: dict) -> str:
    """Bytes per training epoch in MB."""
    return f"{res['bytes_per_epoch'] / 1e6:.1f}"


def report(args, runs: dict, plans: dict, walls: dict) -> str:
    """The markdown tables."""
    lines = [
        f"`{args.dataset}`, {args.model}, {args.layers} layers, hidden {args.hidden}; {args.epochs} epochs per run, "
        f"one run per cell, {os.cpu_count()} cores shared with other jobs (load average at start "
        f"{args.load_start:.1f}, at end {os.getloadavg()[0]:.1f})",
        "",
        "| P | assignment | median step ms | MB per training epoch | run wall s |",
        "|---:|---|---:|---:|---:|",
    ]
    summary = [
        "",
        "| P | best fixed | its ms | planner's pick | its ms | regret | planning s (calibrate / model / shard / steps) "
        "| 100 steps s | planning / 100 steps |",
        "|---:|---|---:|---|---:|---:|---|---:|---:|",
    ]
    for procs in args.procs:
        fixed = {a: r for (p, a), r in runs.items() if p == procs and a != "auto"}
        for a, r in fixed.items():
            lines.append(
                f"| {procs} | {a} | {r['epoch_time_median_s'] * 1e3:.0f} | {mb(r)} | {walls[(procs, a)]:.0f} |"
            )
        auto = runs[(procs, "auto")]
        pick = ",".join(auto["plan"]["choices"])
        lines.append(
            f"| {procs} | auto = {pick} | {auto['epoch_time_median_s'] * 1e3:.0f} | {mb(auto)} | "
            f"{walls[(procs, 'auto')]:.0f} |"
        )
        best = min(fixed, key=lambda a: fixed[a]["epoch_time_median_s"])
        b, t = fixed[best]["epoch_time_median_s"], auto["epoch_time_median_s"]
        plan = auto["plan"]
        tm = plan.get("timing_s", {})
        parts = " / ".join(f"{tm.get(k, 0):.1f}" for k in ("calibrate", "model", "shard", "steps"))
        hundred = 100 * t
        summary.append(
            f"| {procs} | {best} | {b * 1e3:.0f} | {pick} | {t * 1e3:.0f} | {100 * (t / b - 1):+.1f} % | "
            f"{plan['planning_s']:.1f} ({parts}) | {hundred:.0f} | {100 * plan['planning_s'] / hundred:.1f} % |"
        )
    out = lines + summary
    for procs, plan in plans.items():
        out += [
            "",
            f"P = {procs}: every candidate, modelled vs measured (`tessera plan --measure-all`, one layer's "
            f"forward + backward, slowest rank; planning {plan['planning_s']:.1f} s; constants "
            + ", ".join(f"{k} {v:.3g}" for k, v in plan["rates"].items())
            + ")",
            "",
            "| layer | candidate | dense ms | aggregate ms | comm ms | modelled ms | measured ms | measured / modelled |",
            "|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        for la in plan["layers"]:
            for c in sorted(la["candidates"], key=lambda c: c["measured_ms"] or 0):
                m = c["model_ms"]
                meas = c["measured_ms"]
                star = "*" if c["label"] == la["choice"] else ""
                out.append(
                    f"| {la['layer']} | {star}{c['label']} | {m['dense']:.1f} | {m['aggregate']:.1f} | {m['comm']:.1f} | "
                    f"{c['modelled_ms']:.1f} | {meas:.1f} | {meas / c['modelled_ms']:.2f} |"
                )
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run every assignment and auto at each P; print (and optionally write) the tables."""
    args = run_parser(__doc__, epochs=5).parse_args(argv)
    args.load_start = os.getloadavg()[0]
    runs, walls, plans = {}, {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        cache = fresh_plan_cache(Path(tmp))
        for procs in args.procs:
            for a in [*assignments(procs), "auto"]:
                out = Path(tmp) / f"{procs}-{a.replace(',', '+').replace(':', '-')}"
                if a == "auto":
                    os.environ["TESSERA_CACHE"], real = str(cache), os.environ.get("TESSERA_CACHE")
                t0 = time.perf_counter()
                try:
                    runs[(procs, a)] = run_once(args, a, procs, out)
                finally:
                    if a == "auto":
                        os.environ.pop("TESSERA_CACHE") if real is None else os.environ.update(TESSERA_CACHE=real)
                walls[(procs, a)] = time.perf_counter() - t0
                print(f"done P={procs} {a}: {runs[(procs, a)]['epoch_time_median_s'] * 1e3:.0f} ms", file=sys.stderr)
            plans[procs] = plan_all(args, procs)
            print(f"done P={procs} plan --measure-all", file=sys.stderr)
    text = report(args, runs, plans, walls)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
