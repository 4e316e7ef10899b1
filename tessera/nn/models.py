"""Stacked GNN models and ``build_model``, the factory the trainer and CLI use."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from tessera import dense
from tessera.dense import dropout_mask, dropout_with_mask
from tessera.errors import ConfigError
from tessera.nn.conv import GATConv, GCNConv, GINConv, RGCNConv, SAGEConv, SAGELSTMConv
from tessera.nn.conv.base import GraphConv, LayerHints
from tessera.nn.mlp import MLP
from tessera.nn.plan import ExecutionPlan, InputDropout, LayerStep, build_plan
from tessera.nn.recompute import recompute
from tessera.sparse import GraphOperand, LayerSpec
from tessera.sparse.rows import take_rows


class GNN(nn.Module):
    """``num_layers`` convolutions; optional LayerNorm and dropout before each, ReLU (ELU for GAT)
    between them; optionally a label embedding for masked label propagation (SuperGCN §2.5)."""

    #: where the caller keeps the input features: None, the device the model is on
    input_device: torch.device | None = None
    #: in training, keep only each hidden layer's input and run the layer again in backward
    #: (``--memory lean``; :func:`~tessera.nn.plan.build_plan`): the same values in less memory
    recompute: bool = False

    def __init__(
        self,
        convs: list[GraphConv],
        dropout: float,
        activation: str = "relu",
        norms: Sequence[nn.Module] | None = None,
        label_classes: int = 0,
        s_spmm: bool = False,
    ) -> None:
        super().__init__()
        self.convs = nn.ModuleList(convs)
        self.norms = nn.ModuleList(norms) if norms else None
        self.dropout = dropout
        # S-SpMM where dropout/ReLU masks allow it. Off by default: with element-wise dropout masks
        # every cache line of a gathered row stays live, so on CPU it measured slower
        # (docs/design/s-spmm.md).
        self.s_spmm = s_spmm
        self._plans: dict[tuple, ExecutionPlan] = {}
        self.activation = activation
        in_dim = convs[0].describe().in_width
        self.label_emb = nn.Embedding(label_classes, in_dim) if label_classes else None
        if self.label_emb is not None:
            nn.init.zeros_(self.label_emb.weight)

    def reset_parameters(self) -> None:
        """Re-initialise every layer."""
        for conv in self.layers:
            conv.reset_parameters()
        for norm in self.norms or []:
            norm.reset_parameters()  # type: ignore[operator]  # a LayerNorm, typed Module by its ModuleList
        if self.label_emb is not None:
            nn.init.zeros_(self.label_emb.weight)

    @property
    def layers(self) -> tuple[GraphConv, ...]:
        """The graph layers in order (``convs`` holds them as a ModuleList, which types them as modules)."""
        return cast("tuple[GraphConv, ...]", tuple(self.convs))

    def describe(self) -> list[LayerSpec]:
        """Each layer's :class:`LayerSpec`, in order."""
        return [conv.describe() for conv in self.layers]

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
        rows where it can (:attr:`~tessera.nn.conv.base.Fusion.targets`)."""
        operands = list(graph) if isinstance(graph, Sequence) else [graph] * len(self.convs)
        if len(operands) != len(self.convs):
            raise ValueError(f"{len(operands)} operands for {len(self.convs)} layers")
        plan = self.plan()
        # Layer 0's input is the same raw feature tensor at every call unless something before it
        # changes it: it may then be aggregated once (LayerHints.constant_input)
        constant = not x.requires_grad
        if self.label_emb is not None and label_rows is not None:
            # Even with no rows drawn, the input then requires grad on every rank, so all ranks
            # enter the same backward exchanges.
            x = x.index_add(0, label_rows, self.label_emb(labels).to(x.dtype))
            constant = False
        keep = None
        for step, conv, operand in zip(plan.steps, self.layers, operands, strict=True):
            args = (step, conv, operand, x, keep, rows, constant, targets, plan.training)
            if step.recompute:
                x, keep = recompute(self._step, *args)
            else:
                x, keep = self._step(*args)
        if targets is not None and not plan.last_takes_targets:
            x = take_rows(x, targets)
        return x

    def _step(
        self,
        step: LayerStep,
        conv: GraphConv,
        operand: GraphOperand,
        x: torch.Tensor,
        keep: torch.Tensor | None,
        rows: torch.Tensor | None,
        constant: bool,
        targets: torch.Tensor | None,
        training: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One layer's step of the plan: its output and the next dropout's keep mask, if drawn."""
        if step.norm and self.norms is not None:
            x = self.norms[step.index](x)
        if step.input_dropout is InputDropout.MODEL:
            x = dense.dropout(x, self.dropout, training, rows)
        elif step.input_dropout is InputDropout.MASK:
            assert keep is not None  # drawn by the step before
            x = dropout_with_mask(x, keep, self.dropout)
        grad_mask = x != 0 if step.input_grad_mask and x.requires_grad else None
        keep = (
            dropout_mask((x.shape[0], step.out_width), self.dropout, rows, x.device) if step.draws_output_mask else None
        )
        hints = LayerHints(
            input_grad_mask=grad_mask,
            output_mask=keep,
            rows=rows,
            constant_input=constant and step.constant_input,
            epilogue=step.epilogue,
            input_dropout=step.layer_dropout,
            targets=targets if step.targets else None,
        )
        x = conv(x, operand, hints)
        if step.activation_dropout is not None:
            # as with an epilogue, the next layer's linear map may leave its input-gradient
            # product to this node
            x = dense.act_dropout(x, self.activation, step.activation_dropout, training, rows, takes_owed=True)
        return x, keep

    def plan(self) -> ExecutionPlan:
        """The execution plan for the current training mode, dropout, S-SpMM setting and the layers'
        placements, built on first use and kept (:func:`~tessera.nn.plan.build_plan`)."""
        layers = self.layers
        key = (self.training, self.dropout, self.s_spmm, self.recompute, tuple(conv.aggregate_first for conv in layers))
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = build_plan(
                [conv.fusion() for conv in layers],
                [spec.out_width for spec in self.describe()],
                training=self.training,
                dropout=self.dropout,
                activation=self.activation,
                norms=self.norms is not None,
                s_spmm=self.s_spmm,
                recompute=self.recompute,
            )
        return plan


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
