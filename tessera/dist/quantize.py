"""Stochastic integer quantization of exchanged feature rows (SuperGCN §2.4, §7.3).

Each row gets its own zero point ``Z = min`` and scale ``S = (max - min) / (2**b - 1)`` (rounded
up to a float32); a value becomes ``q = floor((x - Z) / S + u)``, clamped to ``[0, 2**b - 1]``,
with ``u`` uniform in (0, 1) from a counter-based hash of (seed, row, column). The rounding is
unbiased, ``E[q * S + Z] = x`` up to 16-bit ``u`` and float32 arithmetic (under ``1e-4 * S``),
the same for any thread count, and needs no state. Every worker encodes what it sends and
decodes what it receives on its own (decentralised, §7.3 (1)). The kernel is fused (§7.3 (2)):
one pass finds a row's min and max, the second quantizes and packs the row while it is still in
cache, multiplying by a reciprocal instead of dividing (§7.3 (3)).

Wire layout, one ``uint8`` record of ``sum(row_bytes(width, bits))`` bytes per row::

    [ceil(width * bits / 8) data bytes][scale: float32 LE][zero: float32 LE]

Value ``j`` sits in data byte ``j // (8 // bits)`` at bit offset ``(j % (8 // bits)) * bits``
(the first value in the low bits); unused bits of the last byte are zero.

A constant row gets ``S = 0`` and decodes exactly. A row holding inf or nan is sent as
``S = Z = nan`` with zero data and decodes to all-nan: non-finite values propagate as through an
fp32 exchange, and the sender does not raise (which would leave its peers waiting in
``all_to_all``). Rows whose span overflows float32 (``max - min > 3.4e38``) or whose scale is
tiny (below about ``3e-39``) are quantized in float64, so every finite row decodes to within one
step ``S`` of its input, plus the float32 rounding of the result.

The random bits come from lowbias32, the hash of :mod:`tessera.ops.dropout`, one hash per two
values (16 bits each), written as 32-bit LLVM IR because numba would widen it to 64-bit lanes;
AVX-512 then hashes 16 at a time and the kernels keep up with memory.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from tessera.dist.wire import row_bytes
from tessera.ops.dropout import _hash32
from tessera.ops.threads import sync_numba_threads

_F32_MAX = np.float64(np.finfo(np.float32).max)
_U16 = np.float32(2.0**-16)
_U17 = np.float32(2.0**-17)
_ABS = np.int32(0x7FFFFFFF)
_POS_INF = np.int32(0x7F800000)  # order keys >= this: +inf or nan
_NEG_INF = np.int32(-0x7F800001)  # order keys <= this: -inf or nan (the key of -inf)
_LO16, _HI16 = np.uint32(0xFFFF), np.uint32(16)
# No nnan/ninf (non-finite rows are detected; the overflow checks need inf) and no reassoc,
# which could turn (x - Z) * inv into x * inv - Z * inv and make it negative at x = Z.
_FAST = {"nsz", "arcp", "contract", "afn"}
_I32 = ir.IntType(32)


def _lowbias32(builder, v):
    for shift, mul in ((16, 0x7FEB352D), (15, 0x846CA68B)):
        v = builder.xor(v, builder.lshr(v, ir.Constant(_I32, shift)))
        v = builder.mul(v, ir.Constant(_I32, mul))
    return builder.xor(v, builder.lshr(v, ir.Constant(_I32, 16)))


@intrinsic
def _hash_u32(typingctx, v):
    return types.uint32(types.uint32), lambda context, builder, sig, args: _lowbias32(builder, args[0])


@intrinsic
def _pair_hash(typingctx, k, key):
    def codegen(context, builder, sig, args):
        v = builder.add(builder.mul(builder.trunc(args[0], _I32), ir.Constant(_I32, 0x85EBCA6B)), args[1])
        return _lowbias32(builder, v)

    return types.uint32(types.int64, types.uint32), codegen


@intrinsic
def _f32_bits(typingctx, x):
    return types.int32(types.float32), lambda context, builder, sig, args: builder.bitcast(args[0], _I32)


@intrinsic
def _bits_f32(typingctx, v):
    return types.float32(types.int32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.FloatType())


@numba.njit(inline="always")
def _order(b):
    # float32 bits <-> int32 keys in the same order (an involution): integer min/max vectorise,
    # numba's float min/max do not.
    return b ^ ((b >> 31) & _ABS)


@numba.njit(inline="always")
def _q(v, h16, zero, inv, qmax):
    # floor(t) + (u < frac(t)) with u = (h16 + 1/2) / 2**16 rounds up with probability frac(t)
    # to within 2**-17, and comparing avoids rounding the sum t + u.
    t = (v - zero) * inv
    t = t if t < qmax else qmax
    f = np.floor(t)
    u = np.float32(np.int32(h16)) * _U16 + _U17
    return np.int32(f) + np.int32(u < t - f)


@numba.njit(inline="always")
def _pack(row, out, bits, zero, inv, qmax, key):
    # Value j takes half j % 2 of the hash of pair j // 2.
    n = row.shape[0]
    if bits == 8:
        for k in range(n // 2):
            h = _pair_hash(k, key)
            out[2 * k] = np.uint8(_q(row[2 * k], h & _LO16, zero, inv, qmax))
            out[2 * k + 1] = np.uint8(_q(row[2 * k + 1], h >> _HI16, zero, inv, qmax))
    elif bits == 4:
        for k in range(n // 2):
            h = _pair_hash(k, key)
            out[k] = np.uint8(
                _q(row[2 * k], h & _LO16, zero, inv, qmax) | (_q(row[2 * k + 1], h >> _HI16, zero, inv, qmax) << 4)
            )
    else:
        for k in range(n // 4):
            h0, h1 = _pair_hash(2 * k, key), _pair_hash(2 * k + 1, key)
            out[k] = np.uint8(
                _q(row[4 * k], h0 & _LO16, zero, inv, qmax)
                | (_q(row[4 * k + 1], h0 >> _HI16, zero, inv, qmax) << 2)
                | (_q(row[4 * k + 2], h1 & _LO16, zero, inv, qmax) << 4)
                | (_q(row[4 * k + 3], h1 >> _HI16, zero, inv, qmax) << 6)
            )
    per = 8 // bits
    b = np.int32(0)
    for j in range(n - n % max(2, per), n):  # values after the last full group
        h = _pair_hash(j // 2, key) >> (_HI16 * np.uint32(j % 2))
        qj = _q(row[j], h & _LO16, zero, inv, qmax)
        if bits == 8:
            out[j] = np.uint8(qj)
        else:
            b |= qj << (bits * (j % per))
            out[n // per] = np.uint8(b)


@numba.njit(inline="always")
def _put_f32(out, k, v):
    b = _f32_bits(v)
    for i in range(4):
        out[k + i] = np.uint8((b >> (8 * i)) & 0xFF)


@numba.njit(inline="always")
def _get_f32(buf, k):
    b = np.int32(0)
    for i in range(4):
        b |= np.int32(buf[k + i]) << (8 * i)
    return _bits_f32(b)


@numba.njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def _encode(x, out, bits, ndata, seed_lo, seed_hi):
    rows, width = x.shape
    qmax = np.float32(2**bits - 1)
    skey = np.uint32(_hash32(_hash32(seed_lo) ^ seed_hi))
    xb = x.view(np.int32)
    for r in numba.prange(rows):
        row, keys, rec = x[r], xb[r], out[r]
        key = _hash_u32(
            np.uint32(_hash_u32(np.uint32(r >> 32) ^ skey) + np.uint32(r & 0xFFFFFFFF) * np.uint32(0x9E3779B9))
        )
        lo, hi = _ABS, ~_ABS
        for j in range(width):
            o = _order(keys[j])
            lo = min(lo, o)
            hi = max(hi, o)
        if width and (hi >= _POS_INF or lo <= _NEG_INF):
            rec[:ndata] = 0
            _put_f32(rec, ndata, np.float32(np.nan))
            _put_f32(rec, ndata + 4, np.float32(np.nan))
            continue
        mn = _bits_f32(_order(lo)) if width else np.float32(0.0)
        mx = _bits_f32(_order(hi)) if width else np.float32(0.0)
        span = np.float64(mx) - np.float64(mn)
        scale = np.float32(span / np.float64(qmax))
        if np.float64(scale) * qmax < span:  # round up (positive float bits are ordered), so t <= qmax
            scale = _bits_f32(_f32_bits(scale) + 1)
        inv = 1.0 / np.float64(scale) if scale > 0 else 0.0
        if inv <= _F32_MAX and span <= _F32_MAX:
            _pack(row, rec, bits, mn, np.float32(inv), qmax, key)
        else:
            _pack(row, rec, bits, np.float64(mn), inv, np.float64(qmax), key)
        _put_f32(rec, ndata, scale)
        _put_f32(rec, ndata + 4, mn)


@numba.njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def _decode(buf, out, bits, ndata):
    rows, width = out.shape
    for r in numba.prange(rows):
        rec, o = buf[r], out[r]
        # float64: q * S + Z neither overflows for rows spanning the float32 range nor rounds twice.
        s = np.float64(_get_f32(rec, ndata))
        z = np.float64(_get_f32(rec, ndata + 4))
        if bits == 8:
            for j in range(width):
                o[j] = np.float32(rec[j] * s + z)
        elif bits == 4:
            for k in range(width // 2):
                v = np.int32(rec[k])
                o[2 * k] = np.float32((v & 15) * s + z)
                o[2 * k + 1] = np.float32((v >> 4) * s + z)
            if width % 2:
                o[width - 1] = np.float32((rec[width // 2] & 15) * s + z)
        else:
            for k in range(width // 4):
                v = np.int32(rec[k])
                o[4 * k] = np.float32((v & 3) * s + z)
                o[4 * k + 1] = np.float32(((v >> 2) & 3) * s + z)
                o[4 * k + 2] = np.float32(((v >> 4) & 3) * s + z)
                o[4 * k + 3] = np.float32((v >> 6) * s + z)
            for j in range(width - width % 4, width):
                o[j] = np.float32(((rec[j // 4] >> (2 * (j % 4))) & 3) * s + z)


def record_bytes(width: int, bits: int) -> tuple[int, int]:
    """(data bytes, whole record bytes) of one encoded ``width``-wide row at ``bits`` (8, 4, 2)."""
    if bits == 32:
        raise ValueError("32-bit rows are sent as float32 directly, not encoded")
    data, params = row_bytes(width, bits)
    return data, data + params


def _check_out(out: torch.Tensor | None, shape: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous CPU {dtype} tensor of shape {shape}, got {out.dtype} {tuple(out.shape)}"
        )
    return out


def encode(x: torch.Tensor, bits: int, seed: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Quantize float32 rows ``x`` (rows, width) to ``bits`` (8, 4, 2): uint8 (rows, record) records."""
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"encode expects a 2-D float32 CPU tensor, got {x.dim()}-D {x.dtype} on {x.device}")
    ndata, record = record_bytes(x.shape[1], bits)
    x = x.detach().contiguous()
    out = _check_out(out, (x.shape[0], record), torch.uint8)
    if x.shape[0]:
        sync_numba_threads()
        seed &= 2**64 - 1
        _encode(x.numpy(), out.numpy(), bits, ndata, np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32))
    return out


def decode(buf: torch.Tensor, width: int, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The float32 (rows, width) values ``q * scale + zero`` of records made by :func:`encode`."""
    ndata, record = record_bytes(width, bits)
    if buf.dim() != 2 or buf.dtype != torch.uint8 or buf.shape[1] != record or buf.device.type != "cpu":
        raise ValueError(
            f"expected uint8 (rows, {record}) CPU records for width {width} at {bits} bits, got {buf.dtype} {tuple(buf.shape)}"
        )
    buf = buf.contiguous()
    out = _check_out(out, (buf.shape[0], width), torch.float32)
    if buf.shape[0]:
        sync_numba_threads()
        _decode(buf.numpy(), out.numpy(), bits, ndata)
    return out
