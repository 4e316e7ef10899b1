"""Throughput of tessera.comm.quantize next to STREAM bandwidth measured in the same run.

Encodes and decodes a ``--rows`` x ``--width`` float32 block at 8, 4 and 2 bits on ``--threads``
threads, in the wire format the halo exchange sends (one scale and zero point per ``--group`` rows,
default ``tessera.comm.wire.GROUP_ROWS``; the rows split into ``--blocks`` equal per-peer blocks).
GB/s is (bytes read + bytes written) / time in 10^9 B/s, from the median of ``--repeats`` runs
after a warm-up, counted the STREAM way (no write-allocate traffic). "reused out" writes into a
preallocated tensor, as the halo exchange does with its persistent per-(layer, direction)
buffers; "new out" lets encode/decode allocate, so it also pays the page faults of fresh memory.
STREAM triad and read (float32 arrays of 200 MB, best of 5) are measured right before each
operation, so a machine shared with other jobs compares like with like; "read" is a sum over one
array, the bound for encode, which reads four bytes for each one at most that it writes. "best"
is the fastest single run.

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

from tessera.comm.quantize import decode, encode
from tessera.comm.wire import group_rows, wire_bytes
from tessera.threads import set_num_threads


def times_s(fn: Callable[[], object], repeats: int) -> list[float]:
    """Wall times of ``repeats`` runs of ``fn`` after one warm-up run."""
    fn()
    out = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def measure(x: torch.Tensor, bits: int, threads: int, repeats: int, group: int, blocks: int) -> list[dict[str, float]]:
    """One result per operation: GB moved, triad just before, reused-out and new-out times."""
    rows, width = x.shape
    splits = [rows // blocks + (i < rows % blocks) for i in range(blocks)]
    buf = torch.empty(sum(int(wire_bytes(n, width, bits, group)) for n in splits), dtype=torch.uint8)
    dec = torch.empty(rows, width)
    runs = {
        "encode": (
            lambda: encode(x, bits, 1, out=buf, splits=splits, group=group),
            lambda: encode(x, bits, 1, splits=splits, group=group),
        ),
        "decode": (
            lambda: decode(buf, width, bits, splits, out=dec, group=group),
            lambda: decode(buf, width, bits, splits, group=group),
        ),
    }
    results = []
    for op, (reused, fresh) in runs.items():
        bw = measure_bandwidth(threads, repeats=5, dtype="float32")
        t_reused, t_fresh = times_s(reused, repeats), times_s(fresh, repeats)
        gb = (x.numel() * 4 + buf.numel()) / 1e9
        median, best, fresh = statistics.median(t_reused), min(t_reused), statistics.median(t_fresh)
        results.append(
            {"bits": bits, "op": op, "gb": gb, "triad": bw["triad"], "read": bw["read"]}
            | {"median": median, "best": best, "fresh": fresh}
        )
    return results


def main(argv: list[str] | None = None) -> None:
    """Print the markdown table."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1_000_000)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--bits", type=int, nargs="+", default=[8, 4, 2])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--group", type=int, help="rows per scale and zero point (default: the wire format's)")
    p.add_argument("--blocks", type=int, default=1, help="per-peer blocks the rows are split into (default 1)")
    p.add_argument(
        "--wait-quiet", type=float, default=0.0, metavar="S", help="first wait up to S s for a quiet machine"
    )
    a = p.parse_args(argv)

    quiet = ""
    if a.wait_quiet > 0:
        from _runner import wait_for_quiet

        waited, load = wait_for_quiet(a.wait_quiet)
        quiet = f"waited {waited:.0f} s for other processes to go quiet (last seen {load:.2f} cores); "
    load_before = os.getloadavg()[0]
    set_num_threads(a.threads)
    x = torch.randn(a.rows, a.width, generator=torch.Generator().manual_seed(0))
    group = group_rows(a.group)
    results = [r for bits in a.bits for r in measure(x, bits, a.threads, a.repeats, group, a.blocks)]

    print(
        f"quantize: {a.rows:,} x {a.width} float32, groups of {group} rows, {a.blocks} block(s), {a.threads} threads, "
        f"median of {a.repeats} after warm-up"
    )
    print(f"{quiet}1-min load average {load_before:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    print()
    print(
        "| bits | op | GB moved | triad GB/s | read GB/s | reused out ms | GB/s | % triad | % read | best ms "
        "| new out ms | GB/s |"
    )
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        gbs = r["gb"] / r["median"]
        print(
            f"| {r['bits']} | {r['op']} | {r['gb']:.3f} | {r['triad']:.1f} | {r['read']:.1f} | {1e3 * r['median']:.1f} "
            f"| {gbs:.1f} | {100 * gbs / r['triad']:.0f}% | {100 * gbs / r['read']:.0f}% | {1e3 * r['best']:.1f} "
            f"| {1e3 * r['fresh']:.1f} | {r['gb'] / r['fresh']:.1f} |"
        )


if __name__ == "__main__":
    main()
