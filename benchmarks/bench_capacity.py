"""Largest-graph benchmark: the biggest synthetic graph each framework trains GCN on within a memory budget.

The graph family is the ``products`` preset scaled by ``s``: ``500,000·s`` vertices and
``12,000,000·s`` undirected edges (stored both ways), 100 features, 47 classes, the preset's
degree exponent, homophily, split and max-degree cap (8000), so the degree distribution stays the
same and only the size grows. Each scale is generated once by tessera in a child process and
written as ``.npy`` files (``_graphdata.dump``); every framework trains on those identical arrays.

Each (framework, scale) is one ``bench_train`` child (``_child.py``, via ``bench_train._one``):
load the arrays, build the model (GCN, ``--layers`` layers, ``--hidden`` wide, dropout 0.5, Adam
lr 0.01 wd 5e-4), then ``--epochs`` (default 1) training steps over the full graph. A scale *fits*
when the child finishes and its peak RSS (``ru_maxrss``: arrays, framework, model, activations,
allocator caches) is at most ``--budget-gib``. Children are killed above the budget, or lower
when the machine has less free memory (``MemAvailable − --reserve-gib``, read before each run),
by a memory cgroup where one is writable, else by polling ``VmRSS`` (``_runner.run_child``).

Search, per framework: train at ``--start``; multiply the scale by ``--factor`` while it fits (or
divide while it does not), then bisect (geometric midpoints) between the largest fit and the
smallest failure ``--bisect`` times. Frameworks advance in lockstep, smallest pending scale first,
so each graph is generated once for all frameworks that need it and deleted afterwards.

    python benchmarks/bench_capacity.py --frameworks tessera dgl pyg --budget-gib 24 --threads 2 \\
        --dgl-python /work/dgl-venv/bin/python --out benchmarks/results/bench_capacity.json

``pyg`` is PyG's ``GCNConv`` on a sparse-CSR ``adj_t`` (``bench_train``'s ``pyg-csr``);
``pyg-edge_index`` is also accepted. The report (markdown, printed and written next to ``--out``
with ``.md``) lists per framework the largest scale that fit and the smallest that did not, and why.
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import signal
import statistics
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import bench_train
from _child import MARKER, peak_rss_mib
from _report import cpu_facts, git_state, label, probe_python
from _runner import ROOT, CgroupCap, Launch, find_jemalloc, run_child, thread_env

# --frameworks name -> bench_train framework
FRAMEWORKS = {"tessera": "tessera", "dgl": "dgl", "pyg": "pyg-csr", "pyg-edge_index": "pyg-edge_index"}
BASE_PRESET = "products"
GIB = 2**30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--frameworks", nargs="+", default=["tessera", "dgl", "pyg"], choices=list(FRAMEWORKS))
    p.add_argument("--budget-gib", type=float, default=24.0, help="peak RSS a run may reach and still fit")
    p.add_argument(
        "--reserve-gib",
        type=float,
        default=1.0,
        help="children are also killed above MemAvailable minus this (read before each run), to protect the machine",
    )
    p.add_argument("--start", type=float, default=1.0, help="first scale tried (1 = the products preset)")
    p.add_argument("--factor", type=float, default=1.5, help="scale multiplier while growing (divisor while shrinking)")
    p.add_argument("--bisect", type=int, default=2, help="bisection steps between the largest fit and smallest failure")
    p.add_argument("--max-scale", type=float, default=100.0, help="stop growing beyond this scale")
    p.add_argument("--min-scale", type=float, default=0.001, help="stop shrinking below this scale")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--epochs", type=int, default=1, help="training epochs per child, after model set-up")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--allocator", default="default", choices=bench_train.ALLOCATORS)
    p.add_argument("--tessera-backend", default="auto")
    p.add_argument(
        "--tessera-reorder",
        default="none",
        choices=("auto", "none", "rcm", "metis", "degree"),
        help="tessera's vertex order (default none: the training footprint alone; auto times four orders, "
        "METIS among them, before training)",
    )
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per child (graph generation or training)")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=10.0,
        help="before each training child, wait up to this many seconds for other processes to use < 0.25 cores",
    )
    p.add_argument("--python", default=None, help="interpreter for tessera/PyG (default: .venv/bin/python)")
    p.add_argument("--dgl-python", default=None, help="DGL interpreter (default: bench_train's, .venv-dgl/bin/python)")
    p.add_argument("--seed", type=int, default=0, help="synthetic graph seed")
    p.add_argument("--data-dir", default=None, help="where the graph .npy files go (default: a temp dir)")
    p.add_argument("--keep-data", action="store_true", help="keep every scale's .npy files and the logs")
    p.add_argument(
        "--out",
        default=None,
        help="results JSON (the markdown goes next to it, .md); default "
        "benchmarks/results/bench_capacity_<date>_<commit>.json",
    )
    a = p.parse_args(argv)
    if a.factor <= 1.0:
        p.error("--factor must be > 1")
    if a.start <= 0 or a.budget_gib <= 0:
        p.error("--start and --budget-gib must be positive")
    return a


def train_args(a: argparse.Namespace) -> argparse.Namespace:
    """``bench_train``'s options for one GCN child per run (one attempt, no warm-up), from ours."""
    argv = [
        "--models", "gcn", "--hidden", str(a.hidden), "--layers", str(a.layers), "--epochs", str(a.epochs),
        "--warmup", "0", "--threads", str(a.threads), "--tessera-backend", a.tessera_backend,
        "--tessera-reorder", a.tessera_reorder,
        "--timeout", str(a.timeout), "--quiet-wait", str(a.quiet_wait), "--retry-noisy", "0",
    ]  # fmt: skip
    if a.python:
        argv += ["--python", a.python]
    if a.dgl_python:
        argv += ["--dgl-python", a.dgl_python]
    return bench_train.parse_args(argv)


def canon(scale: float) -> float:
    """``scale`` to 4 significant digits, so every framework names a scale the same way."""
    return float(f"{scale:.4g}")


def scale_key(scale: float) -> str:
    """Graph key and preset suffix of a scale, e.g. ``x1.5``."""
    return f"x{scale:g}"


# ---------------------------------------------------------------------------------- graph child
def graph_child(spec: dict[str, Any]) -> int:
    """Child-process entry: register the scaled preset, write its arrays with ``_graphdata.dump``,
    print one result line for ``run_child``."""
    import dataclasses

    from _graphdata import dump

    from tessera.graph import synthetic

    try:
        base = synthetic.PRESETS[BASE_PRESET]
        name = f"{BASE_PRESET}-{scale_key(spec['scale'])}"
        synthetic.PRESETS[name] = dataclasses.replace(
            base,
            num_nodes=round(base.num_nodes * spec["scale"]),
            num_undirected_edges=round(base.num_undirected_edges * spec["scale"]),
            name=name,
        )
        res = {"status": "ok", **dump(f"synthetic:{name}", spec["data_dir"], spec["seed"])}
        code = 0
    except Exception as e:  # reported to the parent as a failed graph
        traceback.print_exc()
        res = {"status": "oom" if isinstance(e, MemoryError) else "error", "error": f"{type(e).__name__}: {e}"[:300]}
        code = 1
    res["peak_rss_mib"] = round(peak_rss_mib(), 1)
    sys.stdout.write(MARKER + json.dumps(res) + "\n")
    sys.stdout.flush()
    return code


# ---------------------------------------------------------------------------------- memory
def meminfo_gib(key: str) -> float:
    """A ``/proc/meminfo`` field (e.g. ``MemAvailable``) in GiB."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 2**20
    raise KeyError(key)


def kill_cap(a: argparse.Namespace) -> tuple[float, str]:
    """RSS above which the next child is killed: the budget, or less when the machine has less free."""
    machine = math.floor((meminfo_gib("MemAvailable") - a.reserve_gib) * 100) / 100
    return (a.budget_gib, "budget") if a.budget_gib <= machine else (machine, "machine")


def verdict(rec: dict[str, Any], budget_gib: float) -> tuple[bool, str]:
    """Whether a training run fits the budget, and why not."""
    cap = rec.get("kill_cap_gib", budget_gib)
    where = "the budget" if rec.get("kill_cap_kind") == "budget" else f"the machine limit {cap:g} GiB (< budget)"
    status = rec.get("status")
    if status == "ok":
        peak = rec["peak_rss_mib"] / 1024
        if peak > budget_gib:
            return False, f"peak RSS {peak:.2f} GiB over the budget"
        return True, "fits"
    if status == "graph":
        return False, f"graph generation failed: {rec.get('error', '')}"
    if status == "oom" and rec.get("rc") == -signal.SIGKILL:
        return False, f"killed at {where} (RSS polled {rec.get('poll_peak_rss_mib', 0) / 1024:.2f} GiB)"
    if status == "oom":
        return False, f"{rec.get('error', 'MemoryError')} (at {rec.get('peak_rss_mib', 0) / 1024:.2f} GiB)"
    if status == "timeout":
        return False, f"timeout ({rec.get('error', '')})"
    return False, f"{status}: {rec.get('error', '')}"


# ---------------------------------------------------------------------------------- search
@dataclass
class Search:
    """One framework's search over scales: grow (or shrink) by ``factor``, then bisect."""

    start: float
    factor: float
    bisect: int
    max_scale: float
    min_scale: float
    tried: dict[float, bool] = field(default_factory=dict)
    bisected: int = 0
    stop: str | None = None

    def bracket(self) -> tuple[float | None, float | None]:
        """(largest scale that fit, smallest failing scale above it)."""
        fits = [s for s, ok in self.tried.items() if ok]
        lo = max(fits) if fits else None
        above = [s for s, ok in self.tried.items() if not ok and (lo is None or s > lo)]
        return lo, (min(above) if above else None)

    def next_scale(self) -> float | None:
        """The next scale to try, or ``None`` when the search is over (``stop`` says why)."""
        if self.stop is not None:
            return None
        if not self.tried:
            return canon(self.start)
        lo, hi = self.bracket()
        if hi is None:  # everything fit so far: grow
            nxt = canon(lo * self.factor)
            if nxt > self.max_scale:
                self.stop = f"no failure up to --max-scale {self.max_scale:g}"
                return None
            return nxt
        if lo is None:  # nothing fit yet: shrink
            nxt = canon(hi / self.factor)
            if nxt < self.min_scale:
                self.stop = f"nothing fits down to --min-scale {self.min_scale:g}"
                return None
            return nxt
        mid = canon(math.sqrt(lo * hi))
        if self.bisected >= self.bisect or not lo < mid < hi:
            self.stop = "done"
            return None
        return mid

    def record(self, scale: float, fits: bool) -> None:
        """Note the outcome of ``scale``."""
        lo, hi = self.bracket()
        if lo is not None and hi is not None:
            self.bisected += 1
        self.tried[scale] = fits


# ---------------------------------------------------------------------------------- runs
def make_graph(a: argparse.Namespace, scale: float, gdir: Path, log_dir: Path, cgroup: CgroupCap | None) -> dict:
    """Generate scale ``scale`` into ``gdir`` in a memory-capped child; the graph's meta or a failure."""
    cap, kind = kill_cap(a)
    cache = gdir.parent / f"cache_{scale_key(scale)}"  # tessera caches large synthetic graphs: keep it out of ~
    launch = Launch(
        python=a.python,
        spec={
            "framework": "graph",
            "model": "gcn",
            "allocator": "default",
            "scale": scale,
            "data_dir": str(gdir),
            "seed": a.seed,
            "graph_spec": f"synthetic:{BASE_PRESET}-{scale_key(scale)}",
        },
        env={**thread_env(a.threads), "TESSERA_CACHE": str(cache)},
        tag=f"graph_{scale_key(scale)}",
        log_dir=log_dir,
        timeout_s=a.timeout,
        mem_cap_gib=cap,
        script=Path(__file__).resolve(),
    )
    rec = run_child(launch, cgroup)
    shutil.rmtree(cache, ignore_errors=True)
    rec.update(scale=scale, kill_cap_gib=cap, kill_cap_kind=kind)
    return rec


def train(
    ta: argparse.Namespace,
    a: argparse.Namespace,
    fw: str,
    scale: float,
    gdir: Path,
    jemalloc: str | None,
    cgroup: CgroupCap | None,
    log_dir: Path,
    started: float,
) -> dict[str, Any]:
    """One training child of framework ``fw`` on scale ``scale``, killed above :func:`kill_cap`."""
    cap, kind = kill_cap(a)
    run_ns = argparse.Namespace(**{**vars(ta), "mem_cap_gb": cap})
    spec = f"synthetic:{BASE_PRESET}-{scale_key(scale)}"
    rec = bench_train._one(
        run_ns,
        FRAMEWORKS[fw],
        a.allocator,
        "gcn",
        scale_key(scale),
        spec,
        gdir,
        0,
        jemalloc,
        (cgroup, None),
        log_dir,
        started,
    )
    rec.update(framework=fw, scale=scale, kill_cap_gib=cap, kill_cap_kind=kind)
    return rec


def run_summary(rec: dict[str, Any], fits: bool, why: str) -> str:
    """One log line for a training run."""
    head = f"{rec['framework']} {scale_key(rec['scale'])}:"
    if rec.get("status") == "ok":
        peak, wall = rec["peak_rss_mib"], rec.get("wall_s", 0)
        return f"{head} {'fits' if fits else why}; peak {peak:.0f} MiB, epoch {epoch_text(rec)} s, {wall:.0f} s"
    return f"{head} {why} ({rec.get('wall_s', 0):.0f} s)"


def epoch_text(rec: dict[str, Any]) -> str:
    """Seconds of an ``ok`` run's first epoch, then the median of its later ones if any (``12.10 / 1.52``)."""
    t = rec["epoch_s"]
    return f"{t[0]:.2f}" + (f" / {statistics.median(t[1:]):.2f}" if len(t) > 1 else "")


# ---------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    """Search every framework's largest graph and write the report."""
    a = parse_args(argv)
    ta = train_args(a)
    a.python, a.dgl_python = ta.python, ta.dgl_python
    signal.signal(signal.SIGTERM, bench_train._on_sigterm)
    started = time.perf_counter()
    date = datetime.now(timezone.utc)
    command = "python benchmarks/bench_capacity.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    git = git_state()
    out = (
        Path(a.out)
        if a.out
        else ROOT / "benchmarks" / "results" / f"bench_capacity_{date:%Y-%m-%d}_{git['commit']}.json"
    )
    notes: list[str] = []

    frameworks = list(dict.fromkeys(a.frameworks))
    dgl_env: dict[str, Any] = {}
    if "dgl" in frameworks:
        dgl_env = probe_python(a.dgl_python) if Path(a.dgl_python).exists() else {"error": "no such interpreter"}
        if dgl_env.get("dgl") is None:
            notes.append(f"DGL skipped: `import dgl` fails with {a.dgl_python}: {dgl_env.get('error', '?')}")
            frameworks.remove("dgl")
    jemalloc = find_jemalloc()
    if a.allocator == "jemalloc" and jemalloc is None:
        raise SystemExit("--allocator jemalloc: libjemalloc.so.2 not found")
    cgroup = CgroupCap.detect()
    ram = meminfo_gib("MemTotal")
    if a.budget_gib > ram - a.reserve_gib:
        notes.append(
            f"the {a.budget_gib:g} GiB budget is more than this machine ({ram:.1f} GiB RAM) can give a child: "
            f"children were killed at MemAvailable − {a.reserve_gib:g} GiB instead (kill cap per run below), so a "
            "'machine limit' failure means the graph may still fit the budget on a larger machine."
        )
    facts = {
        **cpu_facts(),
        "date": f"{date:%Y-%m-%d %H:%M} UTC",
        "command": command,
        "git": git,
        "versions_main": probe_python(a.python),
        "versions_dgl": dgl_env,
        "kill": f"cgroup v{cgroup.version} memory limit" if cgroup else "VmRSS polled every 0.2 s",
        "config": {
            k: getattr(a, k)
            for k in ("budget_gib", "reserve_gib", "start", "factor", "bisect", "hidden", "layers", "epochs")
        }
        | {"threads": a.threads, "allocator": a.allocator, "seed": a.seed},
        "frameworks_run": frameworks,
    }

    data_root = Path(a.data_dir) if a.data_dir else Path(tempfile.mkdtemp(prefix="tessera_capacity_"))
    log_dir = data_root / "logs"
    searches = {fw: Search(a.start, a.factor, a.bisect, a.max_scale, a.min_scale) for fw in frameworks}
    graphs: dict[str, dict[str, Any]] = {}
    runs: list[dict[str, Any]] = []
    try:
        while True:
            want = {fw: s.next_scale() for fw, s in searches.items()}
            want = {fw: x for fw, x in want.items() if x is not None}
            if not want:
                break
            scale = min(want.values())
            gdir = data_root / scale_key(scale)
            bench_train._log(f"generating {BASE_PRESET} {scale_key(scale)} ...")
            g = make_graph(a, scale, gdir, log_dir, cgroup)
            graphs[scale_key(scale)] = g
            if g.get("status") == "ok":
                bench_train._log(
                    f"  {g['num_nodes']:,} nodes, {g['num_edges']:,} edges, {g['generate_s']:.1f} s, "
                    f"peak {g['peak_rss_mib']:.0f} MiB"
                )
            for fw in (f for f in frameworks if want.get(f) == scale):
                if g.get("status") == "ok":
                    rec = train(ta, a, fw, scale, gdir, jemalloc, cgroup, log_dir, started)
                else:
                    rec = {"framework": fw, "scale": scale, "status": "graph", "error": g.get("error", g.get("status"))}
                fits, why = verdict(rec, a.budget_gib)
                rec.update(fits=fits, why=why)
                runs.append(rec)
                searches[fw].record(scale, fits)
                bench_train._log(run_summary(rec, fits, why))
            if not a.keep_data:
                shutil.rmtree(gdir, ignore_errors=True)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: run_child has killed the child; report what ran
        notes.append("interrupted: the search did not finish, the table shows the runs made so far")
    finally:
        errors = [r for r in runs if r.get("status") in ("error", "graph")]
        if a.keep_data or errors:
            notes.append(f"logs of the children kept in {log_dir}")
        elif not a.data_dir:
            shutil.rmtree(data_root, ignore_errors=True)

    facts["total_s"] = round(time.perf_counter() - started, 1)
    summary = summarize(frameworks, searches, runs, graphs)
    md = render(a, facts, summary, graphs, runs, notes)
    print(md)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(md + "\n")
    payload = {"facts": facts, "summary": summary, "graphs": graphs, "runs": runs, "notes": notes}
    out.with_suffix(".json").write_text(json.dumps(payload, indent=1, default=str) + "\n")
    bench_train._log(f"wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}")
    return 0


def summarize(
    frameworks: list[str], searches: dict[str, Search], runs: list[dict[str, Any]], graphs: dict[str, Any]
) -> dict[str, Any]:
    """Per framework: the largest fitting run, the smallest failing run above it, and how the search ended."""
    out: dict[str, Any] = {}
    for fw in frameworks:
        lo, hi = searches[fw].bracket()
        mine = {r["scale"]: r for r in runs if r["framework"] == fw}
        out[fw] = {
            "largest_fit": mine.get(lo),
            "smallest_no_fit": mine.get(hi),
            "search_end": searches[fw].stop,
            "runs": len(mine),
            "child_wall_s": round(sum(r.get("wall_s", 0) for r in mine.values()), 1),
        }
    return out


# ---------------------------------------------------------------------------------- report
def _size(graphs: dict[str, Any], scale: float) -> tuple[str, str, str]:
    g = graphs.get(scale_key(scale), {})
    if g.get("status") != "ok":
        return "—", "—", "—"
    return f"{g['num_nodes']:,}", f"{g['num_edges']:,}", str(g["num_features"])


def _gib(mib: float | None) -> str:
    return "—" if mib is None else f"{mib / 1024:.2f}"


def render(
    a: argparse.Namespace,
    facts: dict[str, Any],
    summary: dict[str, Any],
    graphs: dict[str, Any],
    runs: list[dict[str, Any]],
    notes: list[str],
) -> str:
    """The markdown report: setup, the headline table, every graph, every run, notes."""
    vm, vd = facts["versions_main"], facts["versions_dgl"]
    lines = [
        f"# Largest trainable graph: GCN {a.layers} layers, hidden {a.hidden}, full graph, "
        f"{a.budget_gib:g} GiB budget ({facts['date']})",
        "",
        f"- command: `{facts['command']}`",
        f"- machine: {facts['cpu']}, {facts['cores_usable']} usable cores, {facts['simd']}, {facts['mem_gib']} GiB "
        f"RAM, Linux {facts['kernel']}; {a.threads} threads per child; allocator `{a.allocator}`",
        f"- tessera/PyG env: torch {vm.get('torch')}, torch_geometric {vm.get('torch_geometric')}, numba "
        f"{vm.get('numba')}, numpy {vm.get('numpy')}; tessera backends {vm.get('tessera_backends')}, requested "
        f"`{a.tessera_backend}`, vertex order `{a.tessera_reorder}`; git {facts['git'].get('commit')}"
        + (" (tessera/ has uncommitted changes)" if facts["git"].get("tessera_dirty") else ""),
    ]
    if vd.get("dgl"):
        lines.append(f"- DGL env: dgl {vd.get('dgl')}, torch {vd.get('torch')}, numpy {vd.get('numpy')}")
    lines += [
        f"- graphs: synthetic `{BASE_PRESET}` scaled by s (500,000·s vertices, 12,000,000·s undirected edges "
        f"stored both ways, 100 features, 47 classes, max degree 8000), seed {a.seed}",
        f"- a run: load the arrays, build the model, {a.epochs} training epoch(s) (forward, loss, backward, Adam); "
        "it fits when it finishes with peak RSS (ru_maxrss) within the budget. Epoch s: the first epoch (it "
        "includes first touches of new memory and lazy set-up such as JIT compilation)"
        + (", then the median of the later ones" if a.epochs > 1 else ""),
        f"- kill: {facts['kill']} at the budget, or at MemAvailable − {a.reserve_gib:g} GiB when that is lower "
        "(then a failure says 'machine limit' and the largest fit may be understated)",
        f"- search: start {a.start:g}, ×{a.factor:g} until a failure, then {a.bisect} geometric bisection step(s); "
        f"total wall {facts['total_s']:.0f} s",
        "",
        "| framework | largest fit s | vertices | edges | features | peak RSS GiB | epoch s "
        "| smallest no-fit s | vertices | edges | why not |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for fw, s in summary.items():
        fit, nofit = s["largest_fit"], s["smallest_no_fit"]
        row = [label(FRAMEWORKS[fw])]
        if fit is not None:
            row += [f"{fit['scale']:g}", *_size(graphs, fit["scale"]), _gib(fit["peak_rss_mib"]), epoch_text(fit)]
        else:
            row += ["none", "—", "—", "—", "—", "—"]
        if nofit is not None:
            row += [f"{nofit['scale']:g}", *_size(graphs, nofit["scale"])[:2], nofit["why"]]
        else:
            row += ["—", "—", "—", s["search_end"] or ""]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        "## Graphs",
        "",
        "| scale | vertices | edges | features | generate s | generator peak RSS GiB | status |",
        "|---:|---:|---:|---:|---:|---:|---|",
    ]
    for g in sorted(graphs.values(), key=lambda g: g["scale"]):
        ok = g.get("status") == "ok"
        lines.append(
            f"| {g['scale']:g} | {' | '.join(_size(graphs, g['scale']))} | "
            f"{g['generate_s'] if ok else '—'} | {_gib(g.get('peak_rss_mib') or g.get('poll_peak_rss_mib'))} | "
            f"{'ok' if ok else g.get('status') + ' ' + g.get('error', '')} |"
        )
    lines += [
        "",
        "## Every run",
        "",
        "| framework | scale | vertices | edges | peak RSS MiB | kill cap GiB | epoch s | load+build s | child wall s "
        "| verdict |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in runs:
        ok = r.get("status") == "ok"
        peak = r.get("peak_rss_mib") if ok else r.get("poll_peak_rss_mib")
        cells = [
            label(FRAMEWORKS[r["framework"]]),
            f"{r['scale']:g}",
            *_size(graphs, r["scale"])[:2],
            "—" if peak is None else f"{peak:.0f}" + ("" if ok else " (polled)"),
            str(r.get("kill_cap_gib", "—")),
            epoch_text(r) if ok else "—",
            f"{r['load_s'] + r['build_s']:.1f}" if ok else "—",
            str(r.get("wall_s", "—")),
            r["why"],
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Search time", ""]
    for fw, s in summary.items():
        lines.append(f"- {label(FRAMEWORKS[fw])}: {s['runs']} runs, {s['child_wall_s']:.0f} s in training children")
    gen = sum(g.get("wall_s", 0) for g in graphs.values())
    lines.append(f"- graph generation: {len(graphs)} graphs, {gen:.0f} s")
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines)


if __name__ == "__main__":
    if len(sys.argv) == 2 and sys.argv[1].lstrip().startswith("{"):  # run_child's graph child
        sys.exit(graph_child(json.loads(sys.argv[1])))
    sys.exit(main())
