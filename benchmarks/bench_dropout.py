"""The hashed activation + dropout kernel (``tessera.kernels.dropout.run_hashed``), per mode and
storage dtype, against the bytes it moves.

Every hidden layer's dense end runs it twice a step: forward (ReLU or ELU, then dropout, from the
pre-activation) and backward (the activation's derivative read off the saved output, the mask
recomputed from the seed). Times one call over an ``--rows`` x ``--width`` block, keyed by row ids
as a training step keys them, median of ``--repeats`` after a warm-up, for float32 and bfloat16
rows; GB/s counts each element's bytes read and written once.

    python benchmarks/bench_dropout.py --threads 2
"""

from __future__ import annotations

import argparse

import torch
from _runner import median_s

from tessera.kernels.dropout import ACT_MODES, DROP, run_hashed
from tessera.threads import set_num_threads


def main(argv: list[str] | None = None) -> None:
    """Print the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=169_343)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=9)
    a = p.parse_args(argv)
    torch.manual_seed(0)
    set_num_threads(a.threads)
    ids = torch.arange(a.rows)
    relu, relu_grad = ACT_MODES["relu"]
    elu, elu_grad = ACT_MODES["elu"]
    modes = {
        "dropout": (DROP, False),
        "relu + dropout": (relu, False),
        "elu + dropout": (elu, False),
        "relu + dropout, backward": (relu_grad, True),
        "elu + dropout, backward": (elu_grad, True),
    }
    print(f"{a.rows:,} x {a.width}, p = 0.5, {a.threads} threads, median of {a.repeats}")
    print()
    print("| mode | float32 ms | GB/s | bfloat16 ms | GB/s |")
    print("|---|---:|---:|---:|---:|")
    for name, (mode, backward) in modes.items():
        cells = []
        for dt in (torch.float32, torch.bfloat16):
            src = torch.randn(a.rows, a.width).to(dt)
            aux = torch.randn(a.rows, a.width).to(dt) if backward else None
            out = torch.empty(a.rows, a.width, dtype=dt)
            args = (src, out, 12345, 0.5, ids, mode)
            t = median_s(lambda args=args, aux=aux: run_hashed(*args, aux=aux), a.repeats)
            moved = src.numel() * src.element_size() * (3 if backward else 2)
            cells.append(f"{1e3 * t:.1f} | {moved / t / 1e9:.1f}")
        print(f"| {name} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
