"""The hashed dropout in torch integer ops against the numba kernel: the same masks and values, bitwise."""

from __future__ import annotations

import numba
import numpy as np
import pytest
import torch

from tessera.kernels import dropout_torch as dt
from tessera.kernels.dropout import (
    _BLOCK,
    _ELU_DROP,
    _ELU_DROP_GRAD,
    _MASK,
    _RELU_DROP,
    _RELU_DROP_GRAD,
    DROP,
    DROP_IN_PLACE,
    draw_seed,
    dropout,
    dropout_mask,
    element_kept,
    keep_threshold,
    run_hashed,
)
from tessera.memo import tuning

MODES = (DROP, _MASK, _RELU_DROP, _ELU_DROP, _RELU_DROP_GRAD, _ELU_DROP_GRAD, DROP_IN_PLACE)
FORWARD_OF = {_RELU_DROP_GRAD: _RELU_DROP, _ELU_DROP_GRAD: _ELU_DROP}
SEED = (0x5DEECE66D << 20) | 12345  # both 32-bit halves non-zero
BITS = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16, torch.bool: torch.uint8}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    # pieces of 1000 elements: the tensors here span several, and a 2500-wide row is cut in columns
    monkeypatch.setattr(dt, "_CHUNK", 1000)


def _rows(n: int, width: int) -> torch.Tensor:
    """``n`` row ids, shuffled: small ones, ones whose indices cross 2**32 (one row straddles it)
    and beyond, so the key's mixing of ``index >> 32`` matters."""
    edge = 2**32 // width
    ids = [edge, 0, 2 * edge + 1, edge - 1, edge + 1, 1, 5, 2 * edge, 7 * edge + 3][:n]
    gen = torch.Generator().manual_seed(n)
    ids += torch.randint(0, 3 * edge, (n - len(ids),), generator=gen).tolist()
    return torch.tensor(ids, dtype=torch.int64)[torch.randperm(n, generator=gen)]


def _input(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Values of either sign up to about +-12, with zeros of both signs."""
    gen = torch.Generator().manual_seed(sum(shape))
    x = torch.randn(shape, generator=gen) * 4
    flat = x.view(-1)
    flat[::97] = 0.0
    flat[1::97] = -0.0
    return x.to(dtype)


def _both(
    x: torch.Tensor, rows: torch.Tensor | None, p: float, mode: int, device: str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(numba kernel's output, torch implementation's output) for one mode; the second through
    :func:`run_hashed`'s dispatch on ``device`` when given."""
    aux = None
    if mode in FORWARD_OF:
        aux = torch.empty_like(x)
        run_hashed(_input(x.shape, x.dtype), aux, SEED, p, rows, FORWARD_OF[mode])
    second = (dt.run_hashed_torch, "cpu") if device is None else (run_hashed, device)
    outs = []
    for run, where in ((run_hashed, "cpu"), second):
        if mode == DROP_IN_PLACE:
            out = x.clone().to(where)
        else:
            out = torch.empty(x.shape, dtype=torch.bool if mode == _MASK else x.dtype, device=where)
        on_rows, on_aux = (None if t is None else t.to(where) for t in (rows, aux))
        run(x.to(where), out, SEED, p, on_rows, mode, aux=on_aux)
        outs.append(out.cpu())
    return outs[0], outs[1]


CASES = [
    ((3, 5501), None),  # flat indices crossing a _BLOCK boundary, a short last block
    ((41, 3, 101), 303),  # rows of width 303 keyed by global ids
    ((3, 2500), 2500),  # rows wider than a chunk
]


def _check(dtype: torch.dtype, mode: int, p: float, device: str | None = None) -> None:
    for shape, width in CASES:
        rows = None if width is None else _rows(shape[0], width)
        want, got = _both(_input(shape, dtype), rows, p, mode, device)
        if mode == _ELU_DROP and dtype == torch.float64:
            # libm's expm1 (the kernel) and torch.expm1 differ in the last bit; the mask does not
            assert torch.equal(want == 0, got == 0)
            torch.testing.assert_close(got, want, rtol=4.5e-16, atol=0.0)  # 2 ulps
        else:
            assert torch.equal(want.view(BITS[want.dtype]), got.view(BITS[got.dtype])), (shape, width)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_every_mode_matches_the_numba_kernel_bitwise(dtype, mode, p):
    _check(dtype, mode, p)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_cuda_tensors_draw_the_cpu_values(dtype):
    for mode in MODES:
        _check(dtype, mode, 0.5, "cuda")
    x, rows = _input((64, 300), dtype), _rows(64, 300)
    torch.manual_seed(3)
    want = dropout(x, 0.5, rows=rows)
    torch.manual_seed(3)
    assert torch.equal(dropout(x.cuda(), 0.5, rows=rows.cuda()).cpu().view(BITS[dtype]), want.view(BITS[dtype]))


@numba.njit
def _numba_kept(index, seed_lo, seed_hi, threshold):
    out = np.empty(index.size, np.bool_)
    for i in range(index.size):
        out[i] = element_kept(index[i], seed_lo, seed_hi, threshold)
    return out


def test_keep_flags_match_element_kept_at_large_indices():
    idx = torch.cat([torch.arange(b - 300, b + 300) for b in (_BLOCK, 2**32, 2**33 + 7 * _BLOCK, 2**40, 2**47 - 5)])
    for p in (0.1, 0.5, 0.9):
        threshold = keep_threshold(p)
        want = _numba_kept(idx.numpy(), np.uint64(SEED & 0xFFFFFFFF), np.uint64(SEED >> 32), threshold)
        assert torch.equal(dt.keep_flags(idx, SEED, p), torch.from_numpy(want))
        # a flat piece crossing 2**32 takes its keys per element
        crossing = dt._chunk_kept(None, _BLOCK, 2**32 - 300, 600, SEED, int(threshold), torch.device("cpu"))
        assert torch.equal(crossing, dt.keep_flags(torch.arange(2**32 - 300, 2**32 + 300), SEED, p))
    assert not dt.keep_flags(idx, SEED, 1.0 - 2**-40).any()


def test_dropout_through_the_torch_path_equals_the_default():
    x = _input((64, 300), torch.float32).requires_grad_()
    rows = _rows(64, 300)
    for r in (None, rows):
        torch.manual_seed(3)
        want = dropout(x, 0.5, rows=r)
        (gw,) = torch.autograd.grad(want, x, torch.ones_like(want))
        mask_want = dropout_mask((64, 300), 0.5, r)
        torch.manual_seed(3)
        seed = draw_seed()
        direct = torch.empty_like(x)
        dt.run_hashed_torch(x.detach(), direct, seed, 0.5, r, DROP)
        assert torch.equal(direct, want)
        torch.manual_seed(3)
        with tuning.forcing("portable", True):  # the dispatch a GPU tensor takes, on the CPU
            got = dropout(x, 0.5, rows=r)
            (gg,) = torch.autograd.grad(got, x, torch.ones_like(got))
            mask_got = dropout_mask((64, 300), 0.5, r)
        assert torch.equal(got, want) and torch.equal(gg, gw) and torch.equal(mask_got, mask_want)


def test_argument_checks_are_the_kernels():
    x = torch.ones(4, 6)
    with pytest.raises(ValueError, match="rows has 3 ids"):
        dt.run_hashed_torch(x, torch.empty_like(x), 1, 0.5, torch.arange(3), DROP)
    with pytest.raises(ValueError, match="contiguous"):
        dt.run_hashed_torch(x.t(), x.t(), 1, 0.5, None, DROP_IN_PLACE)
    empty = torch.empty(0, 6)
    dt.run_hashed_torch(empty, empty, 1, 0.5, torch.empty(0, dtype=torch.int64), DROP)
