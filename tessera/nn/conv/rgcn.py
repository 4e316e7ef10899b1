"""Relational graph convolution (Schlichtkrull et al.) with PyG ``RGCNConv`` semantics."""

from __future__ import annotations

import torch
from torch import nn

from tessera import dense
from tessera.errors import ConfigError
from tessera.nn.conv._util import glorot_
from tessera.nn.conv.base import GraphConv, LayerHints
from tessera.relational.operand import relational
from tessera.relational.plan import split_variant
from tessera.relational.variants import relational_sum
from tessera.sparse import GraphOperand, LayerSpec, as_operand


class RGCNConv(GraphConv):
    """``x'_i = W_root x_i + sum_r reduce_{j in N_r(i)} W_r x_j + b`` (PyG ``RGCNConv``).

    ``aggr`` is ``mean`` (divide by ``|N_r(i)|``, the in-degree of ``i`` within relation ``r``) or
    ``sum``. ``num_bases`` writes every ``W_r`` as ``sum_b comp[r, b] basis_b``; ``num_blocks``
    makes every ``W_r`` block-diagonal with that many blocks. Parameters are laid out as PyG's
    (``weight``: ``(R, in, out)``, ``(B, in, out)`` with bases, ``(R, blocks, in/blocks,
    out/blocks)`` with blocks; ``comp``; ``root``: ``(in, out)``; ``bias``), so a PyG state dict
    loads as is. ``variant`` picks how the relational sum is computed
    (:mod:`tessera.relational.variants`; ``auto``: by the operand's cost model and measurement;
    ``gtask:RESTRICTIONS``: the gTask variant on the plan those restrictions cut).
    The operation placement (:meth:`place`) decides what a partitioned rank receives for its
    remote sources (:meth:`describe`); None leaves it to the strategy. Called with an edge index,
    it takes PyG's ``edge_type`` after it (a sparse adjacency's integer values are the relation
    ids). As in PyG, edge types need only be below ``num_relations``: a graph with fewer relations
    (its highest ones unused) runs with the first of the layer's relation weights."""

    edge_data = "edge_type"

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        num_relations: int,
        num_bases: int | None = None,
        num_blocks: int | None = None,
        aggr: str = "mean",
        root_weight: bool = True,
        bias: bool = True,
        backend: str = "auto",
        variant: str = "auto",
    ) -> None:
        super().__init__()
        if num_bases is not None and num_blocks is not None:
            raise ConfigError("RGCN takes --num-bases or --num-blocks, not both")
        if aggr not in ("mean", "sum", "add"):
            raise ConfigError(f"RGCN aggregation must be mean or sum, got {aggr!r}")
        if num_relations < 1:
            raise ConfigError(f"RGCN needs at least one relation, got {num_relations}")
        if num_bases is not None and num_bases < 1:
            raise ConfigError(f"--num-bases must be at least 1, got {num_bases}")
        if num_blocks is not None and (num_blocks < 1 or in_channels % num_blocks or out_channels % num_blocks):
            raise ConfigError(
                f"--num-blocks {num_blocks} must divide the layer widths ({in_channels} in, {out_channels} out)"
            )
        self.in_channels, self.out_channels, self.num_relations = in_channels, out_channels, num_relations
        self.num_bases, self.num_blocks = num_bases, num_blocks
        self.aggr = "sum" if aggr == "add" else aggr
        split_variant(variant)  # a bad variant or gTask restriction fails here, in one line
        self.backend, self.variant = backend, variant
        if num_bases is not None:
            self.weight = nn.Parameter(torch.empty(num_bases, in_channels, out_channels))
            self.comp = nn.Parameter(torch.empty(num_relations, num_bases))
        elif num_blocks is not None:
            shape = (num_relations, num_blocks, in_channels // num_blocks, out_channels // num_blocks)
            self.weight = nn.Parameter(torch.empty(shape))
            self.register_parameter("comp", None)
        else:
            self.weight = nn.Parameter(torch.empty(num_relations, in_channels, out_channels))
            self.register_parameter("comp", None)
        self.root = nn.Parameter(torch.empty(in_channels, out_channels)) if root_weight else None
        self.bias = nn.Parameter(torch.empty(out_channels)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Glorot weights, bases, coefficients and root, zero bias (as PyG)."""
        for p in (self.weight, self.comp, self.root):
            if p is not None:
                glorot_(p)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def relation_weights(self) -> torch.Tensor:
        """Every relation's dense ``(in, out)`` matrix, ``(R, in, out)``, from the decomposition."""
        r, i, o = self.num_relations, self.in_channels, self.out_channels
        if self.num_bases is not None:
            return (self.comp @ self.weight.reshape(self.num_bases, -1)).view(r, i, o)
        if self.num_blocks is not None:
            eye = torch.eye(self.num_blocks, dtype=self.weight.dtype, device=self.weight.device)
            return torch.einsum("rbio,bc->rbico", self.weight, eye).reshape(r, i, o)
        return self.weight

    def forward(self, x: torch.Tensor, graph: GraphOperand, hints: LayerHints | None = None) -> torch.Tensor:
        """Apply the convolution to node features ``x`` of shape ``(N, in_channels)``."""
        a = as_operand(graph, self.backend)
        r = relational(a).relations().num_relations
        if r > self.num_relations:
            raise ConfigError(
                f"the graph has {r} relations but this RGCN layer was built for {self.num_relations}: "
                f"build it with num_relations={r} (edge types must be below num_relations)"
            )
        weights = self.relation_weights()
        out = relational_sum(a, x, weights if r == self.num_relations else weights[:r], self.aggr, self.variant)
        if self.root is not None:
            out = out + dense.linear(x, self.root.t())
        return out if self.bias is None else out + self.bias

    def describe(self) -> LayerSpec:
        """Under partition parallelism a rank either gathers its remote sources' input rows (``in``
        wide, once per layer for every relation; ``aggregate_first`` True) or receives their
        owners' ``W_r x_j`` rows (``out`` wide, one per remote (relation, source) pair;
        ``aggregate_first`` False). With no placement fixed the strategy takes the one whose
        exchange moves fewer bytes (``choose_placement``; the description is the gather's)."""
        first = self.aggregate_first is not False
        return LayerSpec(
            self.in_channels,
            self.out_channels,
            self.in_channels if first else self.out_channels,
            first,
            True,
            relations=self.num_relations,
            choose_placement=self.aggregate_first is None,
        )

    def placements(self) -> tuple[bool, ...]:
        return (True, False)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, num_relations={self.num_relations}, aggr={self.aggr}"
