"""Graph attention convolution with PyG ``GATConv`` semantics."""

from __future__ import annotations

import torch
from torch import nn

from tessera import sparse
from tessera.nn.conv._util import glorot_
from tessera.nn.conv.base import GraphConv, SSpmmHints
from tessera.nn.linear import Linear
from tessera.sparse import GraphOperand, LayerSpec, as_operand


class GATConv(GraphConv):
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

    def forward(self, x: torch.Tensor, graph: GraphOperand, hints: SSpmmHints | None = None) -> torch.Tensor:
        """Apply attention to node features ``x`` of shape ``(N, in_channels)`` (no S-SpMM hint applies)."""
        # PyG removes then re-adds self loops; edge weights play no part in GAT.
        a = as_operand(graph, self.backend)
        a = a.with_self_loops() if self.add_self_loops else a.pattern()
        h = self.lin(x).view(-1, self.heads, self.out_channels)
        a_src = (h * self.att_src).sum(-1)
        a_dst = (h * self.att_dst).sum(-1)
        # Fused score, LeakyReLU and per-destination softmax: O(E x heads) memory, no E x F tensor.
        alpha = sparse.gat_attention(a.edge_structure(), a_src, a_dst, self.negative_slope)
        out = sparse.aggregate(a, h, "sum", sparse.dropout(alpha, self.dropout, self.training))
        out = out.reshape(-1, self.heads * self.out_channels) if self.concat else out.mean(1)
        return out if self.bias is None else out + self.bias

    def describe(self) -> LayerSpec:
        width = self.heads * self.out_channels
        return LayerSpec(self.in_channels, width if self.concat else self.out_channels, width, False, True)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, heads={self.heads}"
