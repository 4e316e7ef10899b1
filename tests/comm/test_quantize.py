"""Stochastic quantization of exchanged rows: wire layout (per-peer blocks, parameters per group of
rows), error bounds, unbiasedness, determinism."""

from __future__ import annotations

import math
import os
import platform
import subprocess
import sys

import numba
import numpy as np
import pytest
import torch

from tessera.comm import quantize, wire
from tessera.comm.quantize import _hash_u32, decode, encode, layout
from tessera.comm.wire import GROUP_ROWS, block_bytes, data_bytes, wire_bytes
from tessera.kernels.hashing import hash32 as _hash32
from tessera.threads import set_num_threads

BITS = (8, 4, 2)
GROUPS = (1, 2, 4, 8)


def groups_of(splits, group: int) -> list[tuple[int, int]]:
    """(first row, rows) of every group, block by block: the last group of a block may be short."""
    out, r0 = [], 0
    for n in splits:
        out += [(r0 + k, min(group, n - k)) for k in range(0, n, group)]
        r0 += n
    return out


def params(buf: torch.Tensor, splits, width: int, bits: int, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (scale, zero) read back from the buffer: every row gets its group's."""
    nd, b = data_bytes(width, bits), buf.numpy()
    rows = sum(splits)
    scale, zero = np.empty(rows, np.float32), np.empty(rows, np.float32)
    off = 0
    for r0, m in groups_of(splits, group):
        s, z = b[off + m * nd : off + m * nd + 8].view("<f4")
        scale[r0 : r0 + m], zero[r0 : r0 + m] = s, z
        off += m * nd + 8
    assert off == buf.numel()
    return scale, zero


def group_reduce(x: np.ndarray, splits, group: int, fn) -> np.ndarray:
    """``fn`` over each group's values, broadcast back to its rows."""
    out = np.empty(x.shape[0], np.float64)
    for r0, m in groups_of(splits, group):
        out[r0 : r0 + m] = fn(x[r0 : r0 + m].astype(np.float64))
    return out


def step_bound(x: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """One quantization step per element, plus the float32 rounding of the decoded value."""
    return scale[:, None].astype(np.float64) + np.spacing(np.abs(x)).astype(np.float64)


def awkward_rows() -> np.ndarray:
    """Random, constant, huge, span-overflowing, tiny, subnormal and mixed-magnitude rows, width 11."""
    g = np.random.default_rng(3)
    rows = [
        g.standard_normal(11),
        np.full(11, 0.37),
        np.r_[1e30, -1e30, g.uniform(-1e30, 1e30, 9)],
        np.r_[3e38, -3e38, g.uniform(-3e38, 3e38, 9)],  # max - min overflows float32
        1e-30 * g.standard_normal(11),
        1.0 + 1e-7 * np.arange(11),  # a spread of a few ulps
        1e-40 * np.arange(11),  # subnormal values and scale
        np.r_[1e-5, -1e-5, 1e5, -3e4, 1e-3, 2.5, 0.0, -0.0, 7e2, 1e-38, -8e4],
    ]
    return np.stack(rows).astype(np.float32)


# ---------------------------------------------------------------------------------------- layout
def test_block_bytes():
    assert wire.GROUP_ROWS == GROUP_ROWS == 4
    assert block_bytes(5, 40, 2) == (50, 16)  # 10 data bytes a row; groups of 4 + 1 rows
    assert block_bytes(8, 40, 2) == (80, 16)
    assert block_bytes(5, 40, 2, group=1) == (50, 40)
    assert block_bytes(0, 40, 2) == (0, 0)
    assert block_bytes(5, 40, 32) == (800, 0)
    assert block_bytes(3, 7, 4) == (12, 8) and block_bytes(3, 7, 8, group=2) == (21, 16)
    rows = np.array([[0, 1, 4], [5, 9, 0]])
    data, par = block_bytes(rows, 128, 2)
    assert data.tolist() == [[0, 32, 128], [160, 288, 0]] and par.tolist() == [[0, 8, 8], [16, 24, 0]]
    assert np.array_equal(wire_bytes(rows, 128, 2), data + par)
    for bad in (3, 16):
        with pytest.raises(ValueError):
            block_bytes(1, 4, bad)
    with pytest.raises(ValueError):
        block_bytes(1, 4, 2, group=0)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("width", [0, 1, 2, 3, 4, 5, 7, 8, 13, 64])
@pytest.mark.parametrize("splits", [[0], [1], [6], [3, 0, 5], [4, 4, 1, 2]])
@pytest.mark.parametrize("group", [1, 3, 4])
def test_buffer_length_and_padding(bits, width, splits, group):
    x = torch.randn(sum(splits), width)
    buf = encode(x, bits, seed=1, splits=splits, group=group)
    assert buf.dtype == torch.uint8 and buf.dim() == 1
    assert buf.numel() == sum(wire_bytes(n, width, bits, group) for n in splits)
    rstart, gstart, bstart = layout(splits, width, bits, group)
    assert rstart.tolist() == np.cumsum([0, *splits]).tolist()
    assert gstart.tolist() == np.cumsum([0, *(-(-n // group) for n in splits)]).tolist()
    assert bstart.tolist() == np.cumsum([0, *(wire_bytes(n, width, bits, group) for n in splits)]).tolist()
    nd, per = data_bytes(width, bits), 8 // bits
    if width % per:
        off, last = 0, []
        for _, m in groups_of(splits, group):
            last += [off + (i + 1) * nd - 1 for i in range(m)]
            off += m * nd + 8
        assert (buf[last] >> (bits * (width % per)) == 0).all()  # unused high bits are zero
    out = decode(buf, width, bits, splits, group=group)
    assert out.dtype == torch.float32 and tuple(out.shape) == (sum(splits), width)


def test_layout_on_grid():
    # Values exactly on the grid need no rounding, so the bytes are known. One row per group is
    # the per-row layout: [data][scale][zero].
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 3.0, 2.0], [10.0, 10.0, 10.0, 10.0, 10.0, 10.0]])
    buf = encode(x, 2, seed=5, group=1).view(2, 10)
    assert buf[0, :2].tolist() == [0b11100100, 0b1011]
    assert buf[0, 2:].tolist() == list(np.array([1.0, 0.0], "<f4").tobytes())
    assert buf[1, 2:].tolist() == list(np.array([0.0, 10.0], "<f4").tobytes())
    assert encode(torch.tensor([[-1.0, 14.0, 5.0]]), 4, seed=0)[:2].tolist() == [0xF0, 0x6]
    assert encode(torch.tensor([[-1.0, 254.0, 5.0]]), 8, seed=0)[:3].tolist() == [0, 255, 6]
    for bits in BITS:
        on_grid = x * ((2**bits - 1) // 3)  # scale 1
        assert torch.equal(decode(encode(on_grid, bits, 9, group=1), 6, bits, 2, group=1), on_grid)
    # A group of rows shares one scale and zero point after its rows' data: [row 0][row 1][S][Z].
    y = torch.tensor([[1.0, 2.0, 3.0, 4.0], [2.0, 2.0, 2.0, 2.0], [7.0, 7.0, 7.0, 7.0]])
    buf = encode(y, 2, seed=3, splits=[2, 1], group=4)
    assert buf.numel() == 2 + 8 + 1 + 8
    assert buf[:2].tolist() == [0b11100100, 0b01010101]
    assert buf[2:10].tolist() == list(np.array([1.0, 1.0], "<f4").tobytes())
    assert buf[10:].tolist() == [0] + list(np.array([0.0, 7.0], "<f4").tobytes())  # block 2: a constant group
    assert torch.equal(decode(buf, 4, 2, [2, 1]), y)


# ---------------------------------------------------------------------------------------- error
def _mixed(rows: int, width: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, width, generator=g) * torch.logspace(-6, 6, rows).unsqueeze(1)
    return x + torch.randn(rows, 1, generator=g)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", GROUPS)
def test_round_trip_within_one_step(bits, group):
    x = _mixed(300, 37, 0)
    x = torch.cat([x, torch.from_numpy(awkward_rows()).repeat(1, 4)[:, :37]])
    splits = [37, 0, 101, 1, 169]  # blocks whose last group is cut short
    buf = encode(x, bits, seed=11, splits=splits, group=group)
    xn = x.numpy()
    err = np.abs(decode(buf, 37, bits, splits, group=group).numpy().astype(np.float64) - xn)
    scale, zero = params(buf, splits, 37, bits, group)
    assert (err <= step_bound(xn, scale)).all()
    assert np.array_equal(zero, group_reduce(xn, splits, group, np.min).astype(np.float32))
    span = group_reduce(xn, splits, group, np.max) - group_reduce(xn, splits, group, np.min)
    assert (scale.astype(np.float64) * (2**bits - 1) >= span).all()  # scale rounds up: no clamping
    assert (scale[span > 0] > 0).all()


@pytest.mark.parametrize("bits", BITS)
def test_unbiased(bits):
    # Many independent draws in one call: the same blocks repeated, so every copy of a value has
    # its group's scale and zero but its own random bits (they hash the row index). Blocks of 1, 3,
    # 4 and 5 rows: whole groups and groups cut short at block ends.
    draws = 2000
    g = np.random.default_rng(1)
    normal = (g.standard_normal((4, 11)) * np.array([[1.0], [0.01], [100.0], [1.0]])).astype(np.float32)
    const = np.full((3, 11), -2.5, np.float32)  # a constant group: exact
    base = np.concatenate([awkward_rows(), normal, const])
    splits = [1] * 8 + [4, 3]  # one awkward row per block, 4 normal rows, 3 constant rows
    x = np.tile(base, (draws, 1))
    buf = encode(torch.from_numpy(x), bits, 7, splits=splits * draws)
    dec = decode(buf, 11, bits, splits * draws).numpy().astype(np.float64).reshape(draws, *base.shape)
    mean = dec.mean(axis=0)
    scale, _ = params(buf, splits * draws, 11, bits, GROUP_ROWS)
    s = scale[: base.shape[0], None].astype(np.float64)
    # Per-element variance <= S^2 / 4, so 5 sigma of the mean is 5 S / (2 sqrt(draws)); the last
    # terms cover the bias of 16-bit u and float32 arithmetic (< 2e-4 S) and the float32 rounding
    # of each decoded value.
    bound = 5 * s / (2 * math.sqrt(draws)) + 2e-4 * s + np.spacing(np.abs(base))
    assert (np.abs(mean - base) <= bound).all()
    assert np.array_equal(mean[1], base[1].astype(np.float64))  # the constant rows are exact
    assert np.array_equal(mean[-3:], base[-3:].astype(np.float64))
    assert np.abs(dec[:, 8:12] - base[8:12]).max() > 0  # the normal group does get rounded


@pytest.mark.parametrize("bits", BITS)
def test_unbiased_over_seeds(bits):
    x = torch.from_numpy(awkward_rows()[[0, 4, 5, 7]])  # one group of mixed magnitudes
    draws = 400
    acc = np.zeros(x.shape)
    before = torch.get_num_threads()
    set_num_threads(1)  # tiny calls: skip the parallel launches (results are thread-independent)
    try:
        for seed in range(draws):
            acc += decode(encode(x, bits, seed), 11, bits, 4).numpy()
    finally:
        set_num_threads(before)
    scale, _ = params(encode(x, bits, 0), [4], 11, bits, GROUP_ROWS)
    s = scale[:, None].astype(np.float64)
    bound = 5 * s / (2 * math.sqrt(draws)) + 2e-4 * s + np.spacing(np.abs(x.numpy()))
    assert (np.abs(acc / draws - x.numpy()) <= bound).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", [1, 4])
def test_constant_rows_exact(bits, group):
    vals = [0.0, -0.0, 1.0, -2.5, 1e30, -3.4e38, 1e-45, 1e-40]
    x = torch.tensor(vals).unsqueeze(1).repeat(1, 9).repeat_interleave(group, 0)  # constant groups
    splits = [group] * len(vals)
    buf = encode(x, bits, seed=2, splits=splits, group=group)
    scale, zero = params(buf, splits, 9, bits, group)
    assert (scale == 0).all() and np.array_equal(zero, np.float32(vals).repeat(group))
    assert torch.equal(decode(buf, 9, bits, splits, group=group), x)


@pytest.mark.parametrize("bits", BITS)
def test_extreme_groups(bits):
    # Rows of very different magnitude in one group: the step is the group's, every value within it.
    x = torch.tensor([[3e38, -3e38, 1.0], [1e-3, 2e-3, 0.0], [1e-40, 0.0, -1e-40], [1e30, 5.0, -1e30], [7.0, 7.0, 7.0]])
    for splits in ([5], [2, 3], [1, 4]):
        buf = encode(x, bits, seed=3, splits=splits)
        out = decode(buf, 3, bits, splits)
        assert torch.isfinite(out).all()
        scale, _ = params(buf, splits, 3, bits, GROUP_ROWS)
        err = np.abs(out.numpy().astype(np.float64) - x.numpy())
        assert (err <= step_bound(x.numpy(), scale)).all()
    assert torch.equal(decode(encode(x[[4]], bits, 0), 3, bits, 1), x[[4]])


@pytest.mark.parametrize("bits", BITS)
def test_non_finite_groups_decode_to_nan(bits):
    x = torch.randn(13, 10)
    x[1, 3], x[4, 0], x[9, 9] = float("inf"), float("-inf"), float("nan")
    splits = [2, 6, 5]  # groups: 0-1 | 2-5, 6-7 | 8-11, 12
    buf = encode(x, bits, seed=4, splits=splits)
    out = decode(buf, 10, bits, splits)
    bad = [0, 1, 2, 3, 4, 5, 8, 9, 10, 11]
    good = [6, 7, 12]
    assert torch.isnan(out[bad]).all()
    assert torch.isfinite(out[good]).all()
    scale, _ = params(buf, splits, 10, bits, GROUP_ROWS)
    assert np.isnan(scale[bad]).all()
    err = np.abs(out[good].numpy() - x[good].numpy())
    assert (err <= step_bound(x[good].numpy(), scale[good])).all()
    # per-row groups: only the rows holding a non-finite value
    out1 = decode(encode(x, bits, 4, splits=splits, group=1), 10, bits, splits, group=1)
    assert torch.isnan(out1[[1, 4, 9]]).all() and torch.isfinite(out1[[0, 2, 3, 5, 6, 7, 8, 10, 11, 12]]).all()


# ---------------------------------------------------------------------------------------- blocks
@pytest.mark.parametrize("bits", BITS)
def test_blocks_decode_alone(bits):
    # Each peer's slice of the buffer decodes on its own to the rows the whole buffer decodes to.
    x = _mixed(50, 24, 5)
    splits = [7, 0, 20, 9, 14]
    buf = encode(x, bits, 3, splits=splits)
    whole = decode(buf, 24, bits, splits)
    _, _, bstart = layout(splits, 24, bits)
    r0 = 0
    for i, n in enumerate(splits):
        part = decode(buf[bstart[i] : bstart[i + 1]], 24, bits, n)
        assert torch.equal(part, whole[r0 : r0 + n])
        r0 += n


@pytest.mark.parametrize("bits", BITS)
def test_random_bits_follow_rows_not_groups(bits):
    # With one group's scale for every row (equal ranges), the codes depend on (seed, row, column)
    # only: the same data bytes whatever the block split or group size.
    x = torch.rand(24, 16)
    x[:, 0], x[:, 1] = 0.0, 1.0
    nd = data_bytes(16, bits)
    ref = encode(x, bits, 9, group=1).view(24, nd + 8)[:, :nd]
    for splits, group in (([24], 4), ([5, 11, 8], 4), ([3, 21], 8), ([24], 3)):
        buf = encode(x, bits, 9, splits=splits, group=group)
        off, data = 0, []
        for _, m in groups_of(splits, group):
            data.append(buf[off : off + m * nd].view(m, nd))
            off += m * nd + 8
        assert torch.equal(torch.cat(data), ref)


@pytest.mark.parametrize("bits", BITS)
def test_deterministic_and_seeded(bits):
    x = torch.randn(50, 33)
    a, b, c = encode(x, bits, 123), encode(x, bits, 123), encode(x, bits, 124)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(encode(x, bits, 2**40 + 123), a)  # the high seed bits count too


@pytest.mark.parametrize("bits", BITS)
def test_thread_count_independent(bits):
    x = torch.randn(2001, 29) * 3
    splits = [700, 1, 0, 1300]
    before = torch.get_num_threads()
    try:
        set_num_threads(1)
        one = encode(x, bits, 77, splits=splits)
        d1 = decode(one, 29, bits, splits)
        set_num_threads(2)
        two = encode(x, bits, 77, splits=splits)
        d2 = decode(two, 29, bits, splits)
    finally:
        set_num_threads(before)
    assert torch.equal(one, two) and torch.equal(d1, d2)


def test_out_buffers_and_errors():
    x = torch.randn(5, 7)
    buf = torch.empty(int(wire_bytes(5, 7, 4)), dtype=torch.uint8)
    assert encode(x, 4, 3, out=buf) is buf and torch.equal(buf, encode(x, 4, 3))
    dec = torch.empty(5, 7)
    assert decode(buf, 7, 4, 5, out=dec) is dec
    assert torch.equal(dec, decode(buf, 7, 4, [5]))
    with pytest.raises(ValueError):
        encode(x, 32, 0)
    with pytest.raises(ValueError):
        encode(x, 3, 0)
    with pytest.raises(TypeError):
        encode(x.double(), 8, 0)
    with pytest.raises(ValueError):
        encode(x, 8, 0, splits=[2, 2])  # rows do not add up
    with pytest.raises(ValueError):
        encode(x, 8, 0, splits=[6, -1])
    with pytest.raises(ValueError):
        decode(buf, 9, 4, 5)  # wrong width for the length
    with pytest.raises(ValueError):
        decode(buf, 7, 4, [3, 3])
    with pytest.raises(ValueError):
        encode(x, 8, 0, out=buf)  # 8-bit records need more bytes
    with pytest.raises(ValueError):
        decode(buf, 7, 4, 5, out=torch.empty(5, 8))


def test_hash_matches_dropout():
    @numba.njit
    def both(v):
        a = np.empty(v.size, np.uint32)
        b = np.empty(v.size, np.uint32)
        for i in range(v.size):
            a[i] = _hash_u32(np.uint32(v[i]))
            b[i] = np.uint32(_hash32(np.uint64(v[i])))
        return a, b

    a, b = both(np.random.default_rng(0).integers(0, 2**32, 1000, dtype=np.uint64))
    assert np.array_equal(a, b)


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("width", [64, 100, 256])
def test_vector_kernels_match_the_scalar_definition(bits, width):
    # _pack (64-value chunks where the host has AVX-512BW, 32-value chunks, then one value at a
    # time) writes the bytes of _pack_tail, which quantizes every value alone with its own random
    # bits: the vector kernels round the same values with the same bits.
    @numba.njit(fastmath=quantize._FAST)
    def both(x, bits, zero, inv16, nd):
        a, b = np.zeros((x.shape[0], nd), np.uint8), np.zeros((x.shape[0], nd), np.uint8)
        for i in range(x.shape[0]):
            key = np.uint32(1000003 * i + 17)
            quantize._pack(x[i], a[i], bits, zero, inv16, key)
            quantize._pack_tail(x[i], b[i], bits, zero, inv16, key, 0)
        return a, b

    x = np.random.default_rng(width).uniform(-1.0, 3.0, (40, width)).astype(np.float32)
    x[:, 0], x[:, 1] = -1.0, 3.0  # the ends of the range: codes 0 and 2**bits - 1
    inv16 = np.float32((2**bits - 1) * 65536.0 / 4.0)
    a, b = both(x, bits, np.float32(-1.0), inv16, data_bytes(width, bits))
    assert np.array_equal(a, b)
    assert len(np.unique(a)) > 2 ** min(bits, 4)  # not a degenerate all-equal encoding


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86-64 target features")
def test_generic_target_writes_the_same_bytes():
    # numba's generic x86-64 target has no AVX-512BW, so encode there runs the 32-value kernels
    # only; it must write the bytes this process writes (with the 64-value kernel where the host
    # has it). FMA stays on: without it (x - Z) * inv + 0.5 rounds twice, and an occasional code
    # (1 of these 38400) lands on the other side of a rounding boundary.
    code = (
        "import sys, torch\n"
        "from tessera.comm import quantize\n"
        "assert not quantize._AVX512BW\n"
        "x = torch.randn(64, 200, generator=torch.Generator().manual_seed(5)) * 3\n"
        "bufs = [quantize.encode(x, b, 9, splits=[20, 44]) for b in (8, 4, 2)]\n"
        "sys.stdout.buffer.write(b''.join(t.numpy().tobytes() for t in bufs))\n"
    )
    env = dict(os.environ, NUMBA_CPU_NAME="generic", NUMBA_CPU_FEATURES="+sse4.2,+avx,+avx2,+fma")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, timeout=600)
    assert run.returncode == 0, run.stderr.decode()[-2000:]
    x = torch.randn(64, 200, generator=torch.Generator().manual_seed(5)) * 3
    here = b"".join(encode(x, b, 9, splits=[20, 44]).numpy().tobytes() for b in (8, 4, 2))
    assert run.stdout == here


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("width", [16, 48, 20])
def test_streaming_decode_matches(bits, width, monkeypatch):
    x = torch.randn(300, width) * torch.logspace(-3, 3, 300).unsqueeze(1)
    x[7, 3] = float("nan")
    x[9] = torch.linspace(-3e38, 3e38, width)  # the float64 path
    splits = [101, 0, 199]
    buf = encode(x, bits, seed=8, splits=splits)
    plain = decode(buf, width, bits, splits)
    monkeypatch.setattr(quantize, "_STREAM_BYTES", 0)
    streamed = decode(buf, width, bits, splits)
    assert torch.equal(plain.isnan(), streamed.isnan())
    assert torch.equal(plain.nan_to_num(), streamed.nan_to_num())
    offset = torch.empty(300 * width + 1)[1:].view(300, width)  # misaligned rows: the plain path
    assert torch.equal(decode(buf, width, bits, splits, out=offset).nan_to_num(), plain.nan_to_num())
