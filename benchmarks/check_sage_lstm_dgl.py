"""SAGELSTMConv equals DGL's ``SAGEConv(aggregator_type="lstm")`` to 1e-5 in outputs and gradients.

DGL 2.1 needs torch <= 2.2.1, so it lives in its own venv (``../shared/tools/setup_dgl_venv.sh``)
and the two sides exchange graph, weights, inputs and results through an ``.npz`` file: this
script runs tessera's side, then itself under ``--dgl-python`` with ``--dgl-side``, which imports
only numpy, torch and dgl. The DGL graph gets its edges in tessera's sequence order (by
destination, then source id), so edge ids, and with them DGL's mailbox order, follow it.

    python benchmarks/check_sage_lstm_dgl.py --dgl-python /work/dgl-venv/bin/python
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

TOL = 1e-5


def dgl_side(path: Path) -> None:
    """Load the npz, run DGL's layer with the same weights and write its output and gradients."""
    import dgl
    from dgl.nn import SAGEConv

    d = dict(np.load(path))
    g = dgl.graph((torch.from_numpy(d["src"]), torch.from_numpy(d["dst"])), num_nodes=int(d["n"]))
    x = torch.from_numpy(d["x"]).requires_grad_(True)
    conv = SAGEConv(x.shape[1], int(d["out"]), "lstm")
    conv.load_state_dict({k[6:]: torch.from_numpy(v) for k, v in d.items() if k.startswith("param:")})
    out = conv(g, x)
    (out * torch.from_numpy(d["gout"])).sum().backward()
    res = {"out": out.detach().numpy(), "grad:x": x.grad.numpy()}
    res.update({f"grad:{k}": p.grad.numpy() for k, p in conv.named_parameters()})
    np.savez(path.with_suffix(".dgl.npz"), **res)


def tessera_side(dgl_python: str, in_width: int, out_width: int) -> int:
    """Run tessera's layer on the awkward test graph and compare with DGL's results."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from helpers import awkward_graph
    from tessera.nn.conv import SAGELSTMConv

    torch.manual_seed(0)
    g = awkward_graph(60, 400)
    conv = SAGELSTMConv(in_width, out_width)
    x = torch.randn(g.num_nodes, in_width, requires_grad=True)
    out = conv(x, g)
    gout = torch.randn(out.shape)
    (out * gout).sum().backward()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "sage_lstm.npz"
        params = {f"param:{k}": v.detach().numpy() for k, v in conv.state_dict().items()}
        np.savez(path, src=g.src_index().numpy(), dst=g.dst_index().numpy(), n=g.num_nodes, x=x.detach().numpy(),
                 out=out_width, gout=gout.numpy(), **params)  # fmt: skip
        subprocess.run([dgl_python, __file__, "--dgl-side", str(path)], check=True)
        ref = dict(np.load(path.with_suffix(".dgl.npz")))
    mine = {"out": out, "grad:x": x.grad, **{f"grad:{k}": p.grad for k, p in conv.named_parameters()}}
    worst = 0.0
    for key, value in mine.items():
        err = float(np.abs(value.detach().numpy() - ref[key]).max())
        worst = max(worst, err)
        print(f"{key:24s} max |tessera - dgl| = {err:.2e}")
    deg = g.in_degree()
    print(f"graph: {g.num_nodes} vertices, {g.num_edges} edges, in-degree max {int(deg.max())}, "
          f"{int((deg == 0).sum())} isolated, {int((g.src_index() == g.dst_index()).sum())} self loops")  # fmt: skip
    ok = worst <= TOL
    print(("OK" if ok else "MISMATCH") + f": worst {worst:.2e} (tolerance {TOL})")
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dgl-python", default="/work/dgl-venv/bin/python", help="python of the DGL venv")
    ap.add_argument("--dgl-side", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--in-width", type=int, default=8)
    ap.add_argument("--out-width", type=int, default=5)
    args = ap.parse_args()
    if args.dgl_side:
        dgl_side(args.dgl_side)
        return 0
    return tessera_side(args.dgl_python, args.in_width, args.out_width)


if __name__ == "__main__":
    sys.exit(main())
