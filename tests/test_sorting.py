"""The counting sorts that build, renumber and transpose CSRs equal numpy's stable sorts."""

import numpy as np
import pytest
import torch

from tessera.graph import Graph
from tessera.graph.graph import all_finite
from tessera.graph.sorting import sort_rows, transpose_csr


def test_sort_rows_is_a_stable_sort_within_each_row():
    rng = np.random.default_rng(0)
    indptr = np.array([0, 0, 3, 103, 110])  # an empty row, short rows, one over 64 (the merge sort)
    keys = rng.integers(0, 20, 110)  # many ties: stability is visible
    payload = np.arange(110)
    want = np.concatenate([np.argsort(keys[a:b], kind="stable") + a for a, b in zip(indptr[:-1], indptr[1:])])
    want_keys = keys[want]
    sort_rows(indptr, keys, payload)
    assert np.array_equal(payload, want)
    assert np.array_equal(keys, want_keys)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_transpose_is_the_stable_column_order(dtype):
    rng = np.random.default_rng(1)
    rows, cols = 40, 70
    dst = np.sort(rng.integers(0, rows, 3000))
    src = rng.integers(0, cols, 3000)  # unsorted within rows, with duplicate entries
    indptr = np.zeros(rows + 1, np.int64)
    np.cumsum(np.bincount(dst, minlength=rows), out=indptr[1:])
    t_indptr, t_indices, perm = transpose_csr(indptr.astype(dtype), src.astype(dtype), cols, dtype)
    want = np.lexsort((dst, src))  # by column, then row, ties in stored order
    assert t_indices.dtype == perm.dtype == dtype
    assert np.array_equal(perm, want)
    assert np.array_equal(t_indices, dst[want])
    assert np.array_equal(t_indptr[1:], np.cumsum(np.bincount(src, minlength=cols)))


def test_graph_from_edge_index_keeps_duplicate_edges_in_input_order():
    ei = torch.tensor([[2, 0, 2, 1, 2], [1, 1, 1, 0, 1]])
    g = Graph.from_edge_index(ei, 3, edge_weight=torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert g.indptr.tolist() == [0, 1, 5, 5]
    assert g.indices.tolist() == [1, 0, 2, 2, 2]
    assert g.edge_weight.tolist() == [4.0, 2.0, 1.0, 3.0, 5.0]  # the three edges 2 -> 1 in input order


@pytest.mark.parametrize(
    "values, finite",
    [([1.0, 2.0], True), ([3e38, 3e38], True), ([1.0, float("nan")], False), ([float("inf"), -float("inf")], False)],
)
def test_all_finite(values, finite):
    assert all_finite(torch.tensor(values)) is finite  # 3e38 + 3e38 overflows the sum, not the values


def _reference_self_loops(g: Graph, fill: float) -> Graph:
    """Loops dropped, one appended per vertex, everything re-sorted by from_edge_index."""
    src, dst, w = g.src_index(), g.dst_index(), g.edge_weight
    keep = src != dst
    n = g.num_nodes
    loop_w = torch.full((n,), fill)
    for i in torch.nonzero(~keep).view(-1).tolist():  # a vertex's last stored loop gives the weight
        loop_w[src[i]] = w[i]
    ar = torch.arange(n)
    ei = torch.stack([torch.cat([src[keep], ar]), torch.cat([dst[keep], ar])])
    return Graph.from_edge_index(ei, n, edge_weight=torch.cat([w[keep], loop_w]))


@pytest.mark.parametrize("sorted_rows", [True, False])
def test_add_self_loops_equals_rebuilding_from_edges(sorted_rows):
    rng = np.random.default_rng(2)
    n = 60
    # a hub row over 64 entries (the merge-sort path), duplicate loops, rows with and without loops
    dst = np.concatenate([rng.integers(0, n, 900), np.full(150, 7), [3, 3, 5]])
    src = np.concatenate([rng.integers(0, n, 900), rng.integers(0, n, 150), [3, 3, 5]])
    order = np.argsort(dst, kind="stable")  # grouped by row; sources in input order
    if sorted_rows:
        order = np.lexsort((src, dst))
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    w = torch.from_numpy(rng.random(dst.size).astype(np.float32))
    g = Graph.from_csr(indptr, src[order], n, edge_weight=w)
    got, want = g.add_self_loops(2.0), _reference_self_loops(g, 2.0)
    assert torch.equal(got.indptr, want.indptr)
    assert torch.equal(got.indices, want.indices)
    assert torch.equal(got.edge_weight, want.edge_weight)
