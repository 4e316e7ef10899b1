"""bfloat16 storage for numba kernels: rows stored in half width, arithmetic in float32.

NumPy has no bfloat16, so a bfloat16 tensor reaches numba as its bits (:func:`as_numpy`: a
``uint16`` view). Kernels written over generic arrays read every stored value through
:func:`widen` and write every computed one through :func:`narrow`; for float32 and float64 arrays
both are the identity and compile to the code they replace, so the float32 path is unchanged.
For ``uint16`` arrays, widening is exact (the bits shifted into a float32's high half) and
narrowing rounds to nearest even, as torch's ``.bfloat16()`` does (a NaN stays a NaN). Both are
a few integer instructions that vectorise.
"""

from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

BF16 = torch.bfloat16


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype arithmetic on ``dtype`` storage runs in: float32 for bfloat16, else ``dtype``."""
    return torch.float32 if dtype == BF16 else dtype


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """``t.numpy()``, or for bfloat16 the ``uint16`` array of its bits (same memory)."""
    return t.view(torch.uint16).numpy() if t.dtype == BF16 else t.numpy()


@intrinsic
def _from_bits(typingctx, bits):
    """float32 whose high 16 bits are ``bits`` (a uint16) and low 16 bits zero."""
    if bits != types.uint16:
        return None

    def codegen(context, builder, signature, args):
        wide = builder.zext(args[0], ir.IntType(32))
        return builder.bitcast(builder.shl(wide, ir.Constant(ir.IntType(32), 16)), ir.FloatType())

    return types.float32(bits), codegen


@intrinsic
def _to_bits(typingctx, value):
    """The bfloat16 bits (uint16) nearest a float32, ties to even; NaN as the quiet NaN."""
    if value != types.float32:
        return None

    def codegen(context, builder, signature, args):
        i32 = ir.IntType(32)
        b = builder.bitcast(args[0], i32)
        lsb = builder.and_(builder.lshr(b, ir.Constant(i32, 16)), ir.Constant(i32, 1))
        rounded = builder.add(builder.add(b, ir.Constant(i32, 0x7FFF)), lsb)
        bits = builder.trunc(builder.lshr(rounded, ir.Constant(i32, 16)), ir.IntType(16))
        is_nan = builder.fcmp_unordered("uno", args[0], args[0])
        return builder.select(is_nan, ir.Constant(ir.IntType(16), 0x7FC0), bits)

    return types.uint16(value), codegen


def widen(v):  # pragma: no cover - replaced by the overload inside numba
    """A stored value as the number it holds (inside numba kernels only)."""
    raise NotImplementedError("widen runs inside numba kernels only")


def narrow(out, v):  # pragma: no cover - replaced by the overload inside numba
    """``v`` as ``out``'s arrays store it (inside numba kernels only)."""
    raise NotImplementedError("narrow runs inside numba kernels only")


def accumulator(x, n):  # pragma: no cover - replaced by the overload inside numba
    """An uninitialised 1-D array of ``n`` in the arithmetic type of ``x``'s values (numba only)."""
    raise NotImplementedError("accumulator runs inside numba kernels only")


@overload(widen, inline="always")
def _widen(v):
    if v == types.uint16:
        return lambda v: _from_bits(v)
    return lambda v: v


@overload(narrow, inline="always")
def _narrow(out, v):
    if out.dtype == types.uint16:
        return lambda out, v: _to_bits(np.float32(v))
    return lambda out, v: v


@overload(accumulator, inline="always")
def _accumulator(x, n):
    if x.dtype == types.uint16:
        return lambda x, n: np.empty(n, np.float32)
    return lambda x, n: np.empty(n, x.dtype)
