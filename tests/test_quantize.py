"""Stochastic quantization of exchanged rows: wire layout, error bounds, unbiasedness, determinism."""

from __future__ import annotations

import math

import numba
import numpy as np
import pytest
import torch

from tessera import ops
from tessera.dist import quantize
from tessera.dist.quantize import _hash_u32, decode, encode, record_bytes
from tessera.dist.wire import row_bytes
from tessera.ops.dropout import _hash32

BITS = (8, 4, 2)


def params(buf: torch.Tensor, width: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """Per-row (scale, zero) read back from the records."""
    nd = row_bytes(width, bits)[0]
    p = buf[:, nd : nd + 8].contiguous().view(torch.float32).numpy()
    return p[:, 0], p[:, 1]


def step_bound(x: np.ndarray, buf: torch.Tensor, bits: int) -> np.ndarray:
    """One quantization step per element, plus the float32 rounding of the decoded value."""
    scale, _ = params(buf, x.shape[1], bits)
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


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("width", [0, 1, 2, 3, 4, 5, 7, 8, 13, 64])
@pytest.mark.parametrize("rows", [0, 1, 6])
def test_record_length_and_padding(bits, width, rows):
    x = torch.randn(rows, width)
    buf = encode(x, bits, seed=1)
    nd, np_ = row_bytes(width, bits)
    assert buf.dtype == torch.uint8 and tuple(buf.shape) == (rows, nd + np_)
    assert buf.numel() == rows * sum(row_bytes(width, bits)) and record_bytes(width, bits) == (nd, nd + np_)
    per = 8 // bits
    if rows and width % per:
        assert (buf[:, nd - 1] >> (bits * (width % per)) == 0).all()  # unused high bits are zero
    out = decode(buf, width, bits)
    assert out.dtype == torch.float32 and tuple(out.shape) == (rows, width)


def test_layout_on_grid():
    # Values exactly on the grid need no rounding, so the bytes are known.
    x = torch.tensor([[0.0, 1.0, 2.0, 3.0, 3.0, 2.0], [10.0, 10.0, 10.0, 10.0, 10.0, 10.0]])
    buf = encode(x, 2, seed=5)
    assert buf[0, :2].tolist() == [0b11100100, 0b1011]
    assert buf[0, 2:].tolist() == list(np.array([1.0, 0.0], "<f4").tobytes())
    assert buf[1, 2:].tolist() == list(np.array([0.0, 10.0], "<f4").tobytes())
    assert encode(torch.tensor([[-1.0, 14.0, 5.0]]), 4, seed=0)[0, :2].tolist() == [0xF0, 0x6]
    assert encode(torch.tensor([[-1.0, 254.0, 5.0]]), 8, seed=0)[0, :3].tolist() == [0, 255, 6]
    for bits in BITS:
        on_grid = x * ((2**bits - 1) // 3)  # scale 1
        assert torch.equal(decode(encode(on_grid, bits, 9), 6, bits), on_grid)


@pytest.mark.parametrize("bits", BITS)
def test_round_trip_within_one_step(bits):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 37, generator=g) * torch.logspace(-6, 6, 300).unsqueeze(1) + torch.randn(300, 1, generator=g)
    x = torch.cat([x, torch.from_numpy(awkward_rows()).repeat(1, 4)[:, :37]])
    buf = encode(x, bits, seed=11)
    err = np.abs(decode(buf, 37, bits).numpy().astype(np.float64) - x.numpy())
    assert (err <= step_bound(x.numpy(), buf, bits)).all()
    scale, zero = params(buf, 37, bits)
    assert np.array_equal(zero, x.numpy().min(1))
    span = x.numpy().astype(np.float64).max(1) - x.numpy().astype(np.float64).min(1)
    assert (scale.astype(np.float64) * (2**bits - 1) >= span).all()  # scale rounds up: no clamping
    assert (scale[span > 0] > 0).all()


@pytest.mark.parametrize("bits", BITS)
def test_unbiased(bits):
    x = awkward_rows()
    draws = 2000
    acc = np.zeros(x.shape)
    before = torch.get_num_threads()
    ops.set_num_threads(1)  # 4000 tiny calls: skip the parallel launches (results are thread-independent)
    try:
        for seed in range(draws):
            acc += decode(encode(torch.from_numpy(x), bits, seed), x.shape[1], bits).numpy()
    finally:
        ops.set_num_threads(before)
    mean = acc / draws
    scale, _ = params(encode(torch.from_numpy(x), bits, 0), x.shape[1], bits)
    # Per-element variance <= S^2 / 4, so 5 sigma of the mean is 5 S / (2 sqrt(draws)); the last
    # terms cover the bias of 16-bit u and float32 arithmetic (< 2e-4 S) and the float32 rounding
    # of each decoded value.
    s = scale[:, None].astype(np.float64)
    bound = 5 * s / (2 * math.sqrt(draws)) + 2e-4 * s + np.spacing(np.abs(x))
    assert (np.abs(mean - x) <= bound).all()
    assert np.array_equal(mean[1], x[1].astype(np.float64))  # the constant row is exact


@pytest.mark.parametrize("bits", BITS)
def test_constant_rows_exact(bits):
    vals = [0.0, -0.0, 1.0, -2.5, 1e30, -3.4e38, 1e-45, 1e-40]
    x = torch.tensor(vals).unsqueeze(1).repeat(1, 9)
    buf = encode(x, bits, seed=2)
    scale, zero = params(buf, 9, bits)
    assert (scale == 0).all() and np.array_equal(zero, np.float32(vals))
    assert torch.equal(decode(buf, 9, bits), x)


@pytest.mark.parametrize("bits", BITS)
def test_non_finite_rows_decode_to_nan(bits):
    x = torch.randn(6, 10)
    x[1, 3], x[2, 0], x[3, 9], x[4, 5] = float("inf"), float("-inf"), float("nan"), -float("nan")
    buf = encode(x, bits, seed=4)
    out = decode(buf, 10, bits)
    assert torch.isnan(out[1:5]).all()
    assert torch.isfinite(out[[0, 5]]).all()
    nd = row_bytes(10, bits)[0]
    assert (buf[1:5, :nd] == 0).all()
    assert (np.abs(out[[0, 5]].numpy() - x[[0, 5]].numpy()) <= step_bound(x[[0, 5]].numpy(), buf[[0, 5]], bits)).all()


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
    before = torch.get_num_threads()
    try:
        ops.set_num_threads(1)
        one = encode(x, bits, 77)
        d1 = decode(one, 29, bits)
        ops.set_num_threads(2)
        two = encode(x, bits, 77)
        d2 = decode(two, 29, bits)
    finally:
        ops.set_num_threads(before)
    assert torch.equal(one, two) and torch.equal(d1, d2)


def test_out_buffers_and_errors():
    x = torch.randn(5, 7)
    buf = torch.empty(5, record_bytes(7, 4)[1], dtype=torch.uint8)
    assert encode(x, 4, 3, out=buf) is buf and torch.equal(buf, encode(x, 4, 3))
    dec = torch.empty(5, 7)
    assert decode(buf, 7, 4, out=dec) is dec
    with pytest.raises(ValueError):
        encode(x, 32, 0)
    with pytest.raises(ValueError):
        encode(x, 3, 0)
    with pytest.raises(TypeError):
        encode(x.double(), 8, 0)
    with pytest.raises(ValueError):
        decode(buf, 9, 4)
    with pytest.raises(ValueError):
        encode(x, 8, 0, out=buf)


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
@pytest.mark.parametrize("width", [16, 48, 20])
def test_streaming_decode_matches(bits, width, monkeypatch):
    x = torch.randn(300, width) * torch.logspace(-3, 3, 300).unsqueeze(1)
    x[7, 3] = float("nan")
    x[9] = torch.linspace(-3e38, 3e38, width)  # the float64 row path
    buf = encode(x, bits, seed=8)
    plain = decode(buf, width, bits)
    monkeypatch.setattr(quantize, "_STREAM_BYTES", 0)
    streamed = decode(buf, width, bits)
    assert torch.equal(plain.isnan(), streamed.isnan())
    assert torch.equal(plain.nan_to_num(), streamed.nan_to_num())
    offset = torch.empty(300 * width + 1)[1:].view(300, width)  # misaligned rows: the plain path
    assert torch.equal(decode(buf, width, bits, out=offset).nan_to_num(), plain.nan_to_num())
