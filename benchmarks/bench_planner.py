"""The planner's regret: every fixed per-layer assignment of a small, sensible set vs ``--strategy auto``.

In one script run, per P: each assignment (partition in its three modes, tensor, hybrid:2 where
2 divides P and 1 < 2 < P, and the mixed pairs ``tensor,partition:prepost`` and
``partition:prepost,tensor``) trains for a few epochs (``tessera train --nprocs P``), then
``--strategy auto`` plans afresh and trains; every run starts from an empty cache but for the
partitions (no plan, no kernel decision carried over from another run);
``--rounds R`` repeats the whole sequence R times, interleaved, so a slow spell of the shared
machine falls on every assignment. The tables give each assignment's median over rounds of its
run's median training step after its first (the first holds every kernel trial, which a long run
amortises), bytes per training epoch, the planner's pick in each round and
its regret (the auto runs' median over the best fixed assignment's), the planning time, and per P
the modelled vs measured time of every candidate of every layer (``tessera plan --measure-all``).
``--full-epochs N`` adds one auto run of N epochs per P (fresh plan cache) and reports its
planning time as a share of that whole run's wall time (start-up, planning, training and
evaluation).

    python benchmarks/bench_planner.py --dataset synthetic:arxiv --procs 2 4 --epochs 5 --rounds 3 \
        --full-epochs 100 --md out.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
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


def report(args, runs: dict, plans: dict, full: dict) -> str:
    """The markdown tables."""
    med = statistics.median
    lines = [
        f"`{args.dataset}`, {args.model}, {args.layers} layers, hidden {args.hidden}; {args.epochs} epochs per run, "
        f"{args.rounds} interleaved round(s); {os.cpu_count()} cores (load average at start {args.load_start:.1f}, "
        f"at end {os.getloadavg()[0]:.1f}); median step = median over rounds of each run's median training step "
        "after its first",
        "",
        "| P | assignment | median step ms | per round ms | MB per training epoch |",
        "|---:|---|---:|---|---:|",
    ]
    summary = [
        "",
        "| P | best fixed | its ms | planner's picks (per round) | auto ms | regret | planning s per round |",
        "|---:|---|---:|---|---:|---:|---|",
    ]
    for procs in args.procs:
        steps = {a: [r["steady_median_s"] for r in rs] for (p, a), rs in runs.items() if p == procs}
        if not steps:  # --rounds 0: the full runs and the candidate tables only
            continue
        for a, ts in steps.items():
            rs = runs[(procs, a)]
            name = a if a != "auto" else "auto"
            lines.append(
                f"| {procs} | {name} | {med(ts) * 1e3:.0f} | {' / '.join(f'{t * 1e3:.0f}' for t in ts)} | "
                f"{mb(rs[-1]) if a != 'auto' else '-'} |"
            )
        fixed = {a: med(ts) for a, ts in steps.items() if a != "auto"}
        best = min(fixed, key=fixed.get)
        autos = runs[(procs, "auto")]
        picks = " / ".join(",".join(r["plan"]["choices"]) for r in autos)
        t = med(steps["auto"])
        planning = " / ".join(f"{r['plan']['planning_s']:.1f}" for r in autos)
        summary.append(
            f"| {procs} | {best} | {fixed[best] * 1e3:.0f} | {picks} | {t * 1e3:.0f} | "
            f"{100 * (t / fixed[best] - 1):+.1f} % | {planning} |"
        )
    out = lines + summary
    if full:
        out += [
            "",
            f"One auto run of {args.full_epochs} epochs per P (fresh plan cache): planning time against the "
            "whole run's wall time.",
            "",
            "| P | pick | planning s (calibrate / model / shard / steps) | run wall s | planning / run |",
            "|---:|---|---|---:|---:|",
        ]
        for procs, (res, wall) in full.items():
            plan, tm = res["plan"], res["plan"].get("timing_s", {})
            parts = " / ".join(f"{tm.get(k, 0):.1f}" for k in ("calibrate", "model", "shard", "steps"))
            out.append(
                f"| {procs} | {','.join(plan['choices'])} | {plan['planning_s']:.1f} ({parts}) | {wall:.0f} | "
                f"{100 * plan['planning_s'] / wall:.1f} % |"
            )
    for procs, plan in plans.items():
        out += [
            "",
            f"P = {procs}: every candidate, modelled vs measured (`tessera plan --measure-all`, one layer's "
            f"forward + backward, slowest rank; planning {plan['planning_s']:.1f} s; constants "
            + ", ".join(f"{k} {v:.3g}" for k, v in plan["rates"].items())
            + ")",
            "",
            "| layer | candidate | dense ms | aggregate ms | comm ms | memory ms | modelled ms | measured ms "
            "| measured / modelled |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for la in plan["layers"]:
            for c in sorted(la["candidates"], key=lambda c: c["measured_ms"] or 0):
                m = c["model_ms"]
                meas = c["measured_ms"]
                star = "*" if c["label"] == la["choice"] else ""
                out.append(
                    f"| {la['layer']} | {star}{c['label']} | {m['dense']:.1f} | {m['aggregate']:.1f} | {m['comm']:.1f} | "
                    f"{m.get('memory', 0.0):.1f} | {c['modelled_ms']:.1f} | {meas:.1f} | {meas / c['modelled_ms']:.2f} |"
                )
    return "\n".join(out)


def run_fresh(args: argparse.Namespace, strategy: str, procs: int, out: Path, tmp: Path) -> dict:
    """One run on its own empty cache but for the partitions: ``auto`` plans afresh, and every
    run, fixed or planned, makes its own kernel decisions; ``steady_median_s`` is its median step
    after the first."""
    cache = fresh_plan_cache(Path(tempfile.mkdtemp(dir=tmp)))
    real = os.environ.get("TESSERA_CACHE")
    os.environ["TESSERA_CACHE"] = str(cache)
    try:
        res = run_once(args, strategy, procs, out)
    finally:
        os.environ.pop("TESSERA_CACHE") if real is None else os.environ.update(TESSERA_CACHE=real)
    epochs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [e["epoch_time_s"] for e in epochs if "epoch_time_s" in e]
    res["steady_median_s"] = statistics.median(steps[1:] or steps)
    return res


def main(argv: list[str] | None = None) -> int:
    """Run every assignment and auto at each P, ``--rounds`` times; print (and optionally write) the tables."""
    p = run_parser(__doc__, epochs=5)
    p.add_argument("--rounds", type=int, default=1, help="0: only --full-epochs and the candidate tables")
    p.add_argument("--full-epochs", type=int, default=0, help="one auto run of this many epochs per P (0: none)")
    p.add_argument("--no-measure-all", action="store_true", help="skip the modelled vs measured table")
    args = p.parse_args(argv)
    args.load_start = os.getloadavg()[0]
    runs: dict = {}
    plans, full = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(args.rounds):
            for procs in args.procs:
                for a in [*assignments(procs), "auto"]:
                    out = Path(tmp) / f"{rnd}-{procs}-{a.replace(',', '+').replace(':', '-')}"
                    res = run_fresh(args, a, procs, out, Path(tmp))
                    runs.setdefault((procs, a), []).append(res)
                    print(f"round {rnd} P={procs} {a}: {res['steady_median_s'] * 1e3:.0f} ms", file=sys.stderr)
        for procs in args.procs:
            if args.full_epochs:
                full_args = argparse.Namespace(**{**vars(args), "epochs": args.full_epochs})
                t0 = time.perf_counter()
                res = run_fresh(full_args, "auto", procs, Path(tmp) / f"full-{procs}", Path(tmp))
                full[procs] = (res, time.perf_counter() - t0)
                print(f"P={procs} full run: {full[procs][1]:.0f} s", file=sys.stderr)
            if not args.no_measure_all:
                plans[procs] = plan_all(args, procs)
                print(f"done P={procs} plan --measure-all", file=sys.stderr)
    text = report(args, runs, plans, full)
    print(text)
    if args.md:
        Path(args.md).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
