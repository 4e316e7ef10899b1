"""``dropout(act(x))`` in one pass: the activation and the dropout after it as one autograd node,
drawing the mask :func:`tessera.kernels.dropout.dropout` draws, with its backward able to form
the next layer's owed input-gradient products a chunk of rows at a time."""

from __future__ import annotations

import torch

from tessera import workspace
from tessera.dense.deferred import Owed, accept, owed_rows, prepared
from tessera.kernels.dropout import (
    ACT_MODES,
    ACTIVATIONS,
    HASHED_DTYPES,
    draw_seed,
    dropout,
    keep_threshold,
    run_hashed,
)
from tessera.kernels.placement import host_kernels

# Rows per chunk of a backward that forms owed products: a few megabytes of them, kept in cache
# between the product and the activation's gradient (the size tessera.dense.linear_act measured best)
OWED_CHUNK_BYTES = 4 << 20


class _ActDropout(torch.autograd.Function):
    """``dropout(act(x))`` in one pass over ``x`` into a workspace block, saving only the output:
    its backward reads the activation's derivative off the output and recomputes the mask. With
    an :class:`~tessera.dense.deferred.Owed` record, the next layer's linear map leaves its
    input-gradient product to this backward, which forms it a chunk of rows at a time."""

    @staticmethod
    def forward(ctx, x, act, p, seed, rows, owed):
        x = x.contiguous()
        out = workspace.empty_like(x)
        forward_mode, ctx.grad_mode = ACT_MODES[act]
        run_hashed(x, out, seed, p, rows, forward_mode)
        ctx.p, ctx.seed, ctx.rows, ctx.owed = p, seed, rows, owed
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx, g):
        (y,) = ctx.saved_tensors
        terms, g = ctx.owed.take(g) if ctx.owed is not None else ([], g)
        g = None if g is None else g.contiguous()
        gx = workspace.empty(y.shape, y.dtype if g is None else g.dtype)
        if not terms:
            run_hashed(g, gx, ctx.seed, ctx.p, ctx.rows, ctx.grad_mode, aux=y)
            return gx, None, None, None, None, None
        # the owed rows of g W formed in cache and consumed there: no N x F block of them
        n, width = y.shape
        terms = prepared(terms, gx.dtype)
        step = workspace.chunk_rows(width, gx.element_size(), n, OWED_CHUNK_BYTES)
        buf = torch.empty((step, width), dtype=gx.dtype)
        ids = ctx.rows if ctx.rows is not None else torch.arange(n, dtype=torch.int64)
        for r0 in range(0, n, step):
            r1 = min(n, r0 + step)
            src = owed_rows(buf[: r1 - r0], terms, r0, r1, None if g is None else g[r0:r1])
            run_hashed(src, gx[r0:r1], ctx.seed, ctx.p, ids[r0:r1], ctx.grad_mode, aux=y[r0:r1])
        return gx, None, None, None, None, None


def act_dropout(
    x: torch.Tensor,
    act: str,
    p: float = 0.5,
    training: bool = True,
    rows: torch.Tensor | None = None,
    takes_owed: bool = False,
) -> torch.Tensor:
    """``dropout(act(x), p)`` for ``act`` in :data:`ACTIVATIONS` (ELU with alpha 1), in one pass,
    drawing the mask :func:`dropout` would draw (same seed draw, same ``rows`` keying).
    ``takes_owed``: the output's readers may leave their input-gradient products to this node
    (:mod:`tessera.dense.deferred`), only where nothing asks for the output's own gradient."""
    if act not in ACT_MODES:
        raise ValueError(f"unknown activation {act!r}; choose from {', '.join(ACTIVATIONS)}")
    p = p if training else 0.0
    if not 0.0 <= p < 1.0 or keep_threshold(p) is None or not host_kernels(x) or x.dtype not in HASHED_DTYPES:
        y = torch.relu(x) if act == "relu" else torch.nn.functional.elu(x)
        return dropout(y, p, training, rows)
    # p == 0 keeps every element (threshold 0) and draws no seed, as dropout() draws none then
    seed = draw_seed() if p > 0.0 else 0
    # owed products are formed by rows of a matrix: a 2-D output only
    owed = Owed() if takes_owed and torch.is_grad_enabled() and x.dim() == 2 else None
    y = _ActDropout.apply(x, act, p, seed, rows, owed)
    return y if owed is None else accept(y, owed)
