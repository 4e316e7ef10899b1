"""GCNConv's self loops and normalisation against PyG, on graphs with and without loops."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch_geometric.nn as pyg

from helpers import awkward_edge_index
from tessera import Graph
from tessera.errors import ConfigError
from tessera.nn import GCNConv
from tessera.parallel.partition import _with_self_loops


def _edges(loops: bool) -> tuple[torch.Tensor, int]:
    """The awkward graph (it has self loops, one duplicated) or the same graph without its loops."""
    ei, n = awkward_edge_index()
    return (ei, n) if loops else (ei[:, ei[0] != ei[1]], n)


@pytest.mark.parametrize("improved", [False, True])
@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("loops", [False, True])
def test_gcn_matches_pyg_with_and_without_existing_loops(loops, weighted, improved):
    ei, n = _edges(loops)
    assert bool((ei[0] == ei[1]).any()) == loops
    torch.manual_seed(0)
    ours, theirs = GCNConv(16, 8, improved=improved), pyg.GCNConv(16, 8, improved=improved)
    ours.load_state_dict(theirs.state_dict())
    w = torch.rand(ei.shape[1]) + 0.1 if weighted else None
    x = torch.randn(n, 16)
    a = ours(x, Graph.from_edge_index(ei, n, edge_weight=w))
    # PyG's edge_index path ignores `improved` on unweighted graphs (no weights to fill); tessera
    # follows its weighted path, so an unweighted graph compares with PyG given unit weights.
    pyg_w = torch.ones(ei.shape[1]) if w is None and improved else w
    b = theirs(x, ei) if pyg_w is None else theirs(x, ei, pyg_w)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_existing_loop_keeps_weight_one_on_unweighted_graph():
    """The issue's example: edges 0->1, 1->0, 1->1; vertex 1's loop has weight 1/2, as in PyG."""
    g = Graph.from_edge_index(torch.tensor([[0, 1, 1], [1, 0, 1]]), 2).gcn_norm(improved=True)
    loop = (g.src_index() == 1) & (g.dst_index() == 1)
    assert float(g.edge_weight[loop]) == pytest.approx(0.5)
    new_loop = (g.src_index() == 0) & (g.dst_index() == 0)
    assert float(g.edge_weight[new_loop]) == pytest.approx(2 / 3)  # A + 2I: 2 / sqrt(3 * 3)


def test_self_loops_without_normalisation_are_refused_as_in_pyg():
    with pytest.raises(ValueError):
        pyg.GCNConv(4, 2, normalize=False, add_self_loops=True)
    with pytest.raises(ConfigError, match="normalize"):
        GCNConv(4, 2, normalize=False, add_self_loops=True)
    assert GCNConv(4, 2, normalize=False).add_self_loops is False


@pytest.mark.parametrize("weighted", [False, True])
@pytest.mark.parametrize("fill", [1.0, 2.0])
def test_rank_self_loops_equal_the_graphs(weighted, fill):
    """Partition parallelism's per-rank loops (a rank owning every row) equal Graph.add_self_loops."""
    ei, n = _edges(True)
    w = torch.rand(ei.shape[1]) + 0.1 if weighted else None
    g = Graph.from_edge_index(ei, n, edge_weight=w)
    ref = g.add_self_loops(fill)
    wn = None if w is None else g.edge_weight.numpy()
    deg = g.in_degree().numpy()
    in_w = deg.astype(np.float64) if w is None else np.bincount(g.dst_index().numpy(), wn, minlength=n)
    indptr, cols, vals, new_deg, new_in_w = _with_self_loops(g.indptr.numpy(), g.indices.numpy(), wn, deg, in_w, fill)
    np.testing.assert_array_equal(indptr, ref.indptr.numpy())
    np.testing.assert_array_equal(cols, ref.indices.numpy())
    ref_w = torch.ones(ref.num_edges) if ref.edge_weight is None else ref.edge_weight
    got_w = np.ones(cols.size) if vals is None else vals
    np.testing.assert_allclose(got_w, ref_w.numpy(), rtol=1e-6)
    np.testing.assert_array_equal(new_deg, ref.in_degree().numpy())
    np.testing.assert_allclose(new_in_w, np.bincount(ref.dst_index().numpy(), ref_w.numpy(), minlength=n), rtol=1e-6)
