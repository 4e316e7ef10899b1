"""SuperGCN Table 3 analogue: accuracy of quantized halo exchange, with and without its guards.

Every (config, seed) is one ``tessera train --nprocs P --strategy partition`` run through the CLI
(P local ranks over gloo, METIS parts, pre/post remote aggregation), for the configs fp32; int2;
int2 + masked label propagation (LP, ``--label-prop``); int2 + LayerNorm (LN, ``--norm layer``);
int2 + LP + LN; int4; int8. Each runs a fixed number of epochs (``--patience 0``) and the per-epoch
``metrics.jsonl`` is read back. Runs are interleaved by seed (every config at seed 0, then seed 1,
...), and the tables are rewritten after every run, so a cut-off run still leaves its rows.

Per config, mean ± sd over seeds: the test accuracy after the last epoch, the best test accuracy
over epochs, and the first epoch whose validation accuracy reaches the best validation accuracy of
the fp32 run with the same seed (and 99 % of it), the same on test accuracy, the median epoch time
and the bytes sent per epoch::

    python benchmarks/bench_table3.py --dataset synthetic:arxiv --procs 4 --seeds 0 1 2 --epochs 80
    TESSERA_DATA=../shared/datasets python benchmarks/bench_table3.py --dataset cora --procs 4 \\
        --hidden 16 --epochs 200

``--configs`` also takes the controls fp32+LP, fp32+LN and fp32+LP+LN; ``--reuse`` takes an earlier
run's ``--json``, keeps its runs in the table and runs only the (config, seed) pairs it lacks, so
controls can be added to a finished matrix. ``--tree PATH`` runs another tessera source tree (an
exported commit) instead of this checkout. Results go to
``benchmarks/results/bench_table3_<graph>-p<P>_<machine>_<commit>.md`` (``--md`` overrides);
``--json`` keeps the raw per-epoch curves.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]

# name -> extra CLI flags; fp32 first, since the other rows are measured against it
CONFIGS: dict[str, list[str]] = {
    "fp32": [],
    "int2": ["--comm-bits", "2"],
    "int2+LP": ["--comm-bits", "2", "--label-prop", "{lp}"],
    "int2+LN": ["--comm-bits", "2", "--norm", "layer"],
    "int2+LP+LN": ["--comm-bits", "2", "--label-prop", "{lp}", "--norm", "layer"],
    "int4": ["--comm-bits", "4"],
    "int8": ["--comm-bits", "8"],
    # controls, not in the default matrix: the guards without quantization
    "fp32+LP": ["--label-prop", "{lp}"],
    "fp32+LN": ["--norm", "layer"],
    "fp32+LP+LN": ["--label-prop", "{lp}", "--norm", "layer"],
}
DEFAULT_CONFIGS = ["fp32", "int2", "int2+LP", "int2+LN", "int2+LP+LN", "int4", "int8"]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dataset", default="synthetic:arxiv")
    p.add_argument("--procs", type=int, default=4)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=80, help="epochs of every run (80: 21 arxiv runs in ~1 h on 2 cores)")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, choices=list(CONFIGS))
    p.add_argument("--model", default="gcn")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--label-prop", type=float, default=0.5, help="LP rate of the +LP configs")
    p.add_argument("--reorder", default="none", help="--reorder of every run (none: skip the set-up trial)")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    p.add_argument("--tree", type=Path, default=None, help="tessera source tree to run (default this checkout)")
    p.add_argument("--machine", default=None, help="machine label of the results file (default from the CPU)")
    p.add_argument("--commit", default=None, help="commit label (default the --reuse file's, else the tree's HEAD)")
    p.add_argument("--md", type=Path, default=None, help="results file (default benchmarks/results/...)")
    p.add_argument("--json", type=Path, default=None, help="also write every run's per-epoch curves here")
    p.add_argument(
        "--reuse", type=Path, default=None, help="a --json of an earlier run: its (config, seed) runs are not rerun"
    )
    return p.parse_args(argv)


def machine_label() -> str:
    """Short CPU label like the other result files' (zen3, zen4, zen5, xeon)."""
    info = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        return platform.machine()
    if info.get("vendor_id") == "GenuineIntel":
        return "xeon"
    family, model = int(info.get("cpu family", "0")), int(info.get("model", "0"))
    if family == 25:
        return "zen4" if model >= 0x10 else "zen3"
    return "zen5" if family == 26 else platform.machine()


def commit_of(tree: Path) -> str:
    """Short commit of ``tree`` (this checkout's HEAD when the tree is an export without .git)."""
    for where in (tree, ROOT):
        r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=where)
        if r.returncode == 0:
            return r.stdout.strip()
    return "unknown"


def run_once(a: argparse.Namespace, config: str, seed: int, out: Path) -> dict[str, Any]:
    """One training run; its result.json fields of interest and the per-epoch curves."""
    flags = [f.format(lp=a.label_prop) for f in CONFIGS[config]]
    cmd = [
        sys.executable, "-m", "tessera", "train", "--dataset", a.dataset, "--model", a.model,
        "--hidden", str(a.hidden), "--layers", str(a.layers), "--epochs", str(a.epochs), "--seed", str(seed),
        "--patience", "0", "--checkpoint-every", "100000", "--no-progress", "--out", str(out), "--overwrite",
        "--nprocs", str(a.procs), "--strategy", "partition", "--reorder", a.reorder, *flags,
    ]  # fmt: skip
    tree = (a.tree or ROOT).resolve()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(tree), os.environ.get("PYTHONPATH")]))}
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=a.timeout)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    res = json.loads((out / "result.json").read_text())
    curve = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {
        "config": config,
        "seed": seed,
        "cmd": " ".join(cmd[1:]),
        "wall_s": wall,
        "epoch_time_median_s": res["epoch_time_median_s"],
        "val": [e["val_acc"] for e in curve],
        "test": [e["test_acc"] for e in curve],
        "bytes_per_epoch": bytes_per_epoch(res),
    }


def bytes_per_epoch(res: dict[str, Any]) -> float:
    """Bytes (data and quantization parameters) sent per training epoch, all ranks."""
    comm = res.get("comm")
    if not comm:
        return 0.0

    def total(x: Any) -> float:
        return float(sum(map(total, x))) if isinstance(x, list) else float(x)

    return (total(comm["bytes_data"]) + total(comm["bytes_params"])) / max(comm["epochs"], 1)


def first_reach(curve: list[float], target: float) -> int | None:
    """1-based first epoch whose value is at least ``target`` (None if never)."""
    return next((i + 1 for i, v in enumerate(curve) if v >= target - 1e-12), None)


def mean_sd(xs: list[float], scale: float = 1.0, digits: int = 2) -> str:
    """``mean ± sd`` of ``xs`` times ``scale`` (``–`` when empty)."""
    if not xs:
        return "–"
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{scale * statistics.mean(xs):.{digits}f} ± {scale * sd:.{digits}f}"


def reach_cell(epochs: list[int | None]) -> str:
    """Mean ± sd of the epochs of the seeds that reached, and how many did."""
    hit = [float(e) for e in epochs if e is not None]
    if not hit:
        return f"never (0/{len(epochs)})"
    return f"{mean_sd(hit, digits=1)} ({len(hit)}/{len(epochs)})"


def table(a: argparse.Namespace, records: list[dict[str, Any]]) -> str:
    """The markdown table of every config that has finished runs."""
    fp32_best_val = {r["seed"]: max(r["val"]) for r in records if r["config"] == "fp32"}
    fp32_best_test = {r["seed"]: max(r["test"]) for r in records if r["config"] == "fp32"}
    lines = [
        f"| config | seeds | test acc @ epoch {a.epochs} (%) | best test acc (%) | best val acc (%) | "
        "epoch reaching fp32's best val | epoch reaching 99 % of it | epoch reaching fp32's best test | "
        "median epoch ms | MB sent per epoch |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for config in CONFIGS:
        rs = [r for r in records if r["config"] == config]
        if not rs:
            continue
        paired = [r for r in rs if r["seed"] in fp32_best_val]
        reach = [first_reach(r["val"], fp32_best_val[r["seed"]]) for r in paired]
        reach99 = [first_reach(r["val"], 0.99 * fp32_best_val[r["seed"]]) for r in paired]
        reach_test = [first_reach(r["test"], fp32_best_test[r["seed"]]) for r in paired]
        lines.append(
            f"| {config} | {len(rs)} | {mean_sd([r['test'][-1] for r in rs], 100)} | "
            f"{mean_sd([max(r['test']) for r in rs], 100)} | {mean_sd([max(r['val']) for r in rs], 100)} | "
            f"{reach_cell(reach) if paired else '–'} | {reach_cell(reach99) if paired else '–'} | "
            f"{reach_cell(reach_test) if paired else '–'} | "
            f"{1000 * statistics.median(r['epoch_time_median_s'] for r in rs):.0f} | "
            f"{statistics.mean(r['bytes_per_epoch'] for r in rs) / 1e6:.3g} |"
        )
    return "\n".join(lines)


def report(a: argparse.Namespace, records: list[dict[str, Any]], commit: str, argvs: list[list[str]]) -> str:
    """The whole results file: command, setting, machine and the table."""
    cores = len(os.sched_getaffinity(0))
    cpu = next(
        (ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines() if "model name" in ln),
        "?",
    )
    minutes = sum(r["wall_s"] for r in records) / 60
    seeds = ", ".join(map(str, sorted({r["seed"] for r in records})))
    return "\n".join(
        [
            f"# bench_table3, {a.dataset}, P = {a.procs}, {machine_label()}, {commit}",
            "",
            ", then ".join(f"`python benchmarks/bench_table3.py {' '.join(argv[1:])}`" for argv in argvs),
            "",
            f"{a.dataset}, {a.model}, {a.layers} layers, hidden {a.hidden}, {a.epochs} epochs (patience 0), "
            f"`--nprocs {a.procs} --strategy partition` (METIS, prepost), LP rate {a.label_prop}, "
            f"seeds {seeds}; {cpu}, {cores} cores (shared VM); {len(records)} runs, {minutes:.1f} min of run "
            "wall time. Accuracies are mean ± sd over seeds; the reach columns compare each run's validation "
            "curve with the best validation accuracy of the fp32 run of the same seed, and the last one its test "
            "curve with that run's best test accuracy (mean ± sd of the epochs over the seeds that reached it, "
            "and how many did).",
            "",
            table(a, records),
            "",
        ]
    )


def write(a: argparse.Namespace, md: Path, records: list[dict[str, Any]], commit: str, argvs: list[list[str]]) -> str:
    """Write the results file (and ``--json``); return the results text."""
    text = report(a, records, commit, argvs)
    md.write_text(text)
    if a.json is not None:
        a.json.write_text(json.dumps({"argvs": argvs, "commit": commit, "records": records}))
    return text


def main(argv: list[str] | None = None) -> int:
    """Run every (seed, config), rewriting the results after each run."""
    a = parse_args(argv)
    tree = (a.tree or ROOT).resolve()
    earlier = json.loads(a.reuse.read_text()) if a.reuse else {"argvs": [], "records": []}
    records: list[dict[str, Any]] = earlier["records"]
    commit = a.commit or earlier.get("commit") or commit_of(tree)
    argvs: list[list[str]] = earlier.get("argvs", [earlier["argv"]] if "argv" in earlier else [])
    tag = a.dataset.split(":")[-1].replace("/", "-")
    md = (
        a.md
        or ROOT / "benchmarks" / "results" / f"bench_table3_{tag}-p{a.procs}_{a.machine or machine_label()}_{commit}.md"
    )
    md.parent.mkdir(parents=True, exist_ok=True)
    done = {(r["config"], r["seed"]) for r in records}
    with tempfile.TemporaryDirectory(prefix="table3-") as tmp:
        for seed in a.seeds:
            for config in a.configs:
                if (config, seed) in done:
                    continue
                if argvs[-1] is not sys.argv:  # this invocation's command, once it has run something
                    argvs.append(sys.argv)
                rec = run_once(a, config, seed, Path(tmp) / f"{config}-s{seed}")
                records.append(rec)
                print(
                    f"{config} seed {seed}: test {rec['test'][-1]:.4f} (best {max(rec['test']):.4f}), "
                    f"{rec['epoch_time_median_s'] * 1000:.0f} ms/epoch, {rec['wall_s']:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
                write(a, md, records, commit, argvs)
    print(write(a, md, records, commit, argvs))
    print(f"wrote {md}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
