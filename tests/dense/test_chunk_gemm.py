"""The fused nodes' row-chunk products: the same values on either library, the library measured
once per CPU and kept on disk beside the GEMM path."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tessera import dense
from tessera.dense import Epilogue, chunk_gemm, gemm_path, linear_act
from tessera.dense.dropout_linear import dropout_linear
from tessera.dense.linear_act import CHUNK_BYTES


@pytest.fixture(params=gemm_path.CHUNK_LIBRARIES)
def library(request):
    """Each chunk library this torch build can run, forced for the test."""
    if request.param == "onednn" and not gemm_path.onednn_usable():
        pytest.skip("this torch build has no oneDNN ops")
    with gemm_path.forced_chunks(request.param):
        yield request.param


@pytest.fixture
def fresh(fresh_tuning, monkeypatch, tmp_path):
    """No remembered decisions, a private cache folder, a non-Intel CPU with oneDNN usable."""
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    monkeypatch.setattr(gemm_path, "cpu_model", lambda: "AuthenticAMD AMD EPYC family 26 model 2")
    monkeypatch.setattr(gemm_path, "onednn_usable", lambda: True)
    return tmp_path


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    # sums of up to a few thousand products, rounded in another order: relative to the largest entry
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6 * max(1.0, float(want.abs().max())))


@pytest.mark.parametrize(
    ("rows", "k", "o"), [(1, 8, 8), (8, 1, 8), (8, 8, 1), (2, 2, 2), (700, 33, 65), (4100, 48, 96)]
)
def test_chunk_products_equal_torchs_on_every_shape(library, rows, k, o):
    # a dimension of 1 makes oneDNN's channels-last views ambiguous: such products go to MKL
    gen = torch.Generator().manual_seed(rows + k + o)
    a, w, b = torch.randn(rows, k, generator=gen), torch.randn(o, k, generator=gen), torch.randn(o, generator=gen)
    acc, d = torch.randn(rows, o, generator=gen), torch.randn(rows, o, generator=gen)
    _close(chunk_gemm.product(torch.full((rows, o), float("nan")), a, w, b), F.linear(a, w, b))
    _close(chunk_gemm.product(torch.full((rows, o), float("nan")), a, w), F.linear(a, w))
    _close(chunk_gemm.add_product_(acc.clone(), a, w), acc + F.linear(a, w))
    gw0 = torch.randn(o, k, generator=gen)
    _close(chunk_gemm.add_weight_grad_(gw0.clone(), d, a), gw0 + d.t() @ a)
    _close(chunk_gemm.weight_grad(d, a), d.t() @ a)


def test_a_whole_weight_gradient_sums_its_row_chunks_and_takes_strided_operands(library):
    gen = torch.Generator().manual_seed(11)
    n = 3 * chunk_gemm.weight_grad_rows(40, 4, 1 << 30, chunk_gemm.WEIGHT_GRAD_BYTES) + 1  # 3 chunks and 1 row
    g, x = torch.randn(n, 40, generator=gen), torch.randn(n, 24, generator=gen)
    _close(chunk_gemm.weight_grad(g, x), g.t() @ x)
    wide = torch.randn(n, 48, generator=gen)
    _close(chunk_gemm.weight_grad(g, wide[:, ::2]), g.t() @ wide[:, ::2])  # not contiguous: one product


@pytest.mark.parametrize(
    ("width", "n", "want"),
    [(40, 169343, 24576), (80, 169343, 12288), (256, 169343, 4096), (40, 20000, 20000), (2048, 169343, 512)],
)
def test_weight_gradient_chunks_are_whole_multiples_of_4096_rows(width, n, want):
    # 4 MB of 40-wide rows is 26214 rows, on which oneDNN's weight gradient ran at 60 % speed
    assert chunk_gemm.weight_grad_rows(width, 4, n, 4 << 20) == want


def test_bfloat16_chunks_take_the_widened_products(library):
    gen = torch.Generator().manual_seed(2)
    a, w = torch.randn(300, 16, generator=gen).bfloat16(), torch.randn(24, 16, generator=gen).bfloat16()
    d = torch.randn(300, 24, generator=gen).bfloat16()
    out = chunk_gemm.product(torch.empty(300, 24, dtype=torch.bfloat16), a, w)
    torch.testing.assert_close(out.float(), (a.float() @ w.float().t()), rtol=1e-2, atol=1e-2)
    gw = chunk_gemm.add_weight_grad_(torch.zeros(24, 16), d, a)  # float32 sums of bfloat16 rows
    torch.testing.assert_close(gw, d.float().t() @ a.float(), rtol=1e-2, atol=5e-2)


@pytest.mark.parametrize("pairs", [1, 2])
def test_the_fused_nodes_give_the_same_values_on_either_library(pairs):
    if not gemm_path.onednn_usable():
        pytest.skip("this torch build has no oneDNN ops")
    gen = torch.Generator().manual_seed(4)
    n = 3 * CHUNK_BYTES // (4 * 64) + 17
    xs0 = [torch.randn(n, 12, generator=gen) for _ in range(pairs)]
    ws0 = [torch.randn(64, 12, generator=gen) for _ in range(pairs)]
    b0, w20 = torch.randn(64, generator=gen), torch.randn(7, 64, generator=gen)
    x_in, g = torch.randn(n, 12, generator=gen), torch.randn(n, 7, generator=gen)
    results = {}
    for lib in gemm_path.CHUNK_LIBRARIES:
        xs = [t.clone().requires_grad_() for t in xs0]
        ws = [t.clone().requires_grad_() for t in ws0]
        b, w2, w3 = b0.clone().requires_grad_(), w20.clone().requires_grad_(), ws0[0].clone().requires_grad_()
        with gemm_path.forced_chunks(lib):
            torch.manual_seed(9)
            y = linear_act(xs, ws, b, Epilogue("relu", 0.5, takes_owed=True))
            z = dense.linear(y, w2)  # its input gradient owed to y's node, formed in chunks
            u = dropout_linear(x_in, w3, None, 0.5)
            ((z * g).sum() + u.square().sum()).backward()
        results[lib] = [y.detach(), z.detach(), u.detach(), *(t.grad for t in [*xs, *ws, b, w2, w3])]
    for got, want in zip(results["onednn"], results["mkl"], strict=True):
        _close(got, want)


def test_the_chunk_library_is_measured_once_and_kept_on_disk_beside_the_path(fresh, fresh_tuning, monkeypatch):
    monkeypatch.setattr(gemm_path, "measure", lambda: {"mkl": 1.0, "onednn_kept": 0.8, "onednn": 0.9})
    monkeypatch.setattr(gemm_path, "measure_chunks", lambda: {"mkl": 1.0, "onednn": 0.6})
    assert (gemm_path.gemm_path(), gemm_path.chunk_library()) == ("onednn_kept", "onednn")
    disk = json.loads((fresh / "gemm.json").read_text())
    assert sorted(disk.values()) == ["onednn", "onednn_kept"]
    assert [k for k in disk if k.endswith("|chunks")] == [
        next(k for k in disk if not k.endswith("|chunks")) + "|chunks"
    ]
    # another process reads both from disk and measures nothing
    fresh_tuning.reset()
    monkeypatch.setattr(gemm_path, "measure", lambda: pytest.fail("measured again"))
    monkeypatch.setattr(gemm_path, "measure_chunks", lambda: pytest.fail("measured again"))
    assert (gemm_path.gemm_path(), gemm_path.chunk_library()) == ("onednn_kept", "onednn")


@pytest.mark.parametrize(("mkl_s", "onednn_s", "want"), [(1.0, 0.6, "onednn"), (0.7, 1.0, "mkl"), (1.0, 1.0, "mkl")])
def test_the_faster_chunk_library_is_chosen(mkl_s, onednn_s, want):
    assert gemm_path.choose_chunks({"mkl": mkl_s, "onednn": onednn_s}) == want


def test_intel_cpus_and_builds_without_onednn_use_mkl_for_chunks(fresh, fresh_tuning, monkeypatch):
    monkeypatch.setattr(gemm_path, "measure_chunks", lambda: pytest.fail("measured"))
    monkeypatch.setattr(gemm_path, "cpu_model", lambda: "GenuineIntel Intel(R) Xeon(R) Processor")
    assert gemm_path.chunk_library() == "mkl"
    fresh_tuning.reset()
    monkeypatch.setattr(gemm_path, "cpu_model", lambda: "AuthenticAMD AMD EPYC family 26 model 2")
    monkeypatch.setattr(gemm_path, "onednn_usable", lambda: False)
    assert gemm_path.chunk_library() == "mkl"


def test_measure_chunks_times_both_libraries():
    if not gemm_path.onednn_usable():
        pytest.skip("this torch build has no oneDNN ops")
    seconds = gemm_path.measure_chunks()
    assert set(seconds) == set(gemm_path.CHUNK_LIBRARIES) and all(0 < t < 1 for t in seconds.values())


def test_unknown_chunk_libraries_are_refused():
    with pytest.raises(ValueError, match="mkl, onednn"):
        with gemm_path.forced_chunks("blas"):
            pass
    with pytest.raises(ValueError, match="unknown chunk library"):
        gemm_path.adopt("mkl", "blas")
