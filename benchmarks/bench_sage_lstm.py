"""Epoch time and peak RSS of a 2-layer SAGE-LSTM: tessera vs PyG ``SAGEConv(aggr="lstm")`` vs DGL
``SAGEConv(aggregator_type="lstm")`` (in its own venv), same graph, median of the timed epochs
(forward, cross-entropy on the training vertices, backward, Adam step) after one warm-up epoch.

Every system runs in its own child process (so each has its own peak RSS), one after the other,
in ``--rounds`` interleaved rounds (for a shared, loaded machine); the report is the median over
all rounds' epochs, each round's medians and each system's peak RSS. tessera runs at
``--threads``; each peer runs at every count of ``--peer-threads`` (default: ``--threads`` and 1),
and the ratio is against the fastest peer run: on a loaded 2-core machine DGL's two-thread epoch
can be tens of times its one-thread epoch (each of its thousands of small LSTM steps waits at an
OpenMP barrier for a descheduled thread), so its faster count is the fair comparison.
``--mem-limit-gb`` kills a child whose resident set grows past it (PyG pads every vertex to the
maximum in-degree and can exhaust the machine); a child that fails is reported, not fatal.
``--spec N,M,F,C[,max_degree]`` uses a custom synthetic graph (N vertices, M undirected edges, F
features, C classes) instead of ``--dataset``.

    python benchmarks/bench_sage_lstm.py --dataset synthetic:small --hidden 64 --rounds 3 \\
        --dgl-python /tmp/venv-dgl/bin/python
    python benchmarks/bench_sage_lstm.py --spec 50000,250000,64,8,1000 --rounds 3 --peers dgl
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def _epochs(step, epochs: int) -> list[float]:
    times = []
    for _ in range(epochs + 1):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return times[1:]


def _trainer(model, run, y, train):
    opt = torch.optim.Adam(model.parameters(), lr=0.01)

    def step():
        opt.zero_grad()
        torch.nn.functional.cross_entropy(run()[train], y[train]).backward()
        opt.step()

    return step


def _report(times: list[float]) -> None:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"times": times, "rss_mib": rss}), flush=True)


def dgl_side(path: Path, epochs: int, threads: int, hidden: int) -> None:
    """DGL's run on the npz graph (imports only numpy, torch and dgl)."""
    import dgl
    from dgl.nn import SAGEConv

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    d = dict(np.load(path))
    g = dgl.graph((torch.from_numpy(d["src"]), torch.from_numpy(d["dst"])), num_nodes=int(d["n"]))
    x, y, train = (torch.from_numpy(d[k]) for k in ("x", "y", "train"))
    convs = torch.nn.ModuleList([SAGEConv(x.shape[1], hidden, "lstm"), SAGEConv(hidden, int(d["classes"]), "lstm")])
    _report(_epochs(_trainer(convs, lambda: convs[1](g, torch.relu(convs[0](g, x))), y, train), epochs))


def _graph(args):
    """``--dataset``, or the ``--spec`` synthetic graph."""
    if not args.spec:
        from tessera.datasets import load

        return args.dataset, load(args.dataset)
    from tessera.graph.synthetic import SyntheticSpec, generate

    n, m, f, c, *rest = (int(v) for v in args.spec.split(","))
    spec = SyntheticSpec(n, m, f, c, max_degree=rest[0] if rest else 1000, per_class=(50, 100), name="spec")
    return f"synthetic spec {args.spec}", generate(spec)


def local_side(args, system: str, threads: int) -> None:
    """tessera's or PyG's run (this venv), on the graph of ``--dataset`` / ``--spec``."""
    from tessera.threads import set_num_threads

    set_num_threads(threads)
    torch.manual_seed(0)
    _, g = _graph(args)
    x, y, train, classes = g.x, g.y, g.train_mask, int(g.num_classes)
    if system == "tessera":
        from tessera.nn.models import build_model

        model = build_model("sage-lstm", x.shape[1], args.hidden, classes, dropout=0.0)
        _report(_epochs(_trainer(model, lambda: model(x, g), y, train), args.epochs))
        return
    from torch_geometric.nn import SAGEConv

    ei = g.edge_index()  # sorted by destination, as LSTMAggregation requires
    convs = torch.nn.ModuleList([SAGEConv(x.shape[1], args.hidden, aggr="lstm"), SAGEConv(args.hidden, classes, aggr="lstm")])  # fmt: skip
    _report(_epochs(_trainer(convs, lambda: convs[1](torch.relu(convs[0](x, ei)), ei), y, train), args.epochs))


def _child(args, system: str, threads: int, npz: Path | None) -> dict:
    """Run one system in a child process; its epoch times and peak RSS, or why it failed."""
    common = ["--epochs", str(args.epochs), "--hidden", str(args.hidden)]
    if system == "dgl":
        cmd = [args.dgl_python, __file__, "--dgl-side", str(npz), "--threads", str(threads), *common]
    else:
        src = ["--spec", args.spec] if args.spec else ["--dataset", args.dataset]
        cmd = [sys.executable, __file__, "--side", system, "--threads", str(threads), *src, *common]
    limit = int(args.mem_limit_gb * 2**30) if args.mem_limit_gb else None
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(cmd, stdout=out, stderr=err, text=True)
        peak = 0
        while proc.poll() is None:  # the RSS watchdog (an address-space cap fails DGL's CUDA build early)
            peak = max(peak, _rss(proc.pid))
            if limit and peak > limit:
                proc.kill()
            time.sleep(0.2)
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    lines = [ln for ln in stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        last = (stderr.strip().splitlines() or ["?"])[-1]
        if limit and peak > limit:
            return {"error": f"out of memory (killed at {peak / 2**30:.1f} GB resident, limit {args.mem_limit_gb} GB)"}
        asked = re.search(r"allocate (\d+) bytes", last)
        if asked:
            return {"error": f"out of memory (asked for one {int(asked.group(1)) / 1e9:.1f} GB tensor)"}
        return {"error": f"failed (rc {proc.returncode}): {last[:160]}"}
    return json.loads(lines[-1])


def _rss(pid: int) -> int:
    """Resident bytes of process ``pid`` (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * resource.getpagesize()
    except (OSError, IndexError, ValueError):
        return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="synthetic:small")
    ap.add_argument("--spec", help="N,M,F,C[,max_degree]: a custom synthetic graph instead of --dataset")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peer-threads", help="comma list of thread counts for the peers (default: --threads,1)")
    ap.add_argument("--peers", default="dgl,pyg", help="comma list of dgl, pyg (empty: tessera only)")
    ap.add_argument("--dgl-python", default="/work/dgl-venv/bin/python")
    ap.add_argument("--mem-limit-gb", type=float, default=0.0, help="kill a child past this resident size (0: none)")
    ap.add_argument("--dgl-side", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--side", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dgl_side:
        dgl_side(args.dgl_side, args.epochs, args.threads, args.hidden)
        return 0
    if args.side:
        local_side(args, args.side, args.threads)
        return 0

    name, g = _graph(args)
    deg = g.in_degree()
    print(f"{name}: {g.num_nodes} vertices, {g.num_edges} edges, in-degree max {int(deg.max())}, "
          f"{g.x.shape[1]} features, hidden {args.hidden}, tessera at {args.threads} threads", flush=True)  # fmt: skip
    peers = [p for p in args.peers.split(",") if p]
    counts = [int(t) for t in args.peer_threads.split(",")] if args.peer_threads else sorted({args.threads, 1}, reverse=True)  # fmt: skip
    runs = [("tessera", args.threads)] + [(p, t) for p in peers for t in counts]
    results: dict[tuple[str, int], dict] = {k: {"times": [], "rounds": [], "rss_mib": 0.0} for k in runs}
    with tempfile.TemporaryDirectory() as tmp:
        npz = None
        if "dgl" in peers:
            npz = Path(tmp) / "graph.npz"
            np.savez(npz, src=g.src_index().numpy(), dst=g.dst_index().numpy(), n=g.num_nodes, x=g.x.numpy(),
                     y=g.y.numpy(), train=g.train_mask.numpy(), classes=int(g.num_classes))  # fmt: skip
        del g
        for r in range(args.rounds):
            for k in runs:
                res = results[k]
                if "error" in res:
                    continue
                got = _child(args, *k, npz)
                if "error" in got:
                    res["error"] = got["error"]
                    print(f"round {r}: {k[0]:8s} {k[1]} threads: {got['error']}", flush=True)
                    continue
                res["times"] += got["times"]
                res["rounds"].append(statistics.median(got["times"]))
                res["rss_mib"] = max(res["rss_mib"], got["rss_mib"])
                print(f"round {r}: {k[0]:8s} {k[1]} threads: median epoch {res['rounds'][-1]:.3f} s  (epochs: "
                      f"{', '.join(f'{t:.3f}' for t in got['times'])}), peak RSS {got['rss_mib']:.0f} MiB", flush=True)  # fmt: skip
    _table(results)
    return 0


def _table(results: dict) -> None:
    """The summary: a markdown table, each row's ratio to tessera, and tessera / fastest peer."""
    base = results[next(iter(results))]
    t_med = statistics.median(base["times"]) if base["times"] else None
    print("\n| system | threads | median epoch s | round medians s | peak RSS MiB | tessera / system |")
    print("|---|---:|---:|---|---:|---:|")
    best = None
    for (system, threads), res in results.items():
        if not res["times"]:
            print(f"| {system} | {threads} | {res.get('error', 'no run')} | | | |")
            continue
        med = statistics.median(res["times"])
        ratio = f"{t_med / med:.3f}" if t_med else ""
        rounds = ", ".join(f"{m:.3f}" for m in res["rounds"])
        print(f"| {system} | {threads} | {med:.3f} | {rounds} | {res['rss_mib']:.0f} | {ratio} |")
        if system != "tessera" and (best is None or med < best[0]):
            best = (med, system, threads)
    if best and t_med:
        print(f"\ntessera / fastest peer ({best[1]} at {best[2]} threads) = {t_med / best[0]:.3f}")
        peers = [res["rounds"] for (system, _), res in results.items() if system != "tessera" and res["rounds"]]
        per_round = [t / min(p[r] for p in peers if r < len(p)) for r, t in enumerate(base["rounds"])]
        print(f"per round, tessera / fastest peer of the round: {', '.join(f'{v:.3f}' for v in per_round)}")


if __name__ == "__main__":
    sys.exit(main())
