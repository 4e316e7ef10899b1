"""Stochastic integer quantization of exchanged feature rows (SuperGCN §2.4, §7.3).

Each row gets its own zero point ``Z = min`` and scale ``S = (max - min) / (2**b - 1)`` (rounded
up to a float32); a value becomes ``q = floor((x - Z) / S + u)``, clamped to ``[0, 2**b - 1]``,
with ``u`` uniform in (0, 1) from a counter-based hash of (seed, row, column). The rounding is
unbiased, ``E[q * S + Z] = x`` up to 16-bit ``u`` and float32 arithmetic (under ``2e-4 * S``),
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
subnormal are quantized in float64, so every finite row decodes to within one step ``S`` of its
input, plus the float32 rounding of the result.

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
from numba.core import cgutils
from numba.extending import intrinsic

from tessera.dist.wire import row_bytes
from tessera.ops.dropout import _hash32
from tessera.ops.threads import sync_numba_threads

_F32_MAX = np.float64(np.finfo(np.float32).max)
_F32_HALF = _F32_MAX / 2
_F32_TINY = np.float32(np.finfo(np.float32).tiny)  # smallest normal
_ABS = np.int32(0x7FFFFFFF)
_POS_INF = np.int32(0x7F800000)  # order keys >= this: +inf or nan
_NEG_INF = np.int32(-0x7F800001)  # order keys <= this: -inf or nan (the key of -inf)
# No nnan/ninf (non-finite rows are detected; the overflow checks need inf) and no reassoc,
# which could turn (x - Z) * inv into x * inv - Z * inv and make it negative at x = Z.
_FAST = {"nsz", "arcp", "contract", "afn"}
_I32 = ir.IntType(32)
# decode outputs at least this large (a 32 MiB L3) are written with non-temporal stores: they
# would not stay in cache anyway, and skipping the read-for-ownership of each output line
# nearly halves decode's memory traffic.
_STREAM_BYTES = 32 << 20
_CHUNK = 64  # rows per parallel work item in decode


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


def _one_plus_u(builder, h, high):
    # 1 + (h16 + 1/2) / 2**16 as float32 bits: the 16 random bits under the exponent of 1.0, and
    # the bit below them set, so u is centred in its 2**-16 cell; no int-to-float conversion.
    v = builder.lshr(h, ir.Constant(_I32, 9)) if high else builder.shl(h, ir.Constant(_I32, 7))
    v = builder.or_(builder.and_(v, ir.Constant(_I32, 0x7FFF80)), ir.Constant(_I32, 0x3F800040))
    return builder.bitcast(v, ir.FloatType())


@intrinsic
def _u_lo(typingctx, h):
    return types.float32(types.uint32), lambda context, builder, sig, args: _one_plus_u(builder, args[0], False)


@intrinsic
def _u_hi(typingctx, h):
    return types.float32(types.uint32), lambda context, builder, sig, args: _one_plus_u(builder, args[0], True)


@intrinsic
def _f32_bits(typingctx, x):
    return types.int32(types.float32), lambda context, builder, sig, args: builder.bitcast(args[0], _I32)


@intrinsic
def _bits_f32(typingctx, v):
    return types.float32(types.int32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.FloatType())


@intrinsic
def _order(typingctx, b):
    """float32 bits <-> int32 keys in the same order (an involution): integer min/max vectorise,
    numba's float min/max do not."""

    def codegen(context, builder, sig, args):
        sign = builder.ashr(args[0], ir.Constant(_I32, 31))
        return builder.xor(args[0], builder.and_(sign, ir.Constant(_I32, 0x7FFFFFFF)))

    return types.int32(types.int32), codegen


@intrinsic
def _min32(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.select(builder.icmp_signed("<", args[0], args[1]), args[0], args[1])

    return types.int32(types.int32, types.int32), codegen


@intrinsic
def _max32(typingctx, a, b):
    def codegen(context, builder, sig, args):
        return builder.select(builder.icmp_signed(">", args[0], args[1]), args[0], args[1])

    return types.int32(types.int32, types.int32), codegen


@intrinsic
def _field(typingctx, byte, shift, mask):
    """``(byte >> shift) & mask`` as a float32."""

    def codegen(context, builder, sig, args):
        v = builder.lshr(builder.zext(args[0], _I32), builder.trunc(args[1], _I32))
        return builder.uitofp(builder.and_(v, builder.trunc(args[2], _I32)), ir.FloatType())

    return types.float32(types.uint8, types.int64, types.int64), codegen


@numba.njit(inline="always")
def _q(v, f, zero, inv, top):
    # floor(t + u) as trunc(t + f) - 1 with f = 1 + u: t + f >= 1, so truncation is floor.
    # top = 2**b clamps the rare t + f that rounds past qmax + 1.
    w = (v - zero) * inv + f
    w = w if w < top else top
    return np.int32(w) - np.int32(1)


@numba.njit(inline="always")
def _pack(row, out, bits, zero, inv, top, key):
    # Value j takes half j % 2 of the hash of pair j // 2.
    n = row.shape[0]
    if bits == 8:
        for k in range(n // 2):
            h = _pair_hash(k, key)
            out[2 * k] = np.uint8(_q(row[2 * k], _u_lo(h), zero, inv, top))
            out[2 * k + 1] = np.uint8(_q(row[2 * k + 1], _u_hi(h), zero, inv, top))
    elif bits == 4:
        for k in range(n // 2):
            h = _pair_hash(k, key)
            out[k] = np.uint8(
                _q(row[2 * k], _u_lo(h), zero, inv, top) | (_q(row[2 * k + 1], _u_hi(h), zero, inv, top) << 4)
            )
    else:
        for k in range(n // 4):
            h0, h1 = _pair_hash(2 * k, key), _pair_hash(2 * k + 1, key)
            out[k] = np.uint8(
                _q(row[4 * k], _u_lo(h0), zero, inv, top)
                | (_q(row[4 * k + 1], _u_hi(h0), zero, inv, top) << 2)
                | (_q(row[4 * k + 2], _u_lo(h1), zero, inv, top) << 4)
                | (_q(row[4 * k + 3], _u_hi(h1), zero, inv, top) << 6)
            )
    per = 8 // bits
    b = np.int32(0)
    for j in range(n - n % max(2, per), n):  # values after the last full group
        h = _pair_hash(j // 2, key)
        qj = _q(row[j], _u_hi(h) if j % 2 else _u_lo(h), zero, inv, top)
        if bits == 8:
            out[j] = np.uint8(qj)
        else:
            b |= qj << (bits * (j % per))
            out[n // per] = np.uint8(b)


def _item_ptr(context, builder, aryty, ary, k):
    return cgutils.get_item_pointer(
        context, builder, aryty, context.make_array(aryty)(context, builder, ary), [k], wraparound=False
    )


def _f32_ptr(context, builder, aryty, ary, k):
    return builder.bitcast(_item_ptr(context, builder, aryty, ary, k), ir.FloatType().as_pointer())


@intrinsic
def _put_f32(typingctx, buf, k, v):
    """Store float32 ``v`` at byte ``k`` of uint8 array ``buf`` (unaligned, little-endian)."""

    def codegen(context, builder, sig, args):
        builder.store(args[2], _f32_ptr(context, builder, sig.args[0], args[0], args[1]), align=1)
        return context.get_dummy_value()

    return types.void(buf, types.intp, types.float32), codegen


@intrinsic
def _get_f32(typingctx, buf, k):
    """The float32 at byte ``k`` of uint8 array ``buf``."""

    def codegen(context, builder, sig, args):
        return builder.load(_f32_ptr(context, builder, sig.args[0], args[0], args[1]), align=1)

    return types.float32(buf, types.intp), codegen


@numba.njit(inline="always")
def _scale(mn, mx, qmax):
    # (max - min) / qmax in float64, rounded up to a float32 (positive float bits are ordered) so
    # that t <= qmax; 0 for constant rows.
    span = np.float64(mx) - np.float64(mn)
    scale = np.float32(span * (1.0 / qmax))
    if np.float64(scale) * qmax < span:
        scale = _bits_f32(_f32_bits(scale) + 1)
    return span, scale


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def _encode_rare(row, rec, bits, ndata, lo, hi, key):
    # Rows the float32 path cannot take: non-finite values, spans beyond float32, subnormal
    # scales, width 0. Out of line to keep the hot loop small.
    if row.shape[0] == 0:
        _put_f32(rec, ndata, np.float32(0.0))
        _put_f32(rec, ndata + 4, np.float32(0.0))
    elif hi >= _POS_INF or lo <= _NEG_INF:
        rec[:ndata] = 0
        _put_f32(rec, ndata, np.float32(np.nan))
        _put_f32(rec, ndata + 4, np.float32(np.nan))
    else:
        mn = _bits_f32(_order(lo))
        span, scale = _scale(mn, _bits_f32(_order(hi)), np.float64(2**bits - 1))
        inv = 1.0 / np.float64(scale) if scale > 0 else 0.0
        _pack(row, rec, bits, np.float64(mn), inv, np.float64(2**bits), key)
        _put_f32(rec, ndata, scale)
        _put_f32(rec, ndata + 4, mn)


@numba.njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def _encode(x, out, bits, ndata, seed_lo, seed_hi):
    rows, width = x.shape
    qmax, top = np.float64(2**bits - 1), np.float32(2**bits)
    skey = np.uint32(_hash32(_hash32(seed_lo) ^ seed_hi))
    xb = x.view(np.int32)
    for r in numba.prange(rows):
        row, keys, rec = x[r], xb[r], out[r]
        lo, hi = _ABS, ~_ABS
        for j in range(width):
            o = _order(keys[j])
            lo = _min32(lo, o)
            hi = _max32(hi, o)
        key = _hash_u32(
            np.uint32(_hash_u32(np.uint32(r >> 32) ^ skey) + np.uint32(r & 0xFFFFFFFF) * np.uint32(0x9E3779B9))
        )
        mn = _bits_f32(_order(lo))
        span, scale = _scale(mn, _bits_f32(_order(hi)), qmax)  # nan for non-finite rows and width 0
        # qmax / span rather than 1 / scale keeps the division off the scale's rounding: a shorter
        # dependency chain before the row can be packed; the two differ by under 2**-22.
        inv = np.float32(qmax / span) if span > 0 else np.float32(0.0)
        if span <= _F32_MAX and (scale >= _F32_TINY or scale == 0):
            _pack(row, rec, bits, mn, inv, top, key)
            _put_f32(rec, ndata, scale)
            _put_f32(rec, ndata + 4, mn)
        else:
            _encode_rare(row, rec, bits, ndata, lo, hi, key)


def _stream16(bits: int):
    """Intrinsic ``(rec, o, k, s, z)``: decode values ``16k .. 16k + 15`` of ``rec`` into ``o`` with one
    64-byte-aligned non-temporal vector store (the caller checks the alignment)."""
    per = 8 // bits
    f32x16, i32x16 = ir.VectorType(ir.FloatType(), 16), ir.VectorType(_I32, 16)

    @intrinsic
    def stream16(typingctx, rec, o, k, s, z):
        def codegen(context, builder, sig, args):
            k = args[2]
            src = _item_ptr(context, builder, sig.args[0], args[0], builder.mul(k, ir.Constant(k.type, 16 // per)))
            dst = _item_ptr(context, builder, sig.args[1], args[1], builder.mul(k, ir.Constant(k.type, 16)))
            v = builder.load(builder.bitcast(src, ir.VectorType(ir.IntType(8), 16 // per).as_pointer()), align=1)
            if per > 1:  # lane i takes byte i // per, shifted right by (i % per) * bits
                v = builder.shuffle_vector(v, v, ir.Constant(i32x16, [i // per for i in range(16)]))
            v = builder.zext(v, i32x16)
            if per > 1:
                v = builder.lshr(v, ir.Constant(i32x16, [(i % per) * bits for i in range(16)]))
                v = builder.and_(v, ir.Constant(i32x16, [2**bits - 1] * 16))

            def splat(x):
                one = builder.insert_element(ir.Constant(f32x16, None), x, ir.Constant(_I32, 0))
                return builder.shuffle_vector(one, one, ir.Constant(i32x16, [0] * 16))

            v = builder.fmul(builder.uitofp(v, f32x16), splat(args[3]), flags=["contract"])
            v = builder.fadd(v, splat(args[4]), flags=["contract"])
            store = builder.store(v, builder.bitcast(dst, f32x16.as_pointer()), align=64)
            store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(_I32, 1)]))
            return context.get_dummy_value()

        return types.void(rec, o, types.intp, types.float32, types.float32), codegen

    return stream16


_stream16_8, _stream16_4, _stream16_2 = _stream16(8), _stream16(4), _stream16(2)


@intrinsic
def _fence(typingctx):
    """Order the non-temporal stores before anything that follows."""

    def codegen(context, builder, sig, args):
        builder.fence("seq_cst")
        return context.get_dummy_value()

    return types.void(), codegen


@numba.njit(inline="always")
def _unpack(rec, o, bits, s, z):
    width = o.shape[0]
    if bits == 8:
        for j in range(width):
            o[j] = np.float32(rec[j]) * s + z
    elif bits == 4:
        for k in range(width // 2):
            v = rec[k]
            o[2 * k] = _field(v, 0, 15) * s + z
            o[2 * k + 1] = _field(v, 4, 15) * s + z
    else:
        for k in range(width // 4):
            v = rec[k]
            o[4 * k] = _field(v, 0, 3) * s + z
            o[4 * k + 1] = _field(v, 2, 3) * s + z
            o[4 * k + 2] = _field(v, 4, 3) * s + z
            o[4 * k + 3] = _field(v, 6, 3) * s + z
    if bits < 8:
        per = 8 // bits
        for j in range(width - width % per, width):
            o[j] = _field(rec[j // per], bits * (j % per), 2**bits - 1) * s + z


@numba.njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def _decode(buf, out, bits, ndata, stream):
    rows, width = out.shape
    for c in numba.prange((rows + _CHUNK - 1) // _CHUNK):
        for r in range(c * _CHUNK, min(rows, (c + 1) * _CHUNK)):
            rec, o = buf[r], out[r]
            s, z = _get_f32(rec, ndata), _get_f32(rec, ndata + 4)
            if not abs(np.float64(z)) + np.float64(s) * (2**bits - 1) < _F32_HALF:
                _unpack(rec, o, bits, np.float64(s), np.float64(z))  # q * S + Z could overflow float32
            elif not stream:
                _unpack(rec, o, bits, s, z)
            elif bits == 8:
                for k in range(width // 16):
                    _stream16_8(rec, o, k, s, z)
            elif bits == 4:
                for k in range(width // 16):
                    _stream16_4(rec, o, k, s, z)
            else:
                for k in range(width // 16):
                    _stream16_2(rec, o, k, s, z)
        if stream:
            _fence()


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
        # Streaming stores need every row 64-byte aligned: a 64-byte-aligned tensor, width % 16 == 0.
        stream = out.nbytes >= _STREAM_BYTES and width % 16 == 0 and out.data_ptr() % 64 == 0
        _decode(buf.numpy(), out.numpy(), bits, ndata, stream)
    return out
