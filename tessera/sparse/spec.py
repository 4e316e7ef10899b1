"""What a layer tells the planes below it about itself, without running."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LayerSpec:
    """One graph layer's widths as the sparse primitives see them.

    ``aggregate_width`` is the width of the rows the layer multiplies by its operand (and so the
    width a distributed strategy exchanges per row); ``aggregates_first`` says the aggregation
    reads the layer's input directly (so the aggregated rows need a gradient only when the input
    does); ``edge_values`` marks layers that compute per-edge values (attention), from
    ``edge_terms`` per-vertex scalars at each end of an edge (GAT: one per head)."""

    in_width: int
    out_width: int
    aggregate_width: int
    aggregates_first: bool
    edge_values: bool = False
    edge_terms: int = 0

    def aggregates_input_grad(self, input_needs_grad: bool) -> bool:
        """Whether the backward pass runs this layer's transposed aggregation."""
        return input_needs_grad or not self.aggregates_first
