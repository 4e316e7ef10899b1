"""The exchange quantization of :mod:`tessera.comm.quantize` in portable torch ops, for any device.

:func:`encode_torch` and :func:`decode_torch` take the arguments of ``encode`` and ``decode`` and
give bitwise their bytes and values (wire format, rounding and random bits as in that module's
docstring), in vectorised tensor ops on the input's device; the numba kernels are their fast CPU
form. What they reproduce of the kernels' arithmetic:

* the hashes (lowbias32 of the seed, the row and the value pair) run on int64 tensors holding
  32-bit values, as in :mod:`tessera.kernels.dropout_torch`;
* the kernels compute ``t = (x - Z) * inv16 + 0.5`` as one fused multiply-add, in float32 for
  the values their vector chunks take (a row's first ``32 * (width // 32)``) and in float64 for
  groups quantized in float64; the scalar tail of a float32 row rounds the float32 product, then
  adds the 0.5 in float64. Here the product of two float32 is exact in float64, so the fused
  float32 form is the float64 sum rounded once to float32 (that sum is exact wherever it decides
  the code). In float64, rounding the product first truncates to the same integer: ``t`` could
  only change if the rounded product were a half-integer, which the exact sum then reaches too;
* decode's ``q * S + Z`` is a float32 multiply-add (float64 where it could overflow float32): the
  product is exact in float64, and the sum, rounded to odd there (Boldo and Melquiond, IEEE TC
  2008), rounds once to float32 as the fused form does;
* the sign of a zero point ``Z = 0`` when a group holds zeros of both signs: the zero the kernel's
  min pass keeps, by its lane order (:func:`_zero_sign`). Groups whose float32 ``inv16`` overflows
  (spans under ``qmax * 2**16 / 3.4e38``) are quantized in float64 here; the numba kernel's fast
  path takes them and its codes for them are undefined.

Rows are processed in chunks of about ``_CHUNK`` values, so no int64 temporary spans a large
input. Parameters are written as little-endian float32 (the byte order of every torch device).
"""

from __future__ import annotations

import numpy as np
import torch

from tessera.comm.wire import PARAM_BYTES, block_splits, data_bytes, group_rows, layout
from tessera.kernels.dropout_torch import _lowbias32, _lowbias32_int, _mul32

_M32 = 0xFFFFFFFF
_PAIR_MUL = 0x85EBCA6B  # the pair index multiplier of the rounding hash (tessera.comm.quantize)
_ROW_MUL = 0x9E3779B9  # the row index multiplier of a row's hash key
_F32_MAX = float(np.finfo(np.float32).max)
_F32_HALF = _F32_MAX / 2
_F32_TINY = float(np.finfo(np.float32).tiny)  # smallest normal
_NAN_BITS = 0x7FC00000  # the quiet nan the kernels write as S and Z of a non-finite group
_CHUNK = 1 << 18  # values per chunk of rows (int64 temporaries of 2 MiB)


def _check_out(
    out: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    if out is None:
        return torch.empty(shape, dtype=dtype, device=device)
    if tuple(out.shape) != shape or out.dtype != dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"out must be a contiguous {dtype} tensor of shape {shape} on {device}, "
            f"got {out.dtype} {tuple(out.shape)} on {out.device}"
        )
    return out


class _Places:
    """Where each row's data bytes and each group's parameters lie in the buffer (device tensors)."""

    def __init__(self, splits: list[int], width: int, bits: int, group: int, device: torch.device) -> None:
        self.rstart, self.gstart, self.bstart = layout(splits, width, bits, group)
        self.rows, self.groups, self.nbytes = int(self.rstart[-1]), int(self.gstart[-1]), int(self.bstart[-1])
        self.ndata = data_bytes(width, bits)
        stride = group * self.ndata + PARAM_BYTES
        rstart, gstart, bstart = (torch.as_tensor(a, device=device) for a in (self.rstart, self.gstart, self.bstart))
        blocks = torch.arange(len(splits), device=device)
        # Each row: its block, its group and the offset of its data bytes.
        blk = torch.repeat_interleave(
            blocks, torch.as_tensor(np.diff(self.rstart), device=device), output_size=self.rows
        )
        local = torch.arange(self.rows, device=device) - rstart[blk]
        self.group_of = gstart[blk] + local // group
        self.row_in_group = local % group
        self.row_byte = bstart[blk] + (local // group) * stride + (local % group) * self.ndata
        # Each group: the offset of its scale and zero point, after its rows.
        blk = torch.repeat_interleave(
            blocks, torch.as_tensor(np.diff(self.gstart), device=device), output_size=self.groups
        )
        k = torch.arange(self.groups, device=device) - gstart[blk]
        first = rstart[blk] + k * group
        m = torch.minimum(rstart[blk + 1] - first, torch.full_like(first, group))
        self.param_byte = bstart[blk] + k * stride + m * self.ndata
        self.group_size = m

    def chunks(self, width: int):
        """(first row, end row) of consecutive pieces of about ``_CHUNK`` values."""
        per = max(1, _CHUNK // max(1, width))
        for a in range(0, self.rows, per):
            yield a, min(self.rows, a + per)


def _row_keys(rows: torch.Tensor, seed: int) -> torch.Tensor:
    """The hash key of each row index (int64): ``_row_key`` of :mod:`tessera.comm.quantize`."""
    seed &= 2**64 - 1
    skey = _lowbias32_int(_lowbias32_int(seed & _M32) ^ (seed >> 32))
    hi = _lowbias32(((rows >> 32) ^ skey) & _M32)
    return _lowbias32((hi + _mul32(rows & _M32, _ROW_MUL)) & _M32)


def _random_bits(keys: torch.Tensor, width: int) -> torch.Tensor:
    """The 16 random bits of each value of rows keyed ``keys``: value ``32c + i`` takes half
    ``i // 16`` of the hash of pair ``16c + i % 16``."""
    pairs = torch.arange(16 * -(-width // 32), device=keys.device)
    h = _lowbias32((_mul32(pairs, _PAIR_MUL)[None, :] + keys[:, None]) & _M32)  # each pair hashed once
    j = torch.arange(width, device=keys.device)
    return (h[:, (j >> 5) * 16 + (j & 15)] >> (j & 16)) & 0xFFFF


def _zero_sign(x: torch.Tensor, places: _Places, lo: torch.Tensor, tied: torch.Tensor) -> torch.Tensor:
    """``lo`` with the zero minimum of the ``tied`` groups (zeros of both signs) signed as the
    kernel's min pass picks it. Value ``k`` of a group's whole 16-value vectors sits in lane
    ``k % 16`` of accumulator ``v % 4`` for vector ``v`` of its runs of 64 values (accumulator 0 for
    the rest), each lane keeping the first of equal values; of equal values the kernel keeps the
    lowest (lane, accumulator, pass) and, after them, the first of the values past the last whole
    vector (found on this AVX-512 host, where it matched every case tried)."""
    # Row chunk by row chunk over every row, the tied groups' selected rather than gathered: no wait
    # for the device to count them.
    width, dev, big_key = x.shape[1], x.device, torch.iinfo(torch.int64).max
    first = torch.full_like(lo, big_key, dtype=torch.int64)
    bests, negs = [], []
    for a, b in places.chunks(width):
        g = places.group_of[a:b]
        n = (places.group_size[g] * width)[:, None]
        o = (places.row_in_group[a:b] * width)[:, None] + torch.arange(width, device=dev)
        vec, lane = o // 16, o % 16
        nbig = n // 64
        big = vec < 4 * nbig
        acc = torch.where(big, vec % 4, 0)
        trip = torch.where(big, vec // 4, vec - 3 * nbig)
        key = torch.where(o >= n - n % 16, (1 << 62) + o, ((lane * 4 + acc) << 40) + trip)
        xr = x[a:b]
        key = torch.where((xr == 0) & tied[g][:, None], key, big_key)
        best, col = key.min(dim=1)
        first.scatter_reduce_(0, g, best, "amin")
        bests.append(best)
        negs.append(torch.signbit(xr.gather(1, col[:, None])[:, 0]) & (best < big_key))
    best, neg = torch.cat(bests), torch.cat(negs)
    neg &= best == first[places.group_of]
    negative = torch.zeros_like(first).index_add_(0, places.group_of, neg.to(torch.int64)) > 0
    return torch.where(tied, torch.where(negative, -0.0, 0.0), lo)


def _two_sum(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(s, e)``: ``s = a + b`` rounded and ``e`` its exact error (float64)."""
    s = a + b
    bb = s - a
    return s, (a - (s - bb)) + (b - bb)


def _sum_to_odd(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a + b`` in float64 rounded to odd: exact sums as they are, inexact ones to the neighbour
    with an odd last bit. Rounded once more to 2 or more fewer bits, it rounds like the exact sum."""
    s, e = _two_sum(a, b)
    bits = s.view(torch.int64)
    step = torch.where((e > 0) == (s > 0), 1, -1)  # one ulp towards the exact sum
    return torch.where((e != 0) & ((bits & 1) == 0), (bits + step).view(torch.float64), s)


def _pack(q: torch.Tensor, bits: int, ndata: int) -> torch.Tensor:
    """The data bytes of int64 codes ``q`` (rows, width): ``8 // bits`` per byte, low bits first."""
    if bits == 8:
        return q.to(torch.uint8)
    per = 8 // bits
    rows, width = q.shape
    q = torch.nn.functional.pad(q, (0, ndata * per - width)).view(rows, ndata, per)
    shifts = torch.arange(0, 8, bits, device=q.device)
    return (q << shifts).sum(dim=2).to(torch.uint8)


def encode_torch(
    x: torch.Tensor,
    bits: int,
    seed: int,
    out: torch.Tensor | None = None,
    splits=None,
    group: int | None = None,
) -> torch.Tensor:
    """:func:`tessera.comm.quantize.encode` in torch ops on ``x``'s device: bitwise its buffer."""
    if x.dim() != 2 or x.dtype != torch.float32:
        raise TypeError(f"encode expects a 2-D float32 tensor, got {x.dim()}-D {x.dtype} on {x.device}")
    rows, width = x.shape
    splits = block_splits(splits, rows)
    group = group_rows(group)
    places = _Places(splits, width, bits, group, x.device)
    if places.rows != rows:
        raise ValueError(f"splits {splits} sum to {places.rows}, but x has {rows} rows")
    x = x.detach().contiguous()
    dev = x.device
    out = _check_out(out, (places.nbytes,), torch.uint8, dev)
    if not places.groups:
        return out
    flat = out.view(-1)
    pidx = places.param_byte[:, None] + torch.arange(PARAM_BYTES, device=dev)
    if width == 0:  # no values: S = Z = 0
        flat[pidx] = 0
        return out
    qmax = 2**bits - 1
    # Pass 1: each group's min, max and whether all its values are finite.
    lo = torch.full((places.groups,), torch.inf, device=dev)
    hi = torch.full((places.groups,), -torch.inf, device=dev)
    bad = torch.zeros(places.groups, dtype=torch.int64, device=dev)
    negz = torch.zeros(places.groups, dtype=torch.int64, device=dev)
    posz = torch.zeros(places.groups, dtype=torch.int64, device=dev)
    for a, b in places.chunks(width):
        xc, g = x[a:b], places.group_of[a:b]
        lo.scatter_reduce_(0, g, xc.amin(dim=1), "amin")
        hi.scatter_reduce_(0, g, xc.amax(dim=1), "amax")
        bad.index_add_(0, g, (~torch.isfinite(xc).all(dim=1)).to(torch.int64))
        zero = xc == 0
        sign = torch.signbit(xc)
        negz.index_add_(0, g, (zero & sign).any(dim=1).to(torch.int64))
        posz.index_add_(0, g, (zero & ~sign).any(dim=1).to(torch.int64))
    finite = bad == 0
    lo = _zero_sign(x, places, lo, (lo == 0) & (negz > 0) & (posz > 0))
    hi = torch.where((hi == 0) & (lo == 0), lo, hi)  # all zero: the kernel's max is the same zero
    span = hi.double() - lo.double()
    scale = (span * (1.0 / qmax)).float()  # rounded up to a float32: the next one where it fell short
    scale = torch.where(scale.double() * qmax < span, (scale.view(torch.int32) + 1).view(torch.float32), scale)
    inv16 = torch.where(span > 0, (qmax * 65536.0 / span).float(), 0.0)
    # Spans beyond float32, subnormal scales and (unlike the numba kernel: module docstring) spans under
    # qmax * 2**16 / 3.4e38, whose float32 inv16 overflows, are quantized in float64.
    fast = finite & (span <= _F32_MAX) & ((scale >= _F32_TINY) | (scale == 0)) & (inv16 < torch.inf)
    rare = finite & ~fast
    inv16 = inv16.double()
    inv16_rare = torch.where(rare, 65536.0 / scale.double(), 0.0)
    nan = torch.full_like(scale, 0.0).view(torch.int32).fill_(_NAN_BITS).view(torch.float32)
    params = torch.stack([torch.where(finite, scale, nan), torch.where(finite, lo, nan)], dim=1)
    flat[pidx] = params.view(torch.uint8)
    # Pass 2: the codes, row chunk by row chunk.
    vec = width - width % 32  # values the kernel's vector chunks take
    cols = torch.arange(places.ndata, device=dev)
    for a, b in places.chunks(width):
        xc, g = x[a:b], places.group_of[a:b]
        p = (xc - lo[g][:, None]).double() * inv16[g][:, None]  # exact: two float32 factors
        t = torch.empty(p.shape, dtype=torch.int64, device=dev)
        t[:, :vec] = (p[:, :vec] + 0.5).float().to(torch.int64)  # float32 fma, truncated
        t[:, vec:] = (p[:, vec:].float().double() + 0.5).to(torch.int64)  # float32 product, float64 sum
        # the float64 groups' codes, selected rather than gathered: no wait for the device to count them
        d = xc.double() - lo[g].double()[:, None]
        wide = (d * inv16_rare[g][:, None] + 0.5).to(torch.int64)  # a fused + 0.5 truncates alike
        t = torch.where(rare[g][:, None], wide, t)
        keys = _row_keys(torch.arange(a, b, device=dev), seed)
        q = torch.clamp_max((t + _random_bits(keys, width)) >> 16, qmax)
        q = torch.where(finite[g][:, None], q, 0)
        flat[places.row_byte[a:b, None] + cols] = _pack(q, bits, places.ndata)
    return out


def decode_torch(
    buf: torch.Tensor,
    width: int,
    bits: int,
    splits,
    out: torch.Tensor | None = None,
    group: int | None = None,
) -> torch.Tensor:
    """:func:`tessera.comm.quantize.decode` in torch ops on ``buf``'s device: bitwise its values."""
    splits = block_splits(splits, None)
    group = group_rows(group)
    dev = buf.device
    places = _Places(splits, width, bits, group, dev)
    if buf.dtype != torch.uint8 or buf.numel() != places.nbytes:
        raise ValueError(
            f"expected {places.nbytes} uint8 bytes for blocks of {splits} rows of width {width} at {bits} bits "
            f"in groups of {group}, got {buf.dtype} {tuple(buf.shape)}"
        )
    buf = buf.contiguous().view(-1)
    out = _check_out(out, (places.rows, width), torch.float32, dev)
    if not places.groups or not width:
        return out
    qmax = 2**bits - 1
    pidx = places.param_byte[:, None] + torch.arange(PARAM_BYTES, device=dev)
    params = buf[pidx].view(torch.float32).double()  # (groups, 2): scale, zero
    scale, zero = params[:, 0], params[:, 1]
    wide = ~(zero.abs() + scale * qmax < _F32_HALF)  # q * S + Z could overflow float32: float64
    per = 8 // bits
    cols = torch.arange(places.ndata, device=dev)
    shifts = torch.arange(0, 8, bits, device=dev)
    for a, b in places.chunks(width):
        g = places.group_of[a:b]
        data = buf[places.row_byte[a:b, None] + cols]
        if per > 1:
            data = ((data[:, :, None] >> shifts) & qmax).view(b - a, -1)[:, :width]
        p = data.double() * scale[g][:, None]  # exact: an 8-bit integer times a float32
        z = zero[g][:, None]
        out[a:b] = torch.where(wide[g][:, None], p + z, _sum_to_odd(p, z)).float()
    return out
