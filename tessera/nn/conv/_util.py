"""Parameter initialisation and the aggregate-the-narrower-side rule shared by the layers."""

from __future__ import annotations

import math

import torch

from tessera import sparse
from tessera.nn.conv.base import LayerHints
from tessera.sparse import LayerSpec, Operand


def glorot_(t: torch.Tensor) -> torch.Tensor:
    """Glorot/Xavier uniform init over the last two dimensions (PyG's ``glorot``)."""
    a = math.sqrt(6.0 / (t.size(-2) + t.size(-1)))
    with torch.no_grad():
        return t.uniform_(-a, a)


def linear_then_aggregate(
    a: Operand,
    x: torch.Tensor,
    lin: torch.nn.Linear,
    reduce: str = "sum",
    hints: LayerHints | None = None,
    aggregate_first: bool | None = None,
) -> torch.Tensor:
    """``A (x W^T)`` or ``(A x) W^T``, whichever aggregates the narrower matrix unless
    ``aggregate_first`` fixes the order (same result; WiseGraph's indexing swap and operation
    placement). ``lin`` must have no bias; callers add it after aggregation. Of the S-SpMM
    ``hints``, the side that aggregates uses its own (see :class:`LayerHints`)."""
    hints = hints or LayerHints()
    if aggregates_output(lin, aggregate_first):
        xw = lin(x)
        if hints.output_mask is not None:
            return sparse.masked_aggregate(a, xw, hints.output_mask, reduce)
        return sparse.aggregate(a, xw, reduce)
    return lin(sparse.aggregate(a, x, reduce, grad_mask=hints.input_grad_mask))


def aggregates_output(lin: torch.nn.Linear, aggregate_first: bool | None = None) -> bool:
    """Whether :func:`linear_then_aggregate` aggregates after the linear map: when the output is
    narrower, unless ``aggregate_first`` fixes the order."""
    return lin.out_features <= lin.in_features if aggregate_first is None else not aggregate_first


def linear_spec(lin: torch.nn.Linear, aggregate_first: bool | None = None) -> LayerSpec:
    """The :class:`LayerSpec` of a layer built on :func:`linear_then_aggregate`."""
    last = aggregates_output(lin, aggregate_first)
    return LayerSpec(
        lin.in_features, lin.out_features, lin.out_features if last else lin.in_features, aggregates_first=not last
    )
