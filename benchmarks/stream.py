"""STREAM-style memory bandwidth (copy, scale, add, triad, and a read-only sum) with numba kernels.

Three arrays of ``--array-mb`` MB each (default 200 MB, far larger than any cache), first
touched by the same parallel loop shape the kernels use, then each kernel runs ``--repeats``
times; the best time counts, as in McCalpin's STREAM. Bytes are counted the STREAM way (no
write-allocate traffic): copy and scale move 2 arrays, add and triad 3, each element
``itemsize`` bytes (8 for float64, 4 for float32). ``read`` (not in McCalpin's STREAM) sums one
array: the bound for kernels that read far more than they write, such as quantization.

    python benchmarks/stream.py --threads 2
    python benchmarks/stream.py --threads 2 --json      # one JSON object on stdout

Other scripts call :func:`measure_bandwidth`.
"""

from __future__ import annotations

import argparse
import json
import time

import numba
import numpy as np
from numba import prange

KERNELS = ("copy", "scale", "add", "triad", "read")
ARRAYS_MOVED = {"copy": 2, "scale": 2, "add": 3, "triad": 3, "read": 1}


@numba.njit(parallel=True, cache=False)
def _init(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    for i in prange(a.shape[0]):
        a[i] = 1.0
        b[i] = 2.0
        c[i] = 0.0


@numba.njit(parallel=True, cache=False)
def _copy(a: np.ndarray, c: np.ndarray) -> None:
    for i in prange(a.shape[0]):
        c[i] = a[i]


@numba.njit(parallel=True, cache=False)
def _scale(b: np.ndarray, c: np.ndarray, s: float) -> None:
    for i in prange(c.shape[0]):
        b[i] = s * c[i]


@numba.njit(parallel=True, cache=False)
def _add(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> None:
    for i in prange(a.shape[0]):
        c[i] = a[i] + b[i]


@numba.njit(parallel=True, cache=False)
def _triad(a: np.ndarray, b: np.ndarray, c: np.ndarray, s: float) -> None:
    for i in prange(a.shape[0]):
        a[i] = b[i] + s * c[i]


@numba.njit(parallel=True, fastmath=True, cache=False)
def _read(a: np.ndarray) -> float:
    # fastmath lets the reduction use vector lanes; the sum itself is not used.
    s = 0.0
    for i in prange(a.shape[0]):
        s += a[i]
    return s


def measure_bandwidth(
    threads: int, array_bytes: float = 2e8, repeats: int = 10, dtype: str = "float64"
) -> dict[str, float]:
    """Best-of-``repeats`` bandwidth in GB/s (10^9 bytes/s) of each STREAM kernel on ``threads``
    numba threads; keys ``copy``, ``scale``, ``add``, ``triad``, ``read``."""
    numba.set_num_threads(max(1, min(int(threads), numba.config.NUMBA_NUM_THREADS)))
    dt = np.dtype(dtype)
    n = int(array_bytes) // dt.itemsize
    a, b, c = np.empty(n, dt), np.empty(n, dt), np.empty(n, dt)
    _init(a, b, c)
    s = dt.type(3.0)
    runs = {
        "copy": lambda: _copy(a, c),
        "scale": lambda: _scale(b, c, s),
        "add": lambda: _add(a, b, c),
        "triad": lambda: _triad(a, b, c, s),
        "read": lambda: _read(b),
    }
    best = dict.fromkeys(KERNELS, float("inf"))
    for k in KERNELS:  # compile outside the timed region
        runs[k]()
    for _ in range(repeats):
        for k in KERNELS:
            t0 = time.perf_counter()
            runs[k]()
            best[k] = min(best[k], time.perf_counter() - t0)
    return {k: ARRAYS_MOVED[k] * n * dt.itemsize / best[k] / 1e9 for k in KERNELS}


def main(argv: list[str] | None = None) -> None:
    """Command-line entry: print GB/s per kernel (or JSON with ``--json``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=numba.config.NUMBA_NUM_THREADS)
    p.add_argument("--array-mb", type=float, default=200.0, help="size of each of the 3 arrays, MB (10^6 B)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    a = p.parse_args(argv)
    bw = measure_bandwidth(a.threads, a.array_mb * 1e6, a.repeats, a.dtype)
    if a.json:
        print(json.dumps({"threads": a.threads, "array_mb": a.array_mb, "dtype": a.dtype, "gb_s": bw}))
        return
    print(f"STREAM ({a.dtype}, 3 x {a.array_mb:g} MB, best of {a.repeats}, {a.threads} threads)")
    for k in KERNELS:
        print(f"  {k:<6} {bw[k]:8.2f} GB/s")


if __name__ == "__main__":
    main()
