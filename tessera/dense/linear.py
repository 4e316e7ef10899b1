"""Dense ``x W^T + b`` for full-graph layers, with autograd, writing into workspace buffers.

The forward and input-gradient products run the way :func:`~tessera.dense.gemm_path.gemm_path`
chose for this CPU: MKL or oneDNN into a kept :mod:`~tessera.workspace` block, or oneDNN into a
fresh output where that measured clearly faster. The weight gradient (a reduction over all rows,
a small output) is :func:`~tessera.dense.chunk_gemm.weight_grad`: a sum over row chunks on oneDNN
where the chunk library is oneDNN, else one product on MKL. Other devices and dtypes use
``torch.nn.functional.linear``.

bfloat16 inputs (``--precision bf16``) multiply float32 weights as ``torch.autocast`` does: the
weights are cast to bfloat16 (the cast is part of the graph, so their gradients arrive in float32),
and the products run on oneDNN's bfloat16 GEMM, accumulating in float32, into kept blocks, or,
on a CPU without a native bfloat16 GEMM, on the float32 GEMM over widened chunks
(:mod:`~tessera.dense.widened`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import overload

import numpy as np
import torch
import torch.nn.functional as F

from tessera import workspace
from tessera.bfloat16 import BF16
from tessera.dense import chunk_gemm, widened
from tessera.dense.deferred import owe, owed_to
from tessera.dense.gemm_path import gemm_path, kept_onednn_fits, onednn_add_, onednn_product
from tessera.dense.liveness import live_rows
from tessera.kernels.placement import host_kernels


def _usable(*ts: torch.Tensor) -> bool:
    dt = ts[0].dtype
    return dt in (torch.float32, BF16) and host_kernels(*ts) and all(t.dtype == dt and t.dim() == 2 for t in ts)


@overload
def cast_like(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor: ...
@overload
def cast_like(x: torch.Tensor, t: None) -> None: ...
def cast_like(x: torch.Tensor, t: torch.Tensor | None) -> torch.Tensor | None:
    """A float32 parameter ``t`` in bfloat16 when ``x`` is (autocast's rule, differentiable); else ``t``."""
    return t.to(BF16) if t is not None and x.dtype == BF16 and t.dtype == torch.float32 else t


def _mm_t(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ w.T + b``: into a workspace block (MKL, or oneDNN's in-place product), else a fresh
    oneDNN output, by this CPU's :func:`~tessera.dense.gemm_path.gemm_path`."""
    a, w = a.contiguous(), w.contiguous()
    if gemm_path() == "onednn" and a.dtype == torch.float32:
        return onednn_product(a, w, b)
    return mm_into_(workspace.empty((a.shape[0], w.shape[0]), a.dtype), a, w, b)


def mm_into_(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``out = a @ w.T + b`` into the contiguous ``out``: on oneDNN where this CPU's path keeps
    oneDNN's outputs, else on MKL."""
    if gemm_path() == "onednn_kept" and out.dtype == torch.float32 and out.is_contiguous() and kept_onednn_fits(a, w):
        return onednn_add_(out.zero_(), a, w, b)
    return widened.mm(a, w.t(), out=out) if b is None else widened.addmm(b, a, w.t(), out=out)


def _grads(ctx, g: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The input and weight gradients of ``x @ weight.T`` (saved as ``ctx``'s tensors) for ``g``;
    the input gradient is left to ``x``'s producer where it takes owed products (:mod:`~tessera.dense.deferred`)."""
    x, weight = ctx.saved_tensors
    g = g.contiguous()
    gx = None
    if ctx.needs_input_grad[1]:
        owed = owed_to(x)
        gx = _mm_t(g, weight.t()) if owed is None else owe(owed, x, g, weight)
    gw = None
    if ctx.needs_input_grad[2]:
        # When most rows of g are zero (a loss on the training vertices only), the weight
        # gradient, a reduction over rows, needs only the others. The input gradient
        # stays one product: scattering its live rows into zeros measured slower.
        live = live_rows(g)
        if live is None:
            gw = chunk_gemm.weight_grad(g, x)
        else:
            rows = torch.from_numpy(np.flatnonzero(live))
            gw = chunk_gemm.weight_grad(g.index_select(0, rows), x.index_select(0, rows))
    return gx, gw


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias, x, weight):
        ctx.save_for_backward(x, weight)
        return _mm_t(x, weight, bias)

    @staticmethod
    def backward(ctx, g):
        gx, gw = _grads(ctx, g)
        gb = g.sum(0) if ctx.needs_input_grad[0] else None
        return gb, gx, gw


class _LinearAdd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, acc, x, weight):
        ctx.save_for_backward(x, weight)
        ctx.mark_dirty(acc)
        # the product accumulates into acc: no temporary, no add pass
        path, x = gemm_path() if x.dtype == torch.float32 else "mkl", x.contiguous()
        if path == "onednn_kept" and kept_onednn_fits(x, weight):
            return onednn_add_(acc, x, weight)
        if path == "onednn":
            return acc.add_(_mm_t(x, weight))
        return widened.addmm_(acc, x, weight.t())

    @staticmethod
    def backward(ctx, g):
        return (g, *_grads(ctx, g))


def linear_add_(acc: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``acc += x @ weight.T`` in place, with autograd (``acc`` a fresh result nothing saved,
    such as a layer's aggregate: SAGE's root term then costs no N x F temporary)."""
    weight = cast_like(x, weight)
    if _usable(x, weight) and acc.dtype == x.dtype and acc.is_contiguous():
        return _LinearAdd.apply(acc, x, weight)
    return acc.add_(F.linear(x, weight))


class _LinearSplit(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, *weights):
        w = torch.cat(weights)  # small: sum of the output widths x the input width
        ctx.save_for_backward(x, w)
        ctx.widths = [wi.shape[0] for wi in weights]
        return tuple(_mm_t(x, w).split(ctx.widths, dim=1))

    @staticmethod
    def backward(ctx, *gs):
        x, w = ctx.saved_tensors
        g = workspace.empty((x.shape[0], w.shape[0]), x.dtype)
        for part, gi in zip(g.split(ctx.widths, dim=1), gs):
            if gi is None:
                part.zero_()
            else:
                part.copy_(gi)
        gx = None
        if ctx.needs_input_grad[0]:
            owed = owed_to(x)
            gx = _mm_t(g, w.t()) if owed is None else owe(owed, x, g, w)
        gw = chunk_gemm.weight_grad(g, x) if any(ctx.needs_input_grad[1:]) else None
        return gx, *(gw.split(ctx.widths) if gw is not None else [None] * len(ctx.widths))


def linear_split(x: torch.Tensor, weights: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``x @ w.T`` for each of ``weights`` (same input width) as one product over the stacked
    weights, so ``x`` is read once; backward stacks the output gradients and takes ``x``'s
    gradient and the weights' as one product each, where separate products would read ``x`` once
    per weight and add their input gradients in another ``N x F`` pass. The outputs are column
    slices of one block (not contiguous)."""
    weights = [cast_like(x, w) for w in weights]
    if _usable(x, *weights) and len(weights) > 1:
        return _LinearSplit.apply(x, *weights)
    return tuple(F.linear(x, w) for w in weights)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` like ``torch.nn.functional.linear``; 2-D float32 CPU inputs take
    this CPU's GEMM path (:func:`~tessera.dense.gemm_path.gemm_path`); a bfloat16 ``x`` takes the
    float32 weight and bias cast to bfloat16."""
    weight, bias = cast_like(x, weight), cast_like(x, bias)
    if _usable(x, weight):
        return _Linear.apply(bias, x, weight)
    return F.linear(x, weight, bias)
