"""A host structure's copy on another device is made once per device and array, and holds the
host's arrays (the meta device stands in for a GPU: it keeps shapes and dtypes, not values)."""

import torch

from helpers import awkward_graph
from tessera import Graph

META = torch.device("meta")


def test_a_structure_on_the_cpu_is_itself():
    g = awkward_graph()
    assert g.on(torch.device("cpu")) is g


def test_device_copies_are_made_once_and_match_the_host_arrays():
    g = awkward_graph()
    d = g.on(META)
    assert g.on(META) is d  # kept with the structure
    assert (d.num_rows, d.num_cols, d.num_edges) == (g.num_rows, g.num_cols, g.num_edges)
    for name in ("indptr", "indices"):
        host, copy = getattr(g, name), getattr(d, name)
        assert copy.device == META and copy.shape == host.shape and copy.dtype == host.dtype
        assert getattr(d, name) is copy  # copied once
    for name in ("dst_index", "src_index", "in_degree"):
        host, copy = getattr(g, name)(), getattr(d, name)()
        assert copy.device == META and copy.shape == host.shape and copy.dtype == host.dtype
        assert getattr(d, name)() is copy


def test_the_transpose_and_its_permutation_follow_the_host():
    g = awkward_graph()  # not symmetric: its transpose has arrays of its own
    host = g.transpose(with_perm=True)
    t = g.on(META).transpose()
    assert t is g.on(META).transpose()
    assert t.indptr.device == t.indices.device == t.perm.device == META
    assert t.indptr.shape == host.indptr.shape and t.perm.shape == host.perm.shape


def test_a_symmetric_structure_shares_its_copies_with_its_transpose():
    src = torch.tensor([0, 1, 1, 2, 2, 3])
    dst = torch.tensor([1, 0, 2, 1, 3, 2])
    g = Graph.from_edge_index(torch.stack([src, dst]), 4)
    d = g.on(META)
    t = d.transpose()
    assert t.indptr is d.indptr and t.indices is d.indices
    assert t.perm.device == META and t.perm.shape == (g.num_edges,)
