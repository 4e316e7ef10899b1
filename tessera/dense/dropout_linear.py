"""``dropout(x) @ W^T + b`` as one autograd node that never holds ``dropout(x)`` whole.

A layer whose first op is a linear map of its dropped-out input (GAT's projection) would keep the
dropped-out ``N x F`` block from the forward to the end of the backward, for the weight gradient.
Here the forward drops a few megabytes of rows at a time into a small buffer, in cache, and
multiplies them there; the backward draws the same mask again from the seed (the hashed dropout
is a function of seed and element index) and forms the weight gradient the same way. Only ``x``
itself is kept: a model's input features, which stay in memory anyway (on an arxiv-sized graph the
dropped-out copy is 169 k x 128 float32, 83 MB; docs/design/fused-layers.md).

The values are those of ``linear(dropout(x, p, rows=rows), W, b)`` with the same seed, up to the
products' rounding: the products run over row chunks, so the weight gradient is a sum of chunk
products. ``x`` must not need a gradient (the input gradient is not formed).
"""

from __future__ import annotations

import torch

from tessera import workspace
from tessera.dense import chunk_gemm
from tessera.dense.linear import linear
from tessera.dense.sparse_features import feature_nonzeros, sparse_dropout_linear
from tessera.kernels.dropout import DROP, draw_seed, dropout, keep_threshold, run_hashed
from tessera.kernels.placement import host_kernels

CHUNK_BYTES = 4 << 20


def _dropped_rows(x: torch.Tensor, seed: int, p: float, rows: torch.Tensor | None):
    """Yield ``(r0, r1, rows r0:r1 of dropout(x))`` in chunks of about ``CHUNK_BYTES``, each written
    into the same small buffer (valid until the next chunk)."""
    n, k = x.shape
    step = workspace.chunk_rows(k, x.element_size(), n, CHUNK_BYTES)
    buf = torch.empty((step, k), dtype=x.dtype)
    ids = rows if rows is not None else torch.arange(n, dtype=torch.int64)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        d = buf[: r1 - r0]
        run_hashed(x[r0:r1], d, seed, p, ids[r0:r1], DROP)
        yield r0, r1, d


class _DropoutLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias, x, weight, p, seed, rows):
        x, weight = x.contiguous(), weight.contiguous()
        out = workspace.empty((x.shape[0], weight.shape[0]), x.dtype)
        for r0, r1, d in _dropped_rows(x, seed, p, rows):
            chunk_gemm.product(out[r0:r1], d, weight, bias)
        ctx.p, ctx.seed, ctx.rows = p, seed, rows
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        g = g.contiguous()
        gw = gb = None
        if ctx.needs_input_grad[2]:
            # the same mask drawn again from the seed, chunk by chunk
            gw = torch.zeros_like(weight)
            for r0, r1, d in _dropped_rows(x, ctx.seed, ctx.p, ctx.rows):
                chunk_gemm.add_weight_grad_(gw, g[r0:r1], d)
        if ctx.needs_input_grad[0]:
            gb = g.sum(0)
        return gb, None, gw, None, None, None


def dropout_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    p: float,
    training: bool = True,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``linear(dropout(x, p, training, rows), weight, bias)``: the same random draw and values,
    without a dropped-out copy of ``x`` (fused where ``x`` is a float32 CPU matrix that needs no
    gradient, over its non-zeros only where it is mostly zeros, else composed)."""
    sr = feature_nonzeros(x)
    p_drop = p if training else 0.0
    plain = weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
    if sr is not None and plain and 0.0 <= p_drop < 1.0 and keep_threshold(p_drop) is not None:
        return sparse_dropout_linear(sr, weight, bias, p_drop, None if rows is None else rows.to(torch.int64))
    fused = (
        training
        and 0.0 < p < 1.0
        and keep_threshold(p) is not None
        and not x.requires_grad
        and host_kernels(x)
        and x.dim() == 2
        and x.dtype == weight.dtype == torch.float32
        and (bias is None or bias.dtype == torch.float32)
    )
    if not fused:
        return linear(dropout(x, p, training, rows), weight, bias)
    if rows is not None and rows.numel() != x.shape[0]:
        raise ValueError(f"rows has {rows.numel()} ids for {x.shape[0]} rows")
    seed = draw_seed()  # where dropout would draw it: the same mask from the same generator state
    return _DropoutLinear.apply(bias, x, weight, p, seed, None if rows is None else rows.to(torch.int64))
