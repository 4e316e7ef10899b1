"""``dropout(act(sum_i x_i W_i^T + b))`` as one autograd node: the dense end of a layer that
aggregates first, with the model's activation and the next layer's dropout.

Composed of separate nodes (linear, bias, :func:`~tessera.sparse.act_dropout`), backward holds
three ``N x F`` blocks at once: the activation's output (saved), its gradient, and the gradient
of the pre-activation that the linear map's backward then reads whole. Here the backward walks
the rows in chunks of about a megabyte: each chunk's pre-activation gradient is formed in cache
and consumed there by the weight, bias and input gradient products, so it never exists whole
and is never written to memory.

The forward values are those of the composition (the same products, the bias added by the first
product as ``linear(x, W, b)`` adds it, the same dropout draw); the weight and bias gradients are
sums over row chunks, so their last bits may differ from one product over all rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tessera import workspace
from tessera.bfloat16 import BF16
from tessera.sparse.dropout import ACT_MODES, act_dropout, draw_seed, keep_threshold, run_hashed
from tessera.sparse.linear import linear, linear_add_, mm_into_

CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class Epilogue:
    """What follows a layer's dense transform: ``dropout(act(.), p)``; ``p`` is 0 when the model
    is not training or its next layer has no dropout."""

    act: str
    p: float = 0.0
    #: the output goes only to ops that keep no reference to it (GIN's sum, a GCN that aggregates
    #: first): a ReLU's backward then keeps where the output is non-zero, a byte per element,
    #: instead of the output, which is then freed once the next op has read it
    mask_only: bool = False


def _fusable(xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], ep: Epilogue) -> bool:
    dt = xs[0].dtype
    return (
        0.0 <= ep.p < 1.0
        and keep_threshold(ep.p) is not None
        and dt in (torch.float32, BF16)
        and all(t.device.type == "cpu" and t.dim() == 2 for t in [*xs, *weights])
        and all(x.dtype == dt for x in xs)
        and all(w.dtype in (dt, torch.float32) for w in weights)
    )


def _product(xs, weights, bias) -> torch.Tensor:
    """``x_0 W_0^T + b``, then ``+ x_i W_i^T``: in the order the unfused layers add them, the bias
    added by the first product's kernel rather than in a pass of its own (float32 weights of
    bfloat16 inputs cast, as :func:`~tessera.sparse.linear` casts them)."""
    z = linear(xs[0], weights[0], bias)
    for x, w in zip(xs[1:], weights[1:]):
        z = linear_add_(z, x, w)
    return z


class _LinearAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias, act, p, seed, rows, mask_only, n_in, *xw):
        xs, weights = xw[:n_in], xw[n_in:]
        z = _product(xs, weights, bias).contiguous()  # autograd is off inside forward
        # Into another block, not in place: numba's kernel does not vectorise with its input and
        # output aliased (the pass took 6x as long), and the product's block is free again here
        # for the backward's gradient, so the peak is the same.
        y = workspace.empty_like(z)
        forward_mode, ctx.grad_mode = ACT_MODES[act]
        run_hashed(z, y, seed, p, rows, forward_mode)
        ctx.p, ctx.seed, ctx.rows, ctx.n_in = p, seed, rows, n_in
        # ReLU's backward reads only whether each output is positive (dropped ones are zero)
        kept = torch.gt(y, 0.0, out=workspace.empty(y.shape, torch.bool)) if mask_only and act == "relu" else y
        ctx.save_for_backward(kept, *xs, *weights)
        return y

    @staticmethod
    def backward(ctx, g):
        y, *xw = ctx.saved_tensors  # the output, or where it is positive (bool)
        if y.dtype == torch.bool:
            y = y.view(torch.uint8)
        n_in = ctx.n_in
        xs, weights = xw[:n_in], xw[n_in:]
        need = ctx.needs_input_grad
        need_b, need_x, need_w = need[0], need[7 : 7 + n_in], need[7 + n_in :]
        g = g.contiguous()
        n, width = y.shape
        half = g.dtype == BF16  # bfloat16 products: weight and bias gradients summed in float32
        gxs = [workspace.empty((n, x.shape[1]), x.dtype) if nx else None for x, nx in zip(xs, need_x)]
        gws = [
            torch.zeros_like(w, dtype=torch.float32 if half else w.dtype) if nw else None
            for w, nw in zip(weights, need_w)
        ]
        gb = torch.zeros(width, dtype=torch.float32 if half else g.dtype) if need_b else None
        step = max(64, CHUNK_BYTES // (g.element_size() * max(width, 1)))
        d_buf = torch.empty((min(step, n), width), dtype=g.dtype)
        ids = ctx.rows if ctx.rows is not None else torch.arange(n, dtype=torch.int64)
        wts = [w.to(g.dtype).t().contiguous() if gx is not None else None for w, gx in zip(weights, gxs)]
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            d = d_buf[: r1 - r0]
            run_hashed(g[r0:r1], d, ctx.seed, ctx.p, ids[r0:r1], ctx.grad_mode, aux=y[r0:r1])
            if gb is not None:
                gb += d.sum(0)  # bfloat16 rows are summed in float32 and rounded once (15x faster than dtype=)
            for x, wt, gx, gw in zip(xs, wts, gxs, gws):
                if gw is not None and half:  # no mixed-dtype addmm on CPU: each chunk's product rounded once
                    gw += torch.mm(d.t(), x[r0:r1])
                elif gw is not None:
                    gw.addmm_(d.t(), x[r0:r1])
                if gx is not None:
                    mm_into_(gx[r0:r1], d, wt)
        return (gb, None, None, None, None, None, None, *gxs, *gws)


def linear_act(
    xs: Sequence[torch.Tensor],
    weights: Sequence[torch.Tensor],
    bias: torch.Tensor | None,
    epilogue: Epilogue | None,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dropout(act(sum_i xs[i] @ weights[i].T + bias), p)`` for the ``epilogue`` (None: no
    activation, no dropout), drawing the mask :func:`~tessera.sparse.act_dropout` would draw
    (same seed draw, ``rows`` keying the rows' global ids)."""
    if len(xs) != len(weights) or not xs:
        raise ValueError(f"{len(xs)} inputs for {len(weights)} weights")
    if epilogue is None:
        return _product(xs, weights, bias)
    if not _fusable(xs, weights, epilogue):
        return act_dropout(_product(xs, weights, bias), epilogue.act, epilogue.p, True, rows)
    if epilogue.act not in ACT_MODES:
        raise ValueError(f"unknown activation {epilogue.act!r}; choose from {', '.join(ACT_MODES)}")
    if rows is not None and rows.numel() != xs[0].shape[0]:
        raise ValueError(f"rows has {rows.numel()} ids for {xs[0].shape[0]} rows")
    # p == 0 keeps every element and draws no seed, as act_dropout draws none then
    seed = draw_seed() if epilogue.p > 0.0 else 0
    rows = None if rows is None else rows.to(torch.int64)
    return _LinearAct.apply(bias, epilogue.act, epilogue.p, seed, rows, epilogue.mask_only, len(xs), *xs, *weights)
