"""Asking a model for some vertices' logits only (``targets``, what a training step's loss reads):
the same values and gradients as picking those rows from every vertex's logits, with the last
layer computing only those rows where it can (GIN over the rows' own CSR)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from helpers import awkward_graph
from tessera import sparse
from tessera.graph import synthetic
from tessera.graph.csr import select_rows
from tessera.nn import build_model
from tessera.nn.conv import GINConv
from tessera.nn.conv.base import LayerHints
from tessera.nn.loss import cross_entropy_rows
from tessera.sparse import as_operand
from tessera.sparse.rows import add_rows_, take_rows


def test_select_rows_is_the_csr_of_the_picked_rows():
    g = awkward_graph(n=50, e=300)
    ids = torch.tensor([3, 0, 52, 17, 4, 49], dtype=torch.int64)  # 52: an isolated vertex
    indptr, positions = select_rows(g.indptr, ids)
    ip, ix = g.indptr.numpy(), g.indices.numpy()
    want = [np.arange(ip[i], ip[i + 1]) for i in ids.tolist()]
    assert indptr.dtype == g.indptr.dtype
    assert indptr.tolist() == np.concatenate([[0], np.cumsum([w.size for w in want])]).tolist()
    assert positions.tolist() == np.concatenate(want).tolist()
    assert g.indices[positions].tolist() == ix[np.concatenate(want)].tolist()


@pytest.mark.parametrize("backend", ["reference", "csr"])
@pytest.mark.parametrize("variant", ["pattern", "gcn", "weighted"])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_an_operand_of_some_rows_gives_those_rows_and_their_gradient(backend, variant, reduce):
    gen = torch.Generator().manual_seed(1)
    g = awkward_graph(n=70, e=500)
    g = g.replace(edge_weight=torch.rand(g.num_edges, generator=gen) + 0.5)
    whole = as_operand(g, backend)
    whole = {"pattern": whole.pattern(), "gcn": whole.gcn_normalized(), "weighted": whole.weighted()}[variant]
    ids = torch.randperm(g.num_nodes, generator=gen)[:31]
    sub = whole.rows_of(ids)
    assert sub is not None and sub.num_rows == 31 and sub.num_cols == g.num_nodes
    assert torch.equal(sub.row_vertices, ids)
    assert sub.rows_of(ids) is None  # no selection of a selection
    x = torch.randn(g.num_nodes, 5, dtype=torch.float64, generator=gen)
    gout = torch.randn(31, 5, dtype=torch.float64, generator=gen)
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    got = sparse.aggregate(sub, a, reduce, self_weight=1.25)
    want = sparse.aggregate(whole, b, reduce, self_weight=1.25)[ids]
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    got.backward(gout)
    want.backward(gout)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-12, atol=1e-12)


def test_take_rows_is_indexing_with_its_gradient():
    x = torch.randn(300, 7, dtype=torch.float64)
    for rows in (torch.randperm(300)[:120], torch.rand(300) < 0.3):
        a = x.clone().requires_grad_()
        b = x.clone().requires_grad_()
        g = torch.randn(int(rows.sum()) if rows.dtype == torch.bool else rows.numel(), 7, dtype=torch.float64)
        out = take_rows(a, rows)
        assert torch.equal(out, b[rows])
        out.backward(g)
        b[rows].backward(g)
        assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("n_rows", [0, 5, 3000])
def test_add_rows_adds_the_picked_rows_in_chunks(n_rows):
    # 3000 rows of 200 float32 span several 1 MB gather chunks, the last one partial
    x = torch.randn(5000, 200)
    rows = torch.randperm(5000)[:n_rows]
    out = torch.randn(n_rows, 200)
    want = out.clone().add_(x[rows], alpha=0.75)  # what the gather-add replaces, to the bit
    assert add_rows_(out, x, rows, 0.75) is out
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_cross_entropy_over_every_row_is_cross_entropy():
    logits = torch.randn(400, 9)
    y = torch.randint(0, 9, (400,))
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    la = cross_entropy_rows(a, None, y)
    lb = F.cross_entropy(b, y, reduction="sum")
    assert torch.equal(la, lb)
    la.backward()
    lb.backward()
    assert torch.equal(a.grad, b.grad)


def _both_ways(model, x, g, targets, rows=None):
    """(logits, grads) of ``model(...)[targets]`` and of ``model(..., targets=targets)``, same draws."""
    out = []
    for ask in (False, True):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(7)
        logits = model(x, g, rows=rows, targets=targets) if ask else model(x, g, rows=rows)[targets]
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        out.append((logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    return out


@pytest.mark.parametrize(
    "name",
    # @one-layer: no dropout, so the layer aggregates its constant input once and keeps it
    [
        "gcn",
        "gcn@aggregate-first",
        "gcn@one-layer",
        "sage",
        "sage@aggregate-first",
        "gin",
        "gin-eps",
        "gat",
        "sage-lstm",
    ],
)
def test_a_model_asked_for_some_rows_gives_them_with_the_same_gradients(name):
    g = synthetic.generate("tiny", 0)
    torch.manual_seed(0)
    kind = name.split("@")[0].split("-eps")[0]
    layers, p = (1, 0.0) if name.endswith("@one-layer") else (2, 0.5)
    model = build_model(kind, g.x.shape[1], 16, g.num_classes, layers, p, train_eps=name == "gin-eps")
    if "@" in name:  # the last layer aggregates its input, then transforms it
        model.convs[-1].place(True)
    model.train()
    targets = g.train_mask.nonzero().view(-1)
    # global ids in another order key the dropout draws: targets must follow them
    rows = torch.randperm(g.num_nodes, generator=torch.Generator().manual_seed(3))
    for r in (None, rows):
        (full, gfull), (some, gsome) = _both_ways(model, g.x, g, targets, r)
        assert some.shape == (targets.numel(), g.num_classes)
        torch.testing.assert_close(some, full, rtol=1e-5, atol=1e-6)
        assert gsome.keys() == gfull.keys()
        for k in gfull:
            torch.testing.assert_close(gsome[k], gfull[k], rtol=1e-5, atol=1e-5, msg=k)


def test_gin_aggregates_only_the_target_rows(monkeypatch):
    g = synthetic.generate("tiny", 0)
    conv = GINConv(torch.nn.Sequential(torch.nn.Linear(g.x.shape[1], 8)))
    targets = torch.tensor([5, 1, 9])
    seen = []
    operand = as_operand(g).pattern()
    original = type(operand).rows_of

    def spy(self, ids):
        sub = original(self, ids)
        seen.append(sub.num_rows)
        return sub

    monkeypatch.setattr(type(operand), "rows_of", spy)
    out = conv(g.x, g, LayerHints(targets=targets))
    assert seen == [3]
    torch.testing.assert_close(out, conv(g.x, g)[targets], rtol=1e-6, atol=1e-6)


def test_the_rows_of_a_graph_are_fingerprinted_by_the_graph_and_the_rows():
    # measured kernel choices for the rows' CSR are then kept on disk, as the graph's are
    g = awkward_graph(n=50, e=300)
    a, b = torch.tensor([1, 4, 9]), torch.tensor([1, 4, 10])
    fa = as_operand(g).rows_of(a).matrix.fingerprint()
    assert fa is not None and fa != g.fingerprint()
    assert fa == as_operand(awkward_graph(n=50, e=300)).rows_of(a.clone()).matrix.fingerprint()
    assert as_operand(g).rows_of(b).matrix.fingerprint() not in (None, fa)
    other = awkward_graph(n=50, e=300, seed=1)
    assert as_operand(other).rows_of(a).matrix.fingerprint() != fa
