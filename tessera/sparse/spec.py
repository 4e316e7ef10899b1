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
    ``edge_terms`` per-vertex scalars at each end of an edge (GAT: one per head), or whose per-edge
    work needs each source's row (SAGE-LSTM); ``column_separable``: the aggregation treats feature
    columns independently, so it can run on column slices (tensor parallelism); an LSTM over a
    vertex's neighbour sequence mixes a row's columns. ``relations``: a relational layer (RGCN)
    with that many relations, whose per-edge work needs each source's row and the edge's relation
    (0: not relational). ``choose_placement``: the layer runs either placement and leaves the
    choice to the strategy, which knows what each exchanges (a relational layer with none fixed:
    its sources' input rows, as described, or its transformed rows per remote (relation, source)
    pair at ``out_width``, whichever moves fewer bytes)."""

    in_width: int
    out_width: int
    aggregate_width: int
    aggregates_first: bool
    edge_values: bool = False
    edge_terms: int = 0
    column_separable: bool = True
    relations: int = 0
    choose_placement: bool = False

    def aggregates_input_grad(self, input_needs_grad: bool) -> bool:
        """Whether the backward pass runs this layer's transposed aggregation."""
        return input_needs_grad or not self.aggregates_first
