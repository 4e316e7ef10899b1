"""Stacked GNN models and ``build_model``, the factory the trainer and CLI use."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tessera import ops
from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.nn.conv import GATConv, GCNConv, GINConv, SAGEConv
from tessera.nn.linear import Linear
from tessera.ops.dropout import dropout_with_mask
from tessera.ops.masked import dropout_mask

MODELS = ("gcn", "sage", "gin", "gat")


class GNN(nn.Module):
    """``num_layers`` convolutions; optional LayerNorm and dropout before each, ReLU (ELU for GAT)
    between them; optionally a label embedding for masked label propagation (SuperGCN §2.5)."""

    def __init__(
        self,
        convs: list[nn.Module],
        dropout: float,
        activation: str = "relu",
        norms: list[nn.Module] | None = None,
        label_classes: int = 0,
        s_spmm: bool = False,
    ) -> None:
        super().__init__()
        self.convs = nn.ModuleList(convs)
        self.norms = nn.ModuleList(norms) if norms else None
        self.dropout = dropout
        # S-SpMM where dropout/ReLU masks allow it. Off by default: with element-wise dropout masks
        # every cache line of a gathered row stays live, so on CPU it measured slower (arxiv,
        # jemalloc: 3-layer GCN step 836 vs 599 ms, GIN 810 vs 792 ms; benchmarks/RESULTS.md).
        self.s_spmm = s_spmm
        self.act = F.elu if activation == "elu" else F.relu
        in_dim = getattr(convs[0], "in_channels", None) or convs[0].nn[0].in_features
        self.label_emb = nn.Embedding(label_classes, in_dim) if label_classes else None
        if self.label_emb is not None:
            nn.init.zeros_(self.label_emb.weight)

    def reset_parameters(self) -> None:
        """Re-initialise every layer."""
        for conv in self.convs:
            conv.reset_parameters()
        for norm in self.norms or []:
            norm.reset_parameters()
        if self.label_emb is not None:
            nn.init.zeros_(self.label_emb.weight)

    def forward(
        self,
        x: torch.Tensor,
        graph: Graph,
        label_rows: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for every vertex of ``graph`` from features ``x``; with label propagation the
        embedded ``labels`` are added to the input features of ``label_rows``."""
        if self.label_emb is not None and label_rows is not None:
            # Even with no rows drawn, the input then requires grad on every rank, so all ranks
            # enter the same backward exchanges.
            x = x.index_add(0, label_rows, self.label_emb(labels))
        # S-SpMM (MixGCN §3.2.1): with dropout right after a layer that aggregates last, its mask
        # is drawn first and only the kept outputs are aggregated; a layer that aggregates its
        # input first computes only the input-gradient entries ReLU and dropout let through.
        # Same random draws in the same order, so the same values as the plain composition.
        fuse = (
            self.s_spmm
            and self.training
            and 0.0 < self.dropout < 1.0
            and self.norms is None
            and not _distributed(graph)
        )
        keep = None
        last = len(self.convs) - 1
        for i, conv in enumerate(self.convs):
            if self.norms is not None:
                x = self.norms[i](x)
            x = (
                ops.dropout(x, self.dropout, self.training)
                if keep is None
                else dropout_with_mask(x, keep, self.dropout)
            )
            uses_in, uses_out = conv.s_spmm_sides() if fuse and hasattr(conv, "s_spmm_sides") else (False, False)
            hints = {}
            if uses_in and i > 0 and self.act is F.relu and x.requires_grad:
                hints["input_grad_mask"] = x != 0
            keep = None
            if uses_out and i < last:
                keep = dropout_mask((graph.num_nodes, conv.out_channels), self.dropout)
                hints["output_mask"] = keep
            x = conv(x, graph, **hints)
            if i < last:
                x = self.act(x)
        return x


def _distributed(graph) -> bool:
    return hasattr(graph, "distributed_aggregate")


def _gin_mlp(i: int, o: int, hidden: int) -> nn.Module:
    return nn.Sequential(
        Linear(i, hidden), nn.ReLU(inplace=True), Linear(hidden, o)
    )  # in place: Linear saves only its input


def build_model(
    name: str,
    in_dim: int,
    hidden: int,
    out_dim: int,
    num_layers: int = 2,
    dropout: float = 0.5,
    *,
    heads: int = 8,
    attn_dropout: float | None = None,
    train_eps: bool = False,
    backend: str = "auto",
    norm: str = "none",
    label_classes: int = 0,
    s_spmm: bool = False,
) -> GNN:
    """A ``num_layers``-deep GCN, SAGE, GIN or GAT mapping ``in_dim`` features to ``out_dim`` logits.

    For GAT, ``hidden`` is the concatenated width (``heads`` heads of ``hidden // heads``) and the
    output layer has one head; ``attn_dropout`` defaults to ``dropout``. ``norm="layer"`` puts a
    LayerNorm before each layer; ``label_classes > 0`` adds a label embedding for label propagation;
    ``s_spmm=True`` uses masked aggregation (S-SpMM) where dropout and ReLU masks allow it."""
    name = name.lower()
    if name not in MODELS:
        raise ConfigError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    if num_layers < 1:
        raise ConfigError(f"--layers must be at least 1, got {num_layers}")
    if hidden < 1 or in_dim < 1 or out_dim < 1:
        raise ConfigError(f"layer widths must be positive (in {in_dim}, hidden {hidden}, out {out_dim})")
    dims = [in_dim] + [hidden] * (num_layers - 1) + [out_dim]
    convs: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
        last = i == num_layers - 1
        if name == "gcn":
            convs.append(GCNConv(a, b, backend=backend))
        elif name == "sage":
            convs.append(SAGEConv(a, b, backend=backend))
        elif name == "gin":
            convs.append(GINConv(_gin_mlp(a, b, hidden), train_eps=train_eps, backend=backend))
        else:
            if hidden % heads:
                raise ConfigError(f"GAT hidden width {hidden} must be divisible by --heads {heads}")
            h = 1 if last else heads
            convs.append(
                GATConv(
                    a,
                    b if last else hidden // heads,
                    heads=h,
                    concat=not last,
                    dropout=dropout if attn_dropout is None else attn_dropout,
                    backend=backend,
                )
            )
    if norm not in ("none", "layer"):
        raise ConfigError(f"unknown norm {norm!r}; choose none or layer")
    norms = [nn.LayerNorm(d) for d in dims[:-1]] if norm == "layer" else None
    act = "elu" if name == "gat" else "relu"
    return GNN(convs, dropout, activation=act, norms=norms, label_classes=label_classes, s_spmm=s_spmm)


def exchange_widths(name: str, in_dim: int, hidden: int, out_dim: int, num_layers: int = 2) -> list[int]:
    """Width of the features each layer aggregates (and so exchanges between ranks): GCN and SAGE
    aggregate the narrower side of their linear map (``linear_then_aggregate``), GIN its input."""
    dims = [in_dim] + [hidden] * (num_layers - 1) + [out_dim]
    name = name.lower()
    if name == "gin":
        return dims[:-1]
    if name in ("gcn", "sage"):
        return [b if b <= a else a for a, b in zip(dims[:-1], dims[1:])]
    raise ConfigError(f"exchange widths are defined for gcn, sage and gin, not {name!r}")


def aggregation_widths(name: str, in_dim: int, hidden: int, out_dim: int, num_layers: int = 2) -> list[int]:
    """Width of the features each layer of :func:`build_model` aggregates: as
    :func:`exchange_widths` for GCN, SAGE and GIN; GAT aggregates its transformed features
    (``hidden`` wide, then ``out_dim`` in the one-head output layer)."""
    if name.lower() not in MODELS:
        raise ConfigError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    if name.lower() == "gat":
        return [hidden] * (num_layers - 1) + [out_dim]
    return exchange_widths(name, in_dim, hidden, out_dim, num_layers)
