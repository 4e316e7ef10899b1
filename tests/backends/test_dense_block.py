import numpy as np
import pytest
import torch

from helpers import awkward_graph, dense_adjacency
from tessera import Graph, sparse
from tessera.backends.base import get_backend
from tessera.backends.cpu_dense_block import DenseBlockConfig
from tessera.graph import chunking
from tessera.graph.csr import CSRMatrix

# Small chunks and a low density threshold so that the awkward test graphs do form dense blocks
# (the defaults are tuned for large graphs and would leave them entirely to the CSR kernel).
FORCED = DenseBlockConfig(min_col_density=0.1, min_block_nnz=1, chunk_rows=8, batch_cols=64)


@pytest.fixture
def forced(monkeypatch):
    be = get_backend("dense_block")
    monkeypatch.setattr(be, "config", FORCED)
    return be


def _expected(g, x, reduce, w):
    a = dense_adjacency(g, w, dtype=torch.float64)
    if reduce == "mean":
        a = a / g.in_degree().to(torch.float64).clamp(min=1)[:, None]
    return a


def _check_against_reference(g, reduce, weighted):
    gen = torch.Generator().manual_seed(1)
    w = torch.rand(g.num_edges, generator=gen) if weighted else None
    x = torch.randn(g.num_nodes, 33, generator=gen)
    gy = torch.randn(g.num_nodes, 33, generator=gen)
    outs = {}
    for backend in ("reference", "dense_block"):
        xr = x.clone().requires_grad_()
        y = sparse.aggregate(g, xr, reduce, w, backend)
        y.backward(gy)
        outs[backend] = (y.detach(), xr.grad)
    for got, ref in zip(outs["dense_block"], outs["reference"]):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
    a = _expected(g, x, reduce, w)
    torch.testing.assert_close(outs["dense_block"][0].double(), a @ x.double(), rtol=1e-5, atol=1e-4)
    assert bool((outs["dense_block"][0][-3:] == 0).all()), "isolated vertices aggregate to zero"


@pytest.mark.parametrize("n,e", [(60, 400), (300, 3000)])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_forward_and_input_grad_match_reference(forced, n, e, reduce, weighted):
    g = awkward_graph(n, e, seed=n)
    plan = forced.plan(g)
    assert plan.num_blocks > 0 and plan.remainder is not None and plan.remainder.num_edges > 0
    assert 1 < plan.num_batches < plan.num_blocks  # some blocks batched together, not all
    if n == 300:
        assert plan.remainder.num_edges >= 1024  # exercises the csr kernel, not the small-remainder path
    assert forced.plan(g, transposed=True) is not plan  # directed graph: the transpose has its own chunks
    _check_against_reference(g, reduce, weighted)


@pytest.mark.parametrize("pipeline,batch_cols", [(False, 0), (True, 64)])
def test_unbatched_and_pipelined_match_reference(monkeypatch, forced, pipeline, batch_cols):
    cfg = DenseBlockConfig(**{**FORCED.__dict__, "pipeline": pipeline, "batch_cols": batch_cols})
    monkeypatch.setattr(forced, "config", cfg)
    g = awkward_graph(300, 3000, seed=300)
    plan = forced.plan(g)
    assert plan.num_batches > 1
    if batch_cols == 0:
        assert plan.num_batches == plan.num_blocks
    _check_against_reference(g, "sum", True)


def test_default_config_matches_reference():
    g = awkward_graph(200, 4000, seed=3)
    x = torch.randn(g.num_nodes, 16)
    w = torch.rand(g.num_edges)
    for weight in (None, w):
        ref = sparse.aggregate(g, x, "sum", weight, "reference")
        got = sparse.aggregate(g, x, "sum", weight, "dense_block")
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_symmetric_graph_reuses_forward_plan_with_weights(forced):
    g = awkward_graph(80, 600, seed=5).to_undirected()
    assert forced.plan(g, transposed=True) is forced.plan(g)
    w = torch.rand(g.num_edges, dtype=torch.float64)
    x = torch.randn(g.num_nodes, 7, dtype=torch.float64, requires_grad=True)
    y = sparse.aggregate(g, x, "sum", w, "dense_block")
    gy = torch.randn_like(y)
    y.backward(gy)
    a = dense_adjacency(g, w)
    torch.testing.assert_close(y, a @ x)
    torch.testing.assert_close(x.grad, a.T @ gy)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_gradcheck_float64(forced, reduce):
    g = awkward_graph(n=12, e=40)
    assert forced.plan(g).num_blocks > 0
    x = torch.randn(g.num_nodes, 3, dtype=torch.float64, requires_grad=True)
    w = torch.rand(g.num_edges, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: sparse.aggregate(g, x, reduce, w, "dense_block"), (x, w))
    assert torch.autograd.gradcheck(lambda x: sparse.aggregate(g, x, reduce, None, "dense_block"), (x,))


def test_heads_and_per_head_weights_are_delegated(forced):
    g = awkward_graph()
    x = torch.randn(g.num_nodes, 2, 5)
    w = torch.rand(g.num_edges, 2)
    for weight in (None, w):
        ref = sparse.aggregate(g, x, "sum", weight, "reference")
        got = sparse.aggregate(g, x, "sum", weight, "dense_block")
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def test_in_place_weight_updates_are_seen(forced):
    g = awkward_graph(seed=2)
    x = torch.randn(g.num_nodes, 4, dtype=torch.float64)
    w = torch.rand(g.num_edges, dtype=torch.float64)
    be = get_backend("dense_block")
    first = be.spmm(g, x, w)
    w.data.mul_(2.0)  # no version bump: nothing may be cached by tensor identity
    torch.testing.assert_close(be.spmm(g, x, w), 2 * first)
    torch.testing.assert_close(be.spmm_t(g, x, w), dense_adjacency(g, w).T @ x)


def test_rectangular_matrix(forced):
    gen = torch.Generator().manual_seed(0)
    rows, cols, nnz = 40, 25, 300
    r = torch.sort(torch.randint(0, rows, (nnz,), generator=gen)).values
    indptr = torch.zeros(rows + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(r, minlength=rows), 0)
    c = torch.randint(0, cols, (nnz,), generator=gen)
    m = CSRMatrix(indptr, c, None, rows, cols)
    dense = torch.zeros(rows, cols, dtype=torch.float64).index_put_((r, c), torch.ones(nnz, dtype=torch.float64), True)
    be = get_backend("dense_block")
    assert be.plan(m).num_blocks > 0
    x = torch.randn(cols, 6, dtype=torch.float64)
    g = torch.randn(rows, 6, dtype=torch.float64)
    torch.testing.assert_close(be.spmm(m, x, None), dense @ x)
    torch.testing.assert_close(be.spmm_t(m, g, None), dense.T @ g)


def test_empty_graph_and_zero_width(forced):
    g = Graph.from_edge_index(torch.zeros(2, 0, dtype=torch.int64), 5)
    x = torch.randn(5, 3, requires_grad=True)
    y = sparse.aggregate(g, x, "mean", None, "dense_block")
    assert torch.equal(y, torch.zeros(5, 3))
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros(5, 3))
    g2 = awkward_graph()
    assert sparse.aggregate(g2, torch.randn(g2.num_nodes, 0), "sum", None, "dense_block").shape == (g2.num_nodes, 0)


# ------------------------------------------------------------------------------------ chunking
def _arrays(g):
    t = g.transpose()
    return g.indptr.numpy(), g.indices.numpy(), t.indptr.numpy(), t.indices.numpy()


@pytest.mark.parametrize("rows", [1, 3, 8, 64, 1000])
def test_chunking_is_a_deterministic_partition(rows):
    g = awkward_graph(300, 3000, seed=7)
    a = chunking.locality_chunks(*_arrays(g), rows)
    b = chunking.locality_chunks(*_arrays(g), rows)
    assert np.array_equal(a.order, b.order) and np.array_equal(a.chunk_ptr, b.chunk_ptr)
    assert np.array_equal(np.sort(a.order), np.arange(g.num_nodes))
    sizes = np.diff(a.chunk_ptr)
    assert sizes.min() >= 1 and sizes.max() <= rows
    assert a.num_chunks == -(-g.num_nodes // rows) or sizes.sum() == g.num_nodes
    for c in range(a.num_chunks):
        assert np.all(np.diff(a.chunk(c)) > 0)


def test_chunking_groups_vertices_sharing_in_neighbours():
    # Four groups of 16 vertices; each group reads its own 16 sources. Vertex ids interleave the
    # groups, so contiguous id ranges would mix them; the greedy algorithm must not.
    groups, size = 4, 16
    n = groups * size
    dst, src = [], []
    for v in range(n):
        grp = v % groups
        for s in range(size):
            dst.append(v)
            src.append(grp + groups * s)
    g = Graph.from_edge_index(torch.tensor([src, dst]), n)
    ch = chunking.locality_chunks(*_arrays(g), size)
    assert ch.num_chunks == groups
    for c in range(groups):
        assert len({int(v) % groups for v in ch.chunk(c)}) == 1
    blocks = chunking.compress(g.indptr.numpy(), g.indices.numpy(), n, ch, 0.5, 1)
    assert blocks.num_blocks == groups and blocks.rem_eid.size == 0
    assert blocks.dense_eid.size == g.num_edges and blocks.block_values == g.num_edges  # fully dense


def test_compress_splits_edges_exactly_once():
    g = awkward_graph(300, 3000, seed=9)
    ch = chunking.locality_chunks(*_arrays(g), 16)
    b = chunking.compress(g.indptr.numpy(), g.indices.numpy(), g.num_nodes, ch, 0.2, 1)
    assert b.num_blocks > 0
    both = np.concatenate([b.dense_eid, b.rem_eid])
    assert np.array_equal(np.sort(both), np.arange(g.num_edges))
    assert np.array_equal(b.rem_eid, np.sort(b.rem_eid))
    assert np.all(b.dense_pos < b.block_values)
    assert b.rem_indptr[-1] == b.rem_eid.size


def test_chunking_is_kept_by_the_backend_and_stored_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    g = awkward_graph(seed=4)
    a = chunking.locality_chunking(g, 8, disk_cache=True)
    be = get_backend("dense_block")
    assert be.plan(g) is be.plan(g)  # the backend's own plan cache, not the graph
    assert not g._structure.get("dense_block_plan")
    files = list((tmp_path / "chunks").glob("*-8-0.npz"))  # the backend stores its own size too
    assert len(files) == 1
    g2 = awkward_graph(seed=4)  # same structure, fresh object: loads from disk
    b = chunking.locality_chunking(g2, 8, disk_cache=True)
    assert np.array_equal(a.order, b.order) and np.array_equal(a.chunk_ptr, b.chunk_ptr)


def test_chunking_is_stored_by_default_and_a_damaged_file_is_recomputed(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    monkeypatch.delenv("TESSERA_CHUNK_CACHE", raising=False)
    g = awkward_graph(seed=5)
    want = chunking.locality_chunking(g, 8)
    (path,) = (tmp_path / "chunks").glob("*.npz")
    n = g.num_rows
    bad = [
        (want.order + n, want.chunk_ptr),  # rows out of range
        (np.zeros(n, np.int64), want.chunk_ptr),  # not a permutation
        (want.order, want.chunk_ptr[:-1]),  # does not end at n
        (want.order.astype(np.int32), want.chunk_ptr),
    ]
    for order, ptr in bad:
        np.savez(path, order=order, chunk_ptr=ptr)
        got = chunking.locality_chunking(awkward_graph(seed=5), 8)
        assert np.array_equal(got.order, want.order) and np.array_equal(got.chunk_ptr, want.chunk_ptr)
    monkeypatch.setenv("TESSERA_CHUNK_CACHE", "0")
    path.unlink()
    chunking.locality_chunking(awkward_graph(seed=5), 8)
    assert not path.exists()


def test_cache_size_rule():
    assert chunking.chunk_rows_for_cache(128, 1 << 20) == 256
    assert chunking.chunk_rows_for_cache(128, 1 << 22) > chunking.chunk_rows_for_cache(128, 1 << 20)
    assert chunking.chunk_rows_for_cache(1024, 1 << 16) == 16


def test_describe_reports_plan_statistics(forced):
    g = awkward_graph(300, 3000, seed=11)
    d = forced.describe(g)
    assert d["dense_blocks"] == forced.plan(g).num_blocks > 0
    assert 0 < d["dense_edge_share"] <= 1 and 0.1 <= d["block_density"] <= 1
