"""Layers called as PyG users call them: ``conv(x, edge_index)``, with edge weights or types, and
with a ``torch.sparse`` adjacency in PyG's ``adj_t`` layout equal the PyG layer given its state
dict, forward and backward; the conversion runs once per edge index; wrong inputs are one clear
error saying what to pass."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch_geometric.nn as pyg

import tessera.nn.conv.base as base
import tessera.nn.conv.inputs as inputs
from helpers import awkward_edge_index
from tessera import Graph, GraphError
from tessera.errors import ConfigError
from tessera.nn import GATConv, GCNConv, GINConv, RGCNConv, SAGEConv, SAGELSTMConv, build_model
from tessera.nn.conv.base import GraphConv, LayerHints

R = 4  # relations of the RGCN layers; the graphs' edges use only 0..R-2

pytestmark = pytest.mark.filterwarnings("ignore:Sparse (CSR tensor support|invariant checks):UserWarning")


def mlp(i: int, o: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(i, 16), torch.nn.ReLU(), torch.nn.Linear(16, o))


# name -> (tessera layer, PyG layer, the per-edge data passed after edge_index: None, "weight" or "type")
CASES = {
    "gcn": (lambda: GCNConv(12, 6), lambda: pyg.GCNConv(12, 6), None),
    "gcn-weighted": (lambda: GCNConv(12, 6), lambda: pyg.GCNConv(12, 6), "weight"),
    "sage": (lambda: SAGEConv(12, 6), lambda: pyg.SAGEConv(12, 6), None),
    "gin": (lambda: GINConv(mlp(12, 6), train_eps=True), lambda: pyg.GINConv(mlp(12, 6), train_eps=True), None),
    "gat": (lambda: GATConv(12, 3, heads=2), lambda: pyg.GATConv(12, 3, heads=2), None),
    "rgcn": (lambda: RGCNConv(12, 6, R), lambda: pyg.RGCNConv(12, 6, R), "type"),
}
FORMS = ["edge_index", "coo", "csr"]


@pytest.fixture(scope="module")
def graph():
    """The awkward edges (hub, isolated vertices, self loops, duplicates), features, and per-edge
    weights and relation types (relation R - 1 unused)."""
    ei, n = awkward_edge_index(n=40, e=240)
    gen = torch.Generator().manual_seed(1)
    weight = torch.rand(ei.shape[1], generator=gen) + 0.1
    types = torch.randint(0, R - 1, (ei.shape[1],), generator=gen)
    x = torch.randn(n, 12, generator=gen)
    return ei, n, x, weight, types


def adjacency(ei: torch.Tensor, n: int, values: torch.Tensor, layout: str) -> torch.Tensor:
    """PyG's ``adj_t`` of the edges ``ei`` (row ``i`` holds the sources of ``i``'s in-edges), every
    edge one stored entry (duplicates kept) with its value."""
    if layout == "coo":
        return torch.sparse_coo_tensor(ei.flip(0), values, (n, n))  # uncoalesced: entries as given
    order = torch.argsort(ei[1], stable=True)
    crow = torch.zeros(n + 1, dtype=torch.int64)
    crow[1:] = torch.cumsum(torch.bincount(ei[1], minlength=n), 0)
    return torch.sparse_csr_tensor(crow, ei[0, order], values[order], (n, n))


def assert_same(ours: torch.nn.Module, theirs: torch.nn.Module, run_ours, run_theirs, x: torch.Tensor) -> None:
    """Equal outputs and gradients of the input and of every parameter (by name), to 1e-5."""
    xo, xt = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = run_ours(xo), run_theirs(xt)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    seed = torch.randn_like(b)
    (a * seed).sum().backward()
    (b * seed).sum().backward()
    torch.testing.assert_close(xo.grad, xt.grad, rtol=1e-5, atol=1e-5, msg="gradient of x")
    theirs_params = dict(theirs.named_parameters())
    names = [name for name, _ in ours.named_parameters()]
    assert sorted(names) == sorted(theirs_params)
    for name, p in ours.named_parameters():
        torch.testing.assert_close(p.grad, theirs_params[name].grad, rtol=1e-5, atol=1e-5, msg=f"gradient of {name}")


def layers(case: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    make_ours, make_theirs, _ = CASES[case]
    torch.manual_seed(0)
    theirs = make_theirs()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            if name.endswith("bias") or name == "eps":  # PyG starts them at 0, hiding a missing gradient
                p.uniform_(-0.5, 0.5)
    ours = make_ours()
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_pyg_inputs_equal_the_pyg_layer_forward_and_backward(graph, case, form):
    ei, n, x, weight, types = graph
    kind = CASES[case][2]
    data = {"weight": weight, "type": types, None: None}[kind]
    ours, theirs = layers(case)

    def run_theirs(xt):
        return theirs(xt, ei) if data is None else theirs(xt, ei, data)

    if form == "edge_index":

        def run_ours(xo):
            return ours(xo, ei) if data is None else ours(xo, ei, data)

    elif kind == "type" and form == "coo":
        adj = adjacency(ei, n, torch.ones(ei.shape[1]), form)

        def run_ours(xo):  # the types by name, one per stored entry in storage order
            return ours(xo, adj, edge_type=types)

    else:  # the values are the weights (GCN), the relation ids (RGCN) or all 1
        adj = adjacency(ei, n, torch.ones(ei.shape[1]) if data is None else data, form)

        def run_ours(xo):
            return ours(xo, adj)

    assert_same(ours, theirs, run_ours, run_theirs, x)


@pytest.mark.parametrize("case", ["gcn-weighted", "sage"])
def test_the_adjacency_layout_is_pygs_adj_t(graph, case):
    """PyG itself gives the same output for the edge index and for the adjacency built here, and so
    does tessera. Without duplicate edges and self loops: PyG's sparse path sums duplicates, and its
    GCN adds a second loop where one exists (add_self_loops, not its edge index path's
    add_remaining_self_loops, which tessera follows for every input)."""
    ei, n, x, weight, _ = graph
    key = ei[0] * n + ei[1]
    keep = torch.tensor([i for i in range(ei.shape[1]) if ei[0, i] != ei[1, i] and key[i] not in key[:i]])
    ei, weight = ei[:, keep], weight[keep]
    ours, theirs = layers(case)
    values = weight if case == "gcn-weighted" else torch.ones(ei.shape[1])
    for layout in ("coo", "csr"):
        adj = adjacency(ei, n, values, layout)
        want = theirs(x, ei, weight) if case == "gcn-weighted" else theirs(x, ei)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.testing.assert_close(theirs(x, adj), want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours(x, adj), want, rtol=1e-5, atol=1e-5)


def test_rgcn_takes_a_graph_whose_top_relations_are_unused(graph):
    ei, n, x, _, types = graph
    ours, theirs = layers("rgcn")
    g = Graph.from_edge_index(ei, n, edge_type=types)  # relation count from the types: R - 1
    assert g.num_relations == R - 1
    assert_same(ours, theirs, lambda xo: ours(xo, g), lambda xt: theirs(xt, ei, types), x)
    with pytest.raises(ConfigError, match=f"build it with num_relations={R + 1}"):
        ours(x, ei, torch.where(types == 0, R, types))  # relation R: one above the layer's own


def test_every_layer_is_exported_and_sage_lstm_takes_an_edge_index(graph):
    import tessera.nn
    import tessera.nn.conv

    convs = {n for n in tessera.nn.conv.__all__ if issubclass(getattr(tessera.nn.conv, n), GraphConv)}
    assert convs <= set(tessera.nn.__all__) and {"RGCNConv", "SAGELSTMConv"} <= convs
    ei, n, x, _, _ = graph
    conv = SAGELSTMConv(12, 6)
    torch.testing.assert_close(conv(x, ei), conv(x, Graph.from_edge_index(ei, n)))
    adj = adjacency(ei, n, torch.ones(ei.shape[1]), "csr")
    torch.testing.assert_close(conv(x, adj), conv(x, ei))


def test_the_tessera_graph_path_and_hints_are_unchanged(graph, monkeypatch):
    ei, n, x, weight, _ = graph
    g = Graph.from_edge_index(ei, n, edge_weight=weight)
    conv = GCNConv(12, 6)
    monkeypatch.setattr(base, "pyg_inputs", lambda *a: pytest.fail("a tessera graph is never converted"))
    want = conv(x, g)
    torch.testing.assert_close(conv(x, g, LayerHints()), want)
    torch.testing.assert_close(conv(x, g, hints=LayerHints()), want)
    monkeypatch.undo()
    torch.testing.assert_close(conv(x, ei, weight), want)
    torch.testing.assert_close(conv(x, ei, weight, LayerHints()), want)  # PyG's order, then tessera's hints
    torch.testing.assert_close(conv(x, ei, edge_weight=weight, hints=LayerHints(), size=(n, n)), want)
    model = build_model("sage", 12, 16, 3).eval()  # a model's layers convert too
    torch.testing.assert_close(model(x, ei), model(x, Graph.from_edge_index(ei, n)))


def test_the_conversion_runs_once_per_edge_index(graph, monkeypatch):
    ei, n, x, weight, _ = graph
    ei, weight = ei.clone(), weight.clone()  # fresh tensors: nothing converted yet
    calls = []
    real = inputs.coo_graph
    monkeypatch.setattr(inputs, "coo_graph", lambda *a: calls.append(a[3] is not None) or real(*a))
    gcn, sage = GCNConv(12, 6), SAGEConv(6, 3)
    for _ in range(3):  # a training loop: weighted GCN then SAGE on the same edge index
        sage(gcn(x, ei, weight).relu(), ei)
    assert calls == [True, False]  # one weighted graph, one pattern
    weight.mul_(2)  # changed in place: the weighted graph is made again, the pattern kept
    sage(gcn(x, ei, weight), ei)
    assert calls == [True, False, True]
    ei2 = ei.clone()
    sage(x[:, :6], ei2)
    sage(x[:, :6], ei2)
    assert len(calls) == 4
    adj = adjacency(ei, n, torch.ones(ei.shape[1]), "coo")
    for _ in range(3):
        sage(x[:, :6], adj)
    assert len(calls) == 5


def test_wrong_inputs_are_one_clear_error(graph):
    ei, n, x, weight, types = graph
    gcn, sage, rgcn = GCNConv(12, 6), SAGEConv(12, 6), RGCNConv(12, 6, R)
    g = Graph.from_edge_index(ei, n)
    cases = [
        (lambda: gcn(x[:10], ei), GraphError, r"edge_index refers to vertex \d+ but x has 10 rows"),
        (lambda: gcn(x[:10], adjacency(ei, n, weight, "csr")), GraphError, f"adjacency is {n} x {n} but x has 10 rows"),
        (lambda: gcn(x, ei, weight[:-1]), GraphError, "edge_weight must hold one value per edge"),
        (lambda: gcn(x.to("meta"), ei), GraphError, "edge_index is on cpu but x on meta: put them on one device"),
        (lambda: gcn(x, ei, weight.to("meta")), GraphError, "edge_weight is on meta but the edges on cpu"),
        (lambda: gcn(g, x), TypeError, r"call conv\(x, graph\), not conv\(graph, x\).*torch.stack\(g.edges\(\)\)"),
        (lambda: gcn(ei, x), GraphError, r"the features go first: conv\(x, edge_index\)"),
        (lambda: gcn(x, ei.t()), GraphError, r"shape \(2, E\)"),
        (lambda: gcn(x, [0, 1]), TypeError, "takes the graph as a"),
        (lambda: sage(x, ei, weight), TypeError, "SAGEConv takes no per-edge tensor"),
        (lambda: sage(x, ei, edge_weight=weight), TypeError, "unexpected keyword argument 'edge_weight'"),
        (lambda: sage(x, ei, size=(n, 3)), GraphError, "bipartite graphs are not supported"),
        (lambda: sage(x, adjacency(ei, n, weight, "coo")), GraphError, "values other than 1"),
        (lambda: gcn(x, ei, weight.clone().requires_grad_()), GraphError, r"pass edge_weight.detach\(\)"),
        (lambda: rgcn(x, ei, types.float()), GraphError, "edge_type must hold integer relation ids"),
        (lambda: rgcn(x, adjacency(ei, n, weight, "coo")), GraphError, "needs relation ids"),
        (lambda: rgcn(x, ei), GraphError, "no edge types"),
    ]
    for call, kind, message in cases:
        with pytest.raises(kind, match=message):
            call()
