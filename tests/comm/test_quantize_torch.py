"""The portable (torch ops) exchange quantization equals the numba kernels byte for byte and value for
value: random and awkward data (huge ranges, constants, signed zeros, inf and nan, spans beyond
float32, subnormal scales), every group size and block split, and inputs built where the kernels'
roundings decide the code."""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch

from tessera.comm import quantize
from tessera.comm import quantize_torch as qt
from tessera.comm.quantize import decode, encode
from tessera.comm.quantize_torch import decode_torch, encode_torch
from tessera.comm.wire import wire_bytes
from tessera.memo import tuning

ROWS = 26  # not a multiple of any group size below: every block's last group is short
WIDTHS = (1, 3, 17, 64, 100)
SPLITS = ([ROWS], [5, 0, ROWS - 5], [1, 9, ROWS - 10], [0, ROWS, 0])
SEEDS = (0, 2**64 - 5, -3, 123456789012345)


def awkward(rows: int, width: int, seed: int = 0) -> torch.Tensor:
    """Rows of many kinds, so that groups of any size mix them: normal, huge, constant, zero, mixed
    signed zeros, inf, nan, spans beyond float32, subnormal, tiny and a few-ulp spread."""
    g = np.random.default_rng(seed)
    kinds = [
        lambda: g.standard_normal(width),
        lambda: g.standard_normal(width) * 10.0 ** g.integers(-30, 30),
        lambda: g.standard_normal(width) * 10.0 ** g.integers(-30, 30, width),
        lambda: np.full(width, 0.37),
        lambda: np.zeros(width),
        lambda: np.where(g.random(width) < 0.5, -0.0, 0.0),
        lambda: np.r_[np.inf, g.standard_normal(width - 1)][g.permutation(width)],
        lambda: np.r_[np.nan, g.standard_normal(width - 1)][g.permutation(width)],
        lambda: np.r_[3e38, -3e38, g.uniform(-3e38, 3e38, width)][:width],
        lambda: g.uniform(-3.4e38, 3.4e38, width),
        lambda: 1e-40 * g.standard_normal(width),  # subnormal values and scale
        lambda: 1e-30 * g.standard_normal(width),
        lambda: 1.0 + 1e-7 * g.integers(0, 4, width),
        lambda: g.standard_normal(width),
    ]
    order = g.permutation(rows) % len(kinds)
    with np.errstate(over="ignore"):
        return torch.from_numpy(np.stack([kinds[k]() for k in order]).astype(np.float32))


def same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal float32 tensors (so also nan for nan, -0.0 for -0.0)."""
    return a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))


def check(x: torch.Tensor, bits: int, seed: int, splits=None, group: int | None = None) -> None:
    want = encode(x, bits, seed, splits=splits, group=group)
    got = encode_torch(x, bits, seed, splits=splits, group=group)
    assert torch.equal(got, want), (bits, seed, splits, group, (got != want).nonzero()[:5].view(-1).tolist())
    n = x.shape[0] if splits is None else splits
    assert same_values(
        decode_torch(want, x.shape[1], bits, n, group=group), decode(want, x.shape[1], bits, n, group=group)
    )


@pytest.mark.parametrize("group", [1, 3, 4, 5])
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_equals_the_kernels(bits, group):
    for i, width in enumerate(WIDTHS):
        x = awkward(ROWS, width, seed=i)
        for k, splits in enumerate(SPLITS):
            check(x, bits, SEEDS[(i + k) % len(SEEDS)], splits, group)
        check(torch.randn(ROWS, width) * 5 - 2, bits, i, None, group)


def test_default_group_and_edge_shapes():
    for bits in (8, 4, 2):
        check(awkward(41, 37), bits, 7)  # default group (tessera.comm.wire.GROUP_ROWS)
        check(torch.randn(5, 0), bits, 1, [2, 3])  # no values: S = Z = 0
        check(torch.randn(0, 9), bits, 1, [0, 0])  # no rows
        check(torch.randn(300, 130), bits, 2, [100, 7, 193], 4)


def test_row_chunks_cut_groups_and_blocks(monkeypatch):
    monkeypatch.setattr(qt, "_CHUNK", 90)  # a few rows per chunk, cutting groups and blocks
    for width in (17, 100):
        x = awkward(ROWS, width, seed=4)
        for bits in (8, 2):
            check(x, bits, 3, [7, 0, ROWS - 7], 3)
            check(x, bits, 4, [ROWS], 5)


def test_signed_zero_minimum_is_the_kernels():
    # A zero minimum with zeros of both signs: the zero point is the zero the kernel's min pass
    # keeps (its lane order), the scale +0.
    g = np.random.default_rng(5)
    for width in (3, 17, 40, 64, 100, 130):
        for trial in range(12):
            x = np.zeros((4, width), np.float32)
            if trial % 3 == 1:
                x[:] = g.random((4, width)) < 0.7
            neg = g.random((4, width)) < g.random()
            x[(x == 0) & neg] = -0.0
            for bits in (8, 2):
                check(torch.from_numpy(x), bits, trial, None, 4)


def test_float32_rounding_is_the_kernels():
    # Where the two float32 roundings of t = (x - Z) * inv16 + 0.5 differ (t rounded once, as a
    # fused multiply-add, or the product first) and t + r sits just at a code boundary, so each
    # value's code tells which rounding ran: the kernel's vector chunks (values below 32 * (width
    # // 32)) fuse, its scalar tail rounds the product first.
    bits, width, seed = 8, 100, 11
    inv16 = np.float32(255 * 65536.0)  # span 1: row values in [0, 1]
    r = qt._random_bits(qt._row_keys(torch.arange(1), seed), width)[0].numpy()
    x = np.zeros(width, np.float32)
    x[1] = 1.0
    fused_codes = np.zeros(width, np.int64)
    for j in range(2, width):
        found = False
        for m in range(129, 256):
            target = 65536 * m - int(r[j])  # t + r == 65536 m when t rounds up
            v = np.float32((target - 4) / np.float64(inv16))
            for _ in range(8):
                p = np.float64(v) * np.float64(inv16)
                fused, split = int(np.float32(p + 0.5)), int(np.float64(np.float32(p)) + 0.5)
                if fused == target and split == target - 1 and v < 1:
                    found = True
                    break
                v = np.nextafter(v, np.float32(2))
            if found:
                x[j], fused_codes[j] = v, m
                break
        assert found
    xt = torch.from_numpy(x)[None, :]
    want = encode(xt, bits, seed, group=1).numpy()[:width]
    vec = 32 * (width // 32)
    assert (want[2:vec] == fused_codes[2:vec]).all() and (want[vec:] == fused_codes[vec:] - 1).all()
    check(xt, bits, seed, None, 1)


def test_decode_rounds_once():
    # q * S + Z with q * S halfway between two float32 and Z tiny: rounded once (as the kernel's
    # fused multiply-add) it goes Z's way, where two roundings would tie to even.
    s = np.float32(1 + 2**-23)
    buf = np.zeros(4 + 8, np.uint8)
    buf[:4] = 3
    for z in (np.float32(-1e-30), np.float32(1e-30), np.float32(-3e-39)):
        buf[4:8], buf[8:12] = np.frombuffer(s.tobytes(), np.uint8), np.frombuffer(z.tobytes(), np.uint8)
        b = torch.from_numpy(buf.copy())
        want = decode(b, 4, 8, 1, group=1)
        assert want[0, 0].item() == _nearest32(Fraction(3) * Fraction(float(s)) + Fraction(float(z)))
        if z < 0:  # where a second rounding (to float64, then float32) would tie up to even
            assert want[0, 0].item() != float(np.float32(3 * np.float64(s) + np.float64(z)))
        assert same_values(decode_torch(b, 4, 8, 1, group=1), want)


def _nearest32(v: Fraction) -> float:
    """``v`` rounded once to the nearest float32 (ties to even)."""
    lo = np.float32(float(v))
    cands = [np.nextafter(lo, np.float32(-np.inf)), lo, np.nextafter(lo, np.float32(np.inf))]
    return float(min(cands, key=lambda c: (abs(Fraction(float(c)) - v), int(c.view(np.int32)) & 1)))


def test_tiny_spans_are_quantized_in_float64():
    # Spans under qmax * 2**16 / 3.4e38 (here 1e-35) overflow the float32 inv16 = qmax * 2**16 /
    # span: the portable form quantizes them in float64, within one step of the input.
    x = torch.zeros(8, 40)
    x[0, 0], x[5, 3:9] = 1e-35, -2e-36
    for bits in (8, 4, 2):
        buf = encode_torch(x, bits, 3)
        y = decode_torch(buf, 40, bits, 8)
        scale = buf.view(-1)[-8:].clone().view(torch.float32)[0].item()
        assert scale > 0 and (y - x).abs().max().item() <= scale + 1e-45


def test_tiny_spans_in_the_kernel():
    """A span so small that qmax * 2**16 / span overflows float32 is quantized in float64: within
    one step of the input, as every group, and the same bytes both ways."""
    x = torch.zeros(4, 40)
    x[0, 0] = 1e-35
    buf = encode(x, 8, 3)
    assert torch.equal(buf, encode_torch(x, 8, 3))
    scale = float(np.frombuffer(buf[-8:-4].numpy().tobytes(), dtype="<f4")[0])
    assert 0 < scale and (decode(buf, 40, 8, 4) - x).abs().max().item() <= scale


def test_forced_portable_takes_the_torch_path(monkeypatch):
    x = awkward(ROWS, 17, seed=3)
    want = encode(x, 4, 9, splits=[6, 20], group=3)
    values = decode(want, 17, 4, [6, 20], group=3)
    calls = []

    def spy(fn):
        def wrapped(*args, **kwargs):
            calls.append(fn.__name__)
            return fn(*args, **kwargs)

        return wrapped

    def no_kernel(*args, **kwargs):
        raise AssertionError("the numba kernel ran")

    monkeypatch.setattr(quantize, "encode_torch", spy(encode_torch))
    monkeypatch.setattr(quantize, "decode_torch", spy(decode_torch))
    monkeypatch.setattr(quantize, "_encode", no_kernel)
    monkeypatch.setattr(quantize, "_decode", no_kernel)
    with tuning.forcing("portable", True):  # the dispatch a GPU tensor takes, on the CPU
        buf = torch.empty(int(sum(wire_bytes(np.array([6, 20]), 17, 4, 3))), dtype=torch.uint8)
        assert encode(x, 4, 9, out=buf, splits=[6, 20], group=3) is buf
        out = torch.empty(ROWS, 17)
        assert decode(buf, 17, 4, [6, 20], out=out, group=3) is out
    assert calls == ["encode_torch", "decode_torch"]
    assert torch.equal(buf, want) and same_values(out, values)


def test_argument_checks_match_the_kernels():
    x = torch.randn(5, 7)
    buf = encode(x, 4, 3)
    with tuning.forcing("portable", True):
        assert torch.equal(encode(x, 4, 3), buf)
        for call in (
            lambda: encode(x, 32, 0),
            lambda: encode(x, 3, 0),
            lambda: encode(x, 8, 0, splits=[2, 2]),
            lambda: encode(x, 8, 0, splits=[6, -1]),
            lambda: decode(buf, 9, 4, 5),
            lambda: decode(buf, 7, 4, [3, 3]),
            lambda: encode(x, 8, 0, out=buf),
            lambda: decode(buf, 7, 4, 5, out=torch.empty(5, 8)),
            lambda: decode(buf.int(), 7, 4, 5),
        ):
            with pytest.raises(ValueError):
                call()
        with pytest.raises(TypeError):
            encode(x.double(), 8, 0)
        with pytest.raises(TypeError):
            decode(buf, 7, 4, None)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_equals_the_kernels():
    for bits in (8, 4, 2):
        for width in (17, 100):
            x = awkward(ROWS, width, seed=width)
            want = encode(x, bits, 5, splits=[5, 0, ROWS - 5])
            got = encode(x.cuda(), bits, 5, splits=[5, 0, ROWS - 5])
            assert got.device.type == "cuda" and torch.equal(got.cpu(), want)
            dec = decode(want.cuda(), width, bits, [5, 0, ROWS - 5])
            assert same_values(dec.cpu(), decode(want, width, bits, [5, 0, ROWS - 5]))
