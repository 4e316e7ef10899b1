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

import numba
import numpy as np
import torch

from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.ops.aggregate import inv_in_degree
from tessera.ops.dropout import _BLOCK, _element_hash, block_key, keep_threshold
from tessera.ops.registry import get_backend
from tessera.ops.threads import sync_numba_threads

_REDUCES = ("sum", "mean")


def _backend(name: str):
    return get_backend("csr" if name == "auto" else name)


def _scale_rows(t: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    return t if s is None else t * s.view(-1, *([1] * (t.dim() - 1)))


def _row_scale(graph: Graph, reduce: str, scale: float, dtype: torch.dtype) -> torch.Tensor | None:
    if reduce == "mean":
        s = inv_in_degree(graph, dtype)
        return s if scale == 1.0 else s * scale
    if scale != 1.0:
        return torch.full((graph.num_rows,), float(scale), dtype=dtype)
    return None


def _keep(mask: torch.Tensor) -> torch.Tensor:
    return mask if mask.dtype == torch.bool else mask != 0


def masked_product(backend, graph, x, mask, weight, row_scale, transposed: bool) -> torch.Tensor:
    """``(diag(row_scale) A x) ⊙ mask`` (``A^T`` when ``transposed``) on ``backend``."""
    fused = getattr(backend, "masked_spmm", None)
    if fused is not None and x.dim() == 2:
        return fused(graph, x, mask, weight, row_scale, transposed)
    if x.dim() == 3 and fused is not None and (weight is None or weight.dim() == 1):
        n, h, f = x.shape
        flat = fused(graph, x.reshape(n, h * f), mask.reshape(mask.shape[0], h * f), weight, row_scale, transposed)
        return flat.view(-1, h, f)
    out = backend.spmm_t(graph, x, weight) if transposed else backend.spmm(graph, x, weight)
    return _scale_rows(out, row_scale) * _keep(mask)


class _MaskedAggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, graph: Graph, mask, row_scale, backend_name: str):
        backend = _backend(backend_name)
        out = masked_product(backend, graph, x, mask, weight, row_scale, False)
        ctx.graph, ctx.mask, ctx.row_scale, ctx.backend = graph, mask, row_scale, backend
        ctx.save_for_backward(x if weight is not None and weight.requires_grad else None, weight)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        gm = _scale_rows(torch.where(_keep(ctx.mask), g, 0.0), ctx.row_scale)
        gx = ctx.backend.spmm_t(ctx.graph, gm, weight) if ctx.needs_input_grad[0] else None
        gw = ctx.backend.sddmm_dot(ctx.graph, gm, x) if ctx.needs_input_grad[1] else None
        return gx, gw, None, None, None, None


class _MaskedSpmmT(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, weight, graph: Graph, mask, backend_name: str):
        backend = _backend(backend_name)
        out = masked_product(backend, graph, g, mask, weight, None, True)
        ctx.graph, ctx.mask, ctx.backend = graph, mask, backend
        ctx.save_for_backward(g if weight is not None and weight.requires_grad else None, weight)
        return out

    @staticmethod
    def backward(ctx, go):
        g, weight = ctx.saved_tensors
        gm = torch.where(_keep(ctx.mask), go, 0.0)
        gg = ctx.backend.spmm(ctx.graph, gm, weight) if ctx.needs_input_grad[0] else None
        # out[j] = sum_{e=(j->i)} w_e g[i]  =>  d/dw_e = <gm[j], g[i]>
        gw = ctx.backend.sddmm_dot(ctx.graph, g, gm) if ctx.needs_input_grad[1] else None
        return gg, gw, None, None, None


def _check(graph: Graph, x: torch.Tensor, mask: torch.Tensor, weight, rows: int, cols: int) -> None:
    if x.shape[0] != cols:
        raise ValueError(f"input has {x.shape[0]} rows but the product needs {cols}")
    if tuple(mask.shape) != (rows, *x.shape[1:]):
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected {(rows, *x.shape[1:])}")
    if mask.dtype.is_floating_point or mask.dtype.is_complex:
        raise ValueError(f"mask must be bool or an integer type, got {mask.dtype}")
    if weight is not None and weight.shape[0] != graph.num_edges:
        raise ValueError(f"weight has {weight.shape[0]} entries but the graph has {graph.num_edges} edges")


def masked_aggregate(
    graph: Graph,
    x: torch.Tensor,
    mask: torch.Tensor,
    reduce: str = "sum",
    weight: torch.Tensor | None = None,
    scale: float = 1.0,
    backend: str = "csr",
) -> torch.Tensor:
    """``scale * aggregate(graph, x, reduce, weight) ⊙ mask``, computing only what ``mask``
    (bool or uint8, the output's shape) keeps; entries it drops are exactly zero."""
    if reduce not in _REDUCES:
        raise ConfigError(f"unknown reduce {reduce!r}; choose from {', '.join(_REDUCES)}")
    _check(graph, x, mask, weight, graph.num_rows, graph.num_cols)
    row_scale = _row_scale(graph, reduce, scale, x.dtype)
    return _MaskedAggregate.apply(x, weight, graph, mask.detach(), row_scale, backend)


@numba.njit(parallel=True, cache=True, nogil=True)
def _keep_kernel(out, seed_lo, seed_hi, threshold):
    # the mask of tessera.ops.dropout._masked_scale, element for element
    n = out.size
    nblocks = (n + _BLOCK - 1) // _BLOCK
    for b in numba.prange(nblocks):
        start = b * _BLOCK
        stop = min(n, start + _BLOCK)
        key = block_key(seed_lo, seed_hi, start)
        o = out[start:stop]
        for i in range(stop - start):
            o[i] = _element_hash(start + i, key) >= threshold


def dropout_mask(shape: tuple[int, ...], p: float) -> torch.Tensor:
    """The keep mask (bool) that :func:`tessera.ops.dropout.dropout` would draw for a tensor of
    ``shape`` with drop probability ``p`` (the seed comes from torch's generator, so
    ``torch.manual_seed`` governs it and it does not depend on the thread count)."""
    sync_numba_threads()
    seed = int(torch.randint(0, 2**63 - 1, (1,), dtype=torch.int64).item())
    out = torch.empty(shape, dtype=torch.bool)
    threshold = keep_threshold(p)
    if threshold is None:
        return out.fill_(False)
    _keep_kernel(out.view(-1).numpy(), np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32), threshold)
    return out


def dropout_aggregate(
    graph: Graph,
    x: torch.Tensor,
    p: float = 0.5,
    reduce: str = "sum",
    weight: torch.Tensor | None = None,
    training: bool = True,
    backend: str = "csr",
) -> torch.Tensor:
    """``dropout(aggregate(graph, x, reduce, weight), p)`` as one S-SpMM: dropped outputs are
    never computed, kept ones are scaled by ``1 / (1 - p)``. With ``reduce="sum"`` the result is
    bitwise the same as ``dropout(aggregate(graph, x, "sum", weight, "csr"), p)`` from the same
    torch generator state (the same mask, the same roundings)."""
    if not training or p == 0.0:
        from tessera.ops.aggregate import aggregate

        return aggregate(graph, x, reduce, weight, backend)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout probability must be in [0, 1), got {p}")
    keep = dropout_mask((graph.num_rows, *x.shape[1:]), p)
    return masked_aggregate(graph, x, keep, reduce, weight, 1.0 / (1.0 - p), backend)


def masked_spmm_t(
    graph: Graph,
    g: torch.Tensor,
    mask: torch.Tensor,
    weight: torch.Tensor | None = None,
    backend: str = "csr",
) -> torch.Tensor:
    """``(A^T g) ⊙ mask`` over the transposed CSR: ``out[j] = sum_{e=(j->i)} w_e g[i]`` where
    ``mask[j]`` keeps, zero elsewhere. This is the backward aggregation of ``(A h) W`` followed by
    a ReLU whose mask is ``mask``: only the entries the ReLU lets through are computed."""
    _check(graph, g, mask, weight, graph.num_cols, graph.num_rows)
    return _MaskedSpmmT.apply(g, weight, graph, mask.detach(), backend)
