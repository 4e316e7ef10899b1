"""Counter-based 32-bit hashing (lowbias32) shared by dropout masks and stochastic rounding.

numba computes integer arithmetic on uint32 values in 64-bit lanes; the intrinsics here emit the
hash as 32-bit LLVM IR so AVX-512 hashes 16 values per instruction instead of 8.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

_I32 = ir.IntType(32)


@numba.njit(inline="always")
def hash32(v):
    """lowbias32 (C. Wellons), a full-avalanche 32-bit hash, on the low 32 bits of ``v`` (uint64 lanes)."""
    v = v & 0xFFFFFFFF
    v ^= v >> 16
    v = (v * 0x7FEB352D) & 0xFFFFFFFF
    v ^= v >> 15
    v = (v * 0x846CA68B) & 0xFFFFFFFF
    v ^= v >> 16
    return v


def const(ty: ir.Type, value) -> ir.Constant:
    """``value`` as a constant of the scalar or vector type ``ty`` (a vector gets it in every lane)."""
    return ir.Constant(ty, [value] * ty.count) if isinstance(ty, ir.VectorType) else ir.Constant(ty, value)


def lowbias32_ir(builder: ir.IRBuilder, v: ir.Value) -> ir.Value:
    """Emit lowbias32 of the i32 (or vector of i32) ``v``."""
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        v = builder.xor(v, builder.lshr(v, const(v.type, shift)))
        v = builder.mul(v, const(v.type, mul))
    return builder.xor(v, builder.lshr(v, const(v.type, 16)))


@intrinsic
def hash_u32(typingctx, v):
    """lowbias32 of a uint32, in 32-bit arithmetic."""
    return types.uint32(types.uint32), lambda context, builder, sig, args: lowbias32_ir(builder, args[0])


def index_hash(multiplier: int):
    """An intrinsic ``(i: int64, key: uint32) -> uint32`` computing ``lowbias32(i * multiplier + key)``
    modulo 2**32, equal to :func:`hash32` of the same expression in 64-bit lanes."""

    @intrinsic
    def _index_hash(typingctx, i, key):
        def codegen(context, builder, sig, args):
            v = builder.add(builder.mul(builder.trunc(args[0], _I32), ir.Constant(_I32, multiplier)), args[1])
            return lowbias32_ir(builder, v)

        return types.uint32(types.int64, types.uint32), codegen

    return _index_hash
