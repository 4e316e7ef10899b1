"""A first layer over a mostly-zero input: its non-zeros only against the dense composition.

``dropout(x, 0.5) @ W^T`` and its weight gradient (one forward and backward, as a training step
runs layer 0), over binary inputs of several densities: once on the sparse path
(``tessera.dense.sparse_features``, forced for every density) and once dense (``dropout_linear``'s
row chunks: hashed dropout into a small buffer, then the product), median of ``--repeats`` after a warm-up. The shapes are Cora's (2708 x 1433 to
16), CiteSeer's (3327 x 3703 to 64), and two wider ones; the crossover density sets
``sparse_features.MAX_DENSITY``.

    python benchmarks/bench_sparse_features.py --threads 2
"""

from __future__ import annotations

import argparse

import torch
from _runner import median_s

import tessera.dense.sparse_features as sf
from tessera import dense
from tessera.threads import set_num_threads

SHAPES = ((2708, 1433, 16), (3327, 3703, 64), (50_000, 500, 256), (169_343, 128, 256))


def _step(x: torch.Tensor, w: torch.Tensor) -> None:
    dense.dropout_linear(x, w, None, 0.5, True).sum().backward()


def main(argv: list[str] | None = None) -> None:
    """Print the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--densities", type=float, nargs="+", default=[0.01, 0.03, 0.05, 0.1, 0.2])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=15)
    a = p.parse_args(argv)
    set_num_threads(a.threads)
    print("| rows x features -> width | density | sparse ms | dense ms | sparse / dense |")
    print("|---|---:|---:|---:|---:|")
    for n, k, o in SHAPES:
        for density in a.densities:
            x = (torch.rand(n, k, generator=torch.Generator().manual_seed(0)) < density).float()
            w = torch.randn(o, k, requires_grad=True)
            times = []
            for limit in (1.0, 0.0):  # every density sparse, then none
                sf.MAX_DENSITY = limit
                sf._memo.clear()
                times.append(median_s(lambda x=x, w=w: _step(x, w), a.repeats) * 1e3)
            print(f"| {n} x {k} -> {o} | {density:.2f} | {times[0]:.2f} | {times[1]:.2f} | {times[0] / times[1]:.2f} |")


if __name__ == "__main__":
    main()
