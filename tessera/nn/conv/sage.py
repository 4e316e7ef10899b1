"""GraphSAGE convolution with PyG ``SAGEConv`` semantics (mean aggregation, root weight)."""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from tessera import dense, sparse
from tessera.nn.conv._util import (
    InputAggregate,
    add_bias_,
    aggregates_output,
    finish,
    input_aggregate,
    linear_fusion,
    linear_spec,
    linear_then_aggregate,
    target_aggregate,
)
from tessera.nn.conv.base import Fusion, GraphConv, LayerHints
from tessera.nn.linear import Linear
from tessera.sparse import GraphOperand, LayerSpec, as_operand
from tessera.sparse.rows import take_rows


class SAGEConv(GraphConv):
    """``x'_i = W_l * reduce_{j in N(i)} x_j + b + W_r x_i`` (PyG ``SAGEConv``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        aggr: str = "mean",
        normalize: bool = False,
        root_weight: bool = True,
        bias: bool = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.aggr, self.normalize, self.root_weight, self.backend = aggr, normalize, root_weight, backend
        self.lin_l = Linear(in_channels, out_channels, bias=bias)
        self.lin_r = Linear(in_channels, out_channels, bias=False) if root_weight else None
        self._input_aggregate = InputAggregate()

    def reset_parameters(self) -> None:
        """torch's default Linear init (as PyG's ``Linear`` with kaiming-uniform)."""
        self.lin_l.reset_parameters()
        if self.lin_r is not None:
            self.lin_r.reset_parameters()

    def forward(self, x: torch.Tensor, graph: GraphOperand, hints: LayerHints | None = None) -> torch.Tensor:
        """Apply the convolution to node features ``x`` of shape ``(N, in_channels)``."""
        hints = hints or LayerHints()
        a = as_operand(graph, self.backend).pattern()
        targets, p_in = hints.targets, hints.input_dropout
        last = aggregates_output(self.lin_l, self.aggregate_first)
        split = self.lin_r is not None and hints.output_mask is None and last
        if not split:  # x goes into two products: dropped out once, here
            x = dense.dropout(x, p_in, True, hints.rows)
            hints = replace(hints, input_dropout=0.0)
        if not self.normalize and not last:
            # (A x) W_l^T + b + x W_r^T, the activation and dropout after it: one fused node
            agg = input_aggregate(a, x, self.aggr, hints, (self._input_aggregate, graph))
            xs, ws = (
                ([agg, _rows(x, targets)], [self.lin_l.weight, self.lin_r.weight])
                if self.lin_r is not None
                else ([agg], [self.lin_l.weight])
            )
            return dense.linear_act(xs, ws, self.lin_l.bias, hints.epilogue, hints.output_rows())
        if split:
            xl, xr = self._project_both(x, p_in, hints.rows)
            if targets is None:
                out = sparse.aggregate(a, xl, self.aggr)
            else:
                out, xr = target_aggregate(a, xl, self.aggr, targets), take_rows(xr, targets)
            out = add_bias_(out, self.lin_l.bias).add_(xr)
        else:
            out = linear_then_aggregate(
                a, x, _WeightOnly(self.lin_l), self.aggr, hints, self.aggregate_first, (self._input_aggregate, graph)
            )
            out = add_bias_(out, self.lin_l.bias)
            if self.lin_r is not None:
                out = dense.linear_add_(out, _rows(x, targets), self.lin_r.weight)
        if self.normalize:
            out = F.normalize(out, p=2.0, dim=-1)
        return finish(out, hints)

    def _project_both(self, x: torch.Tensor, p: float, rows: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``dropout(x, p) W_l^T`` and ``dropout(x, p) W_r^T``, with one dropout draw."""
        assert self.lin_r is not None  # projected both ways only with a root weight
        weights = [self.lin_l.weight, self.lin_r.weight]
        if dense.feature_nonzeros(x) is not None:
            # a mostly-zero input (bag of words): one product over its non-zeros, stacked weights
            both = dense.dropout_linear(x, torch.cat(weights), None, p, True, rows)
            return both[:, : self.out_channels], both[:, self.out_channels :]
        # x W_l^T and x W_r^T as one product: x is read once each way, and its gradient is
        # one product instead of two added in another N x F pass
        xl, xr = dense.linear_split(dense.dropout(x, p, True, rows), weights)
        return xl, xr

    def describe(self) -> LayerSpec:
        return linear_spec(self.lin_l, self.aggregate_first)

    def placements(self) -> tuple[bool, ...]:
        return (True, False)

    def fusion(self) -> Fusion:
        """No output mask after ``normalize``, which mixes a row's entries."""
        return linear_fusion(self.lin_l, self.aggregate_first, output_mask=not self.normalize)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, aggr={self.aggr}"


def _rows(x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """The rows of ``x`` the root term reads: the targets' only, when only those are asked for."""
    return x if targets is None else take_rows(x, targets)


class _WeightOnly(nn.Module):
    """A view of a Linear's weight without its bias, so the bias can be added after aggregating."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.weight, self.in_features, self.out_features = lin.weight, lin.in_features, lin.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense.linear(x, self.weight)
