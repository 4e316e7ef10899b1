"""Workspace bytes and resident set of a few training steps in ``--memory fast`` and ``lean``.

Trains ``--model`` on ``--dataset`` (a name or a file) with the ``Trainer`` for ``--steps`` steps,
each followed by an evaluation, once per mode in fresh child processes, and prints per mode the
bytes of the kept workspace blocks and the resident set after the last step.
``--write-npz SPEC PATH`` instead writes a synthetic preset as a gnn-benchmark ``.npz`` (dense
features stored as CSR, the graph's split), the file a user would train from.

    python benchmarks/memory_modes.py --write-npz synthetic:arxiv /tmp/arxiv.npz
    python benchmarks/memory_modes.py --dataset /tmp/arxiv.npz --model gin --hidden 256 --layers 2
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys


def write_npz(spec: str, path: str) -> None:
    """Write synthetic preset ``spec`` as a gnn-benchmark ``.npz`` at ``path``."""
    import numpy as np
    import scipy.sparse as sp

    from tessera.datasets import load

    g = load(spec)
    n, src, dst = g.num_nodes, g.src_index().numpy(), g.dst_index().numpy()
    a = sp.csr_matrix((np.ones(src.size, np.float32), (dst, src)), shape=(n, n))
    x = sp.csr_matrix(g.x.numpy().astype(np.float32))
    np.savez(path, adj_data=a.data, adj_indices=a.indices, adj_indptr=a.indptr, adj_shape=np.array(a.shape),
             attr_data=x.data, attr_indices=x.indices, attr_indptr=x.indptr, attr_shape=np.array(x.shape),
             labels=g.y.numpy(), train_mask=g.train_mask.numpy(), val_mask=g.val_mask.numpy(),
             test_mask=g.test_mask.numpy())  # fmt: skip


def child(args: argparse.Namespace) -> None:
    """One mode's run: prints its workspace bytes and resident set as JSON."""
    import torch

    from tessera import workspace
    from tessera.datasets import load
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    torch.manual_seed(0)
    cfg = TrainConfig(model=args.model, dataset=args.dataset, hidden=args.hidden, layers=args.layers,
                      heads=args.heads, threads=args.threads, memory=args.child, progress=False)  # fmt: skip
    tr = Trainer(cfg, load(args.dataset))
    with tr.kernels():
        for _ in range(args.steps):
            tr.train_step()
            tr.evaluate()
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * 4096
    print(json.dumps({"workspace_mib": workspace.DEFAULT.held_bytes() / 2**20, "rss_mib": rss / 2**20}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dataset", default="synthetic:small")
    ap.add_argument("--model", default="gcn")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--write-npz", nargs=2, metavar=("SPEC", "PATH"))
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.write_npz:
        write_npz(*args.write_npz)
        return 0
    if args.child:
        child(args)
        return 0
    print(f"{args.model} on {args.dataset}, hidden {args.hidden}, {args.layers} layers, {args.steps} steps")
    for mode in ("fast", "lean"):
        out = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--child", mode], capture_output=True,
                             text=True, check=True).stdout  # fmt: skip
        r = json.loads(out.strip().splitlines()[-1])
        print(f"{mode:5s} workspace {r['workspace_mib']:8.1f} MiB  RSS {r['rss_mib']:8.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
