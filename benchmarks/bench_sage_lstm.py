"""Epoch time of a 2-layer SAGE-LSTM: tessera vs PyG ``SAGEConv(aggr="lstm")`` vs DGL
``SAGEConv(aggregator_type="lstm")`` (in its own venv, run as a subprocess), same graph, same
thread count, median of the timed epochs (forward, cross-entropy on the training vertices,
backward, Adam step) after one warm-up epoch.

    python benchmarks/bench_sage_lstm.py --dataset synthetic:small --hidden 64 --threads 2
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="synthetic:small")
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--peers", default="dgl,pyg", help="comma list of dgl, pyg (empty: tessera only)")
    ap.add_argument("--dgl-python", default="/work/dgl-venv/bin/python")
    ap.add_argument("--dgl-side", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.dgl_side:
        dgl_side(args.dgl_side, args.epochs, args.threads, args.hidden)
        return 0

    from tessera.datasets import load
    from tessera.nn.models import build_model
    from tessera.threads import set_num_threads

    set_num_threads(args.threads)
    torch.manual_seed(0)
    g = load(args.dataset)
    x, y, train, classes = g.x, g.y, g.train_mask, int(g.num_classes)
    deg = g.in_degree()
    print(f"{args.dataset}: {g.num_nodes} vertices, {g.num_edges} edges, in-degree max {int(deg.max())}, "
          f"{x.shape[1]} features, hidden {args.hidden}, {args.threads} threads")  # fmt: skip
    results = {}
    model = build_model("sage-lstm", x.shape[1], args.hidden, classes, dropout=0.0)
    results["tessera"] = _epochs(_trainer(model, lambda: model(x, g), y, train), args.epochs)
    peers = [p for p in args.peers.split(",") if p]
    if "pyg" in peers:
        from torch_geometric.nn import SAGEConv

        ei = g.edge_index()  # sorted by destination, as LSTMAggregation requires
        convs = torch.nn.ModuleList([SAGEConv(x.shape[1], args.hidden, aggr="lstm"), SAGEConv(args.hidden, classes, aggr="lstm")])  # fmt: skip
        results["pyg"] = _epochs(_trainer(convs, lambda: convs[1](torch.relu(convs[0](x, ei)), ei), y, train), args.epochs)  # fmt: skip
    if "dgl" in peers:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "graph.npz"
            np.savez(path, src=g.src_index().numpy(), dst=g.dst_index().numpy(), n=g.num_nodes, x=x.numpy(),
                     y=y.numpy(), train=train.numpy(), classes=classes)  # fmt: skip
            cmd = [args.dgl_python, __file__, "--dgl-side", str(path), "--epochs", str(args.epochs),
                   "--threads", str(args.threads), "--hidden", str(args.hidden)]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            results["dgl"] = json.loads(out.strip().splitlines()[-1])
    med = {k: statistics.median(v) for k, v in results.items()}
    for k, v in results.items():
        print(f"{k:8s} median epoch {med[k]:.3f} s  (epochs: {', '.join(f'{t:.3f}' for t in v)})")
    peer = min((med[k] for k in med if k != "tessera"), default=None)
    if peer:
        print(f"tessera / fastest peer = {med['tessera'] / peer:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
