"""``--strategy`` for a distributed run: the per-layer choices it names, or the planner's."""

from __future__ import annotations

import copy
import logging
from typing import Any

import torch

from tessera.comm.group import Comm
from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.nn.models import GNN
from tessera.parallel.base import StrategyOptions
from tessera.parallel.mixed import LayerChoice, StrategyPool, parse_strategy
from tessera.planner.candidates import AUTO_STAGES
from tessera.planner.plan import LayerProbe, Plan, plan_choices, plan_layers
from tessera.train.config import TrainConfig

log = logging.getLogger("tessera")


def model_probe(model: GNN, cfg: TrainConfig) -> LayerProbe:
    """The planner's view of ``model``: copies of each layer in every placement it can run."""
    copies = []
    for conv in model.layers:
        natural = conv.describe().aggregates_first
        places = (natural, *[p for p in conv.placements() if p != natural])
        placed = {}
        for p in places:
            placed[p] = copy.deepcopy(conv)
            placed[p].place(None if p == natural else p)
        copies.append(placed)

    def forward(layer: int, aggregate_first: bool | None, operand, x: torch.Tensor) -> torch.Tensor:
        placed = copies[layer]
        return placed[next(iter(placed)) if aggregate_first is None else aggregate_first](x, operand)

    specs = [{p: c.describe() for p, c in placed.items()} for placed in copies]
    description = {
        "model": cfg.model,
        "widths": [[s.in_width, s.out_width] for s in model.describe()],
        "heads": cfg.heads,
        "norm": cfg.norm,
        "label_prop": cfg.label_prop > 0,
    }
    return LayerProbe(
        placements=[tuple(placed) for placed in copies],
        spec=lambda layer, first: specs[layer][first],
        forward=forward,
        input_grad=cfg.norm == "layer" or cfg.label_prop > 0,
        description=description,
    )


def layer_choices(
    cfg: TrainConfig,
    model: GNN,
    source: Graph | dict[str, Any],
    comm: Comm,
    options: StrategyOptions,
    resumed: dict[str, Any] | None = None,
    auto_bits: bool = False,
    auto_stages: bool = False,
) -> tuple[list[LayerChoice], Plan | None, StrategyPool | None]:
    """Each layer's strategy for a distributed run, the plan's record (None unless ``auto``
    planned) and the strategies it sharded. ``auto`` plans on a whole graph whose layers all run
    under more than one strategy; from part files, or with attention layers, it is partition.
    ``resumed`` is the plan of the checkpoint the run resumes from (``world`` and ``choices``):
    ``auto`` trains with it, unplanned, when it is for this world size. ``auto_bits``
    (``--comm-bits auto``): the plan also chooses each layer's exchange widths
    (:func:`auto_bit_widths`); unplanned layers exchange 32-bit values. ``auto_stages``
    (``--pipeline-stages auto``): the plan chooses each tensor or hybrid layer's stage count too
    (:data:`~tessera.planner.candidates.AUTO_STAGES`)."""
    choices = parse_strategy(cfg.strategy, cfg.layers)
    if choices is not None:
        return choices, None, None
    if not isinstance(source, Graph) or any(s.edge_values for s in model.describe()):
        if cfg.pipeline_stages not in (1, "auto"):  # auto: nothing to choose, partition has no stages
            raise ConfigError(
                "--pipeline-stages is read by the hybrid and tensor strategies only, and --strategy auto runs "
                "partition parallelism for attention layers and from part files; drop --pipeline-stages"
            )
        if auto_bits and comm.rank == 0:
            log.info("--comm-bits auto: these layers run partition parallelism unplanned; they exchange 32-bit values")
        return [LayerChoice("partition")] * cfg.layers, None, None
    if resumed is not None and resumed["world"] == comm.world:
        rec = Plan(choices=tuple(resumed["choices"]), world=comm.world, source="checkpoint")
        return plan_choices(rec), rec, None
    if resumed is not None and comm.rank == 0:
        log.info("the checkpoint's plan is for %d ranks; planning the layers for %d", resumed["world"], comm.world)
    with torch.random.fork_rng():  # planning draws nothing from the run's random stream
        bits = auto_bit_widths(cfg) if auto_bits else None
        stages = AUTO_STAGES if auto_stages else ()
        rec, pool = plan_layers(
            comm, source, options, model_probe(model, cfg), bits, auto_bits=auto_bits, stages=stages
        )
    return plan_choices(rec), rec, pool


def auto_bit_widths(cfg: TrainConfig) -> tuple[int, ...]:
    """The exchange widths ``--comm-bits auto`` chooses among: 32, 8 and 4 bits, and 2 bits only
    with label propagation. SuperGCN pairs int2 with label propagation and LayerNorm; measured
    here (docs/design/quantized-exchange-accuracy.md), int8 and int4 train to fp32's accuracy,
    int2 alone loses 2.4 points that label propagation partly recovers, and LayerNorm lowers
    accuracy at every width, so it is not required."""
    return (32, 8, 4, 2) if cfg.label_prop > 0 else (32, 8, 4)
