"""Stacked GNN models and ``build_model``, the factory the trainer and CLI use."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import nn

from tessera import sparse
from tessera.errors import ConfigError
from tessera.nn.conv import GATConv, GCNConv, GINConv, RGCNConv, SAGEConv, SAGELSTMConv
from tessera.nn.conv.base import GraphConv, LayerHints
from tessera.nn.mlp import MLP
from tessera.sparse import Epilogue, GraphOperand, LayerSpec
from tessera.sparse.dropout import dropout_mask, dropout_with_mask
from tessera.sparse.rows import take_rows


class GNN(nn.Module):
    """``num_layers`` convolutions; optional LayerNorm and dropout before each, ReLU (ELU for GAT)
    between them; optionally a label embedding for masked label propagation (SuperGCN §2.5)."""

    def __init__(
        self,
        convs: list[GraphConv],
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
        self.activation = activation
        in_dim = convs[0].describe().in_width
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

    def describe(self) -> list[LayerSpec]:
        """Each layer's :class:`LayerSpec`, in order."""
        return [conv.describe() for conv in self.convs]

    def forward(
        self,
        x: torch.Tensor,
        graph: GraphOperand | Sequence[GraphOperand],
        label_rows: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        rows: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits for every vertex from features ``x``; ``graph`` is one operand for every layer or
        a sequence of one per layer (a strategy may give each layer its own). With label
        propagation the embedded ``labels`` are added to the input features of ``label_rows``.
        ``rows`` are the global vertex ids of ``x``'s rows (None: their positions): dropout masks
        are keyed by them, so every split and order of the vertices draws the same masks.
        ``targets`` (distinct int64 positions of ``x``'s rows) asks for only those vertices'
        logits, ``self(x, graph)[targets]`` with the same value and gradients: a training step
        whose loss reads the training vertices only. The last layer then computes only those
        rows where it can (:attr:`GraphConv.takes_targets`)."""
        operands = list(graph) if isinstance(graph, Sequence) else [graph] * len(self.convs)
        if len(operands) != len(self.convs):
            raise ValueError(f"{len(operands)} operands for {len(self.convs)} layers")
        # Layer 0's input is the same raw feature tensor at every call unless something before it
        # changes it: it may then be aggregated once (LayerHints.constant_input)
        constant = self.norms is None and not x.requires_grad and (not self.training or self.dropout == 0.0)
        if self.label_emb is not None and label_rows is not None:
            # Even with no rows drawn, the input then requires grad on every rank, so all ranks
            # enter the same backward exchanges.
            x = x.index_add(0, label_rows, self.label_emb(labels).to(x.dtype))
            constant = False
        # S-SpMM (MixGCN §3.2.1): with dropout right after a layer that aggregates last, its mask
        # is drawn first and only the kept outputs are aggregated; a layer that aggregates its
        # input first computes only the input-gradient entries ReLU and dropout let through.
        # Same random draws in the same order, so the same values as the plain composition.
        fuse = self.s_spmm and self.training and 0.0 < self.dropout < 1.0 and self.norms is None
        keep = None
        last = len(self.convs) - 1
        # Without norms the activation and the next layer's dropout run as one pass
        # (sparse.act_dropout: the same draw at the same point, the same values).
        fused_next = self.norms is None and not fuse
        dropped = False
        for i, conv in enumerate(self.convs):
            if self.norms is not None:
                x = self.norms[i](x)
            # a layer that starts with a linear map of its input applies the dropout inside it
            # (sparse.dropout_linear: the same draw, no dropped-out copy of x kept for backward)
            left = not dropped and not fuse and keep is None and conv.takes_input_dropout and self.training
            p_in = self.dropout if left else 0.0
            if not dropped and not left:
                x = (
                    sparse.dropout(x, self.dropout, self.training, rows)
                    if keep is None
                    else dropout_with_mask(x, keep, self.dropout)
                )
            uses_in, uses_out = conv.s_spmm_sides() if fuse else (False, False)
            grad_mask = x != 0 if uses_in and i > 0 and self.activation == "relu" and x.requires_grad else None
            keep = None
            if uses_out and i < last:
                keep = dropout_mask((x.shape[0], conv.describe().out_width), self.dropout, rows)
            dropped = fused_next and i < last
            # between layers: the activation, and the next layer's dropout too where it is fused;
            # a layer that ends in a dense transform applies them in the same node (sparse.linear_act)
            p = self.dropout if dropped and self.training else 0.0
            epilogue = None
            if i < last and conv.takes_epilogue and not fuse:
                # nothing but the next layer reads x, and nothing asks for its gradient: the next
                # layer's linear map may leave its input-gradient product to the epilogue's node
                epilogue = Epilogue(self.activation, p, mask_only=not self.convs[i + 1].keeps_input(), takes_owed=True)
            own = targets if i == last and conv.takes_targets else None
            x = conv(x, operands[i], LayerHints(grad_mask, keep, rows, constant and i == 0, epilogue, p_in, own))
            if i < last and epilogue is None:
                # as with the epilogue above, the next layer's linear map may leave its
                # input-gradient product to this node
                x = sparse.act_dropout(x, self.activation, p, self.training, rows, takes_owed=True)
        if targets is not None and not self.convs[last].takes_targets:
            x = take_rows(x, targets)
        return x


def _gin_mlp(i: int, o: int, hidden: int) -> nn.Module:
    return MLP(i, hidden, o)


def _gcn(a: int, b: int, last: bool, o: dict) -> GraphConv:
    return GCNConv(a, b, backend=o["backend"])


def _sage(a: int, b: int, last: bool, o: dict) -> GraphConv:
    return SAGEConv(a, b, backend=o["backend"])


def _sage_lstm(a: int, b: int, last: bool, o: dict) -> GraphConv:
    return SAGELSTMConv(a, b, backend=o["backend"])


def _gin(a: int, b: int, last: bool, o: dict) -> GraphConv:
    return GINConv(_gin_mlp(a, b, o["hidden"]), train_eps=o["train_eps"], backend=o["backend"])


def _gat(a: int, b: int, last: bool, o: dict) -> GraphConv:
    heads = o["heads"]
    if o["hidden"] % heads:
        raise ConfigError(f"GAT hidden width {o['hidden']} must be divisible by --heads {heads}")
    return GATConv(
        a,
        b if last else o["hidden"] // heads,
        heads=1 if last else heads,
        concat=not last,
        dropout=o["attn_dropout"],
        backend=o["backend"],
    )


def _rgcn(a: int, b: int, last: bool, o: dict) -> GraphConv:
    if o["num_relations"] < 1:
        raise ConfigError(
            "--model rgcn needs a typed graph (edge types): a 'src rel dst' edge list (.rel), N-Triples (.nt), "
            "PyG data with edge_type, or synthetic:<preset>-rel"
        )
    return RGCNConv(
        a, b, o["num_relations"], num_bases=o["num_bases"], num_blocks=o["num_blocks"], backend=o["backend"],
        variant=o["rgcn_variant"],
    )  # fmt: skip


# name -> (builder of layer i from (in width, out width, is last, options), activation between layers)
LayerBuilder = Callable[[int, int, bool, dict], GraphConv]
REGISTRY: dict[str, tuple[LayerBuilder, str]] = {
    "gcn": (_gcn, "relu"),
    "sage": (_sage, "relu"),
    "sage-lstm": (_sage_lstm, "relu"),
    "gin": (_gin, "relu"),
    "gat": (_gat, "elu"),
    "rgcn": (_rgcn, "relu"),
}
MODELS = tuple(REGISTRY)


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
    num_relations: int = 0,
    num_bases: int | None = None,
    num_blocks: int | None = None,
    rgcn_variant: str = "auto",
) -> GNN:
    """A ``num_layers``-deep GCN, SAGE, SAGE-LSTM, GIN, GAT or RGCN mapping ``in_dim`` features to ``out_dim`` logits.

    For GAT, ``hidden`` is the concatenated width (``heads`` heads of ``hidden // heads``) and the
    output layer has one head; ``attn_dropout`` defaults to ``dropout``. ``norm="layer"`` puts a
    LayerNorm before each layer; ``label_classes > 0`` adds a label embedding for label propagation;
    ``s_spmm=True`` uses masked aggregation (S-SpMM) where dropout and ReLU masks allow it.
    RGCN needs the graph's ``num_relations`` and takes ``num_bases`` or ``num_blocks`` and the
    ``rgcn_variant`` of its relational sum (:class:`~tessera.nn.conv.rgcn.RGCNConv`'s ``variant``)."""
    name = name.lower()
    if name not in REGISTRY:
        raise ConfigError(f"unknown model {name!r}; choose from {', '.join(MODELS)}")
    if num_layers < 1:
        raise ConfigError(f"--layers must be at least 1, got {num_layers}")
    if hidden < 1 or in_dim < 1 or out_dim < 1:
        raise ConfigError(f"layer widths must be positive (in {in_dim}, hidden {hidden}, out {out_dim})")
    dims = [in_dim] + [hidden] * (num_layers - 1) + [out_dim]
    build, act = REGISTRY[name]
    options = {
        "backend": backend,
        "hidden": hidden,
        "heads": heads,
        "train_eps": train_eps,
        "attn_dropout": dropout if attn_dropout is None else attn_dropout,
        "num_relations": num_relations,
        "num_bases": num_bases,
        "num_blocks": num_blocks,
        "rgcn_variant": rgcn_variant,
    }
    convs = [build(a, b, i == num_layers - 1, options) for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))]
    if norm not in ("none", "layer"):
        raise ConfigError(f"unknown norm {norm!r}; choose none or layer")
    norms = [nn.LayerNorm(d) for d in dims[:-1]] if norm == "layer" else None
    return GNN(convs, dropout, activation=act, norms=norms, label_classes=label_classes, s_spmm=s_spmm)
