"""What every graph layer offers besides ``forward``: a description of its widths for the
strategies and planner, and which S-SpMM hints it can use."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from tessera.errors import ConfigError
from tessera.sparse import Epilogue, GraphOperand, LayerSpec


@dataclass(frozen=True)
class LayerHints:
    """What a model tells a layer about one call besides its input. The S-SpMM masks (MixGCN
    §3.2.1): ``output_mask`` when the layer's aggregation comes last (only kept outputs are
    computed; the caller applies that dropout mask after the layer), ``input_grad_mask`` when it
    comes first (only the kept entries of the input's gradient are computed). ``rows``: the global
    vertex ids of the input's rows (None: their positions), which keys the layer's own random draws.
    ``constant_input``: the input is the same tensor, unchanged and needing no gradient, at every
    call (layer 0 on the raw features with no dropout, LayerNorm or label embedding before it), so
    a layer that aggregates its input first may aggregate it once and reuse the result (MixGCN
    Algorithm 2, line 1: the raw features are aggregated once). ``epilogue``: the activation and
    dropout the model applies to the output (only for layers that declare
    :attr:`GraphConv.takes_epilogue`), which a layer ending in a dense transform fuses into it.
    ``input_dropout``: the dropout probability the model leaves to the layer to apply to its input
    (only for layers that declare :attr:`GraphConv.takes_input_dropout`; 0: none), keyed by
    ``rows`` as :func:`tessera.sparse.dropout` keys it. ``targets``: the rows of the output the
    caller reads (distinct int64 positions; only for layers that declare
    :attr:`GraphConv.takes_targets`, which then return ``out[targets]`` having computed only
    those rows; None: every row)."""

    input_grad_mask: torch.Tensor | None = None
    output_mask: torch.Tensor | None = None
    rows: torch.Tensor | None = None
    constant_input: bool = False
    epilogue: Epilogue | None = None
    input_dropout: float = 0.0
    targets: torch.Tensor | None = None

    def output_rows(self) -> torch.Tensor | None:
        """The global vertex ids of the output's rows (which key the epilogue's draws): ``rows``,
        or of those the ``targets`` pick."""
        if self.targets is None:
            return self.rows
        return self.targets if self.rows is None else self.rows[self.targets]


class GraphConv(nn.Module):
    """A graph layer: ``forward(x, graph)`` with ``graph`` a :data:`~tessera.sparse.GraphOperand`."""

    #: WiseGraph's operation placement (§5.4): None lets the layer pick the side of its dense
    #: transform it aggregates on (the narrower); True / False fix aggregation before / after it.
    aggregate_first: bool | None = None
    #: whether ``forward`` applies :attr:`LayerHints.epilogue` itself (else the model applies the
    #: activation and dropout to the output)
    takes_epilogue: ClassVar[bool] = False
    #: whether ``forward`` applies :attr:`LayerHints.input_dropout` itself (a layer that starts
    #: with a linear map of its input fuses the dropout into it: :func:`tessera.sparse.dropout_linear`)
    takes_input_dropout: ClassVar[bool] = False
    #: whether ``forward`` computes only :attr:`LayerHints.targets`' rows itself (else the model
    #: selects them from the whole output)
    takes_targets: ClassVar[bool] = False

    @abstractmethod
    def forward(self, x: torch.Tensor, graph: GraphOperand, hints: LayerHints | None = None) -> torch.Tensor:
        """The layer's output for node features ``x`` aggregated over ``graph``."""

    @abstractmethod
    def describe(self) -> LayerSpec:
        """This layer's widths (input, output, aggregated) and whether it aggregates first."""

    def placements(self) -> tuple[bool, ...]:
        """The ``aggregate_first`` orders this layer can run in; most layers have only their own."""
        return (self.describe().aggregates_first,)

    def place(self, aggregate_first: bool | None) -> None:
        """Fix the operation placement (None: the layer's own rule), one of :meth:`placements`."""
        if aggregate_first is not None and aggregate_first not in self.placements():
            side = "before" if aggregate_first else "after"
            raise ConfigError(
                f"{type(self).__name__} cannot aggregate {side} its dense transform; "
                "drop the @aggregate-first/@transform-first suffix for this layer"
            )
        self.aggregate_first = aggregate_first

    def keeps_input(self) -> bool:
        """Whether this layer's backward reads its input itself (a product by a weight saves it).
        When it does not, the layer before keeps only where its ReLU output is non-zero, one byte
        per element, instead of the whole output (:class:`~tessera.sparse.Epilogue` ``mask_only``)."""
        return True

    def s_spmm_sides(self) -> tuple[bool, bool]:
        """Which S-SpMM field of :class:`LayerHints` ``forward`` uses: (``input_grad_mask``, ``output_mask``)."""
        return False, False
