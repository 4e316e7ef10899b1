"""The ``tessera simulate`` subcommand: communication volumes and projected times for P parts."""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from tessera.comm.wire import COMM_BITS
from tessera.errors import ConfigError
from tessera.graph.partition.halo import MODES
from tessera.planner.model import DEFAULT_BANDWIDTH_GBPS, DEFAULT_LATENCY_US, DEFAULT_QUANT_GBPS

if TYPE_CHECKING:
    from tessera.planner.optimum import ChoiceCheck
    from tessera.planner.plan import CandidateRow, Plan
    from tessera.planner.report import SimulatedRun

DESCRIPTION = """\
Compute, without starting any process, the rows and bytes every ordered pair of P ranks exchanges
per training epoch (forward and backward of every layer; evaluation forwards only in --json),
exactly as `tessera train --nprocs P` sends them, and project the communication time with
SuperGCN's model (Eq. 2-6): per exchange, max over ranks of sum over peers of (bytes/BW + latency)
plus quantize/dequantize streaming (b < 32) and LayerNorm (--norm layer) at the quantization
throughput; the epoch time sums its exchanges."""


def _ints(text: str, flag: str) -> list[int]:
    """Comma-separated integers."""
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise ConfigError(f"{flag} takes comma-separated integers, got {text!r}") from None
    if not vals:
        raise ConfigError(f"{flag} needs at least one value")
    return vals


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``simulate`` on an ``add_subparsers()`` object; returns its parser."""
    s = subparsers.add_parser(
        "simulate",
        help="communication volume and projected time for P parts, without starting processes",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("--dataset", help="cora | citeseer | ogbn-* | a path | synthetic:<preset> (default synthetic:small)")
    s.add_argument("--name", help="which dataset, when a directory holds several (e.g. cora)")
    s.add_argument("--parts", required=True, help="number of parts, or several comma-separated (e.g. 8,64,512)")
    s.add_argument(
        "--model",
        default="gcn",
        help="gcn | sage | sage-lstm | gin | gat | rgcn (default gcn; rgcn needs a typed graph)",
    )
    s.add_argument("--heads", type=int, default=8, help="gat's attention heads, as train --heads (default 8)")
    s.add_argument("--hidden", type=int, default=256, help="hidden width (default 256)")
    s.add_argument("--layers", type=int, default=2, help="number of graph layers (default 2)")
    s.add_argument("--out-dim", type=int, help="output width (default: the dataset's number of classes)")
    s.add_argument(
        "--norm", default="none", help="none | layer: LayerNorm before each layer, as train --norm (default none)"
    )
    s.add_argument(
        "--label-prop",
        type=float,
        default=0.0,
        help="masked label propagation share, as train --label-prop (default 0)",
    )
    s.add_argument(
        "--dropout",
        type=float,
        default=0.5,
        help="dropout, as train --dropout: at 0 a layer 0 that aggregates the raw features does so once, "
        "in the first epoch, and steady epochs exchange nothing for it (default 0.5)",
    )
    s.add_argument(
        "--strategy",
        default="partition",
        help="partition, tensor, hybrid or a comma list: tensor adds MixGCN's volumes beside prepost, hybrid "
        "the volumes of --strategy hybrid at each --groups M (default partition)",
    )
    s.add_argument(
        "--groups",
        default="all",
        help="hybrid strategy's M, as train --groups: comma list of values dividing every --parts P, or all "
        "(every divisor of each P; default all)",
    )
    s.add_argument(
        "--pipeline-stages",
        type=int,
        default=1,
        help="tensor strategy's pipeline stages, as train --pipeline-stages: below 32 bits each stage's "
        "blocks carry their own quantization groups (default 1)",
    )
    s.add_argument(
        "--placement",
        default="auto",
        help="each layer's operation placement, as a --strategy entry's @ suffix: auto, aggregate-first or "
        "transform-first, or a comma list of them per layer; rgcn's aggregate-first gathers its input rows, "
        "transform-first sends W_r x_j per remote (relation, source) pair, auto takes the fewer bytes (default auto)",
    )
    s.add_argument("--remote-agg", default="all", help="pre | post | prepost | all, or a comma list (default all)")
    s.add_argument("--comm-bits", default="32,2", help="comma list from 32,8,4,2 (default 32,2)")
    s.add_argument(
        "--bandwidth-gbps",
        type=float,
        default=DEFAULT_BANDWIDTH_GBPS,
        help=f"link bandwidth per rank in GB/s, BW_comm (default {DEFAULT_BANDWIDTH_GBPS}: a 100 Gb/s InfiniBand/Ethernet class interconnect)",
    )
    s.add_argument(
        "--latency-us",
        type=float,
        default=DEFAULT_LATENCY_US,
        help=f"latency per message in microseconds, L_comm (default {DEFAULT_LATENCY_US}: typical MPI small-message latency)",
    )
    s.add_argument(
        "--quant-gbps",
        type=float,
        default=DEFAULT_QUANT_GBPS,
        help=f"throughput of quantize/dequantize/LayerNorm streaming in GB/s, TH_cal (default {DEFAULT_QUANT_GBPS}: "
        "a STREAM triad measured on a 2-core CPU; see docs/design/planner-calibration.md)",
    )
    s.add_argument("--method", default="metis", help="metis | range | random (default metis)")
    s.add_argument("--seed", type=int, default=0, help="partition seed, as train --seed (default 0)")
    s.add_argument("--table-layer", type=int, default=0, help="layer of the Table-5-style comparison (default 0)")
    s.add_argument(
        "--plan",
        action="store_true",
        help="add the planner's modelled choice per layer and P (tessera plan --model-only, at this link model "
        "and compute rates timed here), and whether each is the modelled optimum with every candidate's "
        "communication from the simulator's blocks",
    )
    s.add_argument("--plot", help="write a PNG of volume and projected time versus P here")
    s.add_argument("--json", action="store_true", help="print only JSON to stdout")
    return s


def _modes(text: str) -> tuple[str, ...]:
    if text.strip() == "all":
        return ("pre", "post", "prepost")
    modes = tuple(m.strip() for m in text.split(",") if m.strip())
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        raise ConfigError(f"--remote-agg must be pre, post, prepost, all or a comma list of them, got {text!r}")
    return tuple(dict.fromkeys(modes))


def _placements(text: str, layers: int) -> list[bool | None]:
    """``--placement``: one ``aggregate_first`` value (None: auto) per layer."""
    from tessera.parallel.mixed import PLACEMENTS

    names = [p.strip() for p in str(text).split(",")]
    bad = [p for p in names if p != "auto" and p not in PLACEMENTS]
    if bad or len(names) not in (1, layers):
        raise ConfigError(
            f"--placement takes auto, aggregate-first or transform-first, once or once per layer ({layers}), "
            f"got {text!r}"
        )
    return [None if p == "auto" else PLACEMENTS[p] for p in names] * (layers if len(names) == 1 else 1)


def _bits(text: str) -> tuple[int, ...]:
    bits = _ints(text, "--comm-bits")
    bad = [b for b in bits if b not in COMM_BITS]
    if bad:
        raise ConfigError(f"--comm-bits values must be among {', '.join(map(str, COMM_BITS))}, got {bad[0]}")
    return tuple(sorted(set(bits), reverse=True))


MAX_PARTS = 1 << 20


def run(args: argparse.Namespace) -> int:
    """Simulate every requested P, print the tables (or JSON), write the plot; returns 0."""
    from tessera.datasets import load
    from tessera.nn import build_model
    from tessera.planner.model import CommModel, project, project_tensor
    from tessera.planner.report import SimulatedRun, format_table, format_table5, to_json, write_plot
    from tessera.planner.volume.hybrid import hybrid_volumes
    from tessera.planner.volume.partition import simulate_volumes
    from tessera.planner.volume.tensor import tensor_volumes
    from tessera.train.config import check_range

    parts = _ints(args.parts, "--parts")
    if any(p < 1 for p in parts):
        raise ConfigError(f"--parts values must be at least 1, got {args.parts!r}")
    modes, bits = _modes(args.remote_agg), _bits(args.comm_bits)
    strategies = tuple(dict.fromkeys(s.strip() for s in args.strategy.split(",") if s.strip()))
    if not strategies or any(s not in ("partition", "tensor", "hybrid") for s in strategies):
        raise ConfigError(
            f"--strategy must be partition, tensor, hybrid or a comma list of them, got {args.strategy!r}"
        )
    groups = {p: _groups(args.groups, p) for p in parts} if "hybrid" in strategies else {}
    m = CommModel(args.bandwidth_gbps, args.latency_us, args.quant_gbps)
    if not 0 <= args.dropout < 1:
        raise ConfigError(f"--dropout must be in [0, 1), got {args.dropout}")
    if not 0 <= args.label_prop < 1:
        raise ConfigError(f"--label-prop must be in [0, 1), got {args.label_prop}")
    for name in ("layers", "hidden", "heads", "pipeline_stages", "seed"):
        check_range(name, getattr(args, name))
    if any(p > MAX_PARTS for p in parts):
        raise ConfigError(f"--parts values must be at most {MAX_PARTS:,}, got {args.parts!r}")
    if not 0 <= args.table_layer < args.layers:
        raise ConfigError(f"--table-layer must be in [0, {args.layers}), got {args.table_layer}")
    placements = _placements(args.placement, args.layers)
    t0 = time.perf_counter()
    g = load(args.dataset or "synthetic:small", name=args.name)
    load_s = time.perf_counter() - t0
    out_dim = args.out_dim if args.out_dim is not None else g.num_classes
    if out_dim is None:
        raise ConfigError("the graph has no labels; pass the output width (--out-dim)")
    model = build_model(
        args.model,
        g.num_features,
        args.hidden,
        int(out_dim),
        args.layers,
        heads=args.heads,
        num_relations=g.num_relations or 0,
    )
    for conv, place in zip(model.layers, placements):
        conv.place(place)
    specs = model.describe()
    runs = []
    for p in parts:
        t = time.perf_counter()
        vol = simulate_volumes(
            g, p, specs, modes, bits, args.method, args.seed, args.norm, args.label_prop, args.model, args.dropout
        )
        t1 = time.perf_counter()
        proj = project(vol, m)
        model_s = time.perf_counter() - t1
        timing = replace(vol.timing_s, model=model_s, total=time.perf_counter() - t)
        # the arguments tensor_volumes and hybrid_volumes take after their own
        shared = (args.method, args.seed, args.norm, args.label_prop, bits, args.pipeline_stages, args.dropout)
        tv = None
        if "tensor" in strategies:
            tv = tensor_volumes(g, p, specs, *shared)
            tv = replace(tv, time_s=project_tensor(tv, m))
        hybrid = tuple(hybrid_volumes(g, p, k, specs, mode, *shared) for k in groups.get(p, []) for mode in modes)
        runs.append(SimulatedRun(vol=replace(vol, timing_s=timing), proj=proj, tensor=tv, hybrid=hybrid))
    if args.plan:
        runs = [
            replace(r, plan=plan, check=check)
            for r, (plan, check) in zip(runs, modelled_plans(g, runs, args, m, int(out_dim)))
        ]
    plot = str(write_plot(runs, args.plot)) if args.plot else None
    if args.json:
        sys.stdout.write(to_json(runs, m, plot, args.table_layer) + "\n")
        return 0
    v0 = runs[0].vol
    widths, backward = list(v0.widths), list(v0.backward)
    print(
        f"{v0.dataset}: {v0.vertices:,} vertices, {v0.edges:,} edges; {args.model} {v0.in_dim}->"
        f"{args.hidden}x{args.layers - 1}->{v0.out_dim}, exchange widths {widths}"
        f"{' (0: aggregated once, in the first epoch)' if 0 in widths else ''}, backward exchange per layer "
        f"{backward}; {args.method} partition, seed {args.seed}"
    )
    print(
        f"model: BW {m.bandwidth_gbps:g} GB/s, latency {m.latency_us:g} us, quantization {m.quant_gbps:g} GB/s; "
        "MB = 1e6 bytes, per training epoch (forward + backward); evaluation forwards not included"
    )
    print(format_table(runs))
    if runs[0].vol.placements:
        print()
        print(format_placements(runs))
    for r in runs:
        print()
        print(format_table5(r, args.table_layer))
    if "tensor" in strategies:
        print()
        print(format_tensor_table(runs))
    if "hybrid" in strategies:
        print()
        print(format_hybrid_table(runs))
    if args.plan:
        print()
        print(format_plan_sweep(runs))
    print()
    print(f"load {load_s:.2f} s")
    for r in runs:
        ts = r.vol.timing_s
        print(
            f"P={r.vol.parts}: {ts.total:.2f} s (partition {ts.partition:.2f} s, pair rows {ts.rows:.2f} s, "
            f"bytes {ts.bytes:.2f} s, model {ts.model:.2f} s); cut edges {r.vol.cut_edges:,}"
        )
    if plot:
        print(f"wrote {plot}")
    return 0


def format_tensor_table(runs: list[SimulatedRun]) -> str:
    """Tensor parallelism's volume per P (per bit width) beside prepost's fp32 volume, and the
    first P where tensor's fp32 volume is the smaller."""
    tensors = [r.tensor for r in runs if r.tensor is not None]
    bits = list(tensors[0].bits) if tensors else []
    stages = tensors[0].stages if tensors else 1
    lines = [
        f"tensor parallelism (MixGCN), per training epoch{f', {stages} pipeline stages' if stages > 1 else ''}:",
        f"{'P':>6} "
        + " ".join(f"{f'tensor MB {b}b':>14}" for b in bits)
        + f" {'busiest MB 32b':>14} {'feature MB/rank':>16} {'FLOPs max/mean':>15} {'prepost MB':>11} {'tensor/prepost':>15}"
        + f" {'prepost feat MB/rank':>21} {'prepost FLOPs max/mean':>23}",
    ]
    crossover = None
    for r in runs:
        tv = r.tensor
        if tv is None:
            continue
        prepost = r.vol.modes.get("prepost")
        pre = prepost.bits.get(32) if prepost is not None else None
        pre_bytes = pre.epoch.bytes if pre else None
        ratio = tv.bytes / pre_bytes if pre_bytes else None
        if ratio is not None and ratio < 1 and crossover is None:
            crossover = tv.parts
        lines.append(
            f"{tv.parts:>6} "
            + " ".join(f"{tv.bits[b].bytes / 1e6:>14.3f}" for b in bits)
            + f" {tv.max_rank_bytes / 1e6:>14.3f} {tv.feature_bytes_max / 1e6:>16.3f} "
            f"{tv.flops_max_over_mean:>15.3f} "
            + (f"{pre_bytes / 1e6:>11.3f} {ratio:>14.2f}x" if pre_bytes else f"{'-':>11} {'-':>15}")
            + (
                f" {r.vol.feature_bytes_max['prepost'] / 1e6:>21.3f} {r.vol.flops_max_over_mean:>23.3f}"
                if pre_bytes
                else ""
            )
        )
    if any("prepost" in r.vol.modes for r in runs):
        lines.append(
            f"tensor moves fewer fp32 bytes than prepost from P = {crossover} on (of the simulated P)"
            if crossover
            else "tensor moves more fp32 bytes than prepost at every simulated P"
        )
    return "\n".join(lines)


def format_placements(runs: list[SimulatedRun]) -> str:
    """Per P and bit width, each relational layer's forward exchange under both placements (all
    ranks' bytes) and the one the run takes."""
    lines = ["relational layers' placement (forward exchange, MB over all ranks; * taken, fixed: by --placement):"]
    for r in runs:
        for bits, layers in r.vol.placements.items():
            for la in layers:
                mark = {la.placement: "*"}
                lines.append(
                    f"P={r.vol.parts:>6} {bits:>2}b layer {la.layer}: "
                    f"{mark.get('gather', ' ')}gather {la.gather_bytes / 1e6:.6f}  "
                    f"{mark.get('transform-first', ' ')}transform-first {la.transform_first_bytes / 1e6:.6f}"
                    f"{'  (fixed)' if la.fixed else ''}"
                )
    return "\n".join(lines)


def _groups(text: str, parts: int) -> list[int]:
    """The hybrid ``--groups`` values for ``parts`` ranks: ``all`` is every divisor of ``parts``."""
    from tessera.parallel.hybrid import check_groups

    if str(text).strip() == "all":
        return [m for m in range(1, parts + 1) if parts % m == 0]
    values = _ints(text, "--groups")
    for m in values:
        check_groups(parts, m)
    return sorted(set(values))


def format_hybrid_table(runs: list[SimulatedRun]) -> str:
    """Hybrid parallelism's volume per P, M and halo mode (per bit width: in all, the row groups'
    all-to-alls and the column groups' halo exchanges apart, the busiest sender) beside partition
    parallelism's volume in the same mode and bits (M = 1 is partition, M = P tensor)."""
    lines = [
        "hybrid parallelism (M column slices x G = P/M halo-exchanging parts), per training epoch:",
        f"{'P':>6} {'M':>5} {'G':>5}  {'mode':<8} {'bits':>4} {'hybrid MB':>12} {'all-to-all MB':>14} {'halo MB':>11} "
        f"{'busiest MB':>11} {'partition MB':>13} {'hybrid/partition':>17}",
    ]
    for r in runs:
        for h in r.hybrid:
            for bits, v in h.bits.items():
                same = r.vol.modes.get(h.mode)
                part = same.bits.get(bits) if same is not None else None
                pb = part.epoch.bytes if part else None
                lines.append(
                    f"{h.parts:>6} {h.groups:>5} {h.parts // h.groups:>5}  {h.mode:<8} {bits:>4} "
                    f"{v.bytes / 1e6:>12.3f} {v.alltoall_bytes / 1e6:>14.3f} {v.halo_bytes / 1e6:>11.3f} "
                    f"{v.max_rank_bytes / 1e6:>11.3f} "
                    + (f"{pb / 1e6:>13.3f} {v.bytes / pb:>16.2f}x" if pb else f"{'-':>13} {'-':>17}")
                )
    return "\n".join(lines)


def modelled_plans(
    g, runs: list[SimulatedRun], args: argparse.Namespace, m, out_dim: int
) -> list[tuple[Plan, ChoiceCheck]]:
    """The planner's modelled plan for each run's P (compute rates timed once, here, on the
    smallest P's share of the graph; the link from ``m``), over the runs' own pair rows, with its
    check: whether each layer's choice is its modelled optimum with every candidate's
    communication from the simulator's blocks (:mod:`tessera.planner.optimum`)."""
    from tessera.graph.partition.halo import MODES
    from tessera.nn import build_model
    from tessera.parallel.base import StrategyOptions
    from tessera.planner.calibrate import local_rates
    from tessera.planner.candidates import Context
    from tessera.planner.optimum import check_choices, optimum_layers
    from tessera.planner.plan import aggregate_widths, model_plan
    from tessera.planner.volume.partition import simulate_volumes
    from tessera.train.config import TrainConfig
    from tessera.train.planning import model_probe

    cfg = TrainConfig(
        model=args.model, hidden=args.hidden, layers=args.layers, norm=args.norm, label_prop=args.label_prop
    )
    label_classes = out_dim if args.label_prop > 0 else 0
    model = build_model(
        args.model, g.num_features, args.hidden, out_dim, args.layers, norm=args.norm, label_classes=label_classes
    )
    probe = model_probe(model, cfg)
    options = StrategyOptions(partition=args.method, seed=args.seed, pipeline_stages=args.pipeline_stages)
    rates = local_rates(g, min(r.vol.parts for r in runs), m, widths=aggregate_widths(probe))
    plans = []
    for r in runs:
        vol = r.vol
        if not set(MODES) <= set(vol.rows):
            vol = simulate_volumes(
                g, vol.parts, model.describe(), MODES, (32,), args.method, args.seed, args.norm,
                args.label_prop, args.model, args.dropout,
            )  # fmt: skip
        ctx = Context(g, vol.parts, vol.part, options, rates)
        ctx.use_pair_rows(vol.rows)
        plan = model_plan(ctx, probe)
        plans.append((plan, check_choices(plan, optimum_layers(ctx, probe, vol))))
    return plans


def format_plan_sweep(runs: list[SimulatedRun]) -> str:
    """Per P, each layer's modelled choice and time, and the modelled step time of every layer's
    best candidate of each kind beside it; then whether every choice is the modelled optimum with
    the communication from the simulator's blocks."""
    lines = ["planner, modelled (ms per training step of each layer; * the choice):"]
    for r in runs:
        plan, check = r.plan, r.check
        if plan is None or check is None or plan.layers is None:
            continue
        wrong = [f"layer {i} optimum {o}" for i, (ok, o) in enumerate(zip(check.matches, check.optimum)) if not ok]
        lines.append(
            f"P={plan.world:>6} choice = modelled optimum (communication from the simulator's blocks): "
            + ("yes" if not wrong else "NO (" + ", ".join(wrong) + ")")
            + f"; candidates' modelled communication within {check.comm_rel_diff:.1e} of it"
        )
        for la in plan.layers:
            best: dict[str, CandidateRow] = {}
            for c in la.candidates:
                best.setdefault(c.kind, c)
            others = "  ".join(f"{k} {c.modelled_ms:.2f}" for k, c in best.items())
            top = la.candidates[0]
            lines.append(f"P={plan.world:>6} layer {la.layer}: *{top.label:<40} {top.modelled_ms:>10.2f}   ({others})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Run ``simulate`` standalone (``python -m tessera.cli.simulate``), with the CLI's error handling."""
    from tessera.errors import TesseraError

    parser = argparse.ArgumentParser(prog="tessera")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return run(args)
    except TesseraError as e:
        print(f"tessera: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
