"""Each tessera layer equals the PyG layer of the same name, forward and backward, given PyG's weights."""

import pytest
import torch
import torch_geometric.nn as pyg

from helpers import awkward_edge_index, awkward_graph
from tessera import Graph
from tessera.nn import GATConv, GCNConv, GINConv, SAGEConv, build_model
from tessera.nn.mlp import MLP


def mlp(i, o):
    return torch.nn.Sequential(torch.nn.Linear(i, 32), torch.nn.ReLU(), torch.nn.Linear(32, o))


CASES = {
    "gcn": lambda: (GCNConv(16, 8), pyg.GCNConv(16, 8)),
    "gcn-wide": lambda: (GCNConv(16, 40), pyg.GCNConv(16, 40)),
    # PyG applies improved's fill value 2 only when given edge weights (its add_remaining_self_loops
    # drops the fill for unweighted edges); tessera always uses A + 2I, so compare with unit weights.
    "gcn-improved-weighted": lambda: (GCNConv(16, 8, improved=True), pyg.GCNConv(16, 8, improved=True)),
    "gcn-weighted": lambda: (GCNConv(16, 8), pyg.GCNConv(16, 8)),
    "sage": lambda: (SAGEConv(16, 8), pyg.SAGEConv(16, 8)),
    "sage-wide": lambda: (SAGEConv(16, 40), pyg.SAGEConv(16, 40)),
    "gin": lambda: (GINConv(mlp(16, 8)), pyg.GINConv(mlp(16, 8))),
    # tessera's MLP (what build_model uses): fused ReLU, and the second map's input gradient
    # formed by the first map's node (tessera.dense.deferred)
    "gin-mlp": lambda: (GINConv(MLP(16, 32, 8)), pyg.GINConv(mlp(16, 8))),
    "gin-train-eps": lambda: (
        GINConv(mlp(16, 8), eps=0.3, train_eps=True),
        pyg.GINConv(mlp(16, 8), eps=0.3, train_eps=True),
    ),
    "gat": lambda: (GATConv(16, 8), pyg.GATConv(16, 8)),
    "gat-heads-concat": lambda: (GATConv(16, 5, heads=4), pyg.GATConv(16, 5, heads=4)),
    "gat-heads-mean": lambda: (GATConv(16, 5, heads=4, concat=False), pyg.GATConv(16, 5, heads=4, concat=False)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_layer_matches_pyg_forward_and_gradients(case):
    torch.manual_seed(0)
    ours, theirs = CASES[case]()
    ours.load_state_dict(theirs.state_dict())
    if case.startswith("gin-train"):
        with torch.no_grad():
            theirs.eps.fill_(0.3)
            ours.eps.fill_(0.3)
    ei, n = awkward_edge_index()
    w = None
    if case.endswith("weighted"):
        w = torch.ones(ei.shape[1]) if "improved" in case else torch.rand(ei.shape[1]) + 0.1
    g = Graph.from_edge_index(ei, n, edge_weight=w)
    x1 = torch.randn(n, 16, requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    a, b = ours(x1, g), (theirs(x2, ei) if w is None else theirs(x2, ei, w))
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    proj = torch.randn_like(a)
    (a * proj).sum().backward()
    (b * proj).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)
    for (name, p), q in zip(ours.named_parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-5, msg=f"gradient of {name}")


def test_gat_attention_dropout_only_in_training():
    torch.manual_seed(0)
    ei, n = awkward_edge_index()
    g = Graph.from_edge_index(ei, n)
    conv = GATConv(16, 4, heads=2, dropout=0.6)
    x = torch.randn(n, 16)
    conv.eval()
    assert torch.equal(conv(x, g), conv(x, g))
    conv.train()
    assert not torch.equal(conv(x, g), conv(x, g))


@pytest.mark.parametrize("name", ["gcn", "sage", "gin", "gat"])
def test_build_model_shapes(name):
    ei, n = awkward_edge_index()
    g = Graph.from_edge_index(ei, n)
    m = build_model(name, 16, 32, 5, num_layers=3, dropout=0.1)
    assert len(m.convs) == 3
    assert m(torch.randn(n, 16), g).shape == (n, 5)


def test_build_model_rejects_bad_settings():
    with pytest.raises(Exception, match="unknown model 'mlp'"):
        build_model("mlp", 4, 8, 2)
    with pytest.raises(Exception, match="divisible"):
        build_model("gat", 4, 10, 2, heads=3)


def _saved_bool_masks(out: torch.Tensor) -> int:
    """How many bool tensors the autograd graph behind ``out`` saves (mask-only epilogues)."""
    seen, stack, count = set(), [out.grad_fn], 0
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        count += sum(t.dtype == torch.bool for t in getattr(fn, "saved_tensors", ()) if isinstance(t, torch.Tensor))
        stack.extend(f for f, _ in fn.next_functions)
    return count


@pytest.mark.parametrize(
    ("name", "options", "masks"),
    [("gin", {}, 1), ("gin", {"train_eps": True}, 0), ("sage", {}, 0), ("gcn", {}, 1)],
)
def test_a_relu_output_only_summed_by_the_next_layer_is_kept_as_a_mask(name, options, masks):
    """Between layers whose next one reads its input only through a sum (GIN with a fixed eps,
    a GCN that aggregates first), the ReLU output is not kept for backward: only where it is positive."""
    g = awkward_graph()
    torch.manual_seed(0)
    # widths so both GCN layers aggregate first (each input narrower than its output)
    m = build_model(name, 8, 32, 64, num_layers=2, dropout=0.5, **options)
    m.train()
    out = m(torch.randn(g.num_nodes, 8), g)
    assert m.convs[1].fusion().reads_input == (masks == 0)
    assert _saved_bool_masks(out) == masks


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"heads": 0}, "GATConv heads must be at least 1, got 0"),
        ({"out_channels": 0}, "GATConv out_channels must be at least 1, got 0"),
        ({"dropout": 1.0}, r"GATConv dropout must be in \[0, 1\), got 1.0"),
    ],
)
def test_gat_refuses_impossible_settings_when_built(kwargs, message):
    from tessera.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        GATConv(**{"in_channels": 4, "out_channels": 4, **kwargs})


def test_aggregate_refuses_a_vector_and_names_the_fix():
    from tessera import sparse

    g = awkward_graph()
    with pytest.raises(ValueError, match=r"x must be \(N, F\) or \(N, H, F\).*unsqueeze"):
        sparse.aggregate(g, torch.randn(g.num_nodes), "sum")
