"""Mostly-zero feature matrices: the first linear map (and its input dropout) over the non-zeros only,
with the values, gradients and random draws of the dense composition."""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import awkward_graph
from tessera import dense
from tessera.dense.dropout_linear import dropout_linear
from tessera.dense.sparse_features import feature_nonzeros
from tessera.nn import build_model

MODULE = sys.modules["tessera.dense.sparse_features"]


def _bag_of_words(n: int, k: int, density: float, seed: int = 0) -> torch.Tensor:
    """A binary n x k matrix with about ``density`` of its entries 1, and a few rows all zero."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(n, k, generator=g) < density).float()
    x[::17] = 0.0
    return x


def _autograd_nodes(t: torch.Tensor) -> set[str]:
    """The type names of every node in ``t``'s backward graph."""
    seen, todo, names = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        names.add(type(node).__name__)
        todo.extend(n for n, _ in node.next_functions)
    return names


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta state")
def test_the_non_zeros_are_found_once_per_tensor_and_version():
    x = _bag_of_words(60, 40, 0.03)
    sr = feature_nonzeros(x)
    assert sr is not None and feature_nonzeros(x) is sr
    csr = x.to_sparse_csr()
    assert sr.indptr.tolist() == csr.crow_indices().tolist() and sr.cols.tolist() == csr.col_indices().tolist()
    assert sr.vals.tolist() == csr.values().tolist()
    csc = x.t().contiguous().to_sparse_csr()  # x's columns as rows
    assert sr.col_ptr.tolist() == csc.crow_indices().tolist() and sr.col_rows.tolist() == csc.col_indices().tolist()
    x[0, 0] = 2.0  # in place: found again
    again = feature_nonzeros(x)
    assert again is not sr and again.vals[0] == 2.0


def test_dense_grad_requiring_or_float64_inputs_stay_dense():
    kept = len(MODULE._memo)
    assert feature_nonzeros(torch.relu(torch.randn(300, 200))) is None
    assert len(MODULE._memo) == kept  # turned away on a sample: nothing kept for it
    x = _bag_of_words(30, 20, 0.03)
    assert feature_nonzeros(x.double()) is None
    assert feature_nonzeros(x.clone().requires_grad_()) is None
    assert feature_nonzeros(_bag_of_words(30, 20, 2 * MODULE.MAX_DENSITY, seed=1)) is None


@pytest.mark.parametrize("p", [0.0, 0.5])
@pytest.mark.parametrize("keyed", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_projection_equals_dropout_then_linear(p, keyed, bias, dtype):
    # bfloat16 storage: the output rounded once from float32 sums, as the dense bfloat16 product
    x = _bag_of_words(300, 70, 0.04).to(dtype)
    assert feature_nonzeros(x).dtype == dtype
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 1e-2}
    torch.manual_seed(0)
    w, b = torch.randn(9, 70), torch.randn(9) if bias else None
    rows = torch.randperm(1000)[:300] + 5 if keyed else None
    results = []
    for composed in (False, True):
        wi, bi = w.clone().requires_grad_(), None if b is None else b.clone().requires_grad_()
        torch.manual_seed(7)
        if composed:
            out = dense.linear(dense.dropout(x, p, True, rows), wi, bi)
        else:
            out = dropout_linear(x, wi, bi, p, True, rows)
            assert type(out.grad_fn).__name__ == "_SparseDropoutLinearBackward"
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), wi.grad, None if bi is None else bi.grad, torch.rand(3)))
    (so, sw, sb, snext), (co, cw, cb, cnext) = results
    assert so.dtype == co.dtype == dtype
    torch.testing.assert_close(so, co, **tol)
    torch.testing.assert_close(sw, cw, **tol)
    if bias:
        torch.testing.assert_close(sb, cb, **tol)
    assert torch.equal(snext, cnext)  # the same draws from torch's generator
    if p:
        assert (so.float() != x.float() @ w.t() + (0 if b is None else b)).any()  # the dropout did drop


def test_evaluation_takes_the_sparse_path_without_drawing():
    x = _bag_of_words(100, 50, 0.04)
    w = torch.randn(6, 50)
    torch.manual_seed(1)
    out = dropout_linear(x, w, None, 0.5, training=False)
    after = torch.rand(2)
    torch.manual_seed(1)
    assert torch.equal(after, torch.rand(2))  # no seed drawn
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("model", ["gcn", "sage", "gat"])
def test_a_model_on_a_bag_of_words_graph_trains_as_on_its_dense_features(monkeypatch, fresh_tuning, model):
    # the same model, seed and steps with the sparse path switched off: the same losses and weights
    n, k = 200, 120
    x = _bag_of_words(n, k, 0.03, seed=2)
    graph = awkward_graph(n - 3, 900, seed=3)  # n vertices, three of them isolated
    y = torch.arange(n) % 4
    runs = []
    for density in (MODULE.MAX_DENSITY, 0.0):
        monkeypatch.setattr(MODULE, "MAX_DENSITY", density)
        fresh_tuning.reset()  # the non-zeros found again under the new limit
        torch.manual_seed(0)
        net = build_model(model, k, 16, 4, 2, dropout=0.5, heads=2)
        opt = torch.optim.Adam(net.parameters(), lr=0.01)
        losses = []
        for _ in range(3):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(x, graph), y)
            assert ("_SparseDropoutLinearBackward" in _autograd_nodes(loss)) == (density > 0)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        net.eval()
        runs.append((losses, net(x, graph).detach(), [q.detach().clone() for q in net.parameters()]))
        assert (feature_nonzeros(x) is not None) == (density > 0)
    (sl, so, sp), (dl, do, dp) = runs
    assert sl == pytest.approx(dl, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(so, do, rtol=1e-4, atol=1e-5)
    for a, b in zip(sp, dp):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
