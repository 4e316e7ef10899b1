"""GraphSAGE with an LSTM aggregator, with DGL's ``SAGEConv(aggregator_type="lstm")`` semantics."""

from __future__ import annotations

import math

import torch
from torch import nn

from tessera import sparse
from tessera.nn.conv.base import GraphConv, LayerHints
from tessera.nn.linear import Linear
from tessera.sparse import GraphOperand, LayerSpec, as_operand


class LSTMWeights(nn.Module):
    """A one-layer LSTM's parameters under ``torch.nn.LSTM``'s names and initialisation (so a
    state dict moves to and from DGL's ``SAGEConv.lstm``); the aggregation primitive runs them."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight_ih_l0 = nn.Parameter(torch.empty(4 * hidden_size, input_size))
        self.weight_hh_l0 = nn.Parameter(torch.empty(4 * hidden_size, hidden_size))
        self.bias_ih_l0 = nn.Parameter(torch.empty(4 * hidden_size))
        self.bias_hh_l0 = nn.Parameter(torch.empty(4 * hidden_size))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Uniform in ``+-1/sqrt(hidden)``, as ``torch.nn.LSTM``."""
        bound = 1.0 / math.sqrt(self.weight_hh_l0.shape[1])
        for p in self.parameters():
            nn.init.uniform_(p, -bound, bound)


class SAGELSTMConv(GraphConv):
    """``x'_i = W_self x_i + b + W_neigh h_i`` with ``h_i`` the final hidden state of an
    ``LSTM(in, in)`` run over ``i``'s in-neighbours' features (DGL 2.1 ``SAGEConv`` with
    ``aggregator_type="lstm"``: ``fc_self`` holds the bias, ``fc_neigh`` has none; the parameter
    names and initialisation are DGL's, so state dicts load either way).

    Sequences: a vertex's in-neighbours in ascending source vertex id (the CSR order of a graph
    built from an edge list), parallel edges repeated; the LSTM runs exactly that many steps from a
    zero state, and a vertex without in-edges gets ``h_i = 0``. Under partition parallelism each
    rank receives its remote sources' rows and sorts by global id, so every split computes the
    same sequences as one process. Order matters: a relabelled graph (``--reorder``) trains a
    different function unless its rows keep their global ids.

    Difference from PyG: ``SAGEConv(aggr="lstm")`` (``LSTMAggregation``) pads every vertex's
    sequence with zero rows to the longest in-degree of the graph and returns the output of the
    last padded step, so a vertex of in-degree ``d < max`` runs ``max - d`` further steps on zero
    input (which still move its state through the biases), and a vertex without in-edges gets the
    LSTM's output over ``max`` zero inputs, not 0. The two agree only where every vertex has the
    maximum in-degree. PyG's cost is also ``N x max in-degree`` steps, against ``E`` here.

    Computation (:func:`tessera.sparse.lstm_aggregate`): degree-batched packed sequences with
    the input projection ``x W_ih^T`` computed once per vertex, not once per edge (WiseGraph's
    unique-value extraction); see :mod:`tessera.sparse.lstm` for the measured choice of kernel."""

    def __init__(self, in_channels: int, out_channels: int, bias: bool = True, backend: str = "auto") -> None:
        super().__init__()
        self.in_channels, self.out_channels, self.backend = in_channels, out_channels, backend
        self.lstm = LSTMWeights(in_channels, in_channels)
        self.fc_self = Linear(in_channels, out_channels, bias=bias)
        self.fc_neigh = Linear(in_channels, out_channels, bias=False)
        self._plan_cache: tuple | None = None  # (edge structure, rows, sequence plan) of the last call
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As DGL: ``torch.nn.LSTM``'s init, Xavier-uniform weights with ReLU gain, ``fc_self``'s
        bias as ``torch.nn.Linear`` draws it."""
        gain = nn.init.calculate_gain("relu")
        self.lstm.reset_parameters()
        self.fc_self.reset_parameters()
        nn.init.xavier_uniform_(self.fc_self.weight, gain=gain)
        nn.init.xavier_uniform_(self.fc_neigh.weight, gain=gain)

    def forward(self, x: torch.Tensor, graph: GraphOperand, hints: LayerHints | None = None) -> torch.Tensor:
        """Apply the convolution to node features ``x`` of shape ``(N, in_channels)``; of the
        ``hints`` only ``rows`` applies (the global ids that order each vertex's neighbours)."""
        a = as_operand(graph, self.backend).pattern()
        (x_src,) = a.gather_sources(x)
        plan = self._plan(a, hints.rows if hints is not None else None, x.shape[0])
        w = self.lstm
        h = sparse.lstm_aggregate(plan, x_src, w.weight_ih_l0, w.weight_hh_l0, w.bias_ih_l0, w.bias_hh_l0)
        # The root term reads the owned rows through x_src (its first rows are x), so that a
        # distributed operand's gather is part of the step's graph on a rank without in-edges too:
        # its backward exchange must run on every rank.
        return self.fc_self(x_src[: x.shape[0]]) + self.fc_neigh(h)

    def _plan(self, a, rows: torch.Tensor | None, n: int) -> sparse.SequencePlan:
        """The operand's neighbour sequences, ordered by global source id, made once per (edges, rows)."""
        edges = a.edge_structure()
        cached = self._plan_cache
        if cached is not None and cached[0] is edges and cached[1] is rows:
            return cached[2]
        _, ids = a.edge_ids(torch.arange(n) if rows is None else rows.cpu())  # the plan is made on the host
        plan = sparse.sequence_plan(edges, ids)
        self._plan_cache = (edges, rows, plan)
        return plan

    def describe(self) -> LayerSpec:
        """Aggregates its input (the sources' rows, ``in`` wide) per edge, like attention."""
        return LayerSpec(self.in_channels, self.out_channels, self.in_channels, True, True, column_separable=False)

    def extra_repr(self) -> str:
        return f"{self.in_channels}, {self.out_channels}, aggr=lstm"
