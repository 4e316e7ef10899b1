"""Throughput of tessera.dist.quantize next to STREAM bandwidth measured in the same run.

Encodes and decodes a ``--rows`` x ``--width`` float32 block at 8, 4 and 2 bits on ``--threads``
threads; GB/s is (bytes read + bytes written) / time (10^9 B/s), the median of ``--repeats``
runs after a warm-up, counted the STREAM way (no write-allocate traffic). "reused out" writes
into a preallocated tensor (the kernel alone); "new out" lets encode/decode allocate as the
halo exchange does, so it also pays the page faults of fresh memory. STREAM (float32 arrays,
best of 10) runs before and after; the percentage uses the higher triad.

    python benchmarks/bench_quantize.py --threads 2
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from collections.abc import Callable

import torch
from stream import measure_bandwidth

from tessera import ops
from tessera.dist.quantize import decode, encode, record_bytes


def median_s(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of ``fn`` over ``repeats`` runs after one warm-up run."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def time_bits(x: torch.Tensor, bits: int, repeats: int) -> dict[str, tuple[float, float, float]]:
    """Per op: (GB moved, median s into a reused output, median s allocating the output)."""
    rows, width = x.shape
    buf = torch.empty(rows, record_bytes(width, bits)[1], dtype=torch.uint8)
    dec = torch.empty(rows, width)
    moved = (x.numel() * 4 + buf.numel()) / 1e9
    runs = {
        "encode": (lambda: encode(x, bits, 1, out=buf), lambda: encode(x, bits, 1)),
        "decode": (lambda: decode(buf, width, bits, out=dec), lambda: decode(buf, width, bits)),
    }
    return {op: (moved, median_s(reused, repeats), median_s(fresh, repeats)) for op, (reused, fresh) in runs.items()}


def main(argv: list[str] | None = None) -> None:
    """Print the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--bits", type=int, nargs="+", default=[8, 4, 2])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        metavar="S",
        help="first wait up to S seconds for other processes to go quiet",
    )
    a = p.parse_args(argv)

    load = None
    if a.wait_quiet > 0:
        from _runner import wait_for_quiet

        _, load = wait_for_quiet(a.wait_quiet)
    load_before = os.getloadavg()[0]
    ops.set_num_threads(a.threads)
    x = torch.randn(a.rows, a.width, generator=torch.Generator().manual_seed(0))
    triad = [measure_bandwidth(a.threads, dtype="float32")["triad"]]
    rows = [(bits, op, *timed) for bits in a.bits for op, timed in time_bits(x, bits, a.repeats).items()]
    triad.append(measure_bandwidth(a.threads, dtype="float32")["triad"])
    load_after = os.getloadavg()[0]
    best = max(triad)

    print(f"quantize: {a.rows:,} x {a.width} float32, {a.threads} threads, median of {a.repeats} after warm-up")
    quiet = f"other processes' load before start {load:.2f} cores; " if load is not None else ""
    print(f"STREAM triad (float32): {triad[0]:.1f} GB/s before, {triad[1]:.1f} GB/s after")
    print(f"{quiet}1-min load average {load_before:.2f} at start, {load_after:.2f} at end")
    print()
    print("| bits | op | GB moved | reused out ms | GB/s | % triad | new out ms | GB/s |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|")
    for bits, op, moved, tr, tf in rows:
        print(
            f"| {bits} | {op} | {moved:.3f} | {1e3 * tr:.1f} | {moved / tr:.1f} | {100 * moved / tr / best:.0f}% | {1e3 * tf:.1f} | {moved / tf:.1f} |"
        )


if __name__ == "__main__":
    main()
