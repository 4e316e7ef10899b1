"""Time to first epoch: what ``tessera train`` spends before its steady epochs, in the default environment.

Each run is a fresh child process with no ``LD_PRELOAD`` and no ``MALLOC_CONF`` that goes through
what ``tessera train`` does: import tessera, load the dataset (a synthetic graph is generated from
its seed), set the run up (``Trainer``: ordering, operands, model, optimizer), then epochs of one
training step and one evaluation each. Reported per run: import, load, setup, the first epoch, the
median of the later (steady) epochs, and start-up = load + setup + first epoch in steady epochs.
Beside each epoch, the CPU time the process spent in the kernel during it: the first epoch's is
mostly first touches of the memory that later epochs reuse.

``--runs cold warm`` runs the child twice: ``cold`` with empty caches (a fresh ``NUMBA_CACHE_DIR``
and ``TESSERA_CACHE``: every numba kernel compiled, every ordering computed, a synthetic graph
generated), ``warm`` right after with the caches the cold run left (what a second ``tessera
train`` on the machine gets: compiled kernels, orders, the generated graph and the measured
backend choices read from disk).

    python benchmarks/bench_startup.py --dataset synthetic:products --models gcn sage gin gat \\
        --epochs 4 --threads 2 --runs cold warm --md out.md

``--first-touch GIB`` measures the machine instead: a fresh process writes ``GIB`` GiB of new
memory in 256 MiB pieces, unmaps it and writes as much again; then a second process does the
same right after. It prints seconds per GiB for each, in transparent huge pages (what NumPy's
large arrays and the workspace's blocks ask for) and in 4 KiB pages: what a first epoch pays for
memory no earlier epoch has used.
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

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, os, resource, sys, time
t0 = time.perf_counter()
import torch
from tessera.datasets import load
from tessera.train.config import TrainConfig
from tessera.train.loop import Trainer
spec = json.loads(sys.argv[1])
t_import = time.perf_counter() - t0
t0 = time.perf_counter()
graph = load(spec["dataset"])
t_load = time.perf_counter() - t0
t0 = time.perf_counter()
cfg = TrainConfig(model=spec["model"], dataset=spec["dataset"], hidden=spec["hidden"], threads=spec["threads"],
                  epochs=spec["epochs"], out=spec["out"])
tr = Trainer(cfg, graph)
t_setup = time.perf_counter() - t0
num_nodes, num_edges = graph.num_nodes, graph.num_edges
del graph  # as tessera.train.loop.train does: a renumbered run trains on its own copy
epochs, steps, sys_s = [], [], []
for _ in range(spec["epochs"]):
    t0, s0 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF).ru_stime
    tr.train_step()
    steps.append(time.perf_counter() - t0)
    tr.evaluate()
    epochs.append(time.perf_counter() - t0)
    sys_s.append(resource.getrusage(resource.RUSAGE_SELF).ru_stime - s0)
print(json.dumps({"import_s": t_import, "load_s": t_load, "setup_s": t_setup, "epoch_s": epochs, "step_s": steps,
                  "epoch_sys_s": sys_s,
                  "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                  "num_nodes": num_nodes, "num_edges": num_edges}))
"""


TOUCH = r"""
import ctypes, json, mmap, sys, time
import numpy as np
pieces, huge = int(sys.argv[1]), sys.argv[2] == "huge"
libc = ctypes.CDLL(None)
libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
def write(maps):
    t0 = time.perf_counter()
    for _ in range(pieces):
        m = mmap.mmap(-1, 256 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        a = np.frombuffer(m, np.float32)
        libc.madvise(a.ctypes.data, a.nbytes, 14 if huge else 15)  # MADV_HUGEPAGE / MADV_NOHUGEPAGE
        a.fill(1.0)
        del a
        maps.append(m)
    return (time.perf_counter() - t0) / (pieces / 4)
maps = []
fresh = write(maps)
for m in maps:
    m.close()
print(json.dumps({"fresh": fresh, "reused": write([])}))
"""


def first_touch(gib: float, python: str) -> dict[str, list[float]]:
    """Seconds per GiB of first writes, per page size (``huge``: transparent huge pages, as NumPy
    and the workspace ask for; ``small``: 4 KiB pages): in a fresh process, again in that process
    into the memory it just unmapped, and in a second fresh process right after."""
    pieces = max(1, round(gib * 4))
    out = {}
    for pages in ("huge", "small"):
        runs = [
            json.loads(
                subprocess.run(
                    [python, "-c", TOUCH, str(pieces), pages], capture_output=True, text=True, check=True
                ).stdout
            )
            for _ in range(2)
        ]
        out[pages] = [runs[0]["fresh"], runs[0]["reused"], runs[1]["fresh"]]
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", default="synthetic:products")
    p.add_argument("--models", nargs="+", default=["gcn", "sage", "gin", "gat"])
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--epochs", type=int, default=4, help="epochs per run: the first, then steady ones")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", nargs="+", default=["cold", "warm"], choices=["cold", "warm"])
    p.add_argument("--python", default=str(ROOT / ".venv" / "bin" / "python"))
    p.add_argument("--md", default=None, help="write the markdown table here")
    p.add_argument("--json", default=None, help="write the records here")
    p.add_argument(
        "--first-touch", type=float, default=None, metavar="GIB", help="measure first writes of new memory instead"
    )
    return p.parse_args(argv)


def run_child(a: argparse.Namespace, model: str, caches: Path, out: Path) -> dict:
    """One child in the default environment with ``caches`` as its numba and tessera caches."""
    env = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "MALLOC_CONF")}
    env.update(
        NUMBA_CACHE_DIR=str(caches / "numba"),
        TESSERA_CACHE=str(caches / "tessera"),
        PYTHONPATH=str(ROOT),
        OMP_NUM_THREADS=str(a.threads),
        MKL_NUM_THREADS=str(a.threads),
        NUMBA_NUM_THREADS=str(a.threads),
    )
    spec = {"dataset": a.dataset, "model": model, "hidden": a.hidden, "threads": a.threads, "epochs": a.epochs}
    spec["out"] = str(out)
    t0 = time.perf_counter()
    proc = subprocess.run([a.python, "-c", CHILD, json.dumps(spec)], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"status": "error", "error": proc.stderr.strip().splitlines()[-1:], "wall_s": wall}
    rec = json.loads(proc.stdout.strip().splitlines()[-1])
    steady = statistics.median(rec["epoch_s"][1:]) if len(rec["epoch_s"]) > 1 else float("nan")
    rec.update(status="ok", wall_s=wall, steady_epoch_s=steady)
    rec["startup_s"] = rec["load_s"] + rec["setup_s"] + rec["epoch_s"][0]
    rec["startup_in_epochs"] = rec["startup_s"] / steady
    return rec


def main(argv: list[str] | None = None) -> int:
    """Run every model cold then warm; print and write the table."""
    a = parse_args(argv)
    if a.first_touch is not None:
        for pages, (fresh, reused, again) in first_touch(a.first_touch, a.python).items():
            print(
                f"first writes of {a.first_touch:g} GiB in {pages} pages: {fresh:.2f} s/GiB in a fresh process, "
                f"{reused:.2f} s/GiB into memory it had just unmapped, {again:.2f} s/GiB in a second process right after"
            )
        return 0
    rows = []
    for model in a.models:
        with tempfile.TemporaryDirectory(prefix="tessera-startup-") as tmp:
            caches = Path(tmp)
            if "warm" in a.runs and "cold" not in a.runs:  # fill the caches a warm run reads, unreported
                run_child(a, model, caches, caches / "out-priming")
            for kind in a.runs:
                rec = run_child(a, model, caches, caches / f"out-{kind}")
                rec.update(model=model, run=kind)
                rows.append(rec)
                print(json.dumps({k: v for k, v in rec.items() if k not in ("epoch_s", "step_s")}), flush=True)
    lines = [
        f"`{' '.join([Path(sys.executable).name, *sys.argv])}`",
        "",
        "| model | run | import s | load s | setup s | first epoch s (kernel s) | steady epoch s (kernel s) "
        "| start-up s | start-up / steady epoch | peak RSS MiB |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['run']} | error: {r['error']} |||||||")
            continue
        lines.append(
            f"| {r['model']} | {r['run']} | {r['import_s']:.1f} | {r['load_s']:.1f} | {r['setup_s']:.1f} "
            f"| {r['epoch_s'][0]:.2f} ({r['epoch_sys_s'][0]:.2f}) "
            f"| {r['steady_epoch_s']:.2f} ({statistics.median(r['epoch_sys_s'][1:]):.2f}) | {r['startup_s']:.1f} "
            f"| {r['startup_in_epochs']:.1f} | {r['peak_rss_mib']:.0f} |"
        )
    md = "\n".join(lines)
    print(md)
    if a.md:
        Path(a.md).write_text(md + "\n")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
