"""The workspace (kept blocks for large step tensors) and the ops that write into it: a block is
handed out again only once no tensor uses it, and every op gives the values and gradients of the
plain torch composition it replaces."""

import resource

import pytest
import torch
import torch.nn.functional as F

from helpers import awkward_graph
from tessera import dense, sparse, workspace
from tessera.dense import gemm_path
from tessera.nn.loss import cross_entropy_rows
from tessera.workspace import Workspace


def test_a_block_is_reused_only_when_no_tensor_uses_it():
    ws = Workspace(min_bytes=0)
    a = ws.empty((300, 400))
    b = ws.empty((300, 400))
    assert a.data_ptr() != b.data_ptr()
    pa = a.data_ptr()
    view = a[10:20]
    del a
    assert ws.empty((300, 400)).data_ptr() != pa, "a view keeps its block in use"
    del view
    c = ws.empty((400, 300))  # same bytes and dtype, another shape
    assert c.data_ptr() == pa and c.shape == (400, 300) and c.is_contiguous() and not c._is_view()
    assert c.data_ptr() % 64 == 0
    block = 300 * 400 * 4
    assert ws.held_bytes() == 3 * block  # a's (now c's), b's, and the one taken while the view lived
    del b
    assert ws.release() == 2 * block  # b's and the free one; c's stays
    assert ws.held_bytes() == block
    # another dtype of the same size is another key; small tensors are not kept
    assert ws.empty((300, 400), torch.int32).dtype == torch.int32
    small = Workspace(min_bytes=1 << 20).empty((10, 10))
    assert small.shape == (10, 10)


def test_a_saved_tensor_keeps_its_block_through_backward():
    ws = Workspace(min_bytes=0)

    class Square(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            out = ws.empty(x.shape)
            torch.mul(x, x, out=out)
            ctx.save_for_backward(out.detach().clone(), x)
            return out

        @staticmethod
        def backward(ctx, g):
            _, x = ctx.saved_tensors
            gx = ws.empty(x.shape)
            return torch.mul(g, 2 * x, out=gx)

    x = torch.randn(50, 7, requires_grad=True)
    y = Square.apply(x)
    z = Square.apply(y)  # y is saved: z must not get y's block
    assert z.data_ptr() != y.data_ptr()
    z.sum().backward()
    torch.testing.assert_close(x.grad, 4 * x.detach() ** 3)


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("p", [0.0, 0.3])
def test_relu_dropout_is_the_composition_bit_for_bit(p, rows):
    torch.manual_seed(1)
    x = torch.randn(3000, 96)
    ids = torch.randperm(5000)[:3000] if rows else None
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    torch.manual_seed(7)
    ya = dense.act_dropout(a, "relu", p, True, ids)
    torch.manual_seed(7)
    yb = dense.dropout(torch.relu(b), p, True, ids)
    assert torch.equal(ya, yb)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    assert torch.equal(a.grad, b.grad)


def test_act_dropout_draws_what_dropout_draws():
    torch.manual_seed(3)
    dense.act_dropout(torch.randn(10, 4), "relu", 0.5)
    after_fused = torch.rand(1)
    torch.manual_seed(3)
    dense.dropout(torch.relu(torch.randn(10, 4)), 0.5)
    assert torch.equal(after_fused, torch.rand(1)), "one seed drawn, as dropout draws one"
    torch.manual_seed(3)
    dense.act_dropout(torch.randn(10, 4), "relu", 0.5, training=False)
    dense.act_dropout(torch.randn(10, 4), "relu", 0.0)
    after_none = torch.rand(1)
    torch.manual_seed(3)
    torch.randn(10, 4)
    torch.randn(10, 4)
    assert torch.equal(after_none, torch.rand(1)), "no seed drawn without dropout"


@pytest.mark.parametrize("p", [0.0, 0.4])
def test_elu_dropout_matches_torch(p):
    torch.manual_seed(2)
    x = torch.randn(2000, 33, dtype=torch.float64)
    a = x.clone().requires_grad_()
    b = x.clone().requires_grad_()
    torch.manual_seed(5)
    ya = dense.act_dropout(a, "elu", p)
    torch.manual_seed(5)
    yb = dense.dropout(F.elu(b), p)
    torch.testing.assert_close(ya, yb, rtol=1e-12, atol=1e-12)
    g = torch.randn_like(ya)
    ya.backward(g)
    yb.backward(g)
    torch.testing.assert_close(a.grad, b.grad, rtol=1e-10, atol=1e-12)
    assert torch.autograd.gradcheck(lambda t: dense.act_dropout(t, "elu", 0.0), (a[:20, :5].detach().requires_grad_(),))


def test_act_dropout_refuses_unknown_activation_and_probability():
    with pytest.raises(ValueError, match="unknown activation"):
        dense.act_dropout(torch.randn(3, 3), "tanh", 0.5)
    with pytest.raises(ValueError, match="dropout probability"):
        dense.act_dropout(torch.randn(3, 3), "relu", 1.5)


def test_a_smaller_request_takes_a_free_block_at_most_twice_its_size():
    ws = Workspace(min_bytes=0)
    big = ws.empty((1000, 10))
    pb = big.data_ptr()
    del big
    part = ws.empty((600, 10))  # 60 %: the free 1000-row block, its pages already mapped
    assert part.data_ptr() == pb and part.shape == (600, 10) and part.is_contiguous()
    assert ws.holds(part) and ws.held_bytes() == 1000 * 10 * 4
    assert ws.empty((1000, 10)).data_ptr() != pb, "the block is in use by the smaller tensor"
    del part
    assert ws.empty((400, 10)).data_ptr() != pb, "under half the block: a block of its own"
    exact = ws.empty((400, 10))  # an exact size's free block comes first
    pe = exact.data_ptr()
    del exact
    assert ws.empty((400, 10)).data_ptr() == pe
    assert ws.empty((600, 10), torch.int32).data_ptr() != pb, "another dtype"


def test_cross_entropy_rows_is_indexing_then_cross_entropy_bit_for_bit():
    torch.manual_seed(0)
    logits = torch.randn(5000, 12)
    rows = torch.randperm(5000)[:1700]
    y = torch.randint(0, 12, (1700,))
    a = logits.clone().requires_grad_()
    b = logits.clone().requires_grad_()
    la = cross_entropy_rows(a, rows, y) / 1700
    lb = F.cross_entropy(b[rows], y, reduction="sum") / 1700
    assert torch.equal(la, lb)
    la.backward()
    lb.backward()
    assert torch.equal(a.grad, b.grad)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_aggregate_self_weight_adds_the_root_term(reduce):
    g = awkward_graph(n=40, e=150)
    x = torch.randn(g.num_nodes, 6, dtype=torch.float64, requires_grad=True)
    got = sparse.aggregate(g, x, reduce, self_weight=1.5)
    want = sparse.aggregate(g, x, reduce) + 1.5 * x
    torch.testing.assert_close(got, want)
    assert torch.autograd.gradcheck(lambda t: sparse.aggregate(g, t, reduce, self_weight=1.5), (x,))


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


@pytest.mark.parametrize("path", ["mkl", "onednn_kept"])
@pytest.mark.parametrize("model", ["gcn", "sage", "gin", "gat"])
def test_a_steady_training_step_maps_no_new_memory_for_its_large_tensors(model, path, tmp_path):
    # The hidden activations are above glibc's largest mmap threshold (32 MiB), so without the
    # workspace each is a fresh mmap that page-faults in again every step (checked with the
    # workspace off: SAGE, GIN and GAT steps fault 1-6 activations in again); with it the third step
    # reuses the second's blocks. The dense
    # products run on each path that writes into kept blocks; the fresh-output oneDNN path, taken
    # only where it measured clearly faster, maps new memory by design (tests/test_gemm_path.py).
    if path != "mkl" and not gemm_path.onednn_usable():
        pytest.skip("this torch build has no oneDNN ops")
    from tessera.graph.synthetic import SyntheticSpec, generate
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    # Many vertices, few edges and a modest width, so an activation (59 MiB) dwarfs the tensors under
    # the workspace's 1 MiB floor and glibc's mmap threshold, which its heap trimming sometimes
    # returns and re-faults between steps: weight-sized ones (hidden^2; at 4.5 MiB a GIN step
    # re-faulted about one activation's worth of them) and GAT's per-edge scores (6 MiB each).
    spec = SyntheticSpec(80_000, 160_000, 64, 8, 2.3, 500, 0.75, 0.2, name="wide")
    graph = generate(spec, seed=0)
    n = graph.num_nodes
    hidden = 192
    cfg = TrainConfig(model=model, dataset="synthetic:small", hidden=hidden, heads=4, epochs=3, out=str(tmp_path))
    tr = Trainer(cfg, graph)
    pages_per_activation = n * hidden * 4 // 4096
    with gemm_path.forced(path):
        tr.train_step()
        tr.train_step()
        # the fewest of three steady steps: a step that maps its large tensors afresh does so every time
        steps = []
        for _ in range(3):
            before = _minor_faults()
            tr.train_step()
            steps.append(_minor_faults() - before)
    faults = min(steps)
    assert faults < pages_per_activation // 2, f"{steps} minor faults in steady {model} steps"
    assert workspace.DEFAULT.held_bytes() > 0


def test_linear_add_accumulates_in_place_with_the_gradients_of_an_add():
    torch.manual_seed(4)
    x = torch.randn(3000, 24, requires_grad=True)
    w = torch.randn(16, 24, requires_grad=True)
    base = torch.randn(3000, 16, requires_grad=True)
    acc = base * 1.0
    ptr = acc.data_ptr()
    got = dense.linear_add_(acc, x, w)
    assert got.data_ptr() == ptr
    torch.testing.assert_close(got, base * 1.0 + F.linear(x, w), rtol=1e-5, atol=1e-5)
    g = torch.randn(3000, 16)
    got.backward(g)
    grads = [t.grad.clone() for t in (x, w, base)]
    for t in (x, w, base):
        t.grad = None
    (base * 1.0 + F.linear(x, w)).backward(g)
    for a, t in zip(grads, (x, w, base)):
        torch.testing.assert_close(a, t.grad, rtol=1e-5, atol=1e-4)


def test_a_strided_view_is_copied_into_a_workspace_block():
    t = torch.randn(4096, 192)
    assert workspace.contiguous(t) is t
    left = t[:, :96]  # one output of a stacked product, as SAGE's split projection gives
    c = workspace.contiguous(left)
    assert c.is_contiguous() and workspace.holds(c) and torch.equal(c, left)


def test_blocks_made_in_a_transient_scope_are_dropped_at_its_end_once_free():
    ws = Workspace(min_bytes=0)
    kept = ws.empty((64, 64))  # made before: stays, in use or not
    before = ws.held_bytes()
    with ws.transient():
        trial = ws.empty((64, 64))  # a new block: the one before is in use
        alive = ws.empty((32, 32))  # a new block still in use at the scope's end
        del trial
    assert ws.held_bytes() == before + alive.numel() * 4
    del kept, alive
    assert ws.release() == before + 32 * 32 * 4
