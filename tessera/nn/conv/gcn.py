"""Graph convolution of Kipf & Welling with PyG ``GCNConv`` semantics."""

from __future__ import annotations

import torch
from torch import nn

from tessera.graph import Graph
from tessera.nn.conv._util import aggregates_output, glorot_, linear_then_aggregate
from tessera.nn.linear import Linear


def normalized_graph(graph: Graph, add_self_loops: bool = True, improved: bool = False) -> Graph:
    """The graph with self loops and symmetric normalisation weights, computed once per graph."""
    return graph.cached(("gcn_norm", add_self_loops, improved), lambda: graph.gcn_norm(add_self_loops, improved))


class GCNConv(nn.Module):
    """``x'_i = sum_{j in N(i) + i} w_ji / sqrt(d_i d_j) * W x_j + b`` (PyG ``GCNConv``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        improved: bool = False,
        add_self_loops: bool = True,
        normalize: bool = True,
        bias: bool = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.in_channels, self.out_channels = in_channels, out_channels
        self.improved, self.add_self_loops, self.normalize = improved, add_self_loops, normalize
        self.backend = backend
        self.lin = Linear(in_channels, out_channels, bias=False)
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot weights, zero bias (as PyG)."""
        glorot_(self.lin.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

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
        g = normalized_graph(graph, self.add_self_loops, self.improved) if self.normalize else graph
        out = linear_then_aggregate(
            g, x, self.lin, "sum", g.edge_weight, self.backend, input_grad_mask=input_grad_mask, output_mask=output_mask
        )
        return out if self.bias is None else out + self.bias

    def s_spmm_sides(self) -> tuple[bool, bool]:
        """Which S-SpMM hint this layer uses: (``input_grad_mask``, ``output_mask``)."""
        last = aggregates_output(self.lin)
        return not last, last

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}"
