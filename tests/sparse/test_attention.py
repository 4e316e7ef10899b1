import pytest
import torch
import torch.nn.functional as F

from helpers import awkward_graph
from tessera import Graph, dense, sparse
from tessera.sparse import attention_kernels
from tessera.sparse.attention_kernels import gat_attention
from tessera.threads import set_num_threads


def reference(g, a_src, a_dst, slope=0.2):
    return sparse.edge_softmax(g, F.leaky_relu(sparse.edge_score(g, a_src, a_dst), slope))


def inputs(g, heads, dtype, scale=1.0, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shape = (g.num_nodes, heads) if heads else (g.num_nodes,)
    return [(scale * torch.randn(shape, generator=gen, dtype=dtype)).requires_grad_() for _ in range(2)]


def grads(fn, g, a_src, a_dst, seed=1):
    out = fn(g, a_src, a_dst)
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    return (out, *torch.autograd.grad(out, (a_src, a_dst), go))


@pytest.fixture(params=["rows", "pieces"])
def path(request, monkeypatch):
    """Run each test with hub rows kept whole and with every row over 4 edges cut into pieces."""
    if request.param == "pieces":
        monkeypatch.setattr(attention_kernels, "_CHUNK", 2)
    return request.param


@pytest.mark.parametrize("heads", [0, 1, 3, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_matches_reference_forward_and_backward(path, heads, dtype):
    g = awkward_graph()
    a_src, a_dst = inputs(g, heads, dtype)
    got, ref = grads(gat_attention, g, a_src, a_dst), grads(reference, g, a_src, a_dst)
    assert got[0].shape == ref[0].shape and got[0].dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got[0], ref[0], atol=1e-6, rtol=0)
        for a, b in zip(got[1:], ref[1:]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    else:
        for a, b in zip(got, ref):
            torch.testing.assert_close(a, b)
    assert bool((got[1][-3:] == 0).all() and (got[2][-3:] == 0).all()), "isolated vertices get no gradient"


def test_large_scores_are_stable(path):
    g = awkward_graph()
    a_src, a_dst = inputs(g, 4, torch.float32, scale=60.0)  # exp differences far below float32's range
    got, ref = gat_attention(g, a_src, a_dst), reference(g, a_src, a_dst)
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, ref, atol=1e-6, rtol=0)


def test_gradcheck(path):
    g = awkward_graph(n=12, e=40)
    a_src, a_dst = inputs(g, 2, torch.float64)
    assert torch.autograd.gradcheck(lambda s, d: gat_attention(g, s, d, 0.1), (a_src, a_dst))


def test_int64_indices_and_single_input_gradient():
    g = awkward_graph()
    g64 = awkward_graph()
    g64.indptr, g64.indices = g64.indptr.long(), g64.indices.long()
    a_src, a_dst = inputs(g, 3, torch.float64)
    torch.testing.assert_close(grads(gat_attention, g64, a_src, a_dst), grads(gat_attention, g, a_src, a_dst))
    d = a_dst.detach()
    (gs,) = torch.autograd.grad(gat_attention(g, a_src, d).square().sum(), a_src)
    (ref,) = torch.autograd.grad(reference(g, a_src, d).square().sum(), a_src)
    torch.testing.assert_close(gs, ref)


def test_deterministic_across_runs_and_thread_counts(path):
    g = awkward_graph(n=300, e=3000)
    a_src, a_dst = inputs(g, 8, torch.float32)
    first = grads(gat_attention, g, a_src, a_dst)
    assert all(torch.equal(a, b) for a, b in zip(first, grads(gat_attention, g, a_src, a_dst)))
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            set_num_threads(threads)
            again = grads(gat_attention, g, a_src, a_dst)
            assert all(torch.equal(a, b) for a, b in zip(first, again)), f"differs with {threads} threads"
    finally:
        set_num_threads(before)


@pytest.mark.parametrize("n", [0, 5])
def test_graphs_without_edges(n):
    g = Graph.from_edge_index(torch.zeros(2, 0, dtype=torch.long), n)
    a_src, a_dst = inputs(g, 3, torch.float32)
    out = gat_attention(g, a_src, a_dst)
    assert out.shape == (0, 3)
    out.sum().backward()
    assert torch.equal(a_src.grad, torch.zeros(n, 3)) and torch.equal(a_dst.grad, torch.zeros(n, 3))


def test_shape_mismatch_is_clear():
    g = awkward_graph()
    with pytest.raises(ValueError, match="a_src and a_dst"):
        gat_attention(g, torch.randn(g.num_nodes, 2), torch.randn(g.num_nodes, 3))


def test_rectangular_csr_rows():
    sparse = pytest.importorskip("tessera.graph.csr")
    g = awkward_graph()
    k = 40
    stop = int(g.indptr[k])
    m = sparse.CSRMatrix.from_numpy(g.indptr[: k + 1].numpy(), g.indices[:stop].numpy(), None, k, g.num_nodes)
    a_src, a_dst = inputs(g, 3, torch.float64)
    want = grads(lambda g, s, d: gat_attention(g, s, d)[:stop], g, a_src, a_dst)
    got = grads(lambda m, s, d: gat_attention(m, s, d[:k]), m, a_src, a_dst)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def _attend_both_ways(g, heads, dtype, p, backend, fused):
    """``attend``'s output and input gradients, or the three-node composition's, from one seed."""
    gen = torch.Generator().manual_seed(3)
    a_src, a_dst = (torch.randn(g.num_nodes, heads, generator=gen, dtype=dtype).requires_grad_() for _ in range(2))
    h = torch.randn(g.num_nodes, heads, 5, generator=gen, dtype=dtype).requires_grad_()
    go = torch.randn(g.num_nodes, heads, 5, generator=gen, dtype=dtype)
    keys = sparse.edge_keys(g, torch.arange(g.num_nodes) * 7 + 1, torch.arange(g.num_nodes) * 7 + 1)
    a = sparse.as_operand(g, backend)
    torch.manual_seed(11)
    if fused:
        out = sparse.attend(a, g, a_src, a_dst, h, 0.2, p, keys if p else None)
    else:
        alpha = gat_attention(g, a_src, a_dst, 0.2)
        out = sparse.aggregate(a, h, "sum", dense.dropout(alpha, p, True, keys) if p else alpha)
    return (out, *torch.autograd.grad(out, (a_src, a_dst, h), go), torch.rand(1))


@pytest.mark.parametrize("backend", ["csr", "reference"])
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [0.0, 0.4])
def test_attend_is_attention_dropout_then_aggregate_bit_for_bit(path, backend, heads, dtype, p):
    """One node gives the composition's values, gradients and random draw (same seed, same
    masks keyed by the edge ids, the generator left where the composition leaves it)."""
    g = awkward_graph()
    want = _attend_both_ways(g, heads, dtype, p, backend, False)
    got = _attend_both_ways(g, heads, dtype, p, backend, True)
    for a, b in zip(got, want):
        assert torch.equal(a, b)


def test_attend_keeps_at_most_two_edge_by_head_tensors(monkeypatch):
    """Forward and backward of ``attend`` with dropout take two E x heads blocks from the
    workspace (the composition took three: alpha, its gradient and the score gradient)."""
    from tessera import workspace
    from tessera.graph.synthetic import generate

    g = generate("tiny", seed=0)
    heads = max(1, -(-workspace.MIN_BYTES // (4 * g.num_edges)))  # an E x heads block above the workspace's minimum
    ws = workspace.Workspace()
    monkeypatch.setattr(workspace, "DEFAULT", ws)
    _attend_both_ways(g, heads, torch.float32, 0.5, "csr", True)
    blocks = ws._blocks.get((g.num_edges * heads * 4, torch.float32), [])
    assert len(blocks) == 2


def test_attend_backward_twice_through_a_retained_graph():
    """A second backward (``retain_graph``) makes the dropped weights it freed again: the same
    gradients both times."""
    g = awkward_graph()
    gen = torch.Generator().manual_seed(5)
    a_src, a_dst = (torch.randn(g.num_nodes, 2, generator=gen).requires_grad_() for _ in range(2))
    h = torch.randn(g.num_nodes, 2, 3, generator=gen).requires_grad_()
    keys = sparse.edge_keys(g, torch.arange(g.num_nodes), torch.arange(g.num_nodes))
    out = sparse.attend(sparse.as_operand(g, "csr"), g, a_src, a_dst, h, 0.2, 0.5, keys)
    go = torch.randn(out.shape, generator=gen)
    first = torch.autograd.grad(out, (a_src, a_dst, h), go, retain_graph=True)
    second = torch.autograd.grad(out, (a_src, a_dst, h), go)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_a_recomputed_attend_keeps_no_dropped_weights_beside_its_saved_tensors():
    """Under ``--memory lean`` (``recompute``) the node holds no E x heads dropped weights from
    forward to backward; its backward draws them again: the same output and gradients."""
    from tessera.nn.recompute import recompute

    g = awkward_graph()
    gen = torch.Generator().manual_seed(5)
    a_src, a_dst = (torch.randn(g.num_nodes, 2, generator=gen).requires_grad_() for _ in range(2))
    h = torch.randn(g.num_nodes, 2, 3, generator=gen).requires_grad_()
    keys = sparse.edge_keys(g, torch.arange(g.num_nodes), torch.arange(g.num_nodes))
    operand = sparse.as_operand(g, "csr")

    def step(a_src, a_dst, h):
        return sparse.attend(operand, g, a_src, a_dst, h, 0.2, 0.5, keys)

    torch.manual_seed(0)
    fast = step(a_src, a_dst, h)
    torch.manual_seed(0)
    lean = recompute(step, a_src, a_dst, h)
    assert isinstance(fast.grad_fn.dropped, torch.Tensor) and lean.grad_fn.dropped is None
    assert torch.equal(fast, lean)
    go = torch.randn(fast.shape, generator=gen)
    for a, b in zip(torch.autograd.grad(fast, (a_src, a_dst, h), go), torch.autograd.grad(lean, (a_src, a_dst, h), go)):
        assert torch.equal(a, b)


def test_attend_refuses_features_of_another_graph():
    g = awkward_graph()
    terms = torch.zeros(g.num_nodes, 2)
    with pytest.raises(ValueError, match="h has 5 rows"):
        sparse.attend(sparse.as_operand(g, "csr"), g, terms, terms, torch.zeros(5, 2, 3))
