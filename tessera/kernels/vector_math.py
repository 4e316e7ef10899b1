"""``exp`` and ``expm1`` for numba kernels that vectorise on float32 lanes.

Without Intel's SVML, numba calls libm's scalar ``expf`` / ``expm1f`` for every element, and a loop
that calls one does not vectorise. Here float32 arguments take polynomial forms that LLVM
vectorises; float64 arguments keep libm's functions (their accuracy is what float64 callers want).
Use :func:`exp` and :func:`expm1` inside ``numba.njit`` kernels only.
"""

from __future__ import annotations

import numba
import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload


def _pow2_intrinsic(int_type: types.Integer, float_type: types.Float, mantissa_bits: int, bias: int):
    """An intrinsic ``2.0 ** k`` for an integer ``k`` in the float type's normal exponent range,
    by writing ``k + bias`` into the exponent bits."""
    ir_int = ir.IntType(int_type.bitwidth)  # type: ignore[attr-defined]
    ir_float = ir.FloatType() if float_type.bitwidth == 32 else ir.DoubleType()

    @intrinsic
    def pow2(typingctx, k):
        def codegen(context, builder, sig, args):
            bits = builder.shl(builder.add(args[0], ir.Constant(ir_int, bias)), ir.Constant(ir_int, mantissa_bits))
            return builder.bitcast(bits, ir_float)

        return float_type(int_type), codegen

    return pow2


_pow2_f32 = _pow2_intrinsic(types.int32, types.float32, 23, 127)  # k in [-126, 127]
_pow2_f64 = _pow2_intrinsic(types.int64, types.float64, 52, 1023)  # k in [-1022, 1023]


@numba.njit(fastmath=True, cache=True)
def exp_f32(x):
    """``exp`` of a float32 by a Cephes-style polynomial: 2 ulp; 0 below exp's normal range."""
    # several times faster than libm's scalar expf on attention scores (docs/design/aggregation-kernels.md)
    x = min(x, np.float32(88.0))
    t = np.floor(x * np.float32(1.4426950408889634) + np.float32(0.5))
    r = x - t * np.float32(0.693359375) + t * np.float32(2.12194440e-4)
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    y = (p * r * r + r + np.float32(1.0)) * _pow2_f32(np.int32(max(t, np.float32(-126.0))))
    return y if x > np.float32(-87.33654) else np.float32(0.0)


_LN2 = 0.6931471805599453
# 1/n! for n = 2..11: expm1(r) = r + r^2/2! + ... on |r| <= ln 2 / 2 to about 1e-12 relative
_TAYLOR = tuple(1.0 / float(np.prod(np.arange(1, n + 1, dtype=np.float64))) for n in range(2, 12))


@numba.njit(fastmath=True, cache=True)
def expm1_f32(x):
    """``expm1`` of a float32 (for ``x <= 88``; above, ``expm1(88)``), evaluated in float64 lanes
    and rounded once: the correctly rounded float32 but for rare ties, exact near 0 where
    ``exp(x) - 1`` would lose every digit."""
    # x = k ln2 + r with |r| <= ln2 / 2; expm1(x) = 2^k expm1(r) + (2^k - 1), both terms exact
    # enough in float64. Below -40 the float32 result is -1 whatever the tail.
    v = min(max(np.float64(x), -40.0), 88.0)
    k = np.floor(v * (1.0 / _LN2) + 0.5)
    r = v - k * _LN2
    c0, c1, c2, c3, c4, c5, c6, c7, c8, c9 = _TAYLOR
    p = c9
    p = p * r + c8
    p = p * r + c7
    p = p * r + c6
    p = p * r + c5
    p = p * r + c4
    p = p * r + c3
    p = p * r + c2
    p = p * r + c1
    p = p * r + c0
    e = r + r * r * p
    s = _pow2_f64(np.int64(k))
    return np.float32(s * e + (s - 1.0))


def exp(x):  # pragma: no cover - replaced by the overload inside numba
    """``exp``: float32 by :func:`exp_f32`, float64 by libm (inside numba kernels only)."""
    raise NotImplementedError("vector_math.exp runs inside numba kernels only")


def expm1(x):  # pragma: no cover - replaced by the overload inside numba
    """``expm1``: float32 by :func:`expm1_f32`, float64 by libm (inside numba kernels only)."""
    raise NotImplementedError("vector_math.expm1 runs inside numba kernels only")


@overload(exp, inline="always")
def _exp_overload(x):
    if x == types.float32:
        return lambda x: exp_f32(x)
    return lambda x: np.exp(x)


@overload(expm1, inline="always")
def _expm1_overload(x):
    if x == types.float32:
        return lambda x: expm1_f32(x)
    return lambda x: np.expm1(x)
