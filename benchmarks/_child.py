"""One benchmark run in its own process: load the graph arrays, build one framework's model,
time ``warmup + epochs`` training steps, print one result line.

    python benchmarks/_child.py '{"framework": "pyg-csr", "model": "gcn", "data_dir": "...", ...}'

The step timed is exactly: ``zero_grad``, forward over all vertices, cross entropy on the
train vertices, backward, Adam step (lr 0.01, weight decay 5e-4). The result is printed as one
JSON object on a line starting with :data:`MARKER`; ``bench_train.py`` parses it. Peak RSS is
this process's ``ru_maxrss`` (graph arrays, framework, model, activations, allocator caches).
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import sys
import time
import traceback
from typing import Any

MARKER = "BENCH_RESULT "
# An epoch is "quiet" when its interference (see run()) is below this many cores.
QUIET_LOAD = 0.2


def rss_mib() -> float:
    """Current resident set size in MiB (``VmRSS``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def peak_rss_mib() -> float:
    """Peak resident set size of this process in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def cpu_busy_s() -> float:
    """Busy CPU seconds of the whole machine so far (all cores; idle and iowait excluded)."""
    with open("/proc/stat") as f:
        vals = [int(v) for v in f.readline().split()[1:]]
    # user nice system idle iowait irq softirq steal [guest guest_nice: already in user/nice]
    return (sum(vals[:8]) - vals[3] - vals[4]) / _TICK


def self_cpu_s() -> float:
    """CPU seconds used by this process (all threads)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def runq_wait_s() -> float:
    """Seconds this process's live threads have spent runnable but waiting for a CPU
    (``/proc/<pid>/task/*/schedstat``, field 2); 0 where schedstat is unavailable."""
    total = 0
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return 0.0
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
        except (OSError, IndexError, ValueError):
            continue
    return total / 1e9


def allocator_in_use() -> str:
    """``jemalloc`` when libjemalloc is mapped into this process, else ``glibc``."""
    with open("/proc/self/maps") as f:
        return "jemalloc" if "libjemalloc" in f.read() else "glibc"


def _set_threads(framework: str, threads: int) -> None:
    import torch

    torch.set_num_threads(threads)
    if framework == "tessera":
        from tessera.threads import set_num_threads

        set_num_threads(threads)
    elif framework == "dgl":
        try:
            from dgl.utils.internal import set_num_threads

            set_num_threads(threads)
        except Exception:
            pass  # OMP_NUM_THREADS (set by the parent) still applies


def run(spec: dict[str, Any]) -> dict[str, Any]:
    """Execute one benchmark spec and return the result record."""
    import _peers
    import torch
    from _graphdata import load_arrays

    fw, threads = spec["framework"], int(spec["threads"])
    _set_threads(fw, threads)
    torch.manual_seed(0)
    t0 = time.perf_counter()
    arrays, meta = load_arrays(spec["data_dir"])
    load_s = time.perf_counter() - t0
    rss_load = rss_mib()

    t0 = time.perf_counter()
    model, forward, info = _peers.build(fw, spec["model"], arrays, meta, spec)
    loss_fn = _peers.train_loss(fw)
    x = torch.from_numpy(arrays["x"])
    y = torch.from_numpy(arrays["y"])
    train_idx = torch.from_numpy(arrays["train_mask"]).nonzero().view(-1)
    opt = torch.optim.Adam(model.parameters(), lr=spec["lr"], weight_decay=spec["weight_decay"])
    build_s = time.perf_counter() - t0
    rss_built = rss_mib()

    times: list[float] = []
    losses: list[float] = []
    # Interference per step, in cores: the smaller of (a) CPU time other processes used and
    # (b) time this process's threads sat runnable waiting for a CPU. (a) alone overcounts when
    # this step leaves a core idle (others may use it freely); (b) alone overcounts waits between
    # this process's own thread pools. Both are large only when others took cores we wanted.
    other: list[float] = []
    waits: list[float] = []
    model.train()
    for _ in range(spec["warmup"] + spec["epochs"]):
        busy0, self0, wait0 = cpu_busy_s(), self_cpu_s(), runq_wait_s()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        logits, rows = forward(model, x, train_idx)
        loss = loss_fn(logits, rows, y[train_idx])
        loss.backward()
        opt.step()
        lv = float(loss.detach())
        times.append(time.perf_counter() - t0)
        losses.append(lv)
        other.append(max(0.0, (cpu_busy_s() - busy0) - (self_cpu_s() - self0)) / times[-1])
        waits.append(max(0.0, runq_wait_s() - wait0) / times[-1])

    w = spec["warmup"]
    timed = times[w:]
    interference = [min(o, q) for o, q in zip(other[w:], waits[w:])]
    quiet = [t for t, i in zip(timed, interference) if i < QUIET_LOAD]
    return {
        "status": "ok",
        "framework": fw,
        "model": spec["model"],
        "graph": meta["name"],
        "allocator": spec["allocator"],
        "allocator_in_use": allocator_in_use(),
        "threads": torch.get_num_threads(),
        "warmup_s": [round(t, 5) for t in times[: spec["warmup"]]],
        "epoch_s": [round(t, 5) for t in timed],
        "median_ms": statistics.median(timed) * 1e3,
        "quiet_epochs": len(quiet),
        "quiet_median_ms": statistics.median(quiet) * 1e3 if quiet else None,
        "min_ms": min(timed) * 1e3,
        "max_ms": max(timed) * 1e3,
        "other_load": [round(v, 2) for v in other[w:]],
        "runq_wait": [round(v, 2) for v in waits[w:]],
        "interference": [round(v, 2) for v in interference],
        "interference_mean": round(statistics.fmean(interference), 3),
        "other_load_mean": round(statistics.fmean(other[w:]), 3),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "load_s": round(load_s, 3),
        "build_s": round(build_s, 3),
        "rss_after_load_mib": round(rss_load, 1),
        "rss_after_build_mib": round(rss_built, 1),
        "peak_rss_mib": round(peak_rss_mib(), 1),
        "versions": _peers.versions(fw),
        "python": sys.version.split()[0],
        "info": info,
    }


def main() -> int:
    """Parse the spec from argv, run it, print the result line; exit 1 on a Python error."""
    spec = json.loads(sys.argv[1])
    try:
        res = run(spec)
        code = 0
    except Exception as e:  # reported to the parent as a failed cell
        traceback.print_exc()
        oom = isinstance(e, MemoryError) or "can't allocate memory" in str(e) or "not enough memory" in str(e)
        res = {
            "status": "oom" if oom else "error",
            "framework": spec.get("framework"),
            "model": spec.get("model"),
            "allocator": spec.get("allocator"),
            "error": f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}",
            "peak_rss_mib": round(peak_rss_mib(), 1),
            "pid": os.getpid(),
        }
        code = 1
    sys.stdout.write(MARKER + json.dumps(res) + "\n")
    sys.stdout.flush()
    return code


if __name__ == "__main__":
    sys.exit(main())
