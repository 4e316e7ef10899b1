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
) -> torch.Tensor:
    """``A (x W^T)`` or ``(A x) W^T``, whichever aggregates the narrower matrix (same result;
    WiseGraph's indexing swap). ``lin`` must have no bias; callers add it after aggregation."""
    if lin.out_features <= lin.in_features:
        return ops.aggregate(graph, lin(x), reduce, weight, backend)
    return lin(ops.aggregate(graph, x, reduce, weight, backend))
