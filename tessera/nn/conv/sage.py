"""GraphSAGE convolution with PyG ``SAGEConv`` semantics (mean aggregation, root weight)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera import ops
from tessera.graph import Graph
from tessera.nn.conv._util import aggregates_output, linear_then_aggregate
from tessera.nn.linear import Linear


class SAGEConv(nn.Module):
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

    def reset_parameters(self) -> None:
        """torch's default Linear init (as PyG's ``Linear`` with kaiming-uniform)."""
        self.lin_l.reset_parameters()
        if self.lin_r is not None:
            self.lin_r.reset_parameters()

    def forward(
        self,
        x: torch.Tensor,
        graph: Graph,
        *,
        input_grad_mask: torch.Tensor | None = None,
        output_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Apply the convolution to node features ``x`` of shape ``(N, in_channels)``; the masks are
        S-SpMM hints (see :func:`tessera.nn.conv._util.linear_then_aggregate`)."""
        lin_nobias = _WeightOnly(self.lin_l)
        out = linear_then_aggregate(
            graph,
            x,
            lin_nobias,
            self.aggr,
            None,
            self.backend,
            input_grad_mask=input_grad_mask,
            output_mask=output_mask,
        )
        if self.lin_l.bias is not None:
            out = out + self.lin_l.bias
        if self.lin_r is not None:
            out = out + self.lin_r(x)
        if self.normalize:
            out = F.normalize(out, p=2.0, dim=-1)
        return out

    def s_spmm_sides(self) -> tuple[bool, bool]:
        """Which S-SpMM hint this layer uses: (``input_grad_mask``, ``output_mask``); none after
        ``normalize``, which mixes a row's entries."""
        last = aggregates_output(self.lin_l)
        return not last, last and not self.normalize

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, aggr={self.aggr}"


class _WeightOnly(nn.Module):
    """A view of a Linear's weight without its bias, so the bias can be added after aggregating."""

    def __init__(self, lin: nn.Linear) -> None:
        super().__init__()
        self.weight, self.in_features, self.out_features = lin.weight, lin.in_features, lin.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight)
