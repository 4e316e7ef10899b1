"""Aggregation kernels: every backend against the reference, the csr kernel's feature tiling and
determinism, and S-SpMM (masked aggregation) against masked dense products."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from helpers import awkward_graph, dense_adjacency
from tessera import sparse
from tessera.backends import available_backends, get_backend
from tessera.backends import cpu_csr as csr_mod
from tessera.dense import liveness
from tessera.sparse.masked import dropout_aggregate, masked_aggregate, masked_spmm_t
from tessera.threads import set_num_threads

BACKENDS = available_backends()


@pytest.fixture(scope="module")
def hub():
    """Empty rows, isolated vertices, self loops, duplicate edges, and vertex 3 holding a third of
    all edges (heavy enough for the csr kernel to split it into feature tiles)."""
    return awkward_graph(n=300, e=6000, seed=1)


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    # relative to the largest magnitude: sums that cancel to ~0 are not held to 1e-5 of themselves
    scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=rel, atol=rel * max(scale, 1e-30))


def _threads(n: int):
    class _Ctx:
        def __enter__(self):
            self.before = torch.get_num_threads()
            set_num_threads(n)

        def __exit__(self, *exc):
            set_num_threads(self.before)

    return _Ctx()


def test_hub_graph_is_awkward_and_tiles(hub):
    deg = hub.in_degree()
    assert int(deg.max()) * 3 >= hub.num_edges * 0.99, "one vertex holds a third of all edges"
    assert bool((deg == 0).any()) and int(hub.out_degree()[-3:].sum()) == 0
    src, dst = hub.src_index(), hub.dst_index()
    assert bool((src == dst).any())
    assert torch.unique(dst * hub.num_nodes + src).numel() < hub.num_edges, "duplicate edges"
    for threads in (1, 2):
        for width in (64, 256):
            items = csr_mod.work_items(hub.indptr.numpy().astype(np.int64), width, threads)
            assert (items[:, 2] > 0).any(), "the hub row is split into feature tiles"
            # items cover every (row, feature) exactly once
            cover = np.zeros((hub.num_nodes, width), np.int64)
            for r0, r1, f0, f1 in items:
                cover[r0:r1, f0:f1] += 1
            assert (cover == 1).all()
    be = get_backend("csr")
    for width in (100, 256, 300):  # wide products run as passes over 128-feature blocks
        cover = np.zeros((hub.num_nodes, width), np.int64)
        passes = be._passes(hub, False, width)
        assert len(passes) == (1 if width <= 192 else -(-width // 128))
        for items in passes:
            for r0, r1, f0, f1 in items:
                cover[r0:r1, f0:f1] += 1
        assert (cover == 1).all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("width", [64, 256, 300])
@pytest.mark.parametrize(("reduce", "weighted"), [("sum", False), ("sum", True), ("mean", True)])
def test_forward_and_input_grad_match_reference_float32(hub, backend, width, weighted, reduce):
    gen = torch.Generator().manual_seed(width + weighted)
    x = torch.randn(hub.num_nodes, width, generator=gen)
    w = torch.rand(hub.num_edges, generator=gen) if weighted else None
    g = torch.randn(hub.num_nodes, width, generator=gen)
    results = {}
    for name in ("reference", backend):
        xr = x.clone().requires_grad_(True)
        out = sparse.aggregate(hub, xr, reduce, w, name)
        out.backward(g)
        results[name] = (out.detach(), xr.grad)
    _close(results[backend][0], results["reference"][0])
    _close(results[backend][1], results["reference"][1])
    a = dense_adjacency(hub, w)
    if reduce == "mean":
        a = a / hub.in_degree().to(torch.float64).clamp(min=1)[:, None]
    _close(results[backend][0].double(), a @ x.double())
    assert bool((results[backend][0][-3:] == 0).all())


@pytest.mark.parametrize("backend", BACKENDS)
def test_heads_and_edge_weight_grad_match_reference(hub, backend):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(hub.num_nodes, 4, 24, generator=gen)
    w = torch.rand(hub.num_edges, 4, generator=gen)
    g = torch.randn(hub.num_nodes, 4, 24, generator=gen)
    res = {}
    for name in ("reference", backend):
        xr, wr = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        out = sparse.aggregate(hub, xr, "sum", wr, name)
        out.backward(g)
        res[name] = (out.detach(), xr.grad, wr.grad)
    for a, b in zip(res[backend], res["reference"]):
        _close(a, b)
    # one weight for every head: the 3-D input runs as one wide row
    w1 = torch.rand(hub.num_edges, generator=gen)
    _close(sparse.aggregate(hub, x, "sum", w1, backend), sparse.aggregate(hub, x, "sum", w1, "reference"))


@pytest.mark.parametrize("backend", BACKENDS)
def test_sddmm_dot_matches_reference(hub, backend):
    gen = torch.Generator().manual_seed(3)
    for shape in ((40,), (3, 16)):
        gx = torch.randn(hub.num_nodes, *shape, generator=gen)
        x = torch.randn(hub.num_nodes, *shape, generator=gen)
        _close(get_backend(backend).sddmm_dot(hub, gx, x), get_backend("reference").sddmm_dot(hub, gx, x))


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_csr_gradcheck_with_feature_tiles(reduce):
    g = awkward_graph(n=12, e=60, seed=2)  # hub row heavy enough to tile at width 32
    assert (csr_mod.work_items(g.indptr.numpy().astype(np.int64), 20, 2)[:, 2] > 0).any()
    x = torch.randn(g.num_nodes, 20, dtype=torch.float64, requires_grad=True)
    w = torch.rand(g.num_edges, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: sparse.aggregate(g, x, reduce, w, "csr"), (x, w), fast_mode=True)


def test_csr_is_deterministic_across_threads_and_tilings(hub, monkeypatch):
    be = get_backend("csr")
    gen = torch.Generator().manual_seed(11)
    w = torch.rand(hub.num_edges, generator=gen)
    for width in (64, 256):
        x = torch.randn(hub.num_nodes, width, generator=gen)
        mask = torch.rand(hub.num_nodes, width, generator=gen) < 0.5
        mask[::3] = False
        runs = []
        for threads, per_thread in ((1, 1), (1, 8), (2, 8), (2, 3)):
            monkeypatch.setattr(csr_mod, "_ITEMS_PER_THREAD", per_thread)
            with _threads(threads):
                runs.append(
                    (
                        be.spmm(hub, x, None),
                        be.spmm(hub, x, w),
                        be.spmm_t(hub, x, w),
                        be.masked_spmm(hub, x, mask, w),
                        be.sddmm_dot(hub, x, x),
                    )
                )
        for other in runs[1:]:
            for a, b in zip(runs[0], other):
                assert torch.equal(a, b)
        # the masked product keeps exactly the plain product's values
        assert torch.equal(runs[0][3], torch.where(mask, runs[0][1], 0.0))


def test_output_buffer_is_reused_and_new_outputs_are_correct(hub):
    be = get_backend("csr")
    x = torch.randn(hub.num_nodes, 64)
    out = torch.full((hub.num_nodes, 64), float("nan"))
    got = be.spmm(hub, x, None, out=out)
    assert got.data_ptr() == out.data_ptr()
    _close(got, get_backend("reference").spmm(hub, x, None))
    big = csr_mod.new_output((5000, 1000), torch.float32)  # large enough for the huge-page advice
    assert big.shape == (5000, 1000) and big.dtype == torch.float32


def test_empty_graph_and_zero_width():
    from tessera import Graph

    be = get_backend("csr")
    g = Graph.from_edge_index(torch.zeros(2, 0, dtype=torch.int64), 4)
    assert torch.equal(be.spmm(g, torch.randn(4, 8), None), torch.zeros(4, 8))
    assert torch.equal(be.spmm_t(g, torch.randn(4, 8), None), torch.zeros(4, 8))
    h = awkward_graph(n=10, e=20)
    assert be.spmm(h, torch.randn(h.num_nodes, 0), None).shape == (h.num_nodes, 0)


# ---------------------------------------------------------------------------------------- S-SpMM
def _masks(n: int, f: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    tiles = (torch.rand(n, (f + 15) // 16, generator=gen) < 0.4).repeat_interleave(16, 1)[:, :f]
    return {
        "element": torch.rand(n, f, generator=gen) < 0.5,
        "rows": (torch.rand(n, 1, generator=gen) < 0.3).expand(n, f).contiguous(),  # many rows skipped
        "tiles": tiles & (torch.rand(n, f, generator=gen) < 0.8),  # whole 16-wide tiles dropped
        "mostly": torch.rand(n, f, generator=gen) < 0.97,
        "none": torch.zeros(n, f, dtype=torch.bool),
        "uint8": (torch.rand(n, f, generator=gen) < 0.5).to(torch.uint8),
    }


@pytest.mark.parametrize("width", [40, 256])
@pytest.mark.parametrize(("reduce", "weighted"), [("sum", False), ("mean", True)])
def test_masked_aggregate_equals_masked_dense(hub, width, reduce, weighted):
    gen = torch.Generator().manual_seed(width)
    w64 = torch.rand(hub.num_edges, dtype=torch.float64, generator=gen) if weighted else None
    a = dense_adjacency(hub, w64)
    if reduce == "mean":
        a = a / hub.in_degree().to(torch.float64).clamp(min=1)[:, None]
    x64 = torch.randn(hub.num_nodes, width, dtype=torch.float64, generator=gen)
    full = a @ x64
    for kind, mask in _masks(hub.num_nodes, width, width).items():
        keep = mask != 0
        for dtype, rel in ((torch.float64, 1e-12), (torch.float32, 1e-5)):
            w = None if w64 is None else w64.to(dtype)
            got = masked_aggregate(hub, x64.to(dtype), mask, reduce, w, scale=2.0)
            assert bool((got[~keep] == 0).all()), kind
            _close(got.double()[keep], 2.0 * full[keep], rel)
        ref = masked_aggregate(hub, x64, mask, reduce, w64, 2.0, backend="reference")
        _close(ref, masked_aggregate(hub, x64, mask, reduce, w64, 2.0), 1e-12)


@pytest.mark.parametrize("weighted", [False, True])
def test_masked_spmm_t_equals_masked_dense(hub, weighted):
    gen = torch.Generator().manual_seed(5)
    w = torch.rand(hub.num_edges, dtype=torch.float64, generator=gen) if weighted else None
    at = dense_adjacency(hub, w).T
    g = torch.randn(hub.num_nodes, 64, dtype=torch.float64, generator=gen)
    for kind, mask in _masks(hub.num_nodes, 64, 9).items():
        keep = mask != 0
        got = masked_spmm_t(hub, g, mask, w)
        assert bool((got[~keep] == 0).all()), kind
        _close(got[keep], (at @ g)[keep], 1e-12)


def test_masked_gradcheck():
    g = awkward_graph(n=12, e=60, seed=2)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(g.num_nodes, 20, dtype=torch.float64, requires_grad=True)
    w = torch.rand(g.num_edges, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(g.num_nodes, 20, generator=gen) < 0.5
    mask[1] = False
    mask[2, :16] = False
    for reduce in ("sum", "mean"):
        f = lambda x, w, reduce=reduce: masked_aggregate(g, x, mask, reduce, w, scale=1.5)  # noqa: E731
        assert torch.autograd.gradcheck(f, (x, w), fast_mode=True)
    assert torch.autograd.gradcheck(lambda x, w: masked_spmm_t(g, x, mask, w), (x, w), fast_mode=True)
    x4 = torch.randn(g.num_nodes, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x: masked_spmm_t(g, x, mask[:, :4], None), (x4,))  # full mode
    # the input gradient is A^T (g * mask), the transposed plain product
    out = masked_aggregate(g, x, mask, "sum", w)
    go = torch.randn_like(out)
    (gx,) = torch.autograd.grad(out, x, go)
    _close(gx, get_backend("reference").spmm_t(g, go * mask, w.detach()), 1e-12)


def test_dropout_aggregate_keeps_about_half_scaled():
    g = awkward_graph(n=200, e=2000, seed=4)
    x = torch.randn(g.num_nodes, 64)
    torch.manual_seed(0)
    out = dropout_aggregate(g, x, 0.5)
    full = sparse.aggregate(g, x, "sum", None, "reference")
    live = full != 0
    keep = out[live] != 0
    assert 0.45 < keep.float().mean().item() < 0.55
    _close(out[live][keep], 2.0 * full[live][keep])
    torch.manual_seed(0)
    assert torch.equal(out, dropout_aggregate(g, x, 0.5))
    # the same mask and roundings as dropout after the csr aggregation
    from tessera.kernels.dropout import dropout

    for p in (0.5, 0.3):
        w = torch.rand(g.num_edges)
        torch.manual_seed(1)
        fused = dropout_aggregate(g, x, p, "sum", w)
        torch.manual_seed(1)
        assert torch.equal(fused, dropout(sparse.aggregate(g, x, "sum", w, "csr"), p))
    assert torch.equal(dropout_aggregate(g, x, 0.5, training=False), sparse.aggregate(g, x))


def test_masked_rejects_bad_masks(hub):
    x = torch.randn(hub.num_nodes, 8)
    with pytest.raises(ValueError, match="mask has shape"):
        masked_aggregate(hub, x, torch.ones(hub.num_nodes, 9, dtype=torch.bool))
    with pytest.raises(ValueError, match="bool or an integer"):
        masked_aggregate(hub, x, torch.ones(hub.num_nodes, 8))
    with pytest.raises(Exception, match="unknown reduce"):
        masked_aggregate(hub, x, torch.ones(hub.num_nodes, 8, dtype=torch.bool), "max")


def test_work_items_cover_every_row_once_even_with_fewer_edges_than_items():
    from tessera.backends.cpu_csr import work_items

    for indptr in (np.array([0, 1, 2, 3]), np.array([0, 0, 0]), np.array([0, 5, 5, 6])):
        items = work_items(indptr, 16, 2)
        rows = sorted(r for r0, r1, f0, f1 in items for r in range(r0, r1) if f0 == 0)
        assert rows == list(range(indptr.size - 1))


@pytest.mark.parametrize(
    ("model", "hidden", "layers", "expected"),
    [("gcn", 256, 3, {"forward": 1}), ("sage", 256, 3, {"forward": 1}), ("gin", 64, 2, {"transposed": 1})],
)
def test_models_use_s_spmm_and_match_the_plain_composition(monkeypatch, model, hidden, layers, expected):
    # GCN/SAGE 256->256 aggregate last, so the next dropout's mask limits the aggregation; GIN's
    # second layer aggregates dropout(relu(h)) first, so its backward computes only kept entries.
    from tessera.backends.local import LocalOperand
    from tessera.datasets import load
    from tessera.nn import build_model

    calls: dict[str, int] = {}
    real = LocalOperand.masked_spmm

    def counting(self, x, mask, weight, row_scale, transposed):
        key = "transposed" if transposed else "forward"
        calls[key] = calls.get(key, 0) + 1
        return real(self, x, mask, weight, row_scale, transposed)

    monkeypatch.setattr(LocalOperand, "masked_spmm", counting)
    g = load("synthetic:tiny")
    torch.manual_seed(0)
    m = build_model(model, g.x.shape[1], hidden, int(g.y.max()) + 1, layers, 0.5)
    results = []
    for fused in (True, False):
        m.s_spmm = fused
        m.zero_grad()
        torch.manual_seed(1)
        out = m(g.x, g)
        (out.square() * torch.linspace(0, 1, out.shape[1])).sum().backward()
        results.append((out.detach().clone(), [p.grad.clone() for p in m.parameters()]))
        if fused:
            assert calls == expected
    (a, ga), (b, gb) = results
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for x, y in zip(ga, gb, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
    m.eval()
    calls.clear()
    m(g.x, g)
    assert calls == {}  # no dropout in evaluation: plain aggregation


def test_train_flag_s_spmm_reaches_the_model_and_leaves_the_run_unchanged(monkeypatch, tmp_path, capsys):
    # `tessera train --s-spmm` turns S-SpMM on (the masked kernel runs) and, as S-SpMM computes
    # the same values, the loss history matches the default run's.
    import json

    from tessera.backends.local import LocalOperand
    from tessera.cli.main import main

    calls = []
    real = LocalOperand.masked_spmm
    monkeypatch.setattr(LocalOperand, "masked_spmm", lambda *a, **k: calls.append(1) or real(*a, **k))
    hist = {}
    for flag in ([], ["--s-spmm"]):
        out = tmp_path / ("on" if flag else "off")
        argv = ["train", "--dataset", "synthetic:tiny", "--model", "gcn", "--layers", "3", "--epochs", "3"]
        assert main([*argv, "--hidden", "64", "--out", str(out), "--no-progress", *flag]) == 0
        hist[bool(flag)] = [r["train_loss"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())]
        assert bool(calls) == bool(flag)
    capsys.readouterr()
    np.testing.assert_allclose(hist[True], hist[False], rtol=1e-5)


@pytest.mark.parametrize("weighted", [False, True])
def test_backward_product_of_mostly_zero_rows_gathers_only_live_rows(monkeypatch, weighted):
    # A^T g with g zero outside a few rows (the loss gradient off the training vertices) runs on
    # the transposed CSR kept to edges into live rows: same values as the reference, a plan per
    # live-row pattern, and no plan when most rows are live.
    monkeypatch.setattr(liveness, "MIN_ROWS", 0)
    monkeypatch.setattr(csr_mod, "_LIVE_KEEP", 100)
    g = awkward_graph(n=300, e=3000, seed=3)
    w = torch.rand(g.num_edges) if weighted else None
    csr, ref = get_backend("csr"), get_backend("reference")
    gen = torch.Generator().manual_seed(0)
    plans = csr.plans.get(g, "live_plans", dict)
    for share, width in ((0.1, 7), (0.3, 47), (0.1, 200)):
        x = torch.randn(g.num_nodes, width, generator=gen)
        x[torch.rand(g.num_nodes, generator=gen) >= share] = 0
        before = len(plans)
        _close(csr.spmm_t(g, x, w), ref.spmm_t(g, x, w))
        assert len(plans) == before + 1
        r = int((x == 0).all(1).nonzero()[0])
        x[r, 3] = float("nan")  # a non-finite entry makes its row live and reaches its sources
        got = csr.spmm_t(g, x, w)
        srcs = g.indices[g.indptr[r] : g.indptr[r + 1]].long()
        assert torch.isnan(got[srcs, 3]).all() and len(plans) == before + 2
    dense = torch.randn(g.num_nodes, 16, generator=gen)
    before = len(plans)
    _close(csr.spmm_t(g, dense, w), ref.spmm_t(g, dense, w))
    assert len(plans) == before  # most rows live: the full transposed CSR


@pytest.mark.parametrize("heads", [1, 3])
def test_per_head_weights_of_one_step_are_read_through_the_permutation(heads):
    """A transposed product by per-head weights that change every step (trainable, or in a
    workspace block) reads them through the transpose's permutation instead of a permuted copy:
    bit for bit the product by the permuted copy a fixed weight gets, and no copy is kept."""
    from tessera import workspace

    g = awkward_graph()
    csr = get_backend("csr")
    gen = torch.Generator().manual_seed(4)
    w = torch.rand(g.num_edges, heads, generator=gen)
    x = torch.randn(g.num_nodes, heads, 6, generator=gen)
    fixed = csr.spmm_t(g, x, w)
    trainable = csr.spmm_t(g, x, w.clone().requires_grad_())
    ws = workspace.Workspace(min_bytes=0)
    block = ws.empty(w.shape)
    block.copy_(w)
    assert ws.holds(block) and not ws.holds(w)
    held = workspace.DEFAULT
    try:
        workspace.DEFAULT = ws
        in_block = csr.spmm_t(g, x, block)
    finally:
        workspace.DEFAULT = held
    assert torch.equal(trainable, fixed) and torch.equal(in_block, fixed)
    dense = torch.stack([dense_adjacency(g, w[:, h]).T.float() @ x[:, h] for h in range(heads)], 1)
    torch.testing.assert_close(fixed, dense, rtol=1e-5, atol=1e-5)
    assert csr.plans.entries(g)["transposed_weight"][torch.float32][0]() is w  # the fixed weight's copy only


@pytest.mark.parametrize("heads", [1, 3])
def test_the_reference_backend_multiplies_per_head_weights_head_by_head(heads):
    g = awkward_graph()
    ref = get_backend("reference")
    gen = torch.Generator().manual_seed(5)
    w = torch.rand(g.num_edges, heads, generator=gen)
    x = torch.randn(g.num_nodes, heads, 6, generator=gen)
    fwd = torch.stack([dense_adjacency(g, w[:, h]).float() @ x[:, h] for h in range(heads)], 1)
    bwd = torch.stack([dense_adjacency(g, w[:, h]).T.float() @ x[:, h] for h in range(heads)], 1)
    torch.testing.assert_close(ref.spmm(g, x, w), fwd, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ref.spmm_t(g, x, w.clone().requires_grad_()), bwd, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        ref.spmm_t(g, x, w[:, 0]),
        bwd if heads == 1 else torch.stack([dense_adjacency(g, w[:, 0]).T.float() @ x[:, h] for h in range(heads)], 1),
        rtol=1e-5,
        atol=1e-5,
    )
