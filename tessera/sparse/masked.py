"""S-SpMM (MixGCN §3.2.1): aggregation that computes only the output entries a mask keeps.

``Z = (A X) ⊙ M``: in training the mask comes from dropout right after an aggregation
(forward) or from a ReLU's mask right after a backward aggregation. The csr backend's masked
kernel checks the mask per row in 16-float (one cache line) tiles and gathers and sums only the
tiles that keep something; a row that keeps nothing costs nothing, and the masking multiply and
its extra pass over the output are fused away. Masks with structure at that granularity (dropped
vertices, a ReLU that is dead for a whole row, rows outside the training set) save the memory
traffic as well; an element-wise Bernoulli mask with keep probability ``p`` leaves almost every
tile live (``1 - (1 - p) ** 16``), so there the saving is the fused pass, not the gather.

* :func:`masked_aggregate` — ``(reduce_A x) ⊙ M`` with autograd: ``dx = A^T (g ⊙ M)``.
* :func:`dropout_aggregate` — ``dropout(aggregate(x))`` in one masked product.
* :func:`masked_spmm_t` — ``(A^T g) ⊙ M`` (the ReLU-mask backward case) with autograd:
  ``dg = A (g_out ⊙ M)``.
"""

from __future__ import annotations

import torch

from tessera.graph.csr import CSRStructure
from tessera.kernels.dropout import dropout_mask
from tessera.sparse.aggregate import AggregateFn, aggregate, check_reduce, inv_in_degree, keep_of
from tessera.sparse.operand import Operand, as_operand


def _row_scale(a: Operand, reduce: str, scale: float, x: torch.Tensor) -> torch.Tensor | None:
    if reduce == "mean":
        s = inv_in_degree(a, x.dtype, x.device)
        return s if scale == 1.0 else s * scale
    if scale != 1.0:
        return torch.full((a.num_rows,), float(scale), dtype=x.dtype, device=x.device)
    return None


class _MaskedSpmmT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, weight, a: Operand, mask):
        out = a.masked_spmm(g, mask, weight, None, True)
        ctx.a, ctx.mask = a, mask
        ctx.save_for_backward(g if weight is not None and weight.requires_grad else None, weight)
        return out

    @staticmethod
    def backward(ctx, go):
        g, weight = ctx.saved_tensors
        gm = torch.where(keep_of(ctx.mask), go, 0.0)
        gg = ctx.a.spmm(gm, weight) if ctx.needs_input_grad[0] else None
        # out[j] = sum_{e=(j->i)} w_e g[i]  =>  d/dw_e = <gm[j], g[i]>
        gw = ctx.a.sddmm_dot(g, gm) if ctx.needs_input_grad[1] else None
        return gg, gw, None, None


def _check(a: Operand, x: torch.Tensor, mask: torch.Tensor, weight, rows: int, cols: int) -> None:
    if x.shape[0] != cols:
        raise ValueError(f"input has {x.shape[0]} rows but the product needs {cols}")
    if tuple(mask.shape) != (rows, *x.shape[1:]):
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {(rows, *x.shape[1:])}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise ValueError(f"mask must be bool or an integer type, got {mask.dtype}")
    if weight is not None and weight.shape[0] != a.edge_structure().num_edges:
        raise ValueError(f"weight has {weight.shape[0]} entries but the graph has {a.edge_structure().num_edges} edges")


def masked_aggregate(
    operand: Operand | CSRStructure,
    x: torch.Tensor,
    mask: torch.Tensor,
    reduce: str = "sum",
    weight: torch.Tensor | None = None,
    scale: float = 1.0,
    backend: str = "auto",
) -> torch.Tensor:
    """``scale * aggregate(operand, x, reduce, weight) ⊙ mask``, computing only what ``mask``
    (bool or uint8, the output's shape) keeps; entries it drops are exactly zero."""
    check_reduce(reduce)
    a = as_operand(operand, backend)
    _check(a, x, mask, weight, a.num_rows, a.num_cols)
    row_scale = _row_scale(a, reduce, scale, x)
    return AggregateFn.apply(x, weight, a, row_scale, mask.detach(), None)


def dropout_aggregate(
    operand: Operand | CSRStructure,
    x: torch.Tensor,
    p: float = 0.5,
    reduce: str = "sum",
    weight: torch.Tensor | None = None,
    training: bool = True,
    backend: str = "auto",
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``dropout(aggregate(graph, x, reduce, weight), p, rows=rows)`` as one S-SpMM: dropped outputs are
    never computed, kept ones are scaled by ``1 / (1 - p)``. With ``reduce="sum"`` the result is
    bitwise the same as ``dropout(aggregate(graph, x, "sum", weight, "csr"), p)`` from the same
    torch generator state (the same mask, the same roundings)."""
    a = as_operand(operand, backend)
    if not training or p == 0.0:
        return aggregate(a, x, reduce, weight)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    keep = dropout_mask((a.num_rows, *x.shape[1:]), p, rows, x.device)
    return masked_aggregate(a, x, keep, reduce, weight, 1.0 / (1.0 - p))


def masked_spmm_t(
    operand: Operand | CSRStructure,
    g: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``(A^T g) ⊙ mask`` over the transposed CSR: ``out[j] = sum_{e=(j->i)} w_e g[i]`` where
    ``mask[j]`` keeps, zero elsewhere. This is the backward aggregation of ``(A h) W`` followed by
    a ReLU whose mask is ``mask``: only the entries the ReLU lets through are computed."""
    a = as_operand(operand, backend)
    _check(a, g, mask, weight, a.num_cols, a.num_rows)
    return _MaskedSpmmT.apply(g, weight, a, mask.detach())
