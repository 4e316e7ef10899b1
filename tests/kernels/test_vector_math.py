"""The vectorisable float32 exp and expm1 of the numba kernels against float64 references."""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest

from tessera.kernels.vector_math import exp, expm1


@numba.njit(fastmath=True)
def _apply(fn_id, x, out):
    for i in range(x.size):
        out[i] = exp(x[i]) if fn_id == 0 else expm1(x[i])


def _grid(lo: float, hi: float) -> np.ndarray:
    """Every 1009th float32 between lo and hi (both signs' bit patterns walked in order), plus the edges."""
    a, b = np.float32(lo), np.float32(hi)
    neg = np.arange(np.float32(-0.0).view(np.int32), a.view(np.int32), 1009, dtype=np.int64) if a < 0 else []
    pos = np.arange(0, b.view(np.int32), 1009, dtype=np.int64) if b > 0 else []
    bits = np.concatenate([np.asarray(neg, np.int64), np.asarray(pos, np.int64)]).astype(np.uint32)
    return np.concatenate([bits.view(np.float32), np.array([lo, hi, 0.0, -0.0], np.float32)])


def _ulps(got: np.ndarray, want64: np.ndarray) -> np.ndarray:
    """Distance in float32 ulps from the float64 reference."""
    ulp = np.spacing(np.abs(want64.astype(np.float32))).astype(np.float64)
    return np.abs(got.astype(np.float64) - want64) / ulp


def test_expm1_float32_is_within_one_ulp_of_the_exact_value_and_exact_near_zero():
    x = _grid(-50.0, 88.0)
    x = x[np.abs(x) >= np.finfo(np.float32).tiny]  # normal numbers (fastmath flushes subnormals)
    out = np.empty_like(x)
    _apply(1, x, out)
    want = np.expm1(x.astype(np.float64))
    assert _ulps(out, want).max() <= 1.0
    small = np.abs(x) < 1e-3
    assert small.sum() > 1000 and np.array_equal(out[small], want[small].astype(np.float32))
    assert np.all(out[x < -20] == np.float32(-1.0))


def test_exp_float32_is_within_two_ulps_in_its_normal_range():
    x = _grid(-87.0, 88.0)
    out = np.empty_like(x)
    _apply(0, x, out)
    assert _ulps(out, np.exp(x.astype(np.float64))).max() <= 2.0


@pytest.mark.parametrize("fn_id", [0, 1])
def test_float64_arguments_keep_libms_functions(fn_id):
    x = np.linspace(-30.0, 30.0, 10_001)
    out = np.empty_like(x)
    _apply(fn_id, x, out)
    # libm's own values (Python's math module calls it); NumPy's float64 exp on an AVX-512 CPU is
    # its own SIMD routine, which differs from libm's in the last bit
    libm = math.exp if fn_id == 0 else math.expm1
    assert np.array_equal(out, np.array([libm(v) for v in x]))
