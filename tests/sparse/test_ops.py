import pytest
import torch
from torch_geometric.utils import softmax as pyg_softmax

from helpers import awkward_graph, dense_adjacency
from tessera import dense, sparse
from tessera.backends import available_backends
from tessera.kernels.dropout import dropout
from tessera.threads import set_num_threads


@pytest.mark.parametrize("backend", available_backends())
@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("weighted", [False, True])
def test_aggregate_matches_dense(backend, reduce, weighted):
    g = awkward_graph()
    w = torch.rand(g.num_edges, dtype=torch.float64) if weighted else None
    x = torch.randn(g.num_nodes, 9, dtype=torch.float64)
    a = dense_adjacency(g, w)
    if reduce == "mean":
        deg = g.in_degree().to(torch.float64).clamp(min=1)
        a = a / deg[:, None]
    got = sparse.aggregate(g, x, reduce, w, backend)
    torch.testing.assert_close(got, a @ x)
    assert bool((got[-3:] == 0).all()), "isolated vertices aggregate to zero"


# gradcheck on the Triton backend's interpreter takes tens of seconds: test_triton.py gradchecks it
@pytest.mark.parametrize("backend", [n for n in available_backends() if n != "triton"])
@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_aggregate_gradcheck(backend, reduce):
    g = awkward_graph(n=12, e=40)
    x = torch.randn(g.num_nodes, 3, dtype=torch.float64, requires_grad=True)
    w = torch.rand(g.num_edges, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: sparse.aggregate(g, x, reduce, w, backend), (x, w))
    xh = torch.randn(g.num_nodes, 2, 3, dtype=torch.float64, requires_grad=True)
    wh = torch.rand(g.num_edges, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: sparse.aggregate(g, x, reduce, w, backend), (xh, wh))


def test_edge_softmax_matches_pyg_and_gradcheck():
    g = awkward_graph(n=20, e=80)
    s = torch.randn(g.num_edges, 3, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(sparse.edge_softmax(g, s), pyg_softmax(s, g.dst_index(), num_nodes=g.num_nodes))
    assert torch.autograd.gradcheck(lambda s: sparse.edge_softmax(g, s), (s,))


def test_unknown_backend_and_reduce_are_clear():
    g = awkward_graph()
    x = torch.randn(g.num_nodes, 2)
    with pytest.raises(Exception, match="unknown aggregation backend 'nope'"):
        sparse.aggregate(g, x, backend="nope")
    with pytest.raises(Exception, match="unknown reduce 'max'"):
        sparse.aggregate(g, x, reduce="max")


def test_dropout_statistics_scale_and_mask_reuse_in_backward():
    x = torch.ones(400, 500, requires_grad=True)
    torch.manual_seed(3)
    y = dropout(x, 0.3)
    keep = y != 0
    assert abs(keep.float().mean().item() - 0.7) < 0.005
    torch.testing.assert_close(y[keep], torch.full_like(y[keep], 1 / 0.7))
    y.backward(torch.full_like(y, 2.0))
    assert torch.equal(x.grad != 0, keep)
    torch.testing.assert_close(x.grad[keep], torch.full_like(x.grad[keep], 2 / 0.7))
    # neighbouring elements are not correlated
    k = keep.float().view(-1)
    corr = torch.corrcoef(torch.stack([k[:-1], k[1:]]))[0, 1]
    assert abs(corr.item()) < 0.01


def test_dropout_is_seeded_and_thread_count_independent():
    x = torch.randn(300, 777)
    torch.manual_seed(5)
    a = dropout(x, 0.5)
    before = torch.get_num_threads()
    try:
        set_num_threads(1)
        torch.manual_seed(5)
        b = dropout(x, 0.5)
    finally:
        set_num_threads(before)
    assert torch.equal(a, b)
    c = dropout(x, 0.5)
    assert not torch.equal(a, c)
    assert dropout(x, 0.5, training=False) is x
    assert torch.equal(dropout(x, 0.0), x)


@pytest.mark.parametrize("backend", [n for n in available_backends() if n != "triton"])
def test_rectangular_csr_matrix_matches_dense_and_gradcheck(backend):
    from tessera.graph.csr import CSRMatrix

    gen = torch.Generator().manual_seed(1)
    rows, cols, nnz = 7, 11, 30
    r = torch.randint(0, rows - 1, (nnz,), generator=gen)  # the last row stays empty
    c = torch.randint(0, cols, (nnz,), generator=gen)
    order = torch.argsort(r * cols + c)
    r, c = r[order], c[order]
    indptr = torch.zeros(rows + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(r, minlength=rows), 0)
    w = torch.rand(nnz, dtype=torch.float64)
    m = CSRMatrix.from_numpy(indptr.numpy(), c.numpy(), None, rows, cols)
    dense = torch.zeros(rows, cols, dtype=torch.float64).index_put_((r, c), w, accumulate=True)
    x = torch.randn(cols, 4, dtype=torch.float64, requires_grad=True)
    wg = w.clone().requires_grad_(True)
    torch.testing.assert_close(sparse.aggregate(m, x, "sum", w, backend), dense @ x)
    assert torch.autograd.gradcheck(lambda x, w: sparse.aggregate(m, x, "sum", w, backend), (x, wg))


def _lowbias32_np(v):
    v = v & 0xFFFFFFFF
    v ^= v >> 16
    v = (v * 0x7FEB352D) & 0xFFFFFFFF
    v ^= v >> 15
    v = (v * 0x846CA68B) & 0xFFFFFFFF
    return v ^ (v >> 16)


def test_dropout_mask_is_the_documented_hash_of_seed_and_index():
    # the kernel hashes in 32-bit lanes; the mask must equal the 64-bit definition element for element
    import numpy as np

    from tessera.kernels.dropout import _BLOCK

    n, p = 3 * _BLOCK + 123, 0.4
    torch.manual_seed(11)
    seed = int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item())
    torch.manual_seed(11)
    y = dropout(torch.ones(n), p)
    i = np.arange(n, dtype=np.uint64)
    start = (i // _BLOCK) * _BLOCK
    key = _lowbias32_np(np.uint64(seed >> 32) ^ (start >> np.uint64(32))) ^ np.uint64(seed & 0xFFFFFFFF)
    h = _lowbias32_np((i * np.uint64(0x9E3779B9) + key) & np.uint64(0xFFFFFFFF))
    expected = h >= np.uint64(round(p * 2**32))
    assert np.array_equal(y.numpy() != 0, expected)
    assert torch.equal(dropout(torch.ones(10), 1 - 2**-40), torch.zeros(10))


@pytest.mark.parametrize("width", [37, 20_000])  # rows inside one hash block, and rows spanning blocks
def test_dropout_keyed_by_row_ids_draws_the_whole_tensors_mask(width):
    # Any split of the rows (ranks) in any order (a renumbering) draws, for each row, the mask the
    # whole tensor draws for it, forward and backward; so does dropout_mask.
    from tessera.kernels.dropout import dropout_mask

    n = 300 if width < 1000 else 7
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, width, generator=gen, dtype=torch.float64, requires_grad=True)
    torch.manual_seed(5)
    whole = dropout(x, 0.3)
    g = torch.randn(n, width, generator=gen, dtype=torch.float64)
    (gx_whole,) = torch.autograd.grad(whole, x, g)
    perm = torch.randperm(n, generator=gen)
    for rows in (perm[: n // 3], perm[n // 3 :]):
        torch.manual_seed(5)
        part = x.detach()[rows].requires_grad_()
        got = dropout(part, 0.3, rows=rows)
        assert torch.equal(got, whole[rows])
        (gx,) = torch.autograd.grad(got, part, g[rows])
        assert torch.equal(gx, gx_whole[rows])
        torch.manual_seed(5)
        assert torch.equal(dropout_mask((rows.numel(), width), 0.3, rows), whole[rows] != 0)
    torch.manual_seed(5)
    xp = x.detach()[perm]
    assert torch.equal(dropout(xp, 0.3, rows=perm), whole[perm])
    torch.manual_seed(5)
    assert not torch.equal(dropout(xp, 0.3), whole[perm])  # without ids the positions key it
    with pytest.raises(ValueError, match="ids for"):
        dropout(x, 0.3, rows=perm[:-1])


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("sparse_grad", [False, True])
def test_linear_matches_torch_forward_and_backward(bias, sparse_grad, monkeypatch):
    # sparse_grad: the output gradient is zero outside a tenth of the rows (a loss on training
    # vertices only), so the backward products run on the live rows alone.
    from tessera.dense import liveness

    torch.manual_seed(0)
    x = torch.randn(1031, 67, requires_grad=True)
    w = torch.randn(45, 67, requires_grad=True)
    b = torch.randn(45, requires_grad=True) if bias else None
    g = torch.randn(1031, 45)
    if sparse_grad:
        monkeypatch.setattr(liveness, "MIN_ROWS", 0)
        g[torch.rand(1031) > 0.1] = 0
    assert (liveness.live_rows(g) is not None) == sparse_grad
    state = torch.get_rng_state()
    y = dense.linear(x, w, b)
    assert torch.equal(torch.get_rng_state(), state)  # no random draws: seeds downstream stay put
    y.backward(g)
    grads = [t.grad.clone() for t in (x, w, b) if t is not None]
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    ref = torch.nn.functional.linear(x, w, b)
    ref.backward(g)
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-4)
    for got, t in zip(grads, [t for t in (x, w, b) if t is not None], strict=True):
        torch.testing.assert_close(got, t.grad, rtol=1e-5, atol=1e-3)
    xd, wd = x.detach()[:7].double().requires_grad_(), w.detach()[:5].double().requires_grad_()
    assert torch.autograd.gradcheck(dense.linear, (xd, wd))  # float64: torch's path
    from tessera.nn.linear import Linear

    lin = Linear(67, 45, bias=bias)
    assert set(lin.state_dict()) == set(torch.nn.Linear(67, 45, bias=bias).state_dict())
    torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-4)


def test_live_rows_marks_live_rows_and_forgets_a_modified_tensor(monkeypatch):
    from tessera.dense import liveness

    monkeypatch.setattr(liveness, "MIN_ROWS", 0)
    g = torch.zeros(2000, 33)
    rows = torch.tensor([3, 700, 1999])
    g[rows, 5] = 1.0
    g[1000, 32] = float("nan")  # nan in the last, partial block of 16 still makes a row live
    live = liveness.live_rows(g)
    assert live is not None and torch.from_numpy(live).nonzero().view(-1).tolist() == [3, 700, 1000, 1999]
    assert liveness.live_rows(g) is live  # remembered for the same unmodified tensor
    g[:1500] = 1.0  # in place: most rows now live, and the answer is computed again
    assert liveness.live_rows(g) is None
    assert liveness.live_rows(torch.ones(2000, 33)) is None
