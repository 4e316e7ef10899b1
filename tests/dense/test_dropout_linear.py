"""dropout_linear: linear(dropout(x)) with the same draw and values, keeping no dropped-out copy."""

from __future__ import annotations

import sys

import pytest
import torch

from helpers import awkward_edge_index
from tessera import Graph, dense
from tessera.dense.dropout_linear import dropout_linear
from tessera.nn import build_model
from tessera.nn.conv.base import Fusion
from tessera.nn.conv.gat import GATConv

MODULE = sys.modules["tessera.dense.dropout_linear"]


def _both(x, w, b, p, rows):
    """(fused, composed) outputs and their weight and bias gradients for one projection."""
    results = []
    for fused in (True, False):
        wi, bi = w.detach().clone().requires_grad_(), None if b is None else b.detach().clone().requires_grad_()
        torch.manual_seed(7)
        out = (
            dropout_linear(x, wi, bi, p, True, rows) if fused else dense.linear(dense.dropout(x, p, True, rows), wi, bi)
        )
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), wi.grad, None if bi is None else bi.grad, torch.rand(3)))
    return results


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("keyed", [True, False])
def test_fused_projection_equals_dropout_then_linear_over_several_chunks(monkeypatch, bias, keyed):
    monkeypatch.setattr(MODULE, "CHUNK_BYTES", 64 * 12 * 4)  # 64-row chunks: 5 of them, the last short
    torch.manual_seed(0)
    n, k, o = 300, 12, 20
    x, w = torch.randn(n, k), torch.randn(o, k)
    b = torch.randn(o) if bias else None
    rows = torch.randperm(1000)[:n] if keyed else None
    (fo, fw, fb, fnext), (co, cw, cb, cnext) = _both(x, w, b, 0.4, rows)
    torch.testing.assert_close(fo, co, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(fw, cw, rtol=1e-5, atol=1e-5)
    if bias:
        torch.testing.assert_close(fb, cb, rtol=1e-6, atol=1e-6)
    assert torch.equal(fnext, cnext)  # the same draws from torch's generator
    assert (fo != (x @ w.t() + (0 if b is None else b))).any()  # the dropout did drop


def test_the_node_keeps_the_input_itself_not_a_dropped_out_copy():
    x, w = torch.randn(50, 8), torch.randn(6, 8, requires_grad=True)
    out = dropout_linear(x, w, None, 0.5, True)
    saved = out.grad_fn.saved_tensors
    assert any(t.data_ptr() == x.data_ptr() for t in saved) and all(
        t.shape != (50, 8) or t.data_ptr() == x.data_ptr() for t in saved
    )


def test_unfusable_calls_compose_dropout_and_linear():
    torch.manual_seed(0)
    x, w, b = torch.randn(40, 8, requires_grad=True), torch.randn(6, 8), torch.randn(6)
    torch.manual_seed(3)
    got = dropout_linear(x, w, b, 0.5, True)
    got.sum().backward()
    gx = x.grad.clone()
    x.grad = None
    torch.manual_seed(3)
    want = dense.linear(dense.dropout(x, 0.5, True), w, b)
    want.sum().backward()
    assert torch.equal(got, want) and torch.equal(gx, x.grad)
    assert torch.equal(dropout_linear(x.detach(), w, b, 0.5, training=False), dense.linear(x.detach(), w, b))
    with pytest.raises(ValueError, match="rows has 3 ids for 40 rows"):
        dropout_linear(x.detach(), w, b, 0.5, True, torch.arange(3))


def test_a_gat_model_trains_the_same_with_the_dropout_left_to_its_first_layer(monkeypatch):
    ei, n = awkward_edge_index()
    g = Graph.from_edge_index(ei, n)
    x = torch.randn(n, 16)
    runs = []
    for takes in (True, False):
        monkeypatch.setattr(GATConv, "fusion", lambda self, takes=takes: Fusion(input_dropout=takes))
        torch.manual_seed(0)
        m = build_model("gat", 16, 16, 3, dropout=0.5, heads=2)
        torch.manual_seed(1)
        out = m(x, g)
        out.pow(2).sum().backward()
        runs.append((out.detach(), [p.grad for p in m.parameters()]))
    (a, ga), (b, gb) = runs
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for u, v in zip(ga, gb, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
