"""A model run as MixGCN's mixture of accelerators (§3.2): every layer's aggregation on the host's
CPU kernels, its dense update on the training device, pipelined in row stages
(:func:`tessera.sparse.mixture.aggregate_update`).

:class:`MixtureGNN` runs a :class:`~tessera.nn.models.GNN`'s own layers and parameters (the same
modules and state-dict keys), so a checkpoint moves between the two, and it draws the same dropout
masks in the same order: the input dropout of each layer is applied on the host, keyed by the
rows' global ids, before the layer's aggregation. Layers whose aggregation is an element-wise sum
or mean (GCN, SAGE, GIN) split into a host product and a row-wise update; attention, relational
sums and LSTM aggregation do not (MixGCN §6), nor do LayerNorm or label propagation, which are
refused when the mixture is built."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tessera import dense
from tessera.errors import ConfigError
from tessera.nn.conv import GCNConv, GINConv, SAGEConv
from tessera.nn.conv.base import GraphConv
from tessera.nn.mlp import MLP
from tessera.nn.models import GNN
from tessera.sparse import GraphOperand, Operand, as_operand, inv_in_degree
from tessera.sparse.mixture import HostAggregation, MixturePlan, aggregate_update, host_aggregation
from tessera.sparse.rows import take_rows

MODELS = ("gcn", "sage", "gin")


@dataclass(frozen=True)
class LayerSplit:
    """One layer as a host aggregation and a row-wise update: ``update(z, root, *params)`` with
    ``z`` the (scaled) aggregate and ``root`` the input's own rows (only when ``root``)."""

    operand: Operand
    mean: bool
    update: Callable[..., torch.Tensor]
    params: tuple[torch.Tensor, ...]
    root: bool


def _relu_if(act: bool, y: torch.Tensor) -> torch.Tensor:
    return F.relu(y) if act else y


def split_layer(conv: GraphConv, graph: GraphOperand, act: bool) -> LayerSplit:
    """``conv`` over ``graph`` as a host aggregation and a row-wise update (then ReLU when ``act``);
    a layer with no such split is refused in one line."""
    _check_layer(conv)
    if isinstance(conv, GCNConv):
        a = as_operand(graph, conv.backend)
        a = a.gcn_normalized(conv.add_self_loops, conv.improved) if conv.normalize else a.weighted()
        lin, bias = conv.lin.weight, conv.bias

        def gcn(z: torch.Tensor, r: torch.Tensor | None, w: torch.Tensor, *b: torch.Tensor) -> torch.Tensor:
            return _relu_if(act, F.linear(z, w, b[0] if b else None))

        return LayerSplit(a, False, gcn, (lin,) if bias is None else (lin, bias), False)
    if isinstance(conv, SAGEConv):
        a = as_operand(graph, conv.backend).pattern()
        wl, bl, wr = conv.lin_l.weight, conv.lin_l.bias, None if conv.lin_r is None else conv.lin_r.weight
        params = tuple(p for p in (wl, wr, bl) if p is not None)
        normalize = conv.normalize

        def sage(z: torch.Tensor, r: torch.Tensor | None, *p: torch.Tensor) -> torch.Tensor:
            y = F.linear(z, p[0], p[-1] if bl is not None else None)
            if wr is not None:
                assert r is not None
                y = y + F.linear(r, p[1])
            if normalize:
                y = F.normalize(y, p=2.0, dim=-1)
            return _relu_if(act, y)

        return LayerSplit(a, conv.aggr == "mean", sage, params, wr is not None)
    if isinstance(conv, GINConv) and isinstance(conv.nn, MLP):
        a = as_operand(graph, conv.backend).pattern()
        first, last = conv.nn[0], conv.nn[2]
        assert isinstance(first, nn.Linear) and isinstance(last, nn.Linear)
        eps = conv.eps
        mlp = [first.weight, first.bias, last.weight, last.bias]
        trained = isinstance(eps, nn.Parameter)

        def gin(z: torch.Tensor, r: torch.Tensor | None, *p: torch.Tensor) -> torch.Tensor:
            assert r is not None
            # a fixed eps is read where it is used: a loaded state dict may have changed it
            h = z + ((1 + p[4]) * r if trained else (1.0 + conv.fixed_eps()) * r)
            h = F.relu(F.linear(h, p[0], p[1]))
            return _relu_if(act, F.linear(h, p[2], p[3]))

        return LayerSplit(a, False, gin, tuple(mlp + ([eps] if trained else [])), True)
    raise AssertionError(type(conv).__name__)  # _check_layer refused it


class MixtureGNN(nn.Module):
    """``gnn`` with each layer's aggregation on the host and its update on ``plan.device``;
    ``forward`` takes the GNN's arguments, with ``x`` on the host, and returns logits on the device."""

    #: where the trainer keeps the input features: the first aggregation reads them on the host
    input_device: torch.device | None = torch.device("cpu")

    def __init__(self, gnn: GNN, plan: MixturePlan) -> None:
        super().__init__()
        if gnn.norms is not None or gnn.label_emb is not None:
            raise ConfigError("the mixture of accelerators runs without --norm layer and --label-prop")
        if gnn.activation != "relu":
            raise ConfigError(f"the mixture of accelerators runs ReLU models, not {gnn.activation}")
        for conv in gnn.layers:
            _check_layer(conv)
        # the GNN's own modules, so the state dict has the GNN's keys
        self.convs = gnn.convs
        self.dropout = gnn.dropout
        self.plan = plan
        # per layer: the graph it was last given, the layer's split over it and its tiled aggregation
        self._layers: dict[int, tuple[GraphOperand, LayerSplit, HostAggregation]] = {}

    @property
    def layers(self) -> tuple[GraphConv, ...]:
        """The graph layers in order."""
        return tuple(self.convs)  # type: ignore[arg-type]

    def describe(self) -> list:
        """Each layer's :class:`~tessera.sparse.LayerSpec`, in order."""
        return [conv.describe() for conv in self.layers]

    def _layer(self, i: int, graph: GraphOperand) -> tuple[LayerSplit, HostAggregation]:
        """Layer ``i`` split over ``graph`` and its aggregation cut into the plan's tiles, made once
        per graph."""
        kept = self._layers.get(i)
        if kept is not None and kept[0] is graph:
            return kept[1], kept[2]
        split = split_layer(self.layers[i], graph, act=i < len(self.convs) - 1)
        agg = host_aggregation(split.operand, self.plan, inv_in_degree(split.operand) if split.mean else None)
        self._layers[i] = (graph, split, agg)
        return split, agg

    def forward(
        self,
        x: torch.Tensor,
        graph: GraphOperand | Sequence[GraphOperand],
        label_rows: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits of every vertex (or of ``targets``' rows), as :meth:`GNN.forward` computes them."""
        if label_rows is not None:
            raise ConfigError("the mixture of accelerators runs without --label-prop")
        layers = self.layers
        operands = list(graph) if isinstance(graph, Sequence) else [graph] * len(layers)
        if len(operands) != len(layers):
            raise ValueError(f"{len(operands)} operands for {len(layers)} layers")
        h = x if x.device.type == "cpu" else x.cpu()
        host_rows = None if rows is None else rows.cpu()
        for i, operand in enumerate(operands):
            h = dense.dropout(h, self.dropout, self.training, host_rows)
            split, agg = self._layer(i, operand)
            h = aggregate_update(
                h, agg, split.update, split.params, self.plan, root=split.root, out_on_device=i == len(layers) - 1
            )
        return h if targets is None else take_rows(h, targets.to(h.device))


def _check_layer(conv: GraphConv) -> None:
    if not isinstance(conv, (GCNConv, SAGEConv)) and not (isinstance(conv, GINConv) and isinstance(conv.nn, MLP)):
        raise ConfigError(
            f"the mixture of accelerators runs GCN, SAGE and GIN layers (an element-wise sum or mean), "
            f"not {type(conv).__name__}: use --aggregate-on device"
        )
    if isinstance(conv, SAGEConv) and conv.aggr not in ("sum", "mean"):
        raise ConfigError(f"the mixture of accelerators runs SAGE with sum or mean aggregation, not {conv.aggr}")
