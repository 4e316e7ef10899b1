"""RGCN training-epoch benchmark: tessera vs PyG ``RGCNConv`` and ``FastRGCNConv``, and RGCN vs GCN
test accuracy on the typed synthetic presets.

Epochs: every (graph, framework) runs in its own child process on the same seeded typed graph
(``synthetic:<preset>-rel<R>``, generated in the child), a 2-layer model (ReLU, dropout 0.5,
hidden ``--hidden``, per-relation mean, root weight, bias; Adam lr 0.01), timing ``--warmup +
--epochs`` full-graph training steps and reporting the median. ``FastRGCNConv`` materialises one
``in x out`` matrix per edge; it is reported as skipped when that would not fit in ``--mem-gib``.

    python benchmarks/bench_rgcn.py epochs --graphs arxiv-rel8 arxiv-rel32 --threads 2
    python benchmarks/bench_rgcn.py accuracy --graph arxiv-rel --seeds 0 1 2 3 4 --epochs 100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FRAMEWORKS = ("tessera", "pyg", "pyg-fast")


def _model(framework: str, in_dim: int, hidden: int, out_dim: int, relations: int):
    import torch
    import torch.nn.functional as F
    from torch import nn

    if framework == "tessera":
        from tessera.nn import build_model

        return build_model("rgcn", in_dim, hidden, out_dim, 2, 0.5, num_relations=relations)
    import torch_geometric.nn as pyg

    conv = pyg.RGCNConv if framework == "pyg" else pyg.FastRGCNConv

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.convs = nn.ModuleList([conv(in_dim, hidden, relations), conv(hidden, out_dim, relations)])

        def forward(self, x: torch.Tensor, edge_index: torch.Tensor, edge_type: torch.Tensor) -> torch.Tensor:
            x = F.dropout(x, 0.5, self.training)
            x = F.dropout(F.relu(self.convs[0](x, edge_index, edge_type)), 0.5, self.training)
            return self.convs[1](x, edge_index, edge_type)

    return Net()


def child(args: argparse.Namespace) -> None:
    """Time one framework on one graph; print one JSON line."""
    import torch
    import torch.nn.functional as F

    from tessera.datasets import load

    torch.set_num_threads(args.threads)
    from tessera.threads import set_num_threads

    set_num_threads(args.threads)
    g = load(f"synthetic:{args.graph}")
    fi, r, e = g.num_features, g.num_relations, g.num_edges
    need = 4.0 * e * max(fi * args.hidden, args.hidden * g.num_classes) * 2
    if args.framework == "pyg-fast" and need > args.mem_gib * 2**30:
        print(json.dumps({"skipped": f"per-edge weights need {need / 2**30:.0f} GiB > {args.mem_gib} GiB"}))
        return
    torch.manual_seed(0)
    model = _model(args.framework, fi, args.hidden, g.num_classes, r)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    x, y, train = g.x, g.y, g.train_mask
    inputs = (x, g) if args.framework == "tessera" else (x, g.edge_index(), g.edge_type)
    times = []
    for i in range(args.warmup + args.epochs):
        t0 = time.perf_counter()
        model.train()
        opt.zero_grad()
        loss = F.cross_entropy(model(*inputs)[train], y[train])
        loss.backward()
        opt.step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    out = {"median_s": statistics.median(times), "times_s": times}
    if args.framework == "tessera":
        from tessera.backends.relational import decision_key
        from tessera.backends.select import lookup
        from tessera.sparse import as_operand
        from tessera.sparse.relation_plan import VARIANTS

        rel = as_operand(g).relations()
        dims = [(fi, args.hidden), (args.hidden, g.num_classes)]
        out["variants"] = [lookup(g, decision_key(rel, a, b, "mean"), list(VARIANTS)) for a, b in dims]
    print(json.dumps(out))


def epochs(args: argparse.Namespace) -> None:
    """Run every (graph, framework) child and print a table."""
    rows = []
    for graph in args.graphs:
        for fw in args.frameworks:
            cmd = [sys.executable, __file__, "child", "--graph", graph, "--framework", fw]
            cmd += ["--threads", str(args.threads), "--hidden", str(args.hidden), "--epochs", str(args.epochs)]
            cmd += ["--warmup", str(args.warmup), "--mem-gib", str(args.mem_gib)]
            p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            try:
                res = json.loads(p.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                res = {"skipped": f"failed (exit {p.returncode}): {p.stderr.strip().splitlines()[-1:]}"}
            rows.append((graph, fw, res))
            print(graph, fw, json.dumps(res), flush=True)
    print("\n| graph | framework | median epoch (s) | note |\n|---|---|---|---|")
    for graph, fw, res in rows:
        med = f"{res['median_s']:.3f}" if "median_s" in res else "-"
        note = res.get("skipped") or ", ".join(map(str, res.get("variants", [])))
        print(f"| {graph} | {fw} | {med} | {note} |")


def accuracy(args: argparse.Namespace) -> None:
    """Test accuracy of RGCN and GCN (tessera's trainer) per seed, and the mean margin."""
    import torch

    from tessera.datasets import load
    from tessera.threads import set_num_threads
    from tessera.train.config import TrainConfig
    from tessera.train.loop import train

    torch.set_num_threads(args.threads)
    set_num_threads(args.threads)
    g = load(f"synthetic:{args.graph}")
    acc: dict[str, list[float]] = {"rgcn": [], "gcn": []}
    for seed in args.seeds:
        for model in acc:
            cfg = TrainConfig(
                dataset=f"synthetic:{args.graph}", model=model, hidden=args.hidden, epochs=args.epochs, seed=seed,
                threads=args.threads, progress=False, out=f"{args.out}/{model}-s{seed}", checkpoint_every=10**6,
            )  # fmt: skip
            acc[model].append(train(cfg.validate(), g)["test_acc"])
            print(model, seed, acc[model][-1], flush=True)
    margin = [a - b for a, b in zip(acc["rgcn"], acc["gcn"], strict=True)]
    print(json.dumps({k: [round(v, 4) for v in vs] for k, vs in acc.items()}))
    print(
        f"rgcn {statistics.mean(acc['rgcn']):.4f}, gcn {statistics.mean(acc['gcn']):.4f}, "
        f"margin mean {statistics.mean(margin):.4f} min {min(margin):.4f} over {len(margin)} seeds"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("epochs", "child"):
        s = sub.add_parser(name)
        s.add_argument("--threads", type=int, default=2)
        s.add_argument("--hidden", type=int, default=256)
        s.add_argument("--epochs", type=int, default=5)
        s.add_argument("--warmup", type=int, default=2)
        s.add_argument("--mem-gib", type=float, default=16.0)
        if name == "epochs":
            s.add_argument("--graphs", nargs="+", default=["arxiv-rel8", "arxiv-rel32"])
            s.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
        else:
            s.add_argument("--graph", required=True)
            s.add_argument("--framework", required=True, choices=FRAMEWORKS)
    a = sub.add_parser("accuracy")
    a.add_argument("--graph", default="arxiv-rel")
    a.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    a.add_argument("--epochs", type=int, default=100)
    a.add_argument("--hidden", type=int, default=64)
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--out", default="/tmp/tessera-rgcn-accuracy")
    args = p.parse_args()
    {"epochs": epochs, "child": child, "accuracy": accuracy}[args.cmd](args)


if __name__ == "__main__":
    main()
