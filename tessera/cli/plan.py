"""The ``tessera plan`` subcommand: each layer's candidate strategies on P ranks, modelled and
measured, and the planner's choice (what ``--strategy auto`` trains with)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tessera.errors import ConfigError

if TYPE_CHECKING:
    from tessera.planner.plan import Plan

DESCRIPTION = """\
Plan a model's layers for P ranks as `tessera train --strategy auto` does: model every candidate
(partition post/pre/prepost at each --comm-bits, hybrid:M, tensor; each in every operation placement
the layer can run) from FLOPs at measured rates plus SuperGCN's communication model over the exact
blocks plus NeutronAscend Algorithm 1's padding idle and cache-reuse saving (from the measured cache
and main-memory bandwidths), keep those within --prune of each layer's modelled best, measure a few
forward + backward steps of each on P local processes, and print both times, the choice, and each
candidate's Algorithm 1 terms (M, S, pad, G, r, T_comp, T_mem, T_idle, T_saved). --model-only skips
the processes (the link constants then come from --bandwidth-gbps / --latency-us)."""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on an ``add_subparsers()`` object; returns its parser."""
    from tessera.cli.values import int_or_auto
    from tessera.planner.model import DEFAULT_BANDWIDTH_GBPS, DEFAULT_LATENCY_US
    from tessera.planner.plan import PRUNE_FACTOR

    s = subparsers.add_parser(
        "plan",
        help="each layer's candidate strategies for P ranks, modelled and measured, and the choice",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("--dataset", help="cora | citeseer | ogbn-* | a path | synthetic:<preset> (default synthetic:small)")
    s.add_argument("--name", help="which dataset, when a directory holds several (e.g. cora)")
    s.add_argument("--nprocs", type=int, required=True, help="number of ranks P to plan for")
    s.add_argument("--model", default="gcn", help="gcn | sage | gin (default gcn)")
    s.add_argument("--hidden", type=int, default=256, help="hidden width (default 256)")
    s.add_argument("--layers", type=int, default=2, help="number of graph layers (default 2)")
    s.add_argument("--norm", default="none", help="none | layer, as train --norm (default none)")
    s.add_argument("--label-prop", type=float, default=0.0, help="as train --label-prop (default 0)")
    s.add_argument(
        "--comm-bits",
        default="32",
        help="exchange widths to consider, comma list from 32,8,4,2, or auto as train --comm-bits auto (default 32)",
    )
    s.add_argument(
        "--pipeline-stages", type=int_or_auto, default=1, help="tensor and hybrid stages, or auto (default 1)"
    )
    s.add_argument("--partition", default="metis", help="metis | range | random (default metis)")
    s.add_argument("--seed", type=int, default=0, help="partition seed, as train --seed (default 0)")
    s.add_argument("--backend", default="auto", help="aggregation backend (default auto)")
    s.add_argument("--threads", type=int, help="CPU threads per rank (default: the cores / P)")
    s.add_argument(
        "--prune",
        type=float,
        default=PRUNE_FACTOR,
        help=f"measure candidates modelled within this factor of the best (default {PRUNE_FACTOR})",
    )
    s.add_argument("--measure-all", action="store_true", help="measure every candidate (no pruning)")
    s.add_argument("--model-only", action="store_true", help="decide from the model alone, without starting processes")
    s.add_argument("--no-cache", action="store_true", help="plan afresh, neither reading nor writing the plan cache")
    s.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=DEFAULT_BANDWIDTH_GBPS,
        help="--model-only link bandwidth per rank (GB/s)",
    )
    s.add_argument("--latency-us", type=float, default=DEFAULT_LATENCY_US, help="--model-only latency per message (us)")
    s.add_argument("--timeout", type=float, default=300.0, help="seconds a rank waits on its peers (default 300)")
    s.add_argument("--json", action="store_true", help="print the plan record as JSON")
    return s


def _settings(args: argparse.Namespace):
    """The run the plan is for, as a TrainConfig (validated like `train`'s), the bit widths and
    whether the plan chooses them per layer and direction (``--comm-bits auto``)."""
    from tessera.cli.simulate import _bits
    from tessera.train.config import TrainConfig
    from tessera.train.planning import auto_bit_widths

    cfg = TrainConfig(
        dataset=args.dataset or "synthetic:small",
        name=args.name,
        model=args.model,
        hidden=args.hidden,
        layers=args.layers,
        norm=args.norm,
        label_prop=args.label_prop,
        nprocs=args.nprocs,
        partition=args.partition,
        seed=args.seed,
        backend=args.backend,
        threads=args.threads,
        timeout=args.timeout,
        pipeline_stages=args.pipeline_stages,
    )
    auto_bits = args.comm_bits == "auto"
    bits = auto_bit_widths(cfg) if auto_bits else _bits(args.comm_bits)
    cfg.comm_bits = 32 if auto_bits else bits[0]
    cfg.validate()
    if not args.prune >= 1:
        raise ConfigError(f"--prune must be a factor of at least 1, got {args.prune}")
    return cfg, bits, auto_bits


def run(args: argparse.Namespace, argv: list[str]) -> int:
    """Plan (on ``--nprocs`` processes unless ``--model-only``), print the table; returns 0."""
    from tessera.comm.group import env_world_size

    cfg, bits, auto_bits = _settings(args)
    if not args.model_only and cfg.nprocs > 1 and env_world_size() <= 1:
        from tessera.cli.launch import launch

        return launch(argv, cfg.nprocs)
    from tessera.datasets import load
    from tessera.nn import build_model
    from tessera.parallel.base import StrategyOptions
    from tessera.threads import set_num_threads
    from tessera.train.planning import model_probe

    if cfg.threads:
        set_num_threads(cfg.threads)
    t0 = time.perf_counter()
    g = load(cfg.dataset, name=cfg.name)
    g.require("x", "y")
    assert g.num_classes is not None  # set with the labels
    model = build_model(
        cfg.model, g.num_features, cfg.hidden, int(g.num_classes), cfg.layers, heads=cfg.heads, norm=cfg.norm,
        label_classes=int(g.num_classes) if cfg.label_prop > 0 else 0,
    )  # fmt: skip
    if any(s.edge_values for s in model.describe()):
        raise ConfigError(
            f"--model {cfg.model} computes per-edge values (attention), which the planner does not model: "
            "--strategy auto runs it under partition parallelism, and --strategy partition or tensor choose by hand"
        )
    assert isinstance(cfg.comm_bits, int)
    stages = 1 if cfg.pipeline_stages == "auto" else int(cfg.pipeline_stages)
    options = StrategyOptions(cfg.backend, cfg.remote_agg, cfg.partition, cfg.seed, cfg.comm_bits, stages)
    probe = model_probe(model, cfg)
    factor = float("inf") if args.measure_all else args.prune
    if args.model_only or cfg.nprocs == 1:
        rec = _model_only(g, cfg, options, probe, bits, auto_bits, args)
    else:
        measured = _measured(g, cfg, options, probe, bits, auto_bits, factor, args)
        if measured is None:
            return 0  # a non-zero rank: rank 0 prints
        rec = measured
    total_s = time.perf_counter() - t0
    if args.json:
        doc = {**replace(rec, key=None).to_dict(), "total_s": total_s}
        sys.stdout.write(json.dumps(doc, indent=1) + "\n")
    else:
        from tessera.planner.report import format_plan

        print(
            format_plan(
                rec, f"{cfg.model} {g.num_features}->{cfg.hidden}x{cfg.layers - 1}->{g.num_classes} on {g.name}"
            )
        )
    return 0


def _stages(cfg) -> tuple[int, ...]:
    """The stage counts the plan considers: :data:`AUTO_STAGES` for ``--pipeline-stages auto``, else the run's."""
    from tessera.planner.candidates import AUTO_STAGES

    return AUTO_STAGES if cfg.pipeline_stages == "auto" else ()


def _model_only(g, cfg, options, probe, bits, auto_bits, args) -> Plan:
    from tessera.graph.partition import partition
    from tessera.planner.calibrate import local_rates
    from tessera.planner.candidates import Context
    from tessera.planner.model import CommModel
    from tessera.planner.plan import aggregate_widths, model_plan

    t0 = time.perf_counter()
    link = CommModel(args.bandwidth_gbps, args.latency_us)
    rates = local_rates(g, cfg.nprocs, link, cfg.backend, aggregate_widths(probe))
    part = partition(g, cfg.nprocs, cfg.partition, cfg.seed)
    ctx = Context(g, cfg.nprocs, part, options, rates, bits, auto_bits, None, _stages(cfg))
    rec = model_plan(ctx, probe)
    return replace(rec, planning_s=time.perf_counter() - t0)


def _measured(g, cfg, options, probe, bits, auto_bits, factor, args) -> Plan | None:
    """The measured plan on rank 0 (None on the other ranks)."""
    from tessera.comm.group import init_from_env, shutdown
    from tessera.planner.plan import plan_layers

    comm = init_from_env(cfg.timeout)
    try:
        rec, _ = plan_layers(
            comm, g, options, probe, bits, factor, use_cache=not args.no_cache, auto_bits=auto_bits, stages=_stages(cfg)
        )
    except BaseException:
        shutdown(clean=False)
        raise
    shutdown(clean=True)
    return rec if comm.rank == 0 else None
