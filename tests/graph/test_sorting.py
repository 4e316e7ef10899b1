"""The counting sorts that build, renumber and transpose CSRs equal numpy's stable sorts."""

import copy

import numpy as np
import pytest
import torch

from tessera.backends import get_backend
from tessera.graph import Graph
from tessera.graph.graph import all_finite
from tessera.graph.sorting import (
    mirror_transpose,
    mirrored_values_equal,
    renumbered_csr,
    transpose_csr,
    with_self_loops,
)


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_renumbered_rows_are_the_stable_sort_of_the_renamed_edges(dtype):
    rng = np.random.default_rng(0)
    n = 50
    # a hub row over 64 entries (the merge sort), an empty row, many duplicate edges
    dst = np.concatenate([rng.integers(0, n, 800), np.full(120, 9), [4, 4, 4]])
    src = np.concatenate([rng.integers(0, n, 800), rng.integers(0, n, 120), [6, 6, 6]])
    dst[dst == 13] = 14
    order = np.argsort(dst, kind="stable")  # grouped by row, sources unsorted
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    perm = rng.permutation(n)
    inv = np.argsort(perm)
    got_indptr, got_src, eid = renumbered_csr(indptr.astype(dtype), src[order].astype(dtype), perm, inv)
    # the reference: every stored entry renamed, then sorted by (new row, new source, stored position)
    new_dst, new_src = inv[dst[order]], inv[src[order]]
    want = np.lexsort((np.arange(dst.size), new_src, new_dst))
    assert got_indptr.dtype == got_src.dtype == eid.dtype == dtype
    assert np.array_equal(eid, want)
    assert np.array_equal(got_src, new_src[want])
    assert np.array_equal(got_indptr[1:], np.cumsum(np.bincount(new_dst, minlength=n)))
    # without entry ids: the same structure, the rows sorted with no payload
    bare_indptr, bare_src, none = renumbered_csr(indptr.astype(dtype), src[order].astype(dtype), perm, inv, False)
    assert none is None
    assert np.array_equal(bare_indptr, got_indptr) and np.array_equal(bare_src, got_src)


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
    # with no per-edge data to carry, no entry ids are written: the same structure, no weights
    bare = Graph.from_csr(indptr, src[order], n).add_self_loops()
    assert bare.edge_weight is None
    assert torch.equal(bare.indptr, want.indptr)
    assert torch.equal(bare.indices, want.indices)
    ids, loops, take = with_self_loops(indptr, src[order], want_take=False)
    assert take is None and np.array_equal(loops, want.indices.numpy()) and np.array_equal(ids, want.indptr.numpy())


def _symmetric_csr(rng, n: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted-row CSR of a random undirected multigraph: every edge stored both ways, duplicates
    and self loops included, a hub row over 64 entries."""
    a = np.concatenate([rng.integers(0, n, m), np.full(80, 3), [5, 5]])
    b = np.concatenate([rng.integers(0, n, m), rng.integers(0, n, 80), [5, 5]])
    dst, src = np.concatenate([a, b]), np.concatenate([b, a])
    order = np.lexsort((src, dst))
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    return indptr, src[order]


@pytest.mark.parametrize("dtype", [np.int32, np.int64])
def test_mirror_transpose_is_transpose_csr_for_symmetric_structure(dtype):
    rng = np.random.default_rng(3)
    n = 40
    indptr, indices = (a.astype(dtype) for a in _symmetric_csr(rng, n, 500))
    t_indptr, t_indices, want = transpose_csr(indptr, indices, n, dtype)
    assert np.array_equal(t_indptr, indptr) and np.array_equal(t_indices, indices)  # it is symmetric
    perm = np.empty(indices.size, dtype)
    assert mirror_transpose(indptr, indices, perm)
    assert np.array_equal(perm, want)
    g = Graph.from_csr(indptr, indices, n)
    t = g.transpose()
    assert t.indices is g.indices and t.indptr is g.indptr
    assert callable(t._perm)  # not written until asked for
    assert np.array_equal(copy.deepcopy(g).transpose().perm.numpy(), want)  # a graph still copies
    assert np.array_equal(t.perm.numpy(), want) and t.perm is t.perm
    # a caller about to read perm (attention's backward) gets it from the walk that checks symmetry
    t = Graph.from_csr(indptr, indices, n).transpose(with_perm=True)
    assert not callable(t._perm) and np.array_equal(t.perm.numpy(), want)


def test_mirrored_values_equal_tells_symmetric_values_from_others():
    rng = np.random.default_rng(5)
    n = 40
    indptr, indices = _symmetric_csr(rng, n, 500)
    rows = np.repeat(np.arange(n), np.diff(indptr))
    sym = ((rows + 1.0) * (indices + 1.0)).astype(np.float32)  # w_ij = w_ji
    assert mirrored_values_equal(indptr, indices, sym)
    skew = sym.copy()
    skew[np.flatnonzero(rows != indices)[7]] += 1.0  # one off-diagonal entry changed, its mirror not
    assert not mirrored_values_equal(indptr, indices, skew)
    # one edge 0 -> 1 without its reverse: not symmetric, whatever the values
    assert not mirrored_values_equal(np.array([0, 0, 1, 1]), np.array([0]), np.ones(1, np.float32))


def test_gcn_backward_on_a_symmetric_graph_writes_no_transpose_permutation():
    # GCN's normalised values of an undirected graph are their own transpose: its backward
    # multiplies by the matrix itself, and the E-entry permutation is never built
    rng = np.random.default_rng(6)
    n = 50
    indptr, indices = _symmetric_csr(rng, n, 400)
    a = Graph.from_csr(indptr, indices, n).gcn_norm()
    csr = get_backend("csr")
    g = torch.randn(n, 6)
    got = csr.spmm_t(a, g, a.edge_weight)
    t = a.transpose()
    assert t.indices is a.indices and callable(t._perm)
    dense = torch.zeros(n, n)
    dense.index_put_((a.dst_index(), a.src_index()), a.edge_weight, accumulate=True)
    torch.testing.assert_close(got, dense.t() @ g, rtol=1e-5, atol=1e-5)


def test_gcn_values_of_an_unweighted_graph_need_no_mirror_check(monkeypatch):
    # 1 / sqrt(d_i d_j) is the same both ways: the backward takes the values as their own
    # transpose without walking them; weighted graphs' values, and values changed in place, are checked
    import tessera.backends.base as base
    from tessera.graph.normalize import known_mirrored

    rng = np.random.default_rng(8)
    n = 60
    indptr, indices = _symmetric_csr(rng, n, 500)
    walks = []
    monkeypatch.setattr(base, "mirrored_values_equal", lambda *a: walks.append(1) or mirrored_values_equal(*a))
    csr = get_backend("csr")
    g = torch.randn(n, 5)

    def dense_t(a):
        d = torch.zeros(n, n)
        d.index_put_((a.dst_index(), a.src_index()), a.edge_weight, accumulate=True)
        return d.t() @ g

    a = Graph.from_csr(indptr, indices, n).gcn_norm(improved=True)
    assert known_mirrored(a.edge_weight)
    torch.testing.assert_close(csr.spmm_t(a, g, a.edge_weight), dense_t(a), rtol=1e-5, atol=1e-5)
    assert walks == []
    weights = torch.rand(indices.size)
    b = Graph.from_csr(indptr, indices, n, edge_weight=weights).gcn_norm()
    assert not known_mirrored(b.edge_weight)  # asymmetric weights: so the values may be
    torch.testing.assert_close(csr.spmm_t(b, g, b.edge_weight), dense_t(b), rtol=1e-5, atol=1e-5)
    assert walks == [1]
    c = Graph.from_csr(indptr, indices, n).gcn_norm()
    c.edge_weight[3] += 1.0  # changed in place: no longer known, walked and found asymmetric
    assert not known_mirrored(c.edge_weight)
    torch.testing.assert_close(csr.spmm_t(c, g, c.edge_weight), dense_t(c), rtol=1e-5, atol=1e-5)
    assert walks == [1, 1]


def test_mirror_transpose_refuses_asymmetric_or_unsorted_structure():
    rng = np.random.default_rng(4)
    n = 40
    indptr, indices = _symmetric_csr(rng, n, 500)
    perm = np.empty(indices.size, np.int64)
    one_way = indices.copy()
    row = int(np.searchsorted(indptr, indices.size // 2, side="right")) - 1
    one_way[indptr[row + 1] - 1] = n - 1 if one_way[indptr[row + 1] - 1] != n - 1 else n - 2  # one edge retargeted
    one_way[indptr[row] : indptr[row + 1]].sort()
    assert not mirror_transpose(indptr, one_way, perm)
    extra = np.insert(indices, indptr[7], indices[indptr[7]])  # one more copy of a duplicate, one way only
    assert not mirror_transpose(np.concatenate([indptr[:8], indptr[8:] + 1]), extra, np.empty(extra.size, np.int64))
    unsorted = indices.copy()
    unsorted[indptr[3] : indptr[4]] = unsorted[indptr[3] : indptr[4]][::-1]  # row 3 (the hub) reversed
    assert not mirror_transpose(indptr, unsorted, perm)
    assert not mirror_transpose(indptr[:4], indices[: indptr[3]], perm)  # not square: columns past the rows
    g = Graph.from_csr(indptr, one_way, n)  # a Graph that is not symmetric gets the counting transpose
    t = g.transpose()
    want = transpose_csr(g.indptr.numpy(), g.indices.numpy(), n, np.int32)
    assert t.indices is not g.indices
    assert all(np.array_equal(x.numpy(), y) for x, y in zip((t.indptr, t.indices, t.perm), want))


@pytest.mark.parametrize("symmetric_values", [True, False])
def test_transposed_product_of_a_symmetric_graph(symmetric_values):
    """spmm_t through the shared structure equals the dense ``A^T g``; symmetric values (GCN's
    normalisation) are used as they are, others in transposed order."""
    from tessera.backends import get_backend

    rng = np.random.default_rng(5)
    n = 40
    indptr, indices = _symmetric_csr(rng, n, 500)
    g = Graph.from_csr(indptr, indices, n)
    w = g.gcn_norm(add_self_loops=False).edge_weight if symmetric_values else torch.rand(g.num_edges)
    dense = torch.zeros(n, n, dtype=torch.float64).index_put_(
        (g.dst_index(), g.src_index()), w.double(), accumulate=True
    )
    x = torch.randn(n, 16)
    for name in ("csr", "reference"):
        backend = get_backend(name)
        wt = backend.transposed_weight(g, w)
        assert (wt is w) == symmetric_values
        got = backend.spmm_t(g, x, w)
        torch.testing.assert_close(got.double(), dense.T @ x.double(), rtol=1e-5, atol=1e-5)


def test_a_kept_transposed_weight_goes_when_its_weight_dies():
    """A fixed weight's permuted copy is kept only while the weight lives: a weight used once (a
    measured trial's) must not leave E entries behind for as long as the graph lives."""
    import gc

    from tessera.backends import get_backend

    g = Graph.from_csr(*_symmetric_csr(np.random.default_rng(2), 30, 200), 30)
    backend = get_backend("reference")
    w = torch.rand(g.num_edges)
    wt = backend.transposed_weight(g, w)
    memo = backend.plans.entries(g)["transposed_weight"]
    assert memo[torch.float32][2] is wt
    assert backend.transposed_weight(g, w) is wt  # kept while w lives
    del w
    gc.collect()
    assert torch.float32 not in memo


def test_a_measured_backend_trial_multiplies_by_the_weight_itself(tmp_path, monkeypatch):
    """The trial passes the weight itself, which requires grad, so the backends treat it as they
    will in training (a detached alias looked fixed, and each backend kept a permuted copy of it)."""
    from tessera.backends import get_backend, select

    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    g = Graph.from_csr(*_symmetric_csr(np.random.default_rng(3), 30, 200), 30)
    w = torch.rand(g.num_edges, 2, requires_grad=True)
    seen = []
    for name in ("csr", "reference"):
        backend = get_backend(name)
        real = backend.spmm_t
        monkeypatch.setattr(
            backend, "spmm_t", lambda m, x, weight, real=real: seen.append(weight) or real(m, x, weight)
        )
    select.measure(g, torch.randn(30, 2, 4), w, ["csr", "reference"], True, reps=1)
    assert seen and all(s is w for s in seen)
    for name in ("csr", "reference"):
        assert not get_backend(name).plans.entries(g).get("transposed_weight")
