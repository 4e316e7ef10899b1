"""Graph convolution of Kipf & Welling with PyG ``GCNConv`` semantics."""

from __future__ import annotations

import torch
from torch import nn

from tessera import dense
from tessera.errors import ConfigError
from tessera.nn.conv._util import (
    InputAggregate,
    add_bias_,
    aggregates_output,
    finish,
    glorot_,
    input_aggregate,
    linear_fusion,
    linear_spec,
    linear_then_aggregate,
)
from tessera.nn.conv.base import Fusion, GraphConv, LayerHints
from tessera.nn.linear import Linear
from tessera.sparse import GraphOperand, LayerSpec, as_operand


class GCNConv(GraphConv):
    """``x'_i = sum_{j in N(i) + i} w_ji / sqrt(d_i d_j) * W x_j + b`` (PyG ``GCNConv``).

    Self loops are PyG's remaining self loops: a vertex's existing loop keeps its weight (1 on an
    unweighted graph), a missing one gets 1, or 2 when ``improved``. On an unweighted graph PyG's
    ``edge_index`` path drops the fill value (it has no weights to fill), so ``improved`` has no
    effect there; tessera keeps ``A + 2I`` as in PyG's weighted path (the same as passing PyG
    unit weights). ``add_self_loops`` defaults to ``normalize``; loops without normalisation are
    refused, as in PyG. Called with an edge index, it takes PyG's ``edge_weight`` after it (a sparse
    adjacency's values are the weights)."""

    edge_data = "edge_weight"

    def __init__(
        self, in_channels: int, out_channels: int, improved: bool = False, add_self_loops: bool | None = None,
        normalize: bool = True, bias: bool = True, backend: str = "auto",
    ) -> None:  # fmt: skip
        super().__init__()
        if add_self_loops is None:
            add_self_loops = normalize
        if add_self_loops and not normalize:
            raise ConfigError(
                "GCNConv adds self loops only with normalize=True: pass add_self_loops=False, "
                "or add the loops to the graph (Graph.add_self_loops)"
            )
        self.in_channels, self.out_channels = in_channels, out_channels
        self.improved, self.add_self_loops, self.normalize = improved, add_self_loops, normalize
        self.backend = backend
        self.lin = Linear(in_channels, out_channels, bias=False)
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self._input_aggregate = InputAggregate()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot weights, zero bias (as PyG)."""
        glorot_(self.lin.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor, graph: GraphOperand, hints: LayerHints | None = None) -> torch.Tensor:
        """Apply the convolution to node features ``x`` of shape ``(N, in_channels)``."""
        hints = hints or LayerHints()
        a = as_operand(graph, self.backend)
        a = a.gcn_normalized(self.add_self_loops, self.improved) if self.normalize else a.weighted()
        if aggregates_output(self.lin, self.aggregate_first):
            out = linear_then_aggregate(a, x, self.lin, "sum", hints, self.aggregate_first)
            return finish(add_bias_(out, self.bias), hints)
        x = dense.dropout(x, hints.input_dropout, True, hints.rows)
        agg = input_aggregate(a, x, "sum", hints, (self._input_aggregate, graph))
        return dense.linear_act([agg], [self.lin.weight], self.bias, hints.epilogue, hints.output_rows())

    def describe(self) -> LayerSpec:
        return linear_spec(self.lin, self.aggregate_first)

    def placements(self) -> tuple[bool, ...]:
        return (True, False)

    def fusion(self) -> Fusion:
        # aggregating first, the input goes only into the sum, whose fixed weights need nothing of it
        return linear_fusion(self.lin, self.aggregate_first, reads_input_first=False)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}"
