"""Epoch time of a 2-layer SAGE-LSTM: tessera vs PyG ``SAGEConv(aggr="lstm")`` vs DGL
``SAGEConv(aggregator_type="lstm")`` (in its own venv, run as a subprocess), same graph, same
thread count, median of the timed epochs (forward, cross-entropy on the training vertices,
backward, Adam step) after one warm-up epoch. ``--rounds R`` interleaves R rounds of every
system (for a shared, loaded machine) and reports the median over all rounds' epochs and each
round's ratio. ``--spec N,M,F,C[,max_degree]`` uses a custom synthetic graph (N vertices, M
undirected edges, F features, C classes) instead of ``--dataset``.

    python benchmarks/bench_sage_lstm.py --dataset synthetic:small --hidden 64 --threads 2
    python benchmarks/bench_sage_lstm.py --spec 50000,250000,64,8,1000 --rounds 3 --peers dgl
"""

from __future__ import annotations

import argparse
import json
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


def dgl_side(path: Path, epochs: int, threads: int, hidden: int) -> None:
    """DGL's run on the npz graph (imports only numpy, torch and dgl)."""
    import dgl
    from dgl.nn import SAGEConv

    torch.set_num_threads(threads)
    d = dict(np.load(path))
    g = dgl.graph((torch.from_numpy(d["src"]), torch.from_numpy(d["dst"])), num_nodes=int(d["n"]))
    x, y, train = (torch.from_numpy(d[k]) for k in ("x", "y", "train"))
    convs = torch.nn.ModuleList([SAGEConv(x.shape[1], hidden, "lstm"), SAGEConv(hidden, int(d["classes"]), "lstm")])
    times = _epochs(_trainer(convs, lambda: convs[1](g, torch.relu(convs[0](g, x))), y, train), epochs)
    print(json.dumps(times))


def _graph(args):
    """``--dataset``, or the ``--spec`` synthetic graph."""
    if not args.spec:
        from tessera.datasets import load

        return args.dataset, load(args.dataset)
    from tessera.graph.synthetic import SyntheticSpec, generate

    n, m, f, c, *rest = (int(v) for v in args.spec.split(","))
    spec = SyntheticSpec(n, m, f, c, max_degree=rest[0] if rest else 1000, per_class=(50, 100), name="spec")
    return f"synthetic spec {args.spec}", generate(spec)


def _dgl_run(args, path: Path) -> list[float]:
    cmd = [args.dgl_python, __file__, "--dgl-side", str(path), "--epochs", str(args.epochs),
           "--threads", str(args.threads), "--hidden", str(args.hidden)]  # fmt: skip
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="synthetic:small")
    ap.add_argument("--spec", help="N,M,F,C[,max_degree]: a custom synthetic graph instead of --dataset")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers", default="dgl,pyg", help="comma list of dgl, pyg (empty: tessera only)")
    ap.add_argument("--dgl-python", default="/work/dgl-venv/bin/python")
    ap.add_argument("--dgl-side", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dgl_side:
        dgl_side(args.dgl_side, args.epochs, args.threads, args.hidden)
        return 0

    from tessera.nn.models import build_model
    from tessera.threads import set_num_threads

    set_num_threads(args.threads)
    torch.manual_seed(0)
    name, g = _graph(args)
    x, y, train, classes = g.x, g.y, g.train_mask, int(g.num_classes)
    deg = g.in_degree()
    print(f"{name}: {g.num_nodes} vertices, {g.num_edges} edges, in-degree max {int(deg.max())}, "
          f"{x.shape[1]} features, hidden {args.hidden}, {args.threads} threads", flush=True)  # fmt: skip
    model = build_model("sage-lstm", x.shape[1], args.hidden, classes, dropout=0.0)
    runs = {"tessera": lambda: _epochs(_trainer(model, lambda: model(x, g), y, train), args.epochs)}
    peers = [p for p in args.peers.split(",") if p]
    if "pyg" in peers:
        from torch_geometric.nn import SAGEConv

        ei = g.edge_index()  # sorted by destination, as LSTMAggregation requires
        convs = torch.nn.ModuleList([SAGEConv(x.shape[1], args.hidden, aggr="lstm"), SAGEConv(args.hidden, classes, aggr="lstm")])  # fmt: skip
        runs["pyg"] = lambda: _epochs(_trainer(convs, lambda: convs[1](torch.relu(convs[0](x, ei)), ei), y, train), args.epochs)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        if "dgl" in peers:
            path = Path(tmp) / "graph.npz"
            np.savez(path, src=g.src_index().numpy(), dst=g.dst_index().numpy(), n=g.num_nodes, x=x.numpy(),
                     y=y.numpy(), train=train.numpy(), classes=classes)  # fmt: skip
            runs["dgl"] = lambda: _dgl_run(args, path)
        results: dict[str, list[float]] = {k: [] for k in runs}
        for r in range(args.rounds):
            med = {}
            for k, run in runs.items():
                times = run()
                results[k] += times
                med[k] = statistics.median(times)
                print(f"round {r}: {k:8s} median epoch {med[k]:.3f} s  (epochs: {', '.join(f'{t:.3f}' for t in times)})", flush=True)  # fmt: skip
            _ratio(med, f"round {r}: ")
    med = {k: statistics.median(v) for k, v in results.items()}
    for k in results:
        print(f"all rounds: {k:8s} median epoch {med[k]:.3f} s over {len(results[k])} epochs")
    _ratio(med, "all rounds: ")
    return 0


def _ratio(med: dict[str, float], prefix: str) -> None:
    peer = min((med[k] for k in med if k != "tessera"), default=None)
    if peer:
        print(f"{prefix}tessera / fastest peer = {med['tessera'] / peer:.3f}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
