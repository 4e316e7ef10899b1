"""The GEMM path: the faster kept one unless a fresh output measured clearly faster, kept on disk, same values."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from helpers import PORT, spawn_with_retry
from tessera import dense
from tessera.dense import gemm_path

pytestmark = pytest.mark.distributed  # starts worker processes


@pytest.fixture
def fresh(fresh_tuning, monkeypatch, tmp_path):
    """No remembered decision, a private cache folder, a non-Intel CPU with oneDNN usable."""
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    monkeypatch.setattr(gemm_path, "cpu_model", lambda: "AuthenticAMD AMD EPYC")
    monkeypatch.setattr(gemm_path, "onednn_usable", lambda: True)
    return tmp_path


@pytest.mark.parametrize(
    ("mkl_s", "kept_s", "fresh_s", "want"),
    [
        (1.0, 1.2, 0.95, "mkl"),  # a fresh output within the margin of the best kept path loses
        (1.0, 0.8, 0.75, "onednn_kept"),
        (1.0, 1.2, 0.5, "onednn"),
        (0.5, 0.6, 1.0, "mkl"),
    ],
)
def test_a_fresh_output_is_chosen_only_when_clearly_faster_and_the_choice_is_kept_on_disk(
    fresh, fresh_tuning, monkeypatch, mkl_s, kept_s, fresh_s, want
):
    monkeypatch.setattr(gemm_path, "measure", lambda: {"mkl": mkl_s, "onednn_kept": kept_s, "onednn": fresh_s})
    assert gemm_path.gemm_path() == want
    disk = json.loads((fresh / "gemm.json").read_text())
    assert list(disk.values()) == [want]
    assert "AMD EPYC" in next(iter(disk)) and f"t{torch.get_num_threads()}" in next(iter(disk))

    # another process (nothing in memory) reads the disk and measures nothing
    fresh_tuning.reset()
    monkeypatch.setattr(gemm_path, "measure", lambda: pytest.fail("measured again"))
    assert gemm_path.gemm_path() == want


ZEN = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: {model}
model name\t: AMD EPYC
flags\t\t: fpu sse2

processor\t: 1
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 99
model name\t: AMD EPYC
"""


def test_cpus_that_share_a_name_get_their_own_decision(fresh, fresh_tuning, monkeypatch):
    zen3, zen4 = (gemm_path.describe_cpu(ZEN.format(model=m).splitlines()) for m in (1, 17))
    assert zen3 == "AuthenticAMD AMD EPYC family 25 model 1" and zen4 == "AuthenticAMD AMD EPYC family 25 model 17"
    monkeypatch.setattr(gemm_path, "cpu_model", lambda: zen3)
    monkeypatch.setattr(gemm_path, "measure", lambda: {"mkl": 1.0, "onednn_kept": 0.8, "onednn": 0.9})
    assert gemm_path.gemm_path() == "onednn_kept"
    # the other CPU, in another process, does not take the first one's decision from disk
    fresh_tuning.reset()
    monkeypatch.setattr(gemm_path, "cpu_model", lambda: zen4)
    monkeypatch.setattr(gemm_path, "measure", lambda: {"mkl": 0.5, "onednn_kept": 0.8, "onednn": 0.9})
    assert gemm_path.gemm_path() == "mkl"
    assert sorted(json.loads((fresh / "gemm.json").read_text()).values()) == ["mkl", "onednn_kept"]
    assert gemm_path.describe_cpu([]) == ""


def test_intel_cpus_use_mkl_without_measuring(fresh, monkeypatch):
    monkeypatch.setattr(gemm_path, "cpu_model", lambda: "GenuineIntel Intel(R) Xeon(R) Processor")
    monkeypatch.setattr(gemm_path, "measure", lambda: pytest.fail("measured on Intel"))
    assert gemm_path.gemm_path() == "mkl"


def test_without_onednn_the_path_is_mkl(fresh, monkeypatch):
    monkeypatch.setattr(gemm_path, "onednn_usable", lambda: False)
    monkeypatch.setattr(gemm_path, "measure", lambda: pytest.fail("measured without oneDNN"))
    assert gemm_path.gemm_path() == "mkl"


def test_measure_times_both_paths_on_a_small_product():
    if not gemm_path.onednn_usable():
        pytest.skip("this torch build has no oneDNN linear op")
    seconds = gemm_path.measure(((512, 16, 32), (300, 8, 24)))
    assert set(seconds) == set(gemm_path.PATHS) and all(0 < t < 1 for t in seconds.values())


@pytest.fixture(params=gemm_path.PATHS)
def path(request):
    """Each GEMM path this torch build can run."""
    if request.param != "mkl" and not gemm_path.onednn_usable():
        pytest.skip("this torch build has no oneDNN ops")
    return request.param


def test_forced_rejects_an_unknown_path():
    with pytest.raises(ValueError, match="mkl, onednn_kept, onednn"):
        with gemm_path.forced("blas"):
            pass


def test_every_path_gives_torchs_values_and_gradients(path):
    torch.manual_seed(3)
    x = torch.randn(3000, 48, requires_grad=True)
    w = torch.randn(64, 48, requires_grad=True)
    b = torch.randn(64, requires_grad=True)
    acc0 = torch.randn(3000, 64)
    g = torch.randn(3000, 64)
    with gemm_path.forced(path):
        y = dense.linear(x, w, b)
        acc = dense.linear_add_(acc0.clone(), x, w)
        (y * g).sum().add((acc * g).sum()).backward()
    got = [y.detach(), acc.detach(), x.grad, w.grad, b.grad]
    x.grad = w.grad = b.grad = None
    want_y, want_acc = F.linear(x, w, b), acc0 + F.linear(x, w)
    (want_y * g).sum().add((want_acc * g).sum()).backward()
    for a, e in zip(got, [want_y.detach(), want_acc.detach(), x.grad, w.grad, b.grad], strict=True):
        # the weight gradient may be a sum over row chunks (tessera.dense.chunk_gemm): its rounding
        # is that of a sum of 3000 products, relative to its largest entries
        torch.testing.assert_close(a, e, rtol=1e-5, atol=max(1e-4, 2e-6 * float(e.abs().max())))


def test_linear_split_equals_one_product_per_weight(path):
    torch.manual_seed(5)
    x = torch.randn(2500, 32, requires_grad=True)
    ws = [torch.randn(7, 32, requires_grad=True), torch.randn(11, 32, requires_grad=True)]
    gs = [torch.randn(2500, 7), torch.randn(2500, 11)]
    with gemm_path.forced(path):
        outs = dense.linear_split(x, ws)
        sum((o * g).sum() for o, g in zip(outs, gs)).backward()
    got = [*(o.detach() for o in outs), x.grad, *(w.grad for w in ws)]
    x.grad = ws[0].grad = ws[1].grad = None
    want_outs = [F.linear(x, w) for w in ws]
    sum((o * g).sum() for o, g in zip(want_outs, gs)).backward()
    want = [*(o.detach() for o in want_outs), x.grad, *(w.grad for w in ws)]
    for a, e in zip(got, want, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-4)
    # only one output used: the other's gradient is zero
    x.grad = None
    with gemm_path.forced(path):
        dense.linear_split(x, ws)[1].sum().backward()
    torch.testing.assert_close(x.grad, ws[1].detach().sum(0).expand(2500, 32), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize(("rows", "k", "o"), [(1, 8, 8), (8, 1, 8), (8, 8, 1), (2, 2, 2), (700, 33, 65)])
def test_the_kept_onednn_path_is_right_on_degenerate_shapes(rows, k, o):
    # a dimension of 1 makes the channels-last views ambiguous: such products fall back to MKL
    if not gemm_path.onednn_usable():
        pytest.skip("this torch build has no oneDNN ops")
    torch.manual_seed(rows + k + o)
    x, w, b = torch.randn(rows, k), torch.randn(o, k), torch.randn(o)
    acc = torch.randn(rows, o)
    with gemm_path.forced("onednn_kept"):
        torch.testing.assert_close(dense.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dense.linear_add_(acc.clone(), x, w), acc + F.linear(x, w), rtol=1e-5, atol=1e-5)


def _ranks_that_would_decide_apart(rank, world, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from tessera.comm.group import init_from_env, shutdown
    from tessera.datasets import load
    from tessera.threads import set_num_threads
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    set_num_threads(1)
    # each rank measuring by itself, as ranks started on an empty cache do, and timing differently
    gemm_path._decide = lambda key: gemm_path.PATHS[1 - rank]  # rank 0: onednn_kept, rank 1: mkl
    gemm_path._decide_chunks = lambda key: gemm_path.CHUNK_LIBRARIES[1 - rank]  # rank 0: onednn, rank 1: mkl
    comm = init_from_env(120)
    try:
        cfg = TrainConfig(dataset="synthetic:tiny", epochs=2, out=str(Path(out) / str(rank)), progress=False)
        Trainer(cfg, load("synthetic:tiny"), comm).fit()
        (Path(out) / f"path-{rank}").write_text(f"{gemm_path.gemm_path()} {gemm_path.chunk_library()}")
    finally:
        shutdown()


def test_a_distributed_run_takes_rank_0s_path_and_chunk_library_on_every_rank(tmp_path):
    if not gemm_path.onednn_usable():
        pytest.skip("this torch build has no oneDNN ops")
    spawn_with_retry(_ranks_that_would_decide_apart, (2, PORT, str(tmp_path)), 2)
    assert [(tmp_path / f"path-{r}").read_text() for r in (0, 1)] == ["onednn_kept onednn"] * 2
