"""Everything a training run prepares before its first epoch: the features, the model, the
parallel strategy and this rank's rows, the vertex order, and the split sizes."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessera.backends.ordering import resolve
from tessera.comm.group import Comm
from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.graph.formats import format_bytes, memory_limit
from tessera.graph.order import METHODS, VertexOrder
from tessera.nn import build_model
from tessera.nn.models import GNN
from tessera.parallel import Shard, Strategy, StrategyOptions, make_strategy
from tessera.parallel.base import SPLITS
from tessera.parallel.mixed import make_layer_strategy
from tessera.phases import phase
from tessera.planner.plan import Plan
from tessera.sparse import Operand
from tessera.train.checkpoint import check_plan
from tessera.train.config import TrainConfig
from tessera.train.planning import layer_choices


def _distributed_order(
    source: Graph | dict[str, Any], setting: str, widths: list[int], backend: str, comm: Comm
) -> VertexOrder | None:
    """The order a distributed run renumbers the whole graph by (None: none, or part files): rank 0
    resolves ``setting`` (``auto`` times the orders on rank 0's backends) and computes it, and every
    rank receives its permutation, so all ranks split one numbering."""
    if not isinstance(source, Graph):
        return None
    code = torch.zeros(1, dtype=torch.int64)
    perm = torch.empty(source.num_nodes, dtype=torch.int64)
    if comm.rank == 0:
        method = resolve(source, setting, widths, backend)
        code[0] = METHODS.index(method)
        if method != "none":
            perm = VertexOrder.of(source, method, max(widths)).perm
    method = METHODS[int(comm.broadcast(code)[0])]
    if method == "none":
        return None
    return VertexOrder.from_perm(comm.broadcast(perm).numpy(), method)


def prepare_features(
    x: torch.Tensor, mode: str, non_negative: bool | None = None, in_place: bool = False
) -> torch.Tensor:
    """Node features for training: row-normalised (Kipf & Welling) for ``row``, and for ``auto``
    when every feature is non-negative (bag-of-words style; ``non_negative`` overrides the check,
    for a rank that sees only its rows); unchanged otherwise. ``in_place`` normalises ``x`` itself
    (a copy the caller owns) instead of allocating a second ``N x F`` tensor."""
    if non_negative is None:
        non_negative = bool((x >= 0).all())
    if mode == "row" or (mode == "auto" and non_negative):
        s = x.sum(1, keepdim=True)
        s = torch.where(s == 0, torch.ones_like(s), s)
        x = x.div_(s) if in_place else x / s
    return x


@dataclass
class Setup:
    """One rank's prepared run. ``shard`` holds the rows it trains in training order (``shard.ids``
    maps them to the caller's vertex ids); ``operands`` has one entry per model layer."""

    shard: Shard
    x: torch.Tensor
    model: GNN
    strategy: Strategy
    operands: list[Operand]
    order: VertexOrder | None
    counts: dict[str, int]  # global split sizes
    plan: Plan | None = None  # the planner's record under --strategy auto
    feature_norm: str = "none"  # what --feature-norm did to the features: row or none
    comm_bits: list[tuple[int, int]] | None = None  # each layer's (forward, backward) exchange bits


def _dims(source: Graph | dict[str, Any]) -> tuple[int, int]:
    if isinstance(source, Graph):
        source.require("x", "y", "train_mask", "val_mask", "test_mask")
        assert source.num_classes is not None  # set with the labels
        return source.num_features, int(source.num_classes)
    return int(source["x"].shape[1]), int(source.get("meta", {}).get("num_classes"))


def is_multilabel(source: Graph | dict[str, Any]) -> bool:
    """Whether the graph (or part file) has multi-label targets (``y`` of shape ``(N, C)``)."""
    if isinstance(source, Graph):
        return source.multilabel
    return len(source["y"].shape) == 2


def _relations(cfg: TrainConfig, source: Graph | dict[str, Any]) -> int:
    """The relation count an RGCN model is built for (0 for other models)."""
    if cfg.model.lower() != "rgcn":
        if cfg.num_bases is not None or cfg.num_blocks is not None or cfg.rgcn_variant != "auto":
            raise ConfigError(f"--num-bases, --num-blocks and --rgcn-variant are RGCN options; --model is {cfg.model}")
        return 0
    if isinstance(source, Graph):
        name, relations = source.name, source.num_relations
    else:  # a part file: the whole graph's facts are in its meta
        meta = source.get("meta", {})
        name, relations = meta.get("name", "the partitioned graph"), meta.get("num_relations")
    if relations is None:
        raise ConfigError(
            f"--model rgcn needs a typed graph, but {name} has no edge types; use a 'src rel dst' edge "
            "list (.rel), N-Triples (.nt), PyG data with edge_type, or synthetic:<preset>-rel"
        )
    return int(relations)


def check_out_dir(path: str | os.PathLike) -> None:
    """Refuse a run directory that cannot be created or written, before anything is loaded or
    written: an existing file, a path under a file, an unwritable or pseudo file system. A missing
    directory is probed by creating and removing a uniquely named directory where its first missing
    component would go (unique, so ranks probing the same path at once do not collide)."""
    p = Path(path).absolute()
    try:
        if p.exists():
            if not p.is_dir():
                raise ConfigError(f"--out {path} is an existing file, not a directory; name a directory for the run")
            if not os.access(p, os.W_OK | os.X_OK):
                raise ConfigError(f"--out {path} is not writable; name a directory you can write")
            return
        first = p
        while not first.parent.exists():
            first = first.parent
        if not first.parent.is_dir():
            raise ConfigError(f"--out {path} cannot be created: {first.parent} is a file, not a directory")
        os.rmdir(tempfile.mkdtemp(prefix=".tessera-probe-", dir=first.parent))
    except OSError as e:
        raise ConfigError(f"--out {path} cannot be created ({e.strerror or e}); name a writable directory") from None


def check_model_memory(cfg: TrainConfig, rows: int, in_dim: int) -> None:
    """Refuse a model whose hidden activations and weights alone cannot fit in memory: at least
    ``rows x hidden x (layers - 1) + in_dim x hidden`` float32 values."""
    if cfg.layers < 2:
        return
    need = 4 * (rows * cfg.hidden * (cfg.layers - 1) + in_dim * cfg.hidden + cfg.hidden**2 * (cfg.layers - 2))
    limit = memory_limit()
    if need > limit:
        raise ConfigError(
            f"--hidden {cfg.hidden} with --layers {cfg.layers} on {rows:,} vertices needs at least "
            f"{format_bytes(need)} (vertices x hidden x (layers - 1) x 4 bytes of activations, plus weights), "
            f"more than the {format_bytes(limit)} this process can use; use a smaller --hidden"
        )


def fast_step_bytes(cfg: TrainConfig, rows: int, edges: int, in_dim: int) -> int:
    """The modelled bytes one fast-mode training step keeps for backward: per vertex the input and
    four hidden-width float32 values per hidden layer, and per edge a GAT layer's three per-head
    score arrays (docs/design/memory-modes.md measures them)."""
    per_row = in_dim + 4 * cfg.hidden * max(cfg.layers - 1, 0)
    per_edge = 3 * cfg.heads * max(cfg.layers - 1, 0) if cfg.model.lower() == "gat" else 0
    return 4 * (rows * per_row + edges * per_edge)


def recomputes(cfg: TrainConfig, rows: int, edges: int, in_dim: int) -> bool:
    """Whether training runs the hidden layers again in backward: ``--memory lean``, or ``auto``
    for a model of three or more layers when 1.5x the fast step's modelled bytes do not fit in
    what the process can allocate (with two layers lean keeps more bytes for SAGE and GAT:
    docs/design/memory-modes.md)."""
    if cfg.memory == "auto":
        return cfg.layers >= 3 and 3 * fast_step_bytes(cfg, rows, edges, in_dim) > 2 * memory_limit()
    return cfg.memory == "lean"


def prepare(
    cfg: TrainConfig, source: Graph | dict[str, Any], comm: Comm, checkpoint: tuple[Path, dict] | None = None
) -> Setup:
    """Build the model, split the graph (``source`` is the whole graph, or this rank's part file
    from ``tessera partition --out``) and prepare features, order and operands for ``cfg``;
    ``checkpoint`` (its path and contents) is the one the run resumes from, whose plan ``auto``
    reuses."""
    distributed = comm.world > 1 or not isinstance(source, Graph)
    in_dim, classes = _dims(source)
    if cfg.label_prop > 0 and is_multilabel(source):
        raise ConfigError(
            "--label-prop feeds class ids to the model, but the graph has multi-label targets; drop --label-prop"
        )
    relations = _relations(cfg, source)
    rows = source.num_nodes // comm.world if isinstance(source, Graph) else int(source["x"].shape[0])
    check_model_memory(cfg, rows, in_dim)
    model = build_model(
        cfg.model,
        in_dim,
        cfg.hidden,
        classes,
        cfg.layers,
        cfg.dropout,
        heads=cfg.heads,
        backend=cfg.backend,
        norm=cfg.norm,
        label_classes=classes if cfg.label_prop > 0 else 0,
        s_spmm=cfg.s_spmm,
        num_relations=relations,
        num_bases=cfg.num_bases,
        num_blocks=cfg.num_blocks,
        rgcn_variant=cfg.rgcn_variant,
    )
    edges = source.num_edges // comm.world if isinstance(source, Graph) else int(len(source["src"]))
    model.recompute = recomputes(cfg, rows, edges, in_dim)
    auto_bits, auto_stages = cfg.comm_bits == "auto", cfg.pipeline_stages == "auto"
    bits = 32 if isinstance(cfg.comm_bits, str) else cfg.comm_bits
    stages = 1 if isinstance(cfg.pipeline_stages, str) else cfg.pipeline_stages
    options = StrategyOptions(cfg.backend, cfg.remote_agg, cfg.partition, cfg.seed, bits, stages, cfg.groups)
    plan, layer_bits = None, None
    # A distributed run renumbers the whole graph before planning and splitting it, so each rank's
    # rows (its part's vertices in increasing new id) come in locality order; shard.ids maps back.
    widths = [spec.aggregate_width for spec in model.describe()]
    with phase("ordering the vertices"):
        renumbered = _distributed_order(source, cfg.reorder, widths, cfg.backend, comm) if distributed else None
    original = source
    if renumbered is not None:
        assert isinstance(source, Graph)  # part files are never renumbered
        source = renumbered.permute(source)
    if distributed:
        resumed = check_plan(checkpoint[1], checkpoint[0], model) if checkpoint is not None else None
        with phase("planning each layer (measuring kernels and exchanges)"):
            choices, plan, pool = layer_choices(cfg, model, source, comm, options, resumed, auto_bits, auto_stages)
        layer_bits = [choice.options(options).exchange_bits() for choice in choices]
        for conv, choice in zip(model.layers, choices):
            conv.place(choice.aggregate_first)
        strategy = make_layer_strategy(comm, options, choices, pool)
    else:
        strategy = make_strategy("single", comm, options)
    specs = model.describe()
    strategy.check(specs)
    order = None
    if not isinstance(source, Graph):
        shard = strategy.shard_from_part(source)
    elif distributed:
        shard = strategy.shard(source)
        if renumbered is not None:
            assert isinstance(original, Graph)
            shard.ids, shard.fingerprint = renumbered.ids_to_original(shard.ids), original.fingerprint()
    else:
        # auto times the CPU's kernels: a run on another device keeps the caller's order unless asked
        setting = cfg.reorder if comm.device.type == "cpu" or cfg.reorder != "auto" else "none"
        with phase("choosing a vertex order (measuring aggregation in each)"):
            method = resolve(source, setting, [s.aggregate_width for s in specs], cfg.backend)
        if method != "none":
            with phase(f"computing the {method} vertex order"):
                order = VertexOrder.of(source, method, max(s.aggregate_width for s in specs))
        with phase("renumbering the graph"):
            shard = strategy.shard(source if order is None else order.permute(source))
        if order is not None:  # train in the new numbering; everything user-visible keeps the caller's
            shard.ids, shard.fingerprint = order.perm, source.fingerprint()
    if checkpoint is not None and isinstance(original, Graph) and isinstance(checkpoint[1], dict):
        named = checkpoint[1].get("graph")
        if named not in (None, shard.fingerprint) and named == original.legacy_fingerprint():
            shard.fingerprint = named  # a checkpoint from before tessera.digest: the run keeps its name for the graph
    # Global facts are sums over ranks: split sizes, and whether any feature is negative.
    # (a minimum, not a count of negatives: no N x F temporary; Graph and load_part refuse NaN features)
    negative = shard.x.numel() > 0 and bool(shard.x.amin() < 0)
    local = torch.tensor([float(shard.masks[k].sum()) for k in SPLITS] + [float(negative)])
    total = comm.all_reduce_sum(local)
    # the shard's rows are a copy (renumbered or another rank's slice) unless it is the caller's graph
    owned = not (isinstance(original, Graph) and shard.x is original.x)
    non_negative = bool(total[3] == 0)
    x = prepare_features(shard.x, cfg.feature_norm, non_negative=non_negative, in_place=owned)
    applied = "row" if cfg.feature_norm == "row" or (cfg.feature_norm == "auto" and non_negative) else "none"
    if cfg.precision == "bf16":  # features, activations and their gradients stored in bfloat16
        x = x.to(torch.bfloat16)
    operands = [strategy.operand(spec, i) for i, spec in enumerate(specs)]
    counts = {k: int(total[i]) for i, k in enumerate(SPLITS)}
    return Setup(shard, x, model, strategy, operands, order, counts, plan, applied, layer_bits)
