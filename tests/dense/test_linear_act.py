"""The fused dense transform + activation + dropout equals the composition it replaces."""

import pytest
import torch

from tessera import dense
from tessera.dense import Epilogue, linear_act
from tessera.dense.deferred import owed_to
from tessera.dense.linear_act import CHUNK_BYTES


@pytest.mark.parametrize("act", ["relu", "elu"])
@pytest.mark.parametrize("p", [0.0, 0.5])
@pytest.mark.parametrize("pairs", [1, 2])
@pytest.mark.parametrize("keyed", [False, True])
def test_linear_act_equals_linear_then_act_dropout(act, p, pairs, keyed):
    torch.manual_seed(0)
    n, f_in, f_out = 3 * CHUNK_BYTES // (4 * 64) + 17, 12, 64  # three chunks and a short one
    xs = [torch.randn(n, f_in, requires_grad=True) for _ in range(pairs)]
    ws = [torch.randn(f_out, f_in, requires_grad=True) for _ in range(pairs)]
    b = torch.randn(f_out, requires_grad=True)
    rows = torch.randperm(n) if keyed else None
    torch.manual_seed(7)
    y = linear_act(xs, ws, b, Epilogue(act, p), rows)
    after = torch.randint(0, 2**31, (1,))  # the generator moved exactly as the composition moves it
    g = torch.randn(n, f_out)
    got = torch.autograd.grad(y, [*xs, *ws, b], g)
    torch.manual_seed(7)
    z = dense.linear(xs[0], ws[0], b)
    for x, w in zip(xs[1:], ws[1:]):
        z = dense.linear_add_(z, x, w)
    want_y = dense.act_dropout(z, act, p, True, rows)
    assert torch.equal(torch.randint(0, 2**31, (1,)), after)
    want = torch.autograd.grad(want_y, [*xs, *ws, b], g)
    assert torch.equal(y, want_y)  # same products, same bias order, same mask
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5 * float(c.abs().max()))


def test_linear_act_without_epilogue_is_the_linear_map():
    x, w, b = torch.randn(50, 8), torch.randn(16, 8), torch.randn(16)
    assert torch.equal(linear_act([x], [w], b, None), dense.linear(x, w, b))
    with pytest.raises(ValueError, match="inputs for"):
        linear_act([x], [w, w], b, None)


def test_linear_act_in_eval_mode_draws_nothing():
    x, w = torch.randn(50, 8), torch.randn(16, 8)
    torch.manual_seed(3)
    y = linear_act([x], [w], None, Epilogue("relu", 0.0))
    assert torch.equal(torch.randint(0, 2**31, (1,)), torch.manual_seed(3) and torch.randint(0, 2**31, (1,)))
    assert torch.equal(y, torch.relu(x @ w.T))


@pytest.mark.parametrize("p", [0.0, 0.5])
def test_mask_only_keeps_a_byte_per_output_and_the_same_gradients(p):
    """With ``mask_only`` a ReLU epilogue's node saves where the output is positive instead of
    the output (freed once its reader is done with it), with bit-identical values and gradients."""
    n, f_in, f_out = 2 * CHUNK_BYTES // (4 * 64) + 5, 12, 64
    gen = torch.Generator().manual_seed(1)
    x0, w0 = torch.randn(n, f_in, generator=gen), torch.randn(f_out, f_in, generator=gen)
    b0, g = torch.randn(f_out, generator=gen), torch.randn(n, f_out, generator=gen)
    results = []
    for mask_only in (False, True):
        x, w, b = (t.clone().requires_grad_() for t in (x0, w0, b0))
        torch.manual_seed(7)
        y = linear_act([x], [w], b, Epilogue("relu", p, mask_only))
        saved = y.grad_fn.saved_tensors
        keeps_y = any(s.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for s in saved)
        assert keeps_y != mask_only
        if mask_only:
            assert torch.equal(saved[0], y > 0)
        results.append((y, *torch.autograd.grad(y, (x, w, b), g)))
    for a, c in zip(*results):
        assert torch.equal(a, c)


def test_mask_only_is_ignored_by_activations_whose_backward_reads_the_output():
    x, w = torch.randn(40, 8, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    y = linear_act([x], [w], None, Epilogue("elu", 0.0, mask_only=True))
    assert any(s.untyped_storage().data_ptr() == y.untyped_storage().data_ptr() for s in y.grad_fn.saved_tensors)


def _owed_case(split: bool, other_reader: bool, dtype: torch.dtype):
    """A hidden layer's linear_act feeding the next layer's linear map (or the two maps of
    linear_split), optionally read by something else too; returns the loss's gradients and
    whether the map left its input-gradient product to linear_act."""
    gen = torch.Generator().manual_seed(5)
    n, f_in, hidden = 2 * CHUNK_BYTES // (4 * 64) + 9, 12, 64
    x = torch.randn(n, f_in, generator=gen).to(dtype)
    w1 = torch.randn(hidden, f_in, generator=gen).requires_grad_()
    b1 = torch.randn(hidden, generator=gen).requires_grad_()
    w2 = torch.randn(7, hidden, generator=gen).requires_grad_()
    w3 = torch.randn(5, hidden, generator=gen).requires_grad_()
    g = torch.randn(n, 12, generator=gen).to(dtype)
    y = linear_act([x], [w1], b1, Epilogue("relu", 0.0, takes_owed=True))
    owed = owed_to(y)
    _next_layer_backward(y, w2, w3, g, split, other_reader)
    return [w1.grad, b1.grad, w2.grad, w3.grad], owed is not None and not owed.terms


def _next_layer_backward(y, w2, w3, g, split: bool, other_reader: bool) -> None:
    """Backward through the next layer's map of ``y`` (one linear, or linear_split's two), and
    through a second reader of ``y`` where asked."""
    z = torch.cat(dense.linear_split(y, [w2, w3]), 1) if split else dense.linear(y, torch.cat([w2, w3]))
    loss = (z.float() * g.float()).sum()
    if other_reader:
        loss = loss + (y.float() ** 2).sum()
    loss.backward()


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("other_reader", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_next_layers_input_gradient_formed_in_chunks_equals_the_whole_product(split, other_reader, dtype):
    """The next layer's map leaves ``g W`` to linear_act, which forms it chunk by chunk (no N x F
    gradient block): the gradients are those of the plain product, also when the output has a
    second reader whose gradient arrives summed with the stand-in zeros."""
    import sys

    linear_module = sys.modules["tessera.dense.linear"]
    got, used = _owed_case(split, other_reader, dtype)
    assert used  # the terms were recorded and then taken by linear_act's backward
    # without takes_owed (a caller may ask for the output's own gradient) nothing is owed
    y = linear_act([torch.randn(9, 3)], [torch.randn(4, 3, requires_grad=True)], None, Epilogue("relu"))
    assert owed_to(y) is None
    plain = linear_module.owed_to
    linear_module.owed_to = lambda x: None
    try:
        want, _ = _owed_case(split, other_reader, dtype)
    finally:
        linear_module.owed_to = plain
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=tol, atol=tol * float(c.abs().max()))
    # and against autograd through torch's own ops (float32)
    if dtype == torch.float32:
        gen = torch.Generator().manual_seed(5)
        n, f_in, hidden = 2 * CHUNK_BYTES // (4 * 64) + 9, 12, 64
        x = torch.randn(n, f_in, generator=gen)
        ref = [
            torch.randn(s, generator=gen).requires_grad_()
            for s in [(hidden, f_in), (hidden,), (7, hidden), (5, hidden)]
        ]
        g = torch.randn(n, 12, generator=gen)
        y = torch.relu(x @ ref[0].T + ref[1])
        loss = ((y @ torch.cat(ref[2:]).T) * g).sum() + ((y**2).sum() if other_reader else 0.0)
        loss.backward()
        for a, r in zip(got, ref):
            torch.testing.assert_close(a, r.grad, rtol=1e-4, atol=1e-4 * float(r.grad.abs().max()))


def _act_dropout_case(takes_owed: bool, split: bool, other_reader: bool, keyed: bool, dtype: torch.dtype):
    """GAT's junction: an attention output through act_dropout (ELU, p 0.5) into the next layer's
    linear map; returns the gradients and whether the map's product was owed and taken."""
    gen = torch.Generator().manual_seed(8)
    n, f_in, hidden = 3 * (1 << 20) // (4 * 48) + 5, 6, 48
    x = torch.randn(n, f_in, generator=gen).to(dtype)
    w1 = torch.randn(hidden, f_in, generator=gen).requires_grad_()
    w2 = torch.randn(7, hidden, generator=gen).requires_grad_()
    w3 = torch.randn(5, hidden, generator=gen).requires_grad_()
    g = torch.randn(n, 12, generator=gen).to(dtype)
    rows = torch.randperm(n, generator=gen) if keyed else None
    h = dense.linear(x, w1)
    torch.manual_seed(21)
    y = dense.act_dropout(h, "elu", 0.5, True, rows, takes_owed=takes_owed)
    owed = owed_to(y)
    _next_layer_backward(y, w2, w3, g, split, other_reader)
    return [w1.grad, w2.grad, w3.grad], owed is not None and not owed.terms


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("other_reader", [False, True])
@pytest.mark.parametrize("keyed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_act_dropout_forms_the_next_layers_owed_input_gradient_in_chunks(split, other_reader, keyed, dtype):
    """act_dropout (between GAT's layers) takes the next map's ``g W`` as linear_act does: the same
    gradients as the plain product, the same dropout mask in every chunk, keyed or not."""
    got, used = _act_dropout_case(True, split, other_reader, keyed, dtype)
    assert used
    want, plain_used = _act_dropout_case(False, split, other_reader, keyed, dtype)
    assert not plain_used
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=tol, atol=tol * float(c.abs().max()))
