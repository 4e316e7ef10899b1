"""Graph attention convolution with PyG ``GATConv`` semantics."""

from __future__ import annotations

import torch
from torch import nn

from tessera import ops
from tessera.graph import Graph
from tessera.nn.conv._util import glorot_
from tessera.nn.linear import Linear


def _with_self_loops(graph: Graph) -> Graph:
    # PyG removes then re-adds self loops; edge weights play no part in GAT.
    return graph.cached("gat_loops", lambda: graph.replace(edge_weight=None, edge_type=None).add_self_loops())


class GATConv(nn.Module):
    """Multi-head attention ``x'_i = sum_j alpha_ij W x_j`` with
    ``alpha_ij = softmax_j(LeakyReLU(a_src . W x_j + a_dst . W x_i))`` (PyG ``GATConv``)."""

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        heads: int = 1,
        concat: bool = True,
        negative_slope: float = 0.2,
        dropout: float = 0.0,
        add_self_loops: bool = True,
        bias: bool = True,
        backend: str = "auto",
    ) -> None:
        super().__init__()
        self.in_channels, self.out_channels, self.heads, self.concat = in_channels, out_channels, heads, concat
        self.negative_slope, self.dropout, self.add_self_loops, self.backend = (
            negative_slope,
            dropout,
            add_self_loops,
            backend,
        )
        self.lin = Linear(in_channels, heads * out_channels, bias=False)
        self.att_src = nn.Parameter(torch.empty(1, heads, out_channels))
        self.att_dst = nn.Parameter(torch.empty(1, heads, out_channels))
        self.bias = nn.Parameter(torch.empty(heads * out_channels if concat else out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot weights and attention vectors, zero bias (as PyG)."""
        glorot_(self.lin.weight)
        glorot_(self.att_src)
        glorot_(self.att_dst)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, graph: Graph) -> torch.Tensor:
        """Apply attention to node features ``x`` of shape ``(N, in_channels)``."""
        g = _with_self_loops(graph) if self.add_self_loops else graph
        h = self.lin(x).view(-1, self.heads, self.out_channels)
        a_src = (h * self.att_src).sum(-1)
        a_dst = (h * self.att_dst).sum(-1)
        # Fused score, LeakyReLU and per-destination softmax: O(E x heads) memory, no E x F tensor.
        alpha = ops.dropout(ops.gat_attention(g, a_src, a_dst, self.negative_slope), self.dropout, self.training)
        out = ops.aggregate(g, h, "sum", alpha, self.backend)
        out = out.reshape(-1, self.heads * self.out_channels) if self.concat else out.mean(1)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, heads={self.heads}"
