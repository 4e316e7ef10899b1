"""Small-graph epoch times: tessera vs PyG (edge_index path) on Cora / CiteSeer, same models,
same machine, one process. Reports the median training-step time (forward, backward, Adam step)
over repeated epochs after warm-up, and the ratio tessera / PyG.

    python benchmarks/bench_small.py --datasets cora citeseer --epochs 100 --repeats 3
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch
import torch.nn.functional as F
import torch_geometric.nn as pyg

from tessera.datasets import load
from tessera.graph.formats import to_pyg
from tessera.nn import build_model
from tessera.threads import set_num_threads
from tessera.train.setup import prepare_features


class PygNet(torch.nn.Module):
    """The same architecture as tessera's build_model, written with PyG layers."""

    def __init__(self, name: str, i: int, h: int, o: int, dropout: float, heads: int = 8):
        super().__init__()
        if name == "gcn":
            self.convs = torch.nn.ModuleList([pyg.GCNConv(i, h), pyg.GCNConv(h, o)])
        elif name == "sage":
            self.convs = torch.nn.ModuleList([pyg.SAGEConv(i, h), pyg.SAGEConv(h, o)])
        elif name == "gin":

            def mlp(a, b):
                return torch.nn.Sequential(torch.nn.Linear(a, h), torch.nn.ReLU(), torch.nn.Linear(h, b))

            self.convs = torch.nn.ModuleList([pyg.GINConv(mlp(i, h)), pyg.GINConv(mlp(h, o))])
        else:
            self.convs = torch.nn.ModuleList(
                [
                    pyg.GATConv(i, h // heads, heads=heads, dropout=dropout),
                    pyg.GATConv(h, o, heads=1, concat=False, dropout=dropout),
                ]
            )
        self.dropout, self.act = dropout, (F.elu if name == "gat" else F.relu)

    def forward(self, x, ei):
        for k, conv in enumerate(self.convs):
            x = F.dropout(x, self.dropout, self.training)
            x = conv(x, ei)
            if k < len(self.convs) - 1:
                x = self.act(x)
        return x


def step_times(model, forward, y, train_idx, epochs: int, warmup: int = 5) -> list[float]:
    """Wall time of each training step (forward, loss, backward, Adam step) after warm-up."""
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    model.train()
    times = []
    for e in range(warmup + epochs):
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(forward()[train_idx], y[train_idx])
        loss.backward()
        opt.step()
        if e >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--datasets", nargs="+", default=["cora", "citeseer"])
    ap.add_argument("--models", nargs="+", default=["gcn", "sage", "gin", "gat"])
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    set_num_threads(args.threads)
    print(f"# torch {torch.__version__}, {platform.processor() or platform.machine()}, {args.threads} threads")
    print("| dataset | model | PyG median ms | tessera median ms | tessera / PyG |")
    print("|---|---|---:|---:|---:|")
    for ds in args.datasets:
        g = load(ds)
        x = prepare_features(g.x, "auto")
        data = to_pyg(g)
        train_idx = g.train_mask.nonzero().view(-1)
        for name in args.models:
            hidden = 64 if name == "gat" else args.hidden
            torch.manual_seed(0)
            ours = build_model(name, g.num_features, hidden, g.num_classes, 2, 0.5)
            theirs = PygNet(name, g.num_features, hidden, g.num_classes, 0.5)
            t_ours, t_pyg = [], []
            for _ in range(args.repeats):  # interleave so machine noise hits both alike
                t_pyg += step_times(
                    theirs, lambda m=theirs, x=x, ei=data.edge_index: m(x, ei), g.y, train_idx, args.epochs
                )
                t_ours += step_times(ours, lambda m=ours, x=x, g=g: m(x, g), g.y, train_idx, args.epochs)
            mp, mo = statistics.median(t_pyg) * 1e3, statistics.median(t_ours) * 1e3
            print(f"| {ds} | {name} | {mp:.2f} | {mo:.2f} | {mo / mp:.2f} |", flush=True)


if __name__ == "__main__":
    main()
