"""The aggregation primitive: weighted sum or mean over each vertex's in-edges, with autograd."""

from __future__ import annotations

import torch

from tessera import workspace
from tessera.errors import ConfigError
from tessera.graph.csr import CSRStructure
from tessera.memo import PlanCache
from tessera.sparse.operand import Operand, as_operand
from tessera.sparse.rows import add_rows_

REDUCES = ("sum", "mean")
_inv_degree = PlanCache()


def inv_in_degree(
    operand: Operand | CSRStructure, dtype: torch.dtype = torch.float32, device: torch.device | None = None
) -> torch.Tensor:
    """``1 / in_degree`` per output row, 0 for rows without in-edges (PyG's scatter-mean), on
    ``device`` (default: the degrees' own, the host's), made there once."""
    a = as_operand(operand)
    degree = a.in_degree()
    where = degree.device if device is None else torch.device(device)

    def make() -> torch.Tensor:
        d = degree.to(dtype)
        return torch.where(d > 0, 1.0 / d.clamp(min=1), torch.zeros_like(d)).to(where)

    # keyed by the degree tensor, which every variant of one operand shares
    return _inv_degree.get(degree, (dtype, where), make)


def scale_rows(t: torch.Tensor, s: torch.Tensor | None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``t`` with row ``i`` multiplied by ``s[i]``, into ``out`` when given (which may be ``t``);
    ``t`` unchanged when ``s`` is None."""
    return t if s is None else torch.mul(t, s.view(-1, *([1] * (t.dim() - 1))), out=out)


def check_reduce(reduce: str) -> None:
    """Raise :class:`ConfigError` unless ``reduce`` is ``sum`` or ``mean``."""
    if reduce not in REDUCES:
        raise ConfigError(f"unknown reduce {reduce!r}; choose from {', '.join(REDUCES)}")


def keep_of(mask: torch.Tensor) -> torch.Tensor:
    """A bool or integer mask as bool (non-zero keeps)."""
    return mask if mask.dtype == torch.bool else mask != 0


class AggregateFn(torch.autograd.Function):
    """``(diag(row_scale) A x) ⊙ out_mask + self_weight x`` with autograd, ``A`` the operand's
    values or ``weight``.

    ``out_mask`` (S-SpMM) computes only the outputs it keeps; ``grad_mask`` computes only the
    entries of ``x``'s gradient it keeps. Either may be None. ``self_weight`` (a float, 0 for
    none; not with ``out_mask``) is added in place in both directions: GIN's root term then
    costs no N x F tensor and no gradient sum."""

    @staticmethod
    def forward(ctx, x, weight, a: Operand, row_scale, out_mask, grad_mask, self_weight=0.0):
        if out_mask is None:
            product = a.spmm(x, weight)
            out = scale_rows(product, row_scale, out=product)  # in place on the fresh product
        else:
            out = a.masked_spmm(x, out_mask, weight, row_scale, False)
        own = a.row_vertices
        if self_weight:
            if own is None:
                out.add_(x, alpha=self_weight)
            else:
                add_rows_(out, x, own, self_weight)
        ctx.a, ctx.row_scale, ctx.out_mask, ctx.grad_mask = a, row_scale, out_mask, grad_mask
        ctx.self_weight = self_weight
        ctx.save_for_backward(x if weight is not None and weight.requires_grad else None, weight)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        a = ctx.a
        g_out = g
        if ctx.out_mask is not None:
            g = torch.where(keep_of(ctx.out_mask), g, 0.0)
        if ctx.row_scale is not None:  # into a kept block: g itself may be read by other nodes
            g = scale_rows(g, ctx.row_scale, out=workspace.empty_like(g))
        gx = None
        if ctx.needs_input_grad[0] and ctx.grad_mask is not None:
            gx = a.masked_spmm(g, ctx.grad_mask, weight, None, True)
        elif ctx.needs_input_grad[0]:
            gx = a.spmm_t(g, weight)
        if gx is not None and ctx.self_weight:
            own = a.row_vertices
            if own is None:
                gx.add_(g_out, alpha=ctx.self_weight)
            else:  # distinct rows: each adds into its own vertex's row
                gx.index_add_(0, own, g_out, alpha=ctx.self_weight)
        gw = a.sddmm_dot(g, x) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None, None, None


def aggregate(
    operand: Operand | CSRStructure,
    x: torch.Tensor,
    reduce: str = "sum",
    weight: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    grad_mask: torch.Tensor | None = None,
    self_weight: float = 0.0,
) -> torch.Tensor:
    """``out[i] = reduce_{e=(j->i)} v_e * x[j]`` over in-edges; ``x`` is ``(N, F)`` or ``(N, H, F)``.

    ``v`` is ``weight`` (``(E,)`` or ``(E, H)`` in CSR order) when given, else the operand's values;
    a :class:`~tessera.graph.Graph` or CSR matrix counts as its unweighted single-process operand on
    ``backend``. Mean divides by the in-edge count.

    ``grad_mask`` (bool, ``x``'s shape) makes the backward an S-SpMM: only the entries of ``x``'s
    gradient that the mask keeps are computed, the rest are zero. Pass it when an element-wise
    op whose backward zeroes those entries anyway produced ``x`` (ReLU then dropout: ``x != 0``).

    ``self_weight`` adds ``self_weight * x`` (GIN's ``(1 + eps) x``): each output row's own
    vertex's input row (the operand's :attr:`~tessera.sparse.Operand.row_vertices`, else the row
    of the same position, which needs as many output rows as input rows)."""
    check_reduce(reduce)
    a = as_operand(operand, backend)
    if x.dim() not in (2, 3):
        raise ValueError(
            f"x must be (N, F) or (N, H, F), got shape {tuple(x.shape)}: a vector of one value per vertex is "
            "x.unsqueeze(1)"
        )
    if x.shape[0] != a.num_cols:
        raise ValueError(f"x has {x.shape[0]} rows but the operand has {a.num_cols} source vertices")
    if weight is not None:
        edges = a.edge_structure().num_edges
        if weight.shape[0] != edges:
            raise ValueError(f"weight has {weight.shape[0]} entries but the graph has {edges} edges")
    if grad_mask is not None and (grad_mask.shape != x.shape or grad_mask.dtype != torch.bool):
        raise ValueError(
            f"grad_mask must be bool with x's shape {tuple(x.shape)}, got {grad_mask.dtype} {tuple(grad_mask.shape)}"
        )
    if self_weight and a.row_vertices is None and a.num_rows != a.num_cols:
        raise ValueError(f"self_weight needs as many output rows as input rows, got {a.num_rows} and {a.num_cols}")
    row_scale = inv_in_degree(a, x.dtype, x.device) if reduce == "mean" else None
    return AggregateFn.apply(x, weight, a, row_scale, None, grad_mask, float(self_weight))
