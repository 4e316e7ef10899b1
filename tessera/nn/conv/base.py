"""The contract between a graph layer and the model around it: what a layer offers besides
``forward`` (its widths for the strategies and planner, what it can fuse) and what the model
tells it per call (:class:`LayerHints`)."""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tessera.dense import Epilogue
from tessera.errors import ConfigError
from tessera.nn.conv.inputs import pyg_inputs
from tessera.sparse import GraphOperand, LayerSpec


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
    :attr:`Fusion.epilogue`), which a layer ending in a dense transform fuses into it.
    ``input_dropout``: the dropout probability the model leaves to the layer to apply to its input
    (only for layers that declare :attr:`Fusion.input_dropout`; 0: none), keyed by
    ``rows`` as :func:`tessera.dense.dropout` keys it. ``targets``: the rows of the output the
    caller reads (distinct int64 positions; only for layers that declare
    :attr:`Fusion.targets`, which then return ``out[targets]`` having computed only
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


@dataclass(frozen=True)
class Fusion:
    """What a layer can take over from the model around it; each field names the
    :class:`LayerHints` field the layer then honours. The model reads it once, when it builds its
    execution plan, never per call.

    ``input_dropout``: the layer applies the dropout before it (``hints.input_dropout``) inside its
    first product. ``epilogue``: it applies the activation and dropout after it
    (``hints.epilogue``). ``targets``: it computes only ``hints.targets``' rows. ``input_grad_mask``
    / ``output_mask``: the S-SpMM sides it uses (MixGCN §3.2.1). ``reads_input``: its backward
    reads its input (a product by a weight saves it); when it does not, the layer before keeps only
    where its ReLU output is non-zero, one byte per element (:class:`~tessera.dense.Epilogue`
    ``mask_only``)."""

    input_dropout: bool = False
    epilogue: bool = False
    targets: bool = False
    input_grad_mask: bool = False
    output_mask: bool = False
    reads_input: bool = True


class GraphConv(nn.Module):
    """A graph layer: ``forward(x, graph, hints)`` with ``graph`` a :data:`~tessera.sparse.GraphOperand`.

    Calling a layer: ``conv(x, graph, hints=None)`` with a tessera ``Graph``, CSR matrix or operand
    (what the model passes) runs ``forward`` as it is. A graph given as PyG users hold it is turned
    into a ``Graph`` first, once per edge index or adjacency tensor, by :meth:`__call__`
    (:mod:`tessera.nn.conv.inputs`): ``conv(x, edge_index)`` (PyG's order, ``(2, E)``, row 0 the
    sources), the per-edge tensor named by :attr:`edge_data` after it (``conv(x, edge_index,
    edge_weight)`` for GCN, ``edge_type`` for RGCN; positionally or by name), a ``torch.sparse``
    adjacency in PyG's ``adj_t`` layout (row ``i`` holds the sources of ``i``'s in-edges; its values
    are the ``edge_data``), and ``size=(N, N)``; ``N`` is ``x.shape[0]``. DGL's order
    (``conv(g, x)``), wrong sizes and devices are one-line errors saying what to pass. ``forward``
    itself always receives a tessera graph or operand.

    The contract with the model, all a new layer needs:

    * ``forward(x, graph, hints=None)`` returns the layer's output for input rows ``x``, aggregating
      over ``graph`` (turn it into an operand with :func:`~tessera.sparse.as_operand` and compute
      with the primitives of :mod:`tessera.sparse` and :mod:`tessera.dense`). ``hints`` (None: all
      defaults) carries ``rows`` (the global ids that key the layer's own random draws) and
      ``constant_input`` (the input is the same unchanged tensor at every call: a layer that
      aggregates it first may do so once), which any layer may ignore, and the fields of what the
      layer declared in :meth:`fusion`; a field the layer did not declare stays at its default.
    * ``reset_parameters()`` re-initialises it (by default every torch ``Linear`` directly in it).
    * ``describe()`` returns its :class:`~tessera.sparse.LayerSpec` (widths, whether it aggregates
      first), which strategies and the planner read.
    * ``fusion()`` (default: nothing) declares what the layer takes over from the model
      (:class:`Fusion`); the model's execution plan then hands it those jobs and does not do them
      itself. It may depend on the placement (:meth:`place`), which is fixed before training.
    * ``placements()`` / ``place()`` only for a layer that can aggregate on either side of its dense
      transform (WiseGraph's operation placement).
    """

    #: WiseGraph's operation placement (§5.4): None lets the layer pick the side of its dense
    #: transform it aggregates on (the narrower); True / False fix aggregation before / after it.
    aggregate_first: bool | None = None
    #: The per-edge tensor the layer takes with an edge index, as its PyG counterpart does
    #: (``"edge_weight"``, ``"edge_type"``); None: none.
    edge_data: str | None = None

    def __call__(self, x: torch.Tensor, graph: GraphOperand | torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``forward(x, graph, ...)``, with a graph given as PyG gives it converted first."""
        if not isinstance(graph, GraphOperand):
            graph, args, kwargs = pyg_inputs(type(self).__name__, self.edge_data, x, graph, args, kwargs)
        return super().__call__(x, graph, *args, **kwargs)

    @abstractmethod
    def forward(self, x: torch.Tensor, graph: GraphOperand, hints: LayerHints | None = None) -> torch.Tensor:
        """The layer's output for node features ``x`` aggregated over ``graph``."""

    @abstractmethod
    def describe(self) -> LayerSpec:
        """This layer's widths (input, output, aggregated) and whether it aggregates first."""

    def reset_parameters(self) -> None:
        """Re-initialise the layer's parameters; by default every torch ``Linear`` directly in it."""
        for child in self.children():
            if isinstance(child, nn.Linear):
                child.reset_parameters()

    def fusion(self) -> Fusion:
        """What this layer takes over from the model (:class:`Fusion`); by default nothing."""
        return Fusion()

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
