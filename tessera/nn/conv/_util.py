"""Parameter initialisation and the aggregate-the-narrower-side rule shared by the layers."""

from __future__ import annotations

import math

import torch

from tessera import ops
from tessera.graph import Graph


def glorot_(t: torch.Tensor) -> torch.Tensor:
    """Glorot/Xavier uniform init over the last two dimensions (PyG's ``glorot``)."""
    a = math.sqrt(6.0 / (t.size(-2) + t.size(-1)))
    with torch.no_grad():
        return t.uniform_(-a, a)


def linear_then_aggregate(
    graph: Graph,
    x: torch.Tensor,
    lin: torch.nn.Linear,
    reduce: str = "sum",
    weight: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    input_grad_mask: torch.Tensor | None = None,
    output_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``A (x W^T)`` or ``(A x) W^T``, whichever aggregates the narrower matrix (same result;
    WiseGraph's indexing swap). ``lin`` must have no bias; callers add it after aggregation.

    S-SpMM hints (MixGCN §3.2.1), used by the side that aggregates: ``output_mask`` when the
    aggregation comes last (only kept outputs are computed, dropped ones are zero: the caller
    applies that dropout mask after this layer), ``input_grad_mask`` when it comes first (only the
    kept entries of ``x``'s gradient are computed)."""
    if aggregates_output(lin):
        xw = lin(x)
        if output_mask is not None:
            return ops.masked_aggregate(graph, xw, output_mask, reduce, weight, backend=backend)
        return ops.aggregate(graph, xw, reduce, weight, backend)
    return lin(ops.aggregate(graph, x, reduce, weight, backend, grad_mask=input_grad_mask))


def aggregates_output(lin: torch.nn.Linear) -> bool:
    """Whether :func:`linear_then_aggregate` aggregates after the linear map (the output is narrower)."""
    return lin.out_features <= lin.in_features
