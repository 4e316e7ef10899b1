"""Graph attention convolution with PyG ``GATConv`` semantics."""

from __future__ import annotations

import torch
from torch import nn

from tessera import dense, sparse
from tessera.errors import ConfigError
from tessera.memo import PlanCache
from tessera.nn.conv._util import add_bias_, glorot_
from tessera.nn.conv.base import Fusion, GraphConv, LayerHints
from tessera.nn.linear import Linear
from tessera.sparse import GraphOperand, LayerSpec, as_operand

# per edge structure: the row ids and edge keys of its last training call, shared by every
# layer over those edges (E int64 each: 196 MB on a products-sized graph)
_keys = PlanCache()


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
        for name, value in (("in_channels", in_channels), ("out_channels", out_channels), ("heads", heads)):
            if value < 1:
                raise ConfigError(f"GATConv {name} must be at least 1, got {value}")
        if not 0.0 <= dropout < 1.0:
            raise ConfigError(f"GATConv dropout must be in [0, 1), got {dropout}")
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

    def forward(self, x: torch.Tensor, graph: GraphOperand, hints: LayerHints | None = None) -> torch.Tensor:
        """Apply attention to node features ``x`` of shape ``(N, in_channels)``. Of the ``hints``,
        ``rows`` keys attention dropout by the global ids of each edge's ends, and
        ``input_dropout`` is applied to ``x`` inside the projection."""
        # PyG removes then re-adds self loops; edge weights play no part in GAT.
        a = as_operand(graph, self.backend)
        a = a.with_self_loops() if self.add_self_loops else a.pattern()
        n, heads, width = x.shape[0], self.heads, self.out_channels
        p_in = hints.input_dropout if hints is not None else 0.0
        rows = hints.rows if hints is not None else None
        flat = dense.dropout_linear(x, self.lin.weight, self.lin.bias, p_in, True, rows)
        h = flat.view(n, heads, width)
        # Both ends' attention terms as one product with a block-diagonal (2 heads, heads x width)
        # matrix: no (N, heads, width) temporaries, and the input gradient lands in one block.
        att = torch.cat(
            [torch.block_diag(*self.att_src[0].unsqueeze(1)), torch.block_diag(*self.att_dst[0].unsqueeze(1))]
        )
        terms = dense.linear(flat, att)
        if terms.dtype == torch.bfloat16:  # attention in float32 (N x 2 heads: small)
            terms = terms.float()
        a_src, a_dst = terms[:, :heads].contiguous(), terms[:, heads:].contiguous()
        # The sources' features and attention terms (all local in one process; a partition's
        # remote sources arrive in one exchange), then the terms of every edge's two ends (under
        # tensor parallelism every rank's edge structure is the whole graph: all vertices' terms).
        h_src, a_src = a.gather_sources(h, a_src)
        a_src, a_dst = a.gather_edge_terms(a_src, a_dst)
        edges = a.edge_structure()
        # Attention, its dropout and the weighted sum as one node (sparse.attend): O(E x heads)
        # memory, no E x F tensor, at most two E x heads tensors alive.
        p = self.dropout if self.training else 0.0
        keys = _edge_keys(a, edges, hints, n, h.device) if p > 0.0 else None
        out = sparse.attend(a, edges, a_src, a_dst, h_src, self.negative_slope, p, keys)
        if not self.concat and heads == 1:  # the mean of one head is that head: a view, no N x F copy
            return add_bias_(out, self.bias).squeeze(1)
        if not self.concat:
            return add_bias_(out.mean(1), self.bias)
        # the bias in place on the fresh aggregate, before the reshape: in place on the reshaped
        # view would make autograd copy the whole gradient in backward
        return add_bias_(out, None if self.bias is None else self.bias.view(heads, width)).reshape(-1, heads * width)

    def fusion(self) -> Fusion:
        return Fusion(input_dropout=True)

    def describe(self) -> LayerSpec:
        width = self.heads * self.out_channels
        out = width if self.concat else self.out_channels
        return LayerSpec(self.in_channels, out, width, False, True, edge_terms=self.heads)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, heads={self.heads}"


def _edge_keys(a, edges, hints: LayerHints | None, n: int, device: torch.device) -> torch.Tensor:
    """Global edge keys for attention dropout, made once per (edges, rows) pair: on the host, where
    the edge structure is, and kept on ``device``."""
    rows = hints.rows if hints is not None else None
    entries = _keys.entries(edges)
    hit = entries.get("keys")
    if hit is not None and hit[0] is rows:
        return hit[1]
    ids = a.edge_ids(torch.arange(n) if rows is None else rows.cpu())
    keys = sparse.edge_keys(edges, *ids).to(device)
    entries["keys"] = (rows, keys)
    return keys
