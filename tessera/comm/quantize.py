"""Stochastic integer quantization of exchanged feature rows (SuperGCN §2.4, §7.3).

Rows are quantized in groups of ``G`` consecutive rows (``tessera.comm.wire.GROUP_ROWS``, 4 by
default; a block's last group may be shorter, and no group spans two blocks). Each group gets one
zero point ``Z = min`` and scale ``S = (max - min) / (2**b - 1)`` over all its values (rounded up
to a float32); a value becomes ``q = floor(t + u)``, clamped to ``[0, 2**b - 1]``, where
``t = (x - Z) / S`` is rounded to a multiple of ``2**-16`` and ``u = r / 2**16`` for 16 random
bits ``r`` from a counter-based hash of (seed, row, column); both are computed in 16.16 fixed
point, ``(round(t * 2**16) + r) >> 16``. The rounding is unbiased, ``E[q * S + Z] = x`` up to
the ``2**-17 * S`` rounding of ``t`` and float32 arithmetic (under ``2e-4 * S``),
the same for any thread count, block split or group size, and needs no state. Every worker
encodes what it sends and decodes what it receives on its own (decentralised, §7.3 (1)). The
kernel is fused (§7.3 (2)): one pass finds the group's min and max, the second quantizes and
packs its rows while they are still in cache, multiplying by a reciprocal instead of dividing
(§7.3 (3)).

Wire layout: a flat ``uint8`` buffer holds one block per peer, back to back; a block of ``n``
rows is ``ceil(n / G)`` group records, ``sum(tessera.comm.wire.block_bytes(n, width, bits))``
bytes in all; a group of ``m <= G`` rows is::

    [row 0: ceil(width * bits / 8) data bytes] ... [row m - 1 data][scale: float32 LE][zero: float32 LE]

Value ``j`` of a row sits in its data byte ``j // (8 // bits)`` at bit offset
``(j % (8 // bits)) * bits`` (the first value in the low bits); unused bits of a row's last byte
are zero. :func:`tessera.comm.wire.layout` gives each block's first row, group and byte.

A constant group gets ``S = 0`` and decodes exactly. A group holding inf or nan is sent as
``S = Z = nan`` with zero data and decodes to all-nan (its ``G`` rows): non-finite values
propagate as through an fp32 exchange, if a little wider, and the sender does not raise (which
would leave its peers waiting in ``all_to_all``). Groups whose span overflows float32
(``max - min > 3.4e38``), whose scale is subnormal, or whose span is so small that
``(2**b - 1) * 2**16 / span`` overflows float32 are quantized in float64, so every finite
value decodes to within one step ``S`` of its group of the input, plus the float32 rounding of
the result.

The random bits come from lowbias32, the hash of :mod:`tessera.kernels.dropout`, one hash per two
values (16 bits each): value ``32c + i`` of a row (``i < 32``) takes half ``i // 16`` of the hash
of pair ``16c + i % 16``, so 16 hashes in one vector serve 32 values without shuffles. Both
passes are explicit 16-lane LLVM IR (numba would widen 32-bit hashes to 64-bit lanes and reduce
each row's min/max horizontally); on AVX-512BW hosts the pack pass takes 64 values at a time and
packs their codes with byte packs and multiply-adds. The pack pass prefetches the input a few
groups ahead, so DRAM keeps streaming while the core quantizes. Throughput on 1 M x 256, 2
threads, against the STREAM triad of the same run: ``benchmarks/bench_quantize.py``; figures in
``docs/design/quantize-kernels.md``.
"""

from __future__ import annotations

import numba
import numpy as np
import torch
from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from tessera.comm.quantize_torch import decode_torch, encode_torch
from tessera.comm.wire import PARAM_BYTES, block_splits, data_bytes, group_rows, layout
from tessera.kernels.hashing import const, index_hash, lowbias32_ir
from tessera.kernels.hashing import hash32 as _hash32
from tessera.kernels.hashing import hash_u32 as _hash_u32
from tessera.kernels.llvm import call_intrinsic, prefetch
from tessera.kernels.placement import host_kernels
from tessera.threads import sync_numba_threads

_F32_MAX = np.float64(np.finfo(np.float32).max)
_F32_HALF = _F32_MAX / 2
_F32_TINY = np.float32(np.finfo(np.float32).tiny)  # smallest normal
# No nnan/ninf (non-finite rows are detected; the overflow checks need inf) and no reassoc,
# which could turn (x - Z) * inv into x * inv - Z * inv and make it negative at x = Z.
_FAST = {"nsz", "arcp", "contract", "afn"}
_I32 = ir.IntType(32)
# decode outputs at least this large (a 32 MiB L3) are written with non-temporal stores: they
# would not stay in cache anyway, and skipping the read-for-ownership of each output line
# nearly halves decode's memory traffic.
_STREAM_BYTES = 32 << 20
_CHUNK = 64  # rows per parallel work item in decode
_PARAMS = PARAM_BYTES


_PAIR_MUL = 0x85EBCA6B  # pair index multiplier of the rounding hash (scalar and vector paths)
_pair_hash = index_hash(_PAIR_MUL)


def _splat(builder, x, count: int = 16):
    """A ``count``-lane vector holding the scalar ``x`` in every lane."""
    ty = ir.VectorType(x.type, count)
    one = builder.insert_element(ir.Constant(ty, None), x, ir.Constant(_I32, 0))
    return builder.shuffle_vector(one, one, ir.Constant(ir.VectorType(_I32, count), [0] * count))


@intrinsic
def _f32_bits(typingctx, x):
    return types.int32(types.float32), lambda context, builder, sig, args: builder.bitcast(args[0], _I32)


@intrinsic
def _bits_f32(typingctx, v):
    return types.float32(types.int32), lambda context, builder, sig, args: builder.bitcast(args[0], ir.FloatType())


_F32X16 = ir.VectorType(ir.FloatType(), 16)


def _reduce16(builder, op: str, v):
    """``llvm.vector.reduce.<op>`` of a 16 x float32 vector."""
    return call_intrinsic(builder, f"llvm.vector.reduce.{op}.v16f32", ir.FloatType(), v)


_LANES = 4  # independent accumulators in _value_range: min, max and fma chains have latency


@intrinsic
def _value_range(typingctx, flat, start, n):
    """``(min, max, probe)`` of the float32 values ``flat[start : start + n]``, ``n`` a multiple of
    16, with 16-lane vector min/max; ``probe`` is the sum of ``value * 0``, nan when a value is
    inf or nan (which min/max may skip). Empty: (inf, -inf, 0). Runs of 64 values go through
    ``_LANES`` independent accumulator sets, the 16-value rest through the first."""

    def codegen(context, builder, sig, args):
        aty, (ary, first, count) = sig.args[0], args
        base = cgutils.get_item_pointer(
            context, builder, aty, context.make_array(aty)(context, builder, ary), [first], wraparound=False
        )
        vp = builder.bitcast(base, _F32X16.as_pointer())
        ity = count.type
        nv = builder.udiv(count, ir.Constant(ity, 16))
        nbig = builder.udiv(nv, ir.Constant(ity, _LANES))
        zero = ir.Constant(ity, 0)
        init = (const(_F32X16, np.inf), const(_F32X16, -np.inf), const(_F32X16, 0.0))

        def update(acc, v):
            lo, hi, probe = acc
            return (
                builder.select(builder.fcmp_ordered("<", v, lo), v, lo),  # one vminps
                builder.select(builder.fcmp_ordered(">", v, hi), v, hi),
                builder.fadd(probe, builder.fmul(v, init[2], flags=["contract"]), flags=["contract"]),  # one fma
            )

        def counted_loop(name, trips, state, body):
            # for i in range(trips): state = body(i, state); returns the final state.
            pre = builder.basic_block
            loop, done = builder.append_basic_block(name), builder.append_basic_block(name + ".done")
            builder.cbranch(builder.icmp_unsigned(">", trips, zero), loop, done)
            builder.position_at_end(loop)
            i = builder.phi(ity)
            phis = [builder.phi(v.type) for v in state]
            nxt = body(i, phis)
            i2 = builder.add(i, ir.Constant(ity, 1))
            for phi, a, b in zip([i, *phis], [zero, *state], [i2, *nxt]):
                phi.add_incoming(a, pre)
                phi.add_incoming(b, loop)
            end = builder.basic_block
            builder.cbranch(builder.icmp_unsigned("<", i2, trips), loop, done)
            builder.position_at_end(done)
            outs = []
            for a, b in zip(state, nxt):
                phi = builder.phi(a.type)
                phi.add_incoming(a, pre)
                phi.add_incoming(b, end)
                outs.append(phi)
            return outs

        def big_body(i, phis):
            out = []
            for k in range(_LANES):
                j = builder.add(builder.mul(i, ir.Constant(ity, _LANES)), ir.Constant(ity, k))
                out.extend(update(phis[3 * k : 3 * k + 3], builder.load(builder.gep(vp, [j]), align=4)))
            return out

        accs = counted_loop("range.big", nbig, list(init) * _LANES, big_body)
        done_v = builder.mul(nbig, ir.Constant(ity, _LANES))

        def small_body(i, phis):
            return update(phis, builder.load(builder.gep(vp, [builder.add(done_v, i)]), align=4))

        accs[:3] = counted_loop("range.rest", builder.sub(nv, done_v), accs[:3], small_body)
        lo, hi, probe = accs[:3]
        for k in range(1, _LANES):
            a = accs[3 * k : 3 * k + 3]
            lo = builder.select(builder.fcmp_ordered("<", a[0], lo), a[0], lo)
            hi = builder.select(builder.fcmp_ordered(">", a[1], hi), a[1], hi)
            probe = builder.fadd(probe, a[2])
        out = [_reduce16(builder, "fmin", lo), _reduce16(builder, "fmax", hi)]
        nan = builder.bitcast(builder.fcmp_unordered("uno", probe, probe), ir.IntType(16))  # any lane nan
        bad = builder.icmp_unsigned("!=", nan, ir.Constant(ir.IntType(16), 0))
        out.append(builder.select(bad, ir.Constant(ir.FloatType(), np.nan), ir.Constant(ir.FloatType(), 0.0)))
        return context.make_tuple(builder, sig.return_type, out)

    return types.UniTuple(types.float32, 3)(flat, start, n), codegen


@intrinsic
def _field(typingctx, byte, shift, mask):
    """``(byte >> shift) & mask`` as a float32."""

    def codegen(context, builder, sig, args):
        v = builder.lshr(builder.zext(args[0], _I32), builder.trunc(args[1], _I32))
        return builder.uitofp(builder.and_(v, builder.trunc(args[2], _I32)), ir.FloatType())

    return types.float32(types.uint8, types.int64, types.int64), codegen


@numba.njit(inline="always")
def _q(v, zero, inv16, r, qmax):
    # floor((round(t * 2**16) + r) / 2**16) for t = (v - Z) / S and 16 random bits r: t + u
    # rounded down, u = r / 2**16 uniform; t >= 0 (Z is the minimum), and qmax clamps the rare
    # t that float rounding puts past qmax.
    t = np.int64((v - zero) * inv16 + 0.5)
    return min((t + r) >> 16, qmax)


@numba.njit(inline="always")
def _pack_tail(row, out, bits, zero, inv16, key, j0):
    # Values j0.. (j0 a multiple of 32) one at a time, with the random bits of _pack32.
    per = 8 // bits
    qmax = np.int64(2**bits - 1)
    b = np.int64(0)
    for j in range(j0, row.shape[0]):
        h = np.int64(_pair_hash((j >> 5) * 16 + (j & 15), key))
        qj = _q(row[j], zero, inv16, h >> 16 if j & 16 else h & 0xFFFF, qmax)
        if bits == 8:
            out[j] = np.uint8(qj)
        else:
            b |= qj << (bits * (j % per))
            if j % per == per - 1 or j == row.shape[0] - 1:
                out[j // per] = np.uint8(b)
                b = 0


_I32X16 = ir.VectorType(_I32, 16)
# Each vector kernel prefetches the input this many bytes past the values it quantizes, a few
# lines per chunk. Hardware prefetchers stop at 4 KiB pages, and a group of 4 rows of width 256
# is one page: without this, the min/max pass of every group waited for DRAM with the core idle
# and the pack pass ran with the memory idle. 9 to 10 KiB ran best of the distances from 4 to 16
# KiB, into L1 better than into L2, and one burst of a whole group's lines before each group was no
# faster than none (docs/design/quantize-kernels.md).
_PREFETCH_BYTES = 10240


def _prefetch(builder, ptr, lines: int) -> None:
    """Prefetch (read, into L1) the ``lines`` cache lines from ``_PREFETCH_BYTES`` past ``ptr``."""
    base = builder.bitcast(ptr, ir.IntType(8).as_pointer())
    for k in range(lines):
        prefetch(builder, builder.gep(base, [ir.Constant(_I32, _PREFETCH_BYTES + 64 * k)]))


def _sums16(builder, src, k: int, h, half: int, zero, inv16):
    """``round(t * 2**16) + r`` (see ``_q``; the unclamped code is its high 16 bits) for float32
    vector ``k`` at ``src``, with ``r`` half ``half`` of the 16 pair hashes ``h``."""
    v = builder.load(builder.gep(src, [ir.Constant(_I32, k)]), align=4)
    w = builder.fmul(builder.fsub(v, zero), inv16, flags=["contract"])
    t = builder.fptosi(builder.fadd(w, const(_F32X16, 0.5), flags=["contract"]), _I32X16)
    r = builder.lshr(h, const(_I32X16, 16)) if half else builder.and_(h, const(_I32X16, 0xFFFF))
    return builder.add(t, r)


def _pair_hashes(builder, first, key):
    """lowbias32 of the 16 pair indices ``first .. first + 15`` (an i32), keyed by ``key``."""
    pair = builder.add(_splat(builder, first), ir.Constant(_I32X16, list(range(16))))
    return lowbias32_ir(builder, builder.add(builder.mul(pair, const(_I32X16, _PAIR_MUL)), _splat(builder, key)))


def _chunk_kernel(values: int, bits: int, body):
    """Intrinsic ``(row, out, c, zero, inv16, key)`` that quantizes values ``c * values ..`` of
    float32 ``row`` into their ``values * bits / 8`` bytes of ``out``: ``body(builder, src, c,
    zero, inv16, key)`` returns the bytes, given ``src`` (the values as 16-float vectors), the
    chunk index ``c``, ``zero`` and ``inv16`` in every lane and the scalar hash ``key``. The input
    ``_PREFETCH_BYTES`` ahead is prefetched first."""
    nbytes = values * bits // 8

    @intrinsic
    def kernel(typingctx, row, out, c, zero, inv16, key):
        def codegen(context, builder, sig, args):
            c = args[2]
            first = builder.mul(c, ir.Constant(c.type, values))
            src = _item_ptr(context, builder, sig.args[0], args[0], first)
            src = builder.bitcast(src, _F32X16.as_pointer())
            _prefetch(builder, src, values // 16)
            b = body(builder, src, c, _splat(builder, args[3]), _splat(builder, args[4]), args[5])
            dst = _item_ptr(context, builder, sig.args[1], args[1], builder.mul(c, ir.Constant(c.type, nbytes)))
            builder.store(b, builder.bitcast(dst, b.type.as_pointer()), align=1)
            return context.get_dummy_value()

        return types.void(row, out, types.intp, types.float32, types.float32, types.uint32), codegen

    return kernel


def _pack32(bits: int):
    """Intrinsic ``(row, out, c, zero, inv16, key)``: quantize values ``32c .. 32c + 31`` of
    float32 ``row`` into their ``32 * bits / 8`` bytes of ``out``, 16 lanes at a time, in 16.16
    fixed point (see ``_q``). Value ``32c + i`` rounds with half ``i // 16`` of the hash of pair
    ``16c + i % 16``, so one vector of 16 hashes serves both halves without shuffles; packing
    ``2**bits``-ary values into bytes is done with shifts within 64-bit lanes and truncation."""
    i64x8 = ir.VectorType(ir.IntType(64), 8)
    qmax = const(_I32X16, 2**bits - 1)

    def body(builder, src, c, zero, inv16, key):
        h = _pair_hashes(builder, builder.trunc(builder.mul(c, ir.Constant(c.type, 16)), _I32), key)
        parts = []
        for half in (0, 1):
            v = builder.lshr(_sums16(builder, src, half, h, half, zero, inv16), const(_I32X16, 16))
            v = builder.select(builder.icmp_unsigned(">", v, qmax), qmax, v)
            if bits < 8:  # value pairs (lanes 2m, 2m + 1) meet in 64-bit lane m
                v = builder.bitcast(v, i64x8)
                v = builder.or_(v, builder.lshr(v, const(i64x8, 32 - bits)))
            if bits == 2:  # then pairs of pairs, in the low 32 bits of each 64-bit lane
                i64x4 = ir.VectorType(ir.IntType(64), 4)
                v = builder.bitcast(builder.trunc(v, ir.VectorType(_I32, 8)), i64x4)
                v = builder.or_(v, builder.lshr(v, const(i64x4, 28)))
            parts.append(builder.trunc(v, ir.VectorType(ir.IntType(8), v.type.count)))
        n = parts[0].type.count
        return builder.shuffle_vector(parts[0], parts[1], ir.Constant(ir.VectorType(_I32, 2 * n), list(range(2 * n))))

    return _chunk_kernel(32, bits, body)


def _pack64(bits: int):
    """Intrinsic like ``_pack32`` for values ``64c .. 64c + 63``, with the same random bits (as
    chunks ``2c`` and ``2c + 1``) and bytes, for AVX-512BW: the codes, the high halves of four
    16-lane vectors of 16.16 sums, go into one 64-byte vector by two word shuffles, a saturating
    byte pack (which clamps 8-bit codes at 255) and a qword permutation, then 4- and 2-bit codes
    merge within words and dwords by multiply-adds. Against ``_pack32``'s shifts and truncations
    this makes 4- and 2-bit encoding as fast as 8-bit (``docs/design/quantize-kernels.md``)."""
    i16x32, i8x64 = ir.VectorType(ir.IntType(16), 32), ir.VectorType(ir.IntType(8), 64)
    i64x8 = ir.VectorType(ir.IntType(64), 8)
    high_words = ir.Constant(ir.VectorType(_I32, 32), list(range(1, 64, 2)))
    # the byte pack leaves 128-bit lane l with values 8l .. 8l + 7, then 32 + 8l .. 32 + 8l + 7
    order = ir.Constant(ir.VectorType(_I32, 8), [0, 2, 4, 6, 1, 3, 5, 7])

    def body(builder, src, c, zero, inv16, key):
        first = builder.trunc(builder.mul(c, ir.Constant(c.type, 32)), _I32)
        words = []  # 32 codes in order: the high halves of two sum vectors, by one shuffle
        for k in (0, 1):
            h = _pair_hashes(builder, builder.add(first, ir.Constant(_I32, 16 * k)), key)
            lo, hi = (builder.bitcast(_sums16(builder, src, 2 * k + i, h, i, zero, inv16), i16x32) for i in (0, 1))
            words.append(builder.shuffle_vector(lo, hi, high_words))
        b = call_intrinsic(builder, "llvm.x86.avx512.packuswb.512", i8x64, words[0], words[1])  # saturates at 255
        b = builder.bitcast(builder.shuffle_vector(*[builder.bitcast(b, i64x8)] * 2, order), i8x64)
        if bits < 8:
            qmax = const(i8x64, 2**bits - 1)
            b = builder.select(builder.icmp_unsigned(">", b, qmax), qmax, b)
            w = ir.Constant(i8x64, [1, 1 << bits] * 32)  # byte pairs -> one 2*bits-bit word
            b = call_intrinsic(builder, "llvm.x86.avx512.pmaddubs.w.512", i16x32, b, w)
            if bits == 2:  # word pairs -> one byte-valued dword
                b = call_intrinsic(
                    builder, "llvm.x86.avx512.pmaddw.d.512", _I32X16, b, ir.Constant(i16x32, [1, 16] * 16)
                )
            b = builder.trunc(b, ir.VectorType(ir.IntType(8), 64 * bits // 8))
        return b

    return _chunk_kernel(64, bits, body)


def _host_has_avx512bw() -> bool:
    """Whether numba compiles for this host and it has AVX-512BW (``_pack64``'s instructions)."""
    if numba.config.CPU_NAME not in (None, "host") or numba.config.CPU_FEATURES:  # type: ignore[attr-defined]
        return False  # a portable target (e.g. NUMBA_CPU_NAME=generic): keep to generic IR
    try:
        return bool(llvm_binding.get_host_cpu_features().get("avx512bw"))
    except RuntimeError:
        return False


_AVX512BW = _host_has_avx512bw()


def _chunks_by_bits(kernels):
    """An inlined ``(row, out, bits, zero, inv16, key, c0, c1)`` that runs chunks ``c0 .. c1 - 1``
    through the one of ``kernels`` (for 8, 4 and 2 bits) that ``bits`` names."""
    k8, k4, k2 = kernels

    @numba.njit(inline="always")
    def run(row, out, bits, zero, inv16, key, c0, c1):
        for c in range(c0, c1):
            if bits == 8:
                k8(row, out, c, zero, inv16, key)
            elif bits == 4:
                k4(row, out, c, zero, inv16, key)
            else:
                k2(row, out, c, zero, inv16, key)

    return run


_pack32_chunks = _chunks_by_bits([_pack32(b) for b in (8, 4, 2)])
# Only hosts with AVX-512BW compile the 64-value kernels: elsewhere no x86 intrinsic is emitted.
_pack64_chunks = _chunks_by_bits([_pack64(b) for b in (8, 4, 2)]) if _AVX512BW else None


@numba.njit(inline="always")
def _pack(row, out, bits, zero, inv16, key):
    # float32 zero and inv16: whole 64-value chunks (AVX-512BW) and 32-value chunks in vectors,
    # then the rest one at a time.
    wide = row.shape[0] // 64 if _AVX512BW else 0
    if _AVX512BW:
        _pack64_chunks(row, out, bits, zero, inv16, key, 0, wide)
    chunks = row.shape[0] // 32
    _pack32_chunks(row, out, bits, zero, inv16, key, 2 * wide, chunks)
    _pack_tail(row, out, bits, zero, inv16, key, chunks * 32)


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


@numba.njit(inline="always")
def _row_key(r, skey):
    # The hash key of row r of the encoded tensor: each value's random bits depend on (seed, row,
    # column) only, not on blocks, groups or threads.
    return _hash_u32(
        np.uint32(_hash_u32(np.uint32(r >> 32) ^ skey) + np.uint32(r & 0xFFFFFFFF) * np.uint32(0x9E3779B9))
    )


@numba.njit(fastmath=_FAST, cache=True, nogil=True)
def _encode_rare(rows, rec, bits, ndata, mn, mx, finite, r0, skey):
    # Groups the float32 path cannot take: non-finite values, spans beyond float32, subnormal
    # scales, width 0. ``rows`` are the group's rows, ``rec`` its bytes. Out of line to keep the
    # hot loop small.
    m, width = rows.shape
    pofs = m * ndata
    if width == 0:
        _put_f32(rec, pofs, np.float32(0.0))
        _put_f32(rec, pofs + 4, np.float32(0.0))
    elif not finite:
        rec[:pofs] = 0
        _put_f32(rec, pofs, np.float32(np.nan))
        _put_f32(rec, pofs + 4, np.float32(np.nan))
    else:
        span, scale = _scale(mn, mx, np.float64(2**bits - 1))
        inv16 = 65536.0 / np.float64(scale) if scale > 0 else 0.0
        for i in range(m):
            rr = rec[i * ndata : (i + 1) * ndata]
            _pack_tail(rows[i], rr, bits, np.float64(mn), inv16, _row_key(r0 + i, skey), 0)
        _put_f32(rec, pofs, scale)
        _put_f32(rec, pofs + 4, mn)


@numba.njit(inline="always")
def _locate(g, b, group, stride, ndata, rstart, gstart, bstart):
    # Group g of block b: its first row, its number of rows (short at the block's end), the
    # offset of its bytes and of its parameters.
    k = g - gstart[b]
    r0 = rstart[b] + k * group
    m = min(group, rstart[b + 1] - r0)
    off = bstart[b] + k * stride
    return r0, m, off, off + m * ndata


@numba.njit(parallel=True, fastmath=_FAST, cache=True, nogil=True)
def _encode(x, out, bits, ndata, group, rstart, gstart, bstart, seed_lo, seed_hi):
    width = x.shape[1]
    qmax = np.float64(2**bits - 1)
    skey = np.uint32(_hash32(_hash32(seed_lo) ^ seed_hi))
    flat = x.reshape(-1)  # x is C-contiguous: a group's rows are one run
    stride = group * ndata + _PARAMS
    for g in numba.prange(gstart[-1]):
        b = np.searchsorted(gstart, g, side="right") - 1
        r0, m, off, pofs = _locate(g, b, group, stride, ndata, rstart, gstart, bstart)
        # Pass 1: the group's min and max (its rows then sit in L1 for pass 2).
        first, n = r0 * width, m * width
        mn, mx, probe = _value_range(flat, first, n - n % 16)
        for k in range(first + n - n % 16, first + n):
            v = flat[k]
            mn = v if v < mn else mn
            mx = v if v > mx else mx
            probe += v * np.float32(0.0)
        finite = probe == 0  # no inf or nan in the group
        span, scale = _scale(mn, mx, qmax)  # -inf for width 0
        # qmax / span rather than 1 / scale keeps the division off the scale's rounding: a shorter
        # dependency chain before the rows can be packed; the two differ by under 2**-22.
        inv16 = np.float32(qmax * 65536.0 / span) if span > 0 else np.float32(0.0)
        # a span so small that qmax * 2**16 / span overflows float32 goes the float64 way too
        fits = span <= _F32_MAX and inv16 <= _F32_MAX and (scale >= _F32_TINY or scale == 0)
        if finite and n > 0 and fits:
            for i in range(m):
                rec = out[off + i * ndata : off + (i + 1) * ndata]
                _pack(x[r0 + i], rec, bits, mn, inv16, _row_key(r0 + i, skey))
            _put_f32(out, pofs, scale)
            _put_f32(out, pofs + 4, mn)
        else:
            _encode_rare(x[r0 : r0 + m], out[off : pofs + _PARAMS], bits, ndata, mn, mx, finite, r0, skey)


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

            v = builder.fmul(builder.uitofp(v, f32x16), _splat(builder, args[3]), flags=["contract"])
            v = builder.fadd(v, _splat(builder, args[4]), flags=["contract"])
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
def _decode(buf, out, bits, ndata, group, rstart, gstart, bstart, stream):
    width = out.shape[1]
    ngroups = gstart[-1]
    stride = group * ndata + _PARAMS
    chunk = max(1, _CHUNK // group)  # groups per parallel work item
    for c in numba.prange((ngroups + chunk - 1) // chunk):
        g0 = c * chunk
        b = np.searchsorted(gstart, g0, side="right") - 1
        for g in range(g0, min(ngroups, g0 + chunk)):
            while gstart[b + 1] <= g:
                b += 1
            r0, m, off, pofs = _locate(g, b, group, stride, ndata, rstart, gstart, bstart)
            s, z = _get_f32(buf, pofs), _get_f32(buf, pofs + 4)
            wide = not abs(np.float64(z)) + np.float64(s) * (2**bits - 1) < _F32_HALF
            for i in range(m):
                rec, o = buf[off + i * ndata : off + (i + 1) * ndata], out[r0 + i]
                if wide:
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


def _check_out(out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device.type != "cpu" or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous CPU {dtype} tensor of shape {shape}, got {out.dtype} {tuple(out.shape)}"
        )
    return out


def encode(
    x: torch.Tensor,
    bits: int,
    seed: int,
    out: torch.Tensor | None = None,
    splits=None,
    group: int | None = None,
) -> torch.Tensor:
    """Quantize float32 rows ``x`` (rows, width) to ``bits`` (8, 4, 2): a flat uint8 buffer holding
    one block per entry of ``splits`` (row counts summing to ``rows``; default one block of all
    rows), each laid out as in the module docstring, blocks back to back. ``group`` defaults to
    :data:`tessera.comm.wire.GROUP_ROWS`; ``out`` (uint8, the buffer's length) is reused. Tensors
    off the CPU, or any under ``--backend torch``, take :func:`tessera.comm.quantize_torch.encode_torch`
    (the same bytes)."""
    if not host_kernels(x, *([] if out is None else [out])):
        return encode_torch(x, bits, seed, out=out, splits=splits, group=group)
    if x.dim() != 2 or x.dtype != torch.float32 or x.device.type != "cpu":
        raise TypeError(f"encode expects a 2-D float32 CPU tensor, got {x.dim()}-D {x.dtype} on {x.device}")
    rows, width = x.shape
    splits = block_splits(splits, rows)
    group = group_rows(group)
    rstart, gstart, bstart = layout(splits, width, bits, group)
    if rstart[-1] != rows:
        raise ValueError(f"splits {splits} sum to {int(rstart[-1])}, but x has {rows} rows")
    x = x.detach().contiguous()
    out = _check_out(out, (int(bstart[-1]),), torch.uint8)
    if gstart[-1]:
        sync_numba_threads()
        seed &= 2**64 - 1
        lo, hi = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
        _encode(x.numpy(), out.numpy(), bits, data_bytes(width, bits), group, rstart, gstart, bstart, lo, hi)
    return out


def decode(
    buf: torch.Tensor,
    width: int,
    bits: int,
    splits,
    out: torch.Tensor | None = None,
    group: int | None = None,
) -> torch.Tensor:
    """The float32 (rows, width) values ``q * scale + zero`` of a buffer made by :func:`encode`
    with the same ``splits`` (a row count for one block, or one per block), ``bits`` and ``group``;
    ``out`` is reused when given. Tensors off the CPU, or any under ``--backend torch``, take
    :func:`tessera.comm.quantize_torch.decode_torch` (the same values)."""
    if not host_kernels(buf, *([] if out is None else [out])):
        return decode_torch(buf, width, bits, splits, out=out, group=group)
    splits = block_splits(splits, None)
    group = group_rows(group)
    rstart, gstart, bstart = layout(splits, width, bits, group)
    if buf.dtype != torch.uint8 or buf.device.type != "cpu" or buf.numel() != bstart[-1]:
        raise ValueError(
            f"expected {int(bstart[-1])} uint8 CPU bytes for blocks of {splits} rows of width {width} at {bits} bits "
            f"in groups of {group}, got {buf.dtype} {tuple(buf.shape)}"
        )
    buf = buf.contiguous().view(-1)
    out = _check_out(out, (int(rstart[-1]), width), torch.float32)
    if gstart[-1]:
        sync_numba_threads()
        # Streaming stores need every row 64-byte aligned: a 64-byte-aligned tensor, width % 16 == 0.
        stream = out.nbytes >= _STREAM_BYTES and width % 16 == 0 and out.data_ptr() % 64 == 0
        _decode(buf.numpy(), out.numpy(), bits, data_bytes(width, bits), group, rstart, gstart, bstart, stream)
    return out
