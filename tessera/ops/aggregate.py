"""The aggregation primitive: weighted sum or mean over each vertex's in-edges, with autograd."""

from __future__ import annotations

import torch

from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.ops.registry import AggregationBackend, get_backend

_REDUCES = ("sum", "mean")


def inv_in_degree(graph: Graph, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``1 / in_degree`` per vertex, 0 for vertices without in-edges (PyG's scatter-mean)."""

    def make() -> torch.Tensor:
        d = graph.in_degree().to(dtype)
        return torch.where(d > 0, 1.0 / d.clamp(min=1), torch.zeros_like(d))

    return graph.cached(("inv_deg", dtype), make)


def _scale_rows(t: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return t * s.view(-1, *([1] * (t.dim() - 1)))


def _resolve(name: str, graph: Graph, x: torch.Tensor, weight, reduce: str, direction: str) -> AggregationBackend:
    if name == "auto":
        from tessera.ops.registry import available_backends
        from tessera.ops.select import choose
        from tessera.ops.sparsity import sparse_rows

        # A backward gradient that is zero in most rows (loss on the training vertices only) goes
        # to the csr backend, whose transposed product gathers only the live rows; the measured
        # choice was made on dense inputs.
        if direction == "backward" and "csr" in available_backends() and sparse_rows(x) is not None:
            return get_backend("csr")
        name = choose(graph, x, weight, reduce, direction)
    return get_backend(name)


class _Aggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, graph: Graph, reduce: str, name: str, grad_mask=None):
        out = _resolve(name, graph, x, weight, reduce, "forward").spmm(graph, x, weight)
        if reduce == "mean":
            out = _scale_rows(out, inv_in_degree(graph, out.dtype))
        ctx.graph, ctx.reduce, ctx.name, ctx.grad_mask = graph, reduce, name, grad_mask
        ctx.save_for_backward(x if weight is not None and weight.requires_grad else None, weight)
        return out

    @staticmethod
    def backward(ctx, g):
        x, weight = ctx.saved_tensors
        graph = ctx.graph
        if ctx.reduce == "mean":
            g = _scale_rows(g, inv_in_degree(graph, g.dtype))
        backend = _resolve(ctx.name, graph, g, weight, ctx.reduce, "backward")
        gx = None
        if ctx.needs_input_grad[0] and ctx.grad_mask is not None:
            from tessera.ops.masked import masked_product

            gx = masked_product(backend, graph, g, ctx.grad_mask, weight, None, transposed=True)
        elif ctx.needs_input_grad[0]:
            gx = backend.spmm_t(graph, g, weight)
        gw = None
        if ctx.needs_input_grad[1]:
            gw = backend.sddmm_dot(graph, g, x)
        return gx, gw, None, None, None, None


def aggregate(
    graph: Graph,
    x: torch.Tensor,
    reduce: str = "sum",
    weight: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    grad_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``out[i] = reduce_{e=(j->i)} w_e * x[j]`` over in-edges; ``x`` is ``(N, F)`` or ``(N, H, F)``,
    ``weight`` ``(E,)`` or ``(E, H)`` in CSR order; mean divides by the in-edge count.

    ``grad_mask`` (bool, ``x``'s shape) makes the backward an S-SpMM: only the entries of ``x``'s
    gradient that the mask keeps are computed, the rest are zero. Pass it when an element-wise
    op whose backward zeroes those entries anyway produced ``x`` (ReLU then dropout: ``x != 0``)."""
    if reduce not in _REDUCES:
        raise ConfigError(f"unknown reduce {reduce!r}; choose from {', '.join(_REDUCES)}")
    if hasattr(graph, "distributed_aggregate"):  # a rank's view of a partitioned graph
        return graph.distributed_aggregate(x, reduce, weight, backend)  # (grad_mask: the full product)
    if x.shape[0] != graph.num_cols:
        raise ValueError(f"x has {x.shape[0]} rows but the graph has {graph.num_cols} source vertices")
    if weight is not None and weight.shape[0] != graph.num_edges:
        raise ValueError(f"weight has {weight.shape[0]} entries but the graph has {graph.num_edges} edges")
    if backend != "auto":
        get_backend(backend)  # unknown names fail here, before any work
    if grad_mask is not None and (grad_mask.shape != x.shape or grad_mask.dtype != torch.bool):
        raise ValueError(
            f"grad_mask must be bool with x's shape {tuple(x.shape)}, got {grad_mask.dtype} {tuple(grad_mask.shape)}"
        )
    return _Aggregate.apply(x, weight, graph, reduce, backend, grad_mask)
