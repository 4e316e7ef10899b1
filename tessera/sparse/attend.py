"""GAT's message passing as one autograd node: attention softmax, attention dropout and the
weighted aggregation.

As three nodes (``gat_attention``, ``dropout``, ``aggregate``) a layer keeps ``alpha`` and the
dropped ``alpha`` for the whole forward and backward, and its backward holds three E x heads
tensors at once (``alpha``, its gradient and the score gradient; the aggregation's backward also
permuted a copy of the weights). One node frees the dropped weights as soon as the input
gradient is computed, applies dropout's backward to the weight gradient in place and writes the
score gradient over it: at most two E x heads tensors live at any time (on a products-sized
graph with 8 heads each is 748 MiB).
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from tessera.bfloat16 import compute_dtype
from tessera.graph.csr import CSRStructure
from tessera.kernels.dropout import DROP_IN_PLACE, draw_seed, dropout, keep_threshold, run_hashed, seeded_dropout
from tessera.kernels.placement import host_kernels
from tessera.sparse.aggregate import aggregate
from tessera.sparse.attention_kernels import check_terms, gat_attention, gat_attention_backward, gat_attention_forward
from tessera.sparse.operand import Operand
from tessera.sparse.saving import recomputed


class _Attend(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_src, a_dst, h, a: Operand, edges: CSRStructure, slope: float, drop):
        alpha = gat_attention_forward(edges, a_src, a_dst, slope)
        w = alpha if drop is None else seeded_dropout(alpha, *drop)
        out = a.spmm(h, w)
        ctx.a, ctx.edges, ctx.slope, ctx.drop = a, edges, slope, drop
        # the dropped weights as an attribute, not a saved tensor, so backward can free them early;
        # none in a recomputed step (lean), whose backward draws them again from alpha
        ctx.dropped = None if drop is None or recomputed() else w
        ctx.save_for_backward(a_src, a_dst, h, alpha)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        a_src, a_dst, h, alpha = ctx.saved_tensors
        w = alpha if ctx.drop is None else ctx.dropped
        if w is None:  # a second backward through the graph (retain_graph): made again
            w = seeded_dropout(alpha, *ctx.drop)
        ctx.dropped = None
        need_src, need_dst, need_h = ctx.needs_input_grad[:3]
        gh = ctx.a.spmm_t(g, w) if need_h else None
        del w
        if not (need_src or need_dst):
            return None, None, gh, None, None, None, None
        grad = ctx.a.sddmm_dot(g, h)  # a new tensor that only this node sees: updated in place
        if ctx.drop is not None:
            seed, p, ids = ctx.drop
            run_hashed(grad, grad, seed, p, ids, DROP_IN_PLACE)
        gsrc, gdst = gat_attention_backward(
            ctx.edges, a_src, a_dst, alpha, grad, ctx.slope, need_src, overwrite_grad=True
        )
        return gsrc, (gdst if need_dst else None), gh, None, None, None, None


def attend(
    operand: Operand,
    edges: CSRStructure,
    a_src: torch.Tensor,
    a_dst: torch.Tensor,
    h: torch.Tensor,
    negative_slope: float = 0.2,
    p: float = 0.0,
    ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """``aggregate(operand, h, "sum", dropout(gat_attention(edges, a_src, a_dst), p, rows=ids))``
    as one node: the same values, gradients and random draw, with fewer E x heads tensors kept.

    ``edges`` is the operand's :meth:`~Operand.edge_structure`, ``a_src``/``a_dst`` ``(N, H)``
    terms over its columns and rows, ``h`` ``(N, H, F)`` the sources' features, ``ids`` the
    per-edge dropout keys (:func:`~tessera.sparse.edge_keys`); ``p`` 0 for no dropout. With
    bfloat16 ``h`` the terms are float32, as are the attention weights and their gradients."""
    check_terms(edges, a_src, a_dst)
    if h.shape[0] != operand.num_cols:
        raise ValueError(f"h has {h.shape[0]} rows but the operand has {operand.num_cols} source vertices")
    fused = (
        a_src.dim() == 2
        and host_kernels(a_src)
        # bfloat16 features take float32 attention (weights, scores and their gradients)
        and a_src.dtype == a_dst.dtype == compute_dtype(h.dtype)
        and h.dtype in (torch.float32, torch.float64, torch.bfloat16)
        and (p == 0.0 or (0.0 < p < 1.0 and keep_threshold(p) is not None))
    )
    if not fused:
        alpha = gat_attention(edges, a_src, a_dst, negative_slope)
        return aggregate(operand, h, "sum", dropout(alpha, p, True, ids) if p else alpha)
    # the seed drawn where dropout() would draw it, so the masks are the composition's
    drop = (draw_seed(), float(p), ids) if p else None  # seeded_dropout's arguments
    return _Attend.apply(a_src.contiguous(), a_dst.contiguous(), h, operand, edges, float(negative_slope), drop)
