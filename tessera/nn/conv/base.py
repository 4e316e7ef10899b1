"""What every graph layer offers besides ``forward``: a description of its widths for the
strategies and planner, and which S-SpMM hints it can use."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from tessera.sparse import GraphOperand, LayerSpec


@dataclass(frozen=True)
class SSpmmHints:
    """S-SpMM hints (MixGCN §3.2.1) a model passes to a layer: ``output_mask`` when the layer's
    aggregation comes last (only kept outputs are computed; the caller applies that dropout mask
    after the layer), ``input_grad_mask`` when it comes first (only the kept entries of the
    input's gradient are computed)."""

    input_grad_mask: torch.Tensor | None = None
    output_mask: torch.Tensor | None = None


class GraphConv(nn.Module):
    """A graph layer: ``forward(x, graph)`` with ``graph`` a :data:`~tessera.sparse.GraphOperand`."""

    @abstractmethod
    def forward(self, x: torch.Tensor, graph: GraphOperand, hints: SSpmmHints | None = None) -> torch.Tensor:
        """The layer's output for node features ``x`` aggregated over ``graph``."""

    @abstractmethod
    def describe(self) -> LayerSpec:
        """This layer's widths (input, output, aggregated) and whether it aggregates first."""

    def s_spmm_sides(self) -> tuple[bool, bool]:
        """Which :class:`SSpmmHints` field ``forward`` uses: (``input_grad_mask``, ``output_mask``)."""
        return False, False
