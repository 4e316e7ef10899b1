"""Full-graph training-epoch benchmark: tessera vs PyG (edge_index and sparse-CSR paths) vs DGL.

Every (graph, model, framework, allocator) runs in its own child process, under a memory cap
and a timeout, on the identical graph (generated once by tessera, handed to every child as
``.npy`` files; see ``_graphdata.py``). A child times ``--warmup + --epochs`` training steps
(zero_grad, forward, mean cross entropy on the train vertices written as each framework's users
write it (``_peers.train_loss``), backward, Adam step with lr 0.01 and weight decay 5e-4; dropout
0.5) and reports the per-epoch times and its peak
RSS. Frameworks run interleaved per model and repeat, so machine noise hits all of them alike.
PyG and DGL compute every vertex's logits and pick the training rows; tessera's step asks its
model for the training rows' logits only (``targets``, as ``tessera train`` does), so a last
layer that can computes no others; the losses and gradients are the same.

Each framework runs under the process's default allocator (``default``: glibc's malloc, what a
user of the README's commands gets) and jemalloc with decay disabled (``jemalloc``, via
``LD_PRELOAD``; marked n/a where libjemalloc is not installed; ``TESSERA_JEMALLOC`` names a
library elsewhere). Each graph's first table is the headline: tessera in the default
environment against each peer's best allocator, time and peak RSS; the second compares each
framework's better allocator and lists both.

``--tessera-tree LABEL=PATH`` (repeatable) adds a column ``tessera@LABEL``: another tessera source
tree (e.g. the previous commit as a git worktree), run interleaved with the others by that tree's
own ``benchmarks/_child.py`` with ``PYTHONPATH=PATH``, so its own ``tessera`` package is imported;
the report shows ``tessera`` (this tree) ÷ ``tessera@LABEL`` and every repeat's median.

    python benchmarks/bench_train.py --graphs arxiv products --models gcn sage gin gat \\
        --hidden 256 --layers 2 --epochs 10 --warmup 3 --threads 2 \\
        --allocators default jemalloc --json out.json --md out.md

    git worktree add /tmp/tessera-before HEAD~1
    python benchmarks/bench_train.py --graphs arxiv --models gcn sage --frameworks tessera \\
        --tessera-tree before=/tmp/tessera-before --repeats 3 --md out.md
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from _report import (
    TREE_PREFIX,
    cpu_facts,
    detail_table,
    git_state,
    graph_table,
    group,
    headline_table,
    label,
    probe_python,
    tree_table,
)
from _runner import (
    JOIN_CGROUPS,
    ROOT,
    CgroupCap,
    CpuWeight,
    Launch,
    allocator_env,
    find_jemalloc,
    probe_tessera_tree,
    run_child,
    thread_env,
    tree_pythonpath,
    wait_for_quiet,
)

FRAMEWORKS = ("tessera", "pyg-edge_index", "pyg-csr", "dgl")
ALLOCATORS = ("default", "jemalloc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graphs", nargs="+", default=["arxiv"], help="synthetic presets or tessera dataset specs")
    p.add_argument("--models", nargs="+", default=["gcn", "sage", "gin", "gat"], choices=["gcn", "sage", "gin", "gat"])
    p.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    p.add_argument("--allocators", nargs="+", default=list(ALLOCATORS), choices=ALLOCATORS)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dropout", type=float, default=0.5)
    p.add_argument("--epochs", type=int, default=10, help="timed epochs per child")
    p.add_argument("--warmup", type=int, default=3, help="untimed epochs per child, before the timed ones")
    p.add_argument("--repeats", type=int, default=1, help="children per cell (interleaved); epoch times pooled")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tessera-backend", default="auto")
    p.add_argument(
        "--tessera-precision",
        choices=("fp32", "bf16"),
        default="fp32",
        help="storage precision of this tree's tessera runs (tessera train --precision); tessera@LABEL trees run fp32",
    )
    p.add_argument(
        "--tessera-reorder",
        default="auto",
        choices=("auto", "none", "rcm", "metis", "degree"),
        help="tessera's vertex order, as tessera train --reorder (default auto, what tessera train does)",
    )
    p.add_argument(
        "--tessera-tree",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="also time the tessera source tree at PATH (e.g. a git worktree of the previous commit) as "
        "framework tessera@LABEL, with PATH/benchmarks/_child.py, PYTHONPATH=PATH and the --python "
        "interpreter; repeatable",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per child")
    p.add_argument("--mem-cap-gb", type=float, default=21.0, help="memory cap per child, GiB")
    p.add_argument("--max-total-s", type=float, default=None, help="skip children that would start after this")
    p.add_argument(
        "--quiet-wait",
        type=float,
        default=20.0,
        help="before each child, wait up to this many seconds for other processes to use < 0.25 cores",
    )
    p.add_argument(
        "--retry-noisy",
        type=int,
        default=1,
        help="re-run a child (up to N times) when fewer than half its timed epochs were quiet (other processes "
        "interfering < 0.2 cores); the attempt with the most quiet epochs is kept",
    )

    p.add_argument(
        "--cpu-shares",
        type=int,
        default=0,
        help="run each child in a cgroup with this cpu.shares (v1 default 1024; 0 = off) so other jobs on a "
        "shared machine cannot take its cores; this slows every other process while a child runs",
    )
    p.add_argument("--python", default=None, help="interpreter for tessera/PyG (default: .venv/bin/python)")
    p.add_argument("--dgl-python", default=str(ROOT / ".venv-dgl" / "bin" / "python"))
    p.add_argument("--data-dir", default=None, help="where the graph .npy files go (default: a temp dir)")
    p.add_argument("--keep-data", action="store_true", help="keep the .npy graph files")
    p.add_argument("--no-stream", action="store_true", help="skip the STREAM bandwidth measurement")
    p.add_argument("--json", default=None, help="write all records and facts here")
    p.add_argument("--md", default=None, help="also write the markdown report here")
    p.add_argument("--seed", type=int, default=0, help="synthetic graph seed")
    p.add_argument(
        "--render",
        nargs="+",
        metavar="JSON",
        default=None,
        help="run nothing: rebuild the report from saved --json files (several are merged, e.g. one per graph)",
    )
    a = p.parse_args(argv)
    if a.python is None:
        venv = ROOT / ".venv" / "bin" / "python"
        a.python = str(venv) if venv.exists() else sys.executable
    return a


def tessera_trees(specs: list[str]) -> dict[str, Path]:
    """``["before=/tmp/t"]`` -> ``{"tessera@before": Path("/tmp/t")}``, checked."""
    out: dict[str, Path] = {}
    for s in specs:
        lab, sep, path = s.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", lab) or not path:
            raise SystemExit(f"--tessera-tree {s!r}: expected LABEL=PATH, LABEL of letters, digits, . _ -")
        tree = Path(path).expanduser().resolve()
        for need in ("tessera/__init__.py", "benchmarks/_child.py"):
            if not (tree / need).is_file():
                raise SystemExit(f"--tessera-tree {s!r}: {tree / need} does not exist")
        if tree == ROOT.resolve():
            raise SystemExit(f"--tessera-tree {s!r}: that is this tree (framework tessera)")
        fw = TREE_PREFIX + lab
        if fw in out:
            raise SystemExit(f"--tessera-tree: label {lab!r} given twice")
        out[fw] = tree
    return out


def graph_spec(name: str) -> str:
    """``arxiv`` -> ``synthetic:arxiv``; anything with a ``:`` or a path is passed through."""
    return name if (":" in name or "/" in name or name.startswith("ogbn-")) else f"synthetic:{name}"


def _on_sigterm(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def measure_stream(python: str, threads: int, cpu: CpuWeight | None = None) -> dict[str, Any] | None:
    """STREAM GB/s via ``stream.py`` in a child (keeps 600 MB out of this process), in a raised-
    priority cgroup when ``cpu`` is given, like the benchmark children."""
    cmd = [python, str(ROOT / "benchmarks" / "stream.py"), "--threads", str(threads), "--json"]
    cg = cpu.create("stream") if cpu else None
    if cg is not None:
        cmd = ["sh", "-c", JOIN_CGROUPS, "sh", str(cg), "--", *cmd]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **thread_env(threads)})
        return json.loads(r.stdout.strip().splitlines()[-1]) if r.returncode == 0 else {"error": r.stderr[-300:]}
    except (OSError, subprocess.TimeoutExpired, json.JSONDecodeError, IndexError) as e:
        return {"error": str(e)}
    finally:
        if cg is not None:
            CgroupCap.remove(cg)


def dump_graph(python: str, spec: str, out_dir: Path, seed: int) -> dict[str, Any]:
    """Generate/load ``spec`` with tessera in a child process and write its ``.npy`` arrays."""
    r = subprocess.run(
        [python, str(ROOT / "benchmarks" / "_graphdata.py"), spec, str(out_dir), str(seed)],
        capture_output=True,
        text=True,
        env={**os.environ, **thread_env(os.cpu_count() or 1)},
        cwd=ROOT,
    )
    if r.returncode != 0:
        raise SystemExit(f"could not build graph {spec}: {r.stderr.strip()[-1000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark matrix and print (and optionally save) the report."""
    a = parse_args(argv)
    if a.render:
        return render_saved(a.render, a.md, a.json)
    # SIGTERM unwinds like Ctrl-C, so the running child, its cgroups and the temp files are removed
    signal.signal(signal.SIGTERM, _on_sigterm)
    started = time.perf_counter()
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    command = "python benchmarks/bench_train.py " + " ".join(shlex.quote(x) for x in (argv or sys.argv[1:]))
    notes: list[str] = []

    # ---------------------------------------------------------------- environment
    jemalloc = find_jemalloc()
    if "jemalloc" in a.allocators and jemalloc is None:
        notes.append("jemalloc: libjemalloc.so.2 not found (apt-get install libjemalloc2); jemalloc column is n/a.")
    main_env = probe_python(a.python)
    frameworks = list(a.frameworks)
    trees = tessera_trees(a.tessera_tree)
    tree_facts: dict[str, Any] = {}
    for fw, tree in trees.items():
        probe = probe_tessera_tree(a.python, tree)
        want = tree / "tessera" / "__init__.py"
        if "error" in probe or Path(probe.get("tessera_file", "")).resolve() != want:
            raise SystemExit(
                f"{fw}: with PYTHONPATH={tree} {a.python} imports "
                f"{probe.get('tessera_file') or 'nothing'} ({probe.get('error', f'expected {want}')})"
            )
        tree_facts[fw] = probe
    # each tree's column right after this tree's, in the order given
    at = frameworks.index("tessera") + 1 if "tessera" in frameworks else len(frameworks)
    frameworks[at:at] = list(trees)
    dgl_env: dict[str, Any] = {}
    if "dgl" in frameworks:
        if not Path(a.dgl_python).exists():
            notes.append(
                f"DGL skipped: no interpreter at {a.dgl_python} (build it with /work/shared/tools/setup_dgl_venv.sh)."
            )
            frameworks.remove("dgl")
        else:
            dgl_env = probe_python(a.dgl_python)
            if dgl_env.get("dgl") is None:
                notes.append(f"DGL skipped: `import dgl` fails in {a.dgl_python}: {dgl_env.get('error', '?')}")
                frameworks.remove("dgl")
    if any(f.startswith("pyg") for f in frameworks):
        missing = [m for m in ("torch_sparse", "pyg_lib") if main_env.get(m) is None]
        if missing:
            notes.append(
                f"PyG: {', '.join(missing)} not installed (no wheels for torch {main_env.get('torch')}); the CSR "
                "column uses a torch.sparse_csr adj_t (torch.sparse.mm), PyG's fastest path available here."
            )
        if "pyg-csr" in frameworks and "gat" in a.models:
            notes.append(
                "† PyG CSR for GAT: GATConv accepts the sparse adj_t but removes/re-adds self loops on it and "
                "computes messages through an internal edge index, so it is the edge-index path plus conversions."
            )
    cgroup = CgroupCap.detect()
    cpu = CpuWeight.detect(a.cpu_shares) if a.cpu_shares > 0 else None
    if a.cpu_shares > 0 and cpu is None:
        notes.append("--cpu-shares ignored: no writable cpu cgroup controller.")
    cap_desc = (
        f"cgroup v{cgroup.version} memory limit ({cgroup.base})"
        if cgroup
        else "RSS polled every 0.2 s, child killed above the cap"
    )
    facts = {
        **cpu_facts(),
        "date": date,
        "command": command,
        "threads": a.threads,
        "python_main": a.python,
        "python_dgl": a.dgl_python if "dgl" in frameworks else None,
        "versions_main": main_env,
        "versions_dgl": dgl_env,
        "jemalloc": jemalloc,
        "jemalloc_conf": "dirty_decay_ms:-1,muzzy_decay_ms:-1",
        "mem_cap": f"{a.mem_cap_gb:g} GiB per child, {cap_desc}",
        "cpu_priority": cpu.describe() if cpu else "none (children compete with other processes as equals)",
        "timeout_s": a.timeout,
        "git": git_state(),
        "config": {k: getattr(a, k) for k in ("hidden", "layers", "heads", "dropout", "epochs", "warmup", "repeats")},
        "frameworks_run": frameworks,
    }
    if trees:
        facts["tessera_trees"] = tree_facts
    if not a.no_stream:
        _log("measuring STREAM bandwidth ...")
        facts["stream"] = measure_stream(a.python, a.threads, cpu)

    # ---------------------------------------------------------------- runs
    data_root = Path(a.data_dir) if a.data_dir else Path(tempfile.mkdtemp(prefix="tessera_bench_"))
    log_dir = data_root / "logs"
    runs: list[dict[str, Any]] = []
    graphs_meta: dict[str, Any] = {}
    total = len(a.graphs) * len(a.models) * a.repeats * len(frameworks) * len(a.allocators)
    done = 0
    try:
        for gname in a.graphs:
            spec = graph_spec(gname)
            gdir = data_root / gname.replace("/", "_").replace(":", "_")
            _log(f"building graph {spec} ...")
            meta = dump_graph(a.python, spec, gdir, a.seed)
            graphs_meta[gname] = meta
            _log(f"  {meta['num_nodes']} nodes, {meta['num_edges']} edges, {meta['num_features']} features")
            for model in a.models:
                for rep in range(a.repeats):
                    for fw in frameworks:
                        for alloc in a.allocators:
                            done += 1
                            rec = _one(
                                a,
                                fw,
                                alloc,
                                model,
                                gname,
                                spec,
                                gdir,
                                rep,
                                jemalloc,
                                (cgroup, cpu),
                                log_dir,
                                started,
                                trees.get(fw),
                            )
                            runs.append(rec)
                            _log(f"[{done}/{total}] {_summary(rec)}")
            if not a.keep_data:
                shutil.rmtree(gdir, ignore_errors=True)
    finally:
        if not a.keep_data and not a.data_dir and sys.exc_info()[0] is not None:
            shutil.rmtree(data_root, ignore_errors=True)  # interrupted
        elif not a.keep_data and not a.data_dir:
            # keep the logs of failed children for inspection
            failed = [r for r in runs if r.get("status") not in ("ok", "na", "skipped")]
            if not failed:
                shutil.rmtree(data_root, ignore_errors=True)
            else:
                notes.append(f"logs of failed children kept in {log_dir}")

    # ---------------------------------------------------------------- report
    facts["total_s"] = round(time.perf_counter() - started, 1)
    md = render(a, facts, frameworks, graphs_meta, runs, notes)
    print(md)
    if a.md:
        Path(a.md).parent.mkdir(parents=True, exist_ok=True)
        Path(a.md).write_text(md + "\n")
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        payload = {"facts": facts, "graphs": graphs_meta, "notes": notes, "runs": runs}
        Path(a.json).write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return 0


def _one(
    a: argparse.Namespace,
    fw: str,
    alloc: str,
    model: str,
    gname: str,
    spec: str,
    gdir: Path,
    rep: int,
    jemalloc: str | None,
    cgroups: tuple[CgroupCap | None, CpuWeight | None],
    log_dir: Path,
    started: float,
    tree: Path | None = None,
) -> dict[str, Any]:
    """Run one cell (retrying while the machine is too busy) and return the kept record; ``tree``:
    the source tree of a ``tessera@LABEL`` framework, whose own child script runs it."""
    base = {"framework": fw, "allocator": alloc, "model": model, "graph_key": gname, "repeat": rep}
    env = allocator_env(alloc, jemalloc)
    if env is None:
        return {**base, "status": "na", "error": "jemalloc not installed"}
    if a.max_total_s is not None and time.perf_counter() - started > a.max_total_s:
        return {**base, "status": "skipped", "error": f"time budget of {a.max_total_s:g} s spent"}
    child_spec = {
        "framework": "tessera" if tree is not None else fw,
        "model": model,
        "allocator": alloc,
        "data_dir": str(gdir),
        "graph_spec": spec,
        "threads": a.threads,
        "hidden": a.hidden,
        "layers": a.layers,
        "heads": a.heads,
        "dropout": a.dropout,
        "epochs": a.epochs,
        "warmup": a.warmup,
        "lr": 0.01,
        "weight_decay": 5e-4,
        "backend": a.tessera_backend,
        "reorder": a.tessera_reorder,
    }
    if fw == "tessera" and tree is None and a.tessera_precision != "fp32":
        child_spec["precision"] = a.tessera_precision
    child_env = {**thread_env(a.threads), **env}
    if tree is not None:
        child_env["PYTHONPATH"] = tree_pythonpath(tree)
    launch = Launch(
        python=a.dgl_python if fw == "dgl" else a.python,
        spec=child_spec,
        env=child_env,
        tag=f"{gname}_{model}_{fw}_{alloc}_{rep}".replace("/", "_").replace(":", "_"),
        log_dir=log_dir,
        timeout_s=a.timeout,
        mem_cap_gib=a.mem_cap_gb,
        script=None if tree is None else tree / "benchmarks" / "_child.py",
        cwd=tree,
    )
    attempts: list[dict[str, Any]] = []
    need = (a.epochs + 1) // 2  # a run is clean when at least half its timed epochs were quiet
    for attempt in range(1 + max(0, a.retry_noisy)):
        waited, load0 = wait_for_quiet(a.quiet_wait) if a.quiet_wait > 0 else (0.0, float("nan"))
        rec = run_child(launch, *cgroups)
        rec.update(base, quiet_wait_s=round(waited, 1), load_before=round(load0, 2))
        attempts.append(rec)
        if rec.get("status") != "ok" or rec.get("quiet_epochs", 0) >= need or attempt == a.retry_noisy:
            break
        if a.max_total_s is not None and time.perf_counter() - started > a.max_total_s:
            break
        _log(f"    noisy ({rec['quiet_epochs']}/{a.epochs} quiet epochs): {_summary(rec)}; retrying")
    ok = [r for r in attempts if r.get("status") == "ok"]
    best = min(ok, key=lambda r: (-r["quiet_epochs"], r["interference_mean"])) if ok else attempts[-1]
    best["attempts"] = [
        {
            "median_ms": r.get("median_ms"),
            "quiet_epochs": r.get("quiet_epochs"),
            "interference_mean": r.get("interference_mean"),
            "status": r.get("status"),
        }
        for r in attempts
    ]
    return best


def _summary(r: dict[str, Any]) -> str:
    head = f"{r['graph_key']} {r['model']} {r['framework']} {r['allocator']}:"
    if r.get("status") == "ok":
        return (
            f"{head} {r['median_ms']:.1f} ms (quiet {_q(r)}, min {r['min_ms']:.1f}), peak {r['peak_rss_mib']:.0f} MiB, "
            f"loss {r['loss_first']:.3f}->{r['loss_last']:.3f}, {r.get('wall_s', 0):.0f} s, "
            f"interference {r.get('interference_mean', 0):.2f} cores (others used {r.get('other_load_mean', 0):.2f})"
        )
    return f"{head} {r.get('status')} {r.get('error', '')} ({r.get('wall_s', 0)} s)"


def _q(r: dict[str, Any]) -> str:
    q = r.get("quiet_median_ms")
    return f"{q:.1f} ms over {r['quiet_epochs']} epochs" if q is not None else "none"


def render_saved(paths: list[str], md_path: str | None, json_path: str | None) -> int:
    """Re-render (and merge) reports from saved JSON files; settings come from the first
    file's command line, graphs / runs / notes from all of them."""
    saved = [json.loads(Path(p).read_text()) for p in paths]
    first = saved[0]
    cmd = shlex.split(first["facts"]["command"])
    a = parse_args(cmd[cmd.index("benchmarks/bench_train.py") + 1 :] if "benchmarks/bench_train.py" in cmd else [])
    facts = dict(first["facts"])
    graphs: dict[str, Any] = {}
    runs: list[dict[str, Any]] = []
    notes: list[str] = []
    models: list[str] = []
    for d in saved:
        graphs.update(d["graphs"])
        runs += d["runs"]
        notes += [n for n in d["notes"] if n not in notes]
        dcmd = shlex.split(d["facts"]["command"])
        dargs = parse_args(dcmd[dcmd.index("benchmarks/bench_train.py") + 1 :])
        models += [m for m in dargs.models if m not in models]
    if len(saved) > 1:
        facts["command"] = "` ; `".join(d["facts"]["command"] for d in saved)
        facts["date"] = " / ".join(dict.fromkeys(d["facts"]["date"] for d in saved))
        facts["total_s"] = sum(d["facts"].get("total_s", 0) for d in saved)
        facts["git"] = {
            "commit": " / ".join(dict.fromkeys(d["facts"]["git"].get("commit", "?") for d in saved)),
            "tessera_dirty": any(d["facts"]["git"].get("tessera_dirty") for d in saved),
        }
        streams = [d["facts"]["stream"] for d in saved if "gb_s" in (d["facts"].get("stream") or {})]
        if streams:  # each run measured STREAM once; keep the least disturbed (fastest) one
            facts["stream"] = max(streams, key=lambda st: st["gb_s"]["triad"])
    a.models = models
    present = {r["framework"] for r in runs}
    frameworks = [f for f in FRAMEWORKS if f in present]
    tree_fws = [f for f in dict.fromkeys(r["framework"] for r in runs) if f.startswith(TREE_PREFIX)]
    at = frameworks.index("tessera") + 1 if "tessera" in frameworks else len(frameworks)
    frameworks[at:at] = tree_fws
    for d in saved[1:]:
        for fw, tf in d["facts"].get("tessera_trees", {}).items():
            facts.setdefault("tessera_trees", {}).setdefault(fw, tf)
    md = render(a, facts, frameworks, graphs, runs, notes)
    print(md)
    if md_path:
        Path(md_path).write_text(md + "\n")
    if json_path:
        payload = {"facts": facts, "graphs": graphs, "notes": notes, "runs": runs, "merged_from": paths}
        Path(json_path).write_text(json.dumps(payload, indent=1, default=str) + "\n")
    return 0


def render(
    a: argparse.Namespace,
    facts: dict[str, Any],
    frameworks: list[str],
    graphs_meta: dict[str, Any],
    runs: list[dict[str, Any]],
    notes: list[str],
) -> str:
    """The markdown report: machine facts, one table per graph, the detail table, notes."""
    vm, vd = facts["versions_main"], facts["versions_dgl"]
    lines = [
        f"# Training-epoch benchmark ({facts['date']})",
        "",
        f"- command: `{facts['command']}`",
        f"- machine: {facts['cpu']}, {facts['cores_usable']} usable cores ({facts['cores_online']} online), "
        f"{facts['simd']}, {facts['mem_gib']} GiB RAM, Linux {facts['kernel']}",
        f"- threads: {facts['threads']} (torch.set_num_threads, OMP/MKL/NUMBA_NUM_THREADS"
        + (", tessera ops.set_num_threads" if "tessera" in frameworks else "")
        + ")",
        f"- tessera/PyG env: torch {vm.get('torch')}, torch_geometric {vm.get('torch_geometric')}, "
        f"numba {vm.get('numba')}, numpy {vm.get('numpy')}, torch_sparse {vm.get('torch_sparse') or 'absent'}, "
        f"pyg_lib {vm.get('pyg_lib') or 'absent'}; tessera backends {vm.get('tessera_backends')}, "
        f"requested `{a.tessera_backend}`, vertex order `{a.tessera_reorder}`, "
        f"precision `{a.tessera_precision}`; git {facts['git'].get('commit')}"
        + (" (tessera/ has uncommitted changes)" if facts["git"].get("tessera_dirty") else ""),
    ]
    if "dgl" in frameworks:
        lines.append(f"- DGL env: dgl {vd.get('dgl')}, torch {vd.get('torch')}, numpy {vd.get('numpy')}")
    lines += [
        f"- allocators: default = glibc malloc; jemalloc = LD_PRELOAD {facts['jemalloc'] or 'n/a'} "
        f"with MALLOC_CONF={facts['jemalloc_conf']}",
        f"- model: {a.layers} layers, hidden {a.hidden} (GAT {a.heads} heads × {a.hidden // a.heads}), dropout "
        f"{a.dropout}, Adam lr 0.01 wd 5e-4; {a.warmup} warm-up + {a.epochs} timed epochs per child, "
        f"{a.repeats} child(ren) per cell; median epoch time reported",
        f"- CPU priority of children: {facts['cpu_priority']}",
        f"- memory cap: {facts['mem_cap']}; timeout {a.timeout:g} s per child; total wall {facts['total_s']:.0f} s",
        "- noise control: the machine is shared, so every timed epoch records its *interference*, in cores: the "
        "smaller of the CPU other processes used during it (/proc/stat busy time minus the child's own CPU time) and "
        "the time the child's threads waited runnable for a CPU (/proc/self/task/*/schedstat); an epoch is *quiet* "
        "below 0.2 cores. "
        "Table times are the median over quiet epochs (over all epochs when fewer than 3 were quiet; marked ⚠). "
        + (
            f"Before each child the harness waits ≤ {a.quiet_wait:g} s for a quiet machine, and "
            if a.quiet_wait > 0
            else "The harness "
        )
        + f"re-runs a child up to {a.retry_noisy}× when under half its epochs were quiet, keeping the attempt with "
        "the most quiet epochs.",
    ]
    for fw, tf in facts.get("tessera_trees", {}).items():
        lines.append(
            f"- {fw}: tree {tf['path']} (git {tf.get('commit')}"
            + (", tessera/ has uncommitted changes" if tf.get("tessera_dirty") else "")
            + f"), run by its own benchmarks/_child.py with PYTHONPATH={tf['path']}; `import tessera` there gives "
            f"{tf.get('tessera_file')} (source sha1 {tf.get('src_sha1')})"
        )
    st = facts.get("stream")
    if st and "gb_s" in st:
        g = st["gb_s"]
        lines.append(
            f"- STREAM ({st['dtype']}, 3 × {st['array_mb']:g} MB, {st['threads']} threads, best of 10): "
            + ", ".join(f"{k} {v:.1f}" for k, v in g.items())
            + " GB/s"
        )
    elif st:
        lines.append(f"- STREAM failed: {st.get('error')}")
    grouped = group(runs)
    for gname, meta in graphs_meta.items():
        lines += [
            "",
            f"## {gname} ({meta['spec']}): {meta['num_nodes']:,} nodes, {meta['num_edges']:,} edges, "
            f"{meta['num_features']} features, {meta['num_classes']} classes, {meta['num_train']:,} train",
            "",
        ]
        if "tessera" in frameworks and "default" in a.allocators and any(f in frameworks for f in FRAMEWORKS[1:]):
            ours = "tessera" + ("" if a.tessera_precision == "fp32" else f" {a.tessera_precision}")
            lines += headline_table(gname, a.models, frameworks, grouped, a.mem_cap_gb, a.timeout, ours) + [""]
        lines += graph_table(gname, a.models, frameworks, a.allocators, grouped, a.mem_cap_gb, a.timeout)
    if any(f.startswith(TREE_PREFIX) for f in frameworks):
        lines += ["", "## tessera trees: every repeat", ""]
        lines += tree_table(list(graphs_meta), a.models, frameworks, a.allocators, runs, facts)
    lines += ["", "## Every run", ""]
    lines += detail_table(grouped, a.mem_cap_gb, a.timeout)
    hashes = {
        r.get("versions", {}).get("tessera_src_sha1")
        for r in runs
        if r.get("framework") == "tessera" and r.get("status") == "ok"
    } - {None}
    if len(hashes) > 1:
        notes = [
            *notes,
            f"tessera/ changed while this ran (others were editing it): tessera children ran {len(hashes)} "
            f"different source versions ({', '.join(sorted(hashes))}; per run in the JSON, versions.tessera_src_sha1).",
        ]
    if notes:
        lines += ["", "## Notes", ""] + [f"- {n}" for n in notes]
    failed = [r for r in grouped.values() if r.get("status") not in ("ok", "na")]
    if failed:
        lines += ["", "## Failures", ""]
        for r in failed:
            lines.append(
                f"- {r['graph_key']} {r['model']} {label(r['framework'])} {r['allocator']}: "
                f"{r.get('status')} — {r.get('error', '')}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
