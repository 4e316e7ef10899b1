"""``dropout(act(sum_i x_i W_i^T + b))`` as one autograd node: the dense end of a layer that
aggregates first, with the model's activation and the next layer's dropout.

Composed of separate nodes (linear, bias, :func:`~tessera.sparse.act_dropout`), a step holds
``N x F`` blocks the node does not need: the pre-activation, the activation's gradient, and the
gradient of the pre-activation that the linear map's backward then reads whole. Here both
directions walk the rows in chunks of a few megabytes: each chunk's pre-activation (forward) and
pre-activation gradient (backward) is formed in cache and consumed there, by the activation and
dropout, then by the weight, bias and input gradient products, so neither exists whole or is
written to memory. When the next layer's linear map reads the output, it leaves its input-gradient
product to this node (:mod:`~tessera.dense.deferred`), which forms that too chunk by chunk: at
hidden width 256 on a 500 k-vertex graph no 512 MB block is written, read or paged in either way.

The forward values are those of the composition up to the products' rounding (the same products
over row chunks, the bias added by the first product as ``linear(x, W, b)`` adds it, the same
dropout draw); the weight and bias gradients are sums over row chunks, so their last bits may
differ from one product over all rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from tessera import workspace
from tessera.bfloat16 import BF16
from tessera.dense import chunk_gemm
from tessera.dense.act_dropout import act_dropout
from tessera.dense.deferred import Owed, accept, owed_rows, prepared
from tessera.dense.linear import cast_like, linear, linear_add_
from tessera.kernels.dropout import ACT_MODES, draw_seed, keep_threshold, run_hashed
from tessera.kernels.placement import host_kernels

# Rows per chunk, both ways: 4 MB of the output, the size that ran fastest among chunks of 1 to 8 MB
# (docs/design/chunk-sizes.md).
CHUNK_BYTES = 4 << 20


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
    #: the output's readers may leave their input-gradient products to this node
    #: (:mod:`tessera.dense.deferred`): only where nothing asks for the output's own gradient, as
    #: between a model's layers
    takes_owed: bool = False


def _fusable(xs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor], ep: Epilogue) -> bool:
    dt = xs[0].dtype
    return (
        0.0 <= ep.p < 1.0
        and keep_threshold(ep.p) is not None
        and dt in (torch.float32, BF16)
        and host_kernels(*xs, *weights)
        and all(t.dim() == 2 for t in [*xs, *weights])
        and all(x.dtype == dt for x in xs)
        and all(w.dtype in (dt, torch.float32) for w in weights)
    )


def _positive(y: torch.Tensor) -> torch.Tensor:
    """``y > 0`` into a kept bool block; float32 on NumPy's comparison, which runs several times
    faster than torch's (docs/design/fused-layers.md)."""
    out = workspace.empty(y.shape, torch.bool)
    if y.dtype == torch.float32 and host_kernels(y) and y.is_contiguous():
        np.greater(y.numpy(), np.float32(0.0), out=out.numpy())
        return out
    return torch.gt(y, 0.0, out=out)


def _product(xs, weights, bias) -> torch.Tensor:
    """``x_0 W_0^T + b``, then ``+ x_i W_i^T``: in the order the unfused layers add them, the bias
    added by the first product's kernel rather than in a pass of its own (float32 weights of
    bfloat16 inputs cast, as :func:`~tessera.dense.linear` casts them)."""
    z = linear(xs[0], weights[0], bias)
    for x, w in zip(xs[1:], weights[1:]):
        z = linear_add_(z, x, w)
    return z


class _LinearAct(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias, act, p, seed, rows, mask_only, owed, n_in, *xw):
        xs, weights = xw[:n_in], xw[n_in:]
        dt = xs[0].dtype
        cs = [x.contiguous() for x in xs]
        ws = [cast_like(cs[0], w).contiguous() for w in weights]
        b = cast_like(cs[0], bias)
        n, width = cs[0].shape[0], ws[0].shape[0]
        y = workspace.empty((n, width), dt)
        forward_mode, ctx.grad_mode = ACT_MODES[act]
        # Row chunks: each chunk's pre-activation is formed in cache and passed through the
        # activation and dropout there, so no N x F pre-activation block is written or read.
        step = workspace.chunk_rows(width, y.element_size(), n, CHUNK_BYTES)
        z_buf = torch.empty((step, width), dtype=dt)
        ids = rows if rows is not None else torch.arange(n, dtype=torch.int64)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            z = z_buf[: r1 - r0]
            # bias added by the first product, then the others added into it, as _product does
            chunk_gemm.product(z, cs[0][r0:r1], ws[0], b)
            for x, w in zip(cs[1:], ws[1:]):
                chunk_gemm.add_product_(z, x[r0:r1], w)
            run_hashed(z, y[r0:r1], seed, p, ids[r0:r1], forward_mode)
        ctx.p, ctx.seed, ctx.rows, ctx.n_in, ctx.owed = p, seed, rows, n_in, owed
        # ReLU's backward reads only whether each output is positive (dropped ones are zero)
        kept = _positive(y) if mask_only and act == "relu" else y
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
        need_b, need_x, need_w = need[0], need[8 : 8 + n_in], need[8 + n_in :]
        # the next layer's input-gradient products, owed to this output's gradient (tessera.dense.deferred)
        owed, g = ctx.owed.take(g) if ctx.owed is not None else ([], g)
        g = None if g is None else g.contiguous()
        n, width = y.shape
        dt = xs[0].dtype if g is None else g.dtype
        half = dt == BF16  # bfloat16 products: weight and bias gradients summed in float32
        gxs = [workspace.empty((n, x.shape[1]), x.dtype) if nx else None for x, nx in zip(xs, need_x)]
        gb = torch.zeros(width, dtype=torch.float32 if half else dt) if need_b else None
        step = chunk_gemm.weight_grad_rows(width, torch.finfo(dt).bits // 8, n, CHUNK_BYTES)
        gws = chunk_gemm.WeightGrads(list(xs), list(need_w), width, torch.float32 if half else weights[0].dtype, step)
        d_buf = torch.empty((step, width), dtype=dt)
        g_buf = torch.empty((step, width), dtype=dt) if owed else None
        ids = ctx.rows if ctx.rows is not None else torch.arange(n, dtype=torch.int64)
        # transposed once: each chunk's input gradient is d @ W, a product by (W^T)^T
        wts = [w.to(dt).t().contiguous() if gx is not None else None for w, gx in zip(weights, gxs)]
        owed = prepared(owed, dt)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            d = d_buf[: r1 - r0]
            src = g[r0:r1] if g is not None else None
            if owed:
                src = owed_rows(g_buf[: r1 - r0], owed, r0, r1, src)
            run_hashed(src, d, ctx.seed, ctx.p, ids[r0:r1], ctx.grad_mode, aux=y[r0:r1])
            if gb is not None:
                gb += d.sum(0)  # bfloat16 rows are summed in float32 and rounded once (15x faster than dtype=)
            gws.add(d, r0, r1)
            for wt, gx in zip(wts, gxs):
                if gx is not None:
                    chunk_gemm.product(gx[r0:r1], d, wt)
        return (gb, None, None, None, None, None, None, None, *gxs, *gws.result())


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
    owed = Owed() if epilogue.takes_owed and torch.is_grad_enabled() else None
    y = _LinearAct.apply(bias, epilogue.act, epilogue.p, seed, rows, epilogue.mask_only, owed, len(xs), *xs, *weights)
    return y if owed is None else accept(y, owed)
