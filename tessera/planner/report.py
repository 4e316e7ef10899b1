"""Text tables, a SuperGCN-Table-5-style comparison, a PNG plot and JSON of simulated runs.

A *run* (:class:`SimulatedRun`) is one P's partition volumes and their projected times, with the
tensor and hybrid volumes and the planner's modelled plan where the simulation asked for them.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessera.files import atomic_write
from tessera.planner.model import CommModel, ExchangeTime, Projection
from tessera.planner.records import Record
from tessera.planner.volume.hybrid import HybridVolumes
from tessera.planner.volume.partition import BitsVolume, DirectionVolume, PartitionVolumes
from tessera.planner.volume.tensor import TensorVolumes

if TYPE_CHECKING:
    from tessera.planner.optimum import ChoiceCheck
    from tessera.planner.plan import LayerPlan, Plan

MB = 1e6


@dataclass(frozen=True, kw_only=True)
class SimulatedRun:
    """One P of ``tessera simulate``: the partition volumes (``vol``), their projected times per
    mode and bit width (``proj``), and where asked the tensor volumes, the hybrid volumes of each
    M and mode, and the planner's modelled plan with its check against the modelled optimum."""

    vol: PartitionVolumes
    proj: dict[str, dict[int, Projection]]
    tensor: TensorVolumes | None = None
    hybrid: tuple[HybridVolumes, ...] = ()
    plan: Plan | None = None
    check: ChoiceCheck | None = None


@dataclass(frozen=True)
class Table5Row(Record):
    """One method of the Table-5-style comparison: rows, megabytes (data, parameters, in all) and
    the projected milliseconds of the layer's forward exchange."""

    rows: int
    data_MB: float
    params_MB: float
    MB: float
    time_ms: float


@dataclass(frozen=True)
class Table5Epoch(Record):
    """One mode's training epoch at fp32 and at the lowest bit width, in megabytes, and their ratio."""

    fp32_MB: float
    quant_MB: float
    ratio: float | None


@dataclass(frozen=True, kw_only=True)
class Table5(Record):
    """SuperGCN Table 5 for one layer's forward exchange (see :func:`table5`); the two ratios
    against the quantized prepost exist only when a bit width below 32 was simulated."""

    parts: int
    layer: int
    width: int
    rows: dict[str, Table5Row] = field(default_factory=dict)
    low_bits: int
    pre_over_prepost: float | None
    post_over_prepost: float | None
    prepost_fp32_over_quant: float | None = None
    pre_fp32_over_prepost_quant: float | None = None
    epoch: dict[str, Table5Epoch] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        if self.low_bits >= 32:
            del out["prepost_fp32_over_quant"], out["pre_fp32_over_prepost_quant"]
        return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt_x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


# ---------------------------------------------------------------------------------------- tables
def format_table(runs: list[SimulatedRun]) -> str:
    """Per P, mode and bits: MB per training epoch (all ranks), the busiest sender's MB, projected
    communication time per epoch and its speedup over fp32 post."""
    head = f"{'P':>5}  {'mode':<8} {'bits':>4}  {'total MB/epoch':>14}  {'busiest rank MB':>15}  {'comm ms/epoch':>13}  {'vs fp32 post':>12}"
    lines = [head, "-" * len(head)]
    for run in runs:
        vol, proj = run.vol, run.proj
        for mode, per_mode in vol.modes.items():
            for bits, v in per_mode.bits.items():
                t = proj[mode][bits]
                lines.append(
                    f"{vol.parts:>5}  {mode:<8} {bits:>4}  {v.epoch.bytes / MB:>14.3f}  "
                    f"{v.epoch.max_rank_bytes / MB:>15.3f}  {t.epoch.time_s * 1e3:>13.3f}  "
                    f"{_fmt_x(t.speedup_vs_fp32_post):>12}"
                )
    return "\n".join(lines)


def table5(run: SimulatedRun, layer: int = 0) -> Table5:
    """SuperGCN Table 5 for one layer's forward exchange: pre / post / prepost at fp32 and prepost
    at the lowest simulated bit width (data and parameters apart), with reduction factors."""
    vol, proj = run.vol, run.proj
    modes = vol.modes
    low = min(min(m.bits) for m in modes.values())
    r: dict[str, Table5Row] = {}
    for mode, per_mode in modes.items():
        for bits in sorted({32, low} & set(per_mode.bits)):
            d = per_mode.bits[bits].layers[layer].forward
            t = proj[mode][bits].layers[layer].forward
            if d is None or t is None:  # the layer aggregates its constant input once: no exchange per epoch
                continue
            r[f"{mode}/{bits}"] = Table5Row(d.rows, d.data_bytes / MB, d.param_bytes / MB, d.bytes / MB, t.time_s * 1e3)

    def get(key: str) -> float | None:
        return r[key].MB if key in r else None

    pp = get("prepost/32")
    quant: dict[str, float | None] = {}
    if low < 32:
        q = get(f"prepost/{low}")
        quant = {"prepost_fp32_over_quant": _ratio(pp, q), "pre_fp32_over_prepost_quant": _ratio(get("pre/32"), q)}
    epoch = {}
    for mode, per_mode in modes.items():
        if 32 in per_mode.bits and low < 32:
            a, b = per_mode.bits[32].epoch.bytes, per_mode.bits[low].epoch.bytes
            epoch[mode] = Table5Epoch(a / MB, b / MB, _ratio(a, b))
    return Table5(
        parts=vol.parts,
        layer=layer,
        width=vol.widths[layer],
        rows=r,
        low_bits=low,
        pre_over_prepost=_ratio(get("pre/32"), pp),
        post_over_prepost=_ratio(get("post/32"), pp),
        **quant,
        epoch=epoch,
    )


def format_table5(run: SimulatedRun, layer: int = 0) -> str:
    """:func:`table5` as text, laid out like SuperGCN's Table 5."""
    t = table5(run, layer)
    low = t.low_bits
    lines = [
        f"Table-5-style: {run.vol.dataset}, P={t.parts}, layer {layer} forward exchange (width {t.width})",
        f"{'method':<28} {'rows':>10} {'volume MB':>12} {'time ms':>10}",
    ]
    if not t.rows:
        lines.append("(none per epoch: the layer aggregates its constant input once, in the first epoch)")
    for key, row in t.rows.items():
        mode, bits = key.split("/")
        if bits == "32":
            lines.append(f"{mode + ' (fp32)':<28} {row.rows:>10,} {row.MB:>12.3f} {row.time_ms:>10.3f}")
    q = t.rows.get(f"prepost/{low}") if low < 32 else None
    if q is not None:
        name = f"prepost + Int{low}"
        lines.append(f"{name + ' data':<28} {q.rows:>10,} {q.data_MB:>12.3f} {'':>10}")
        lines.append(f"{name + ' params':<28} {'':>10} {q.params_MB:>12.3f} {'':>10}")
        lines.append(f"{name + ' total':<28} {'':>10} {q.MB:>12.3f} {q.time_ms:>10.3f}")
    red = [("pre/prepost", t.pre_over_prepost), ("post/prepost", t.post_over_prepost)]
    if q is not None:
        red += [
            (f"prepost fp32 / prepost+Int{low} (params included)", t.prepost_fp32_over_quant),
            (f"pre fp32 / prepost+Int{low}", t.pre_fp32_over_prepost_quant),
        ]
    shown = [f"{name} {_fmt_x(r)}" for name, r in red if r is not None]
    if shown:
        lines.append("bytes reduction: " + "; ".join(shown))
    if t.epoch:
        lines.append(
            f"per training epoch, fp32 -> Int{low} (params included): "
            + "; ".join(f"{m} {e.fp32_MB:.2f} -> {e.quant_MB:.2f} MB ({_fmt_x(e.ratio)})" for m, e in t.epoch.items())
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- plot
def write_plot(runs: list[SimulatedRun], path: str | Path) -> Path:
    """PNG of total MB per epoch and projected communication ms per epoch versus P (log axes), one
    line per mode and bit width; with tensor volumes (``runs[i].tensor``) also tensor
    parallelism's lines and two more panels, per-rank feature memory and the busiest rank's
    aggregation work over the mean (MixGCN Figs. 9-11 analogues). Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    runs = sorted(runs, key=lambda r: r.vol.parts)
    ps = [r.vol.parts for r in runs]
    tensors = [r.tensor for r in runs if r.tensor is not None]
    tensor = len(tensors) == len(runs)
    fig, axes = plt.subplots(2 if tensor else 1, 2, figsize=(11, 8.4 if tensor else 4.2), squeeze=False)
    a, b = axes[0]
    first = runs[0].vol
    colors = {
        "pre": "tab:blue",
        "post": "tab:orange",
        "prepost": "tab:green",
        "partition": "tab:green",
        "tensor": "tab:red",
    }
    markers = {
        "pre": "s",
        "post": "o",
        "prepost": "^",
        "partition": "^",
        "tensor": "D",
    }  # pre and post coincide on symmetric graphs

    def style(mode: str, bits: int) -> dict[str, Any]:
        label = f"{mode} {'fp32' if bits == 32 else f'int{bits}'}"
        return dict(
            color=colors.get(mode), linestyle="-" if bits == 32 else "--", marker=markers.get(mode, "o"), label=label
        )

    for mode, per_mode in first.modes.items():
        for bits in per_mode.bits:
            a.plot(ps, [r.vol.modes[mode].bits[bits].epoch.bytes / MB for r in runs], **style(mode, bits))
            b.plot(ps, [r.proj[mode][bits].epoch.time_s * 1e3 for r in runs], **style(mode, bits))
    titles = [
        (a, "volume per training epoch", "MB (all ranks)"),
        (b, "projected comm time (Eq. 6)", "ms per epoch"),
    ]
    if tensor:
        for bits in tensors[0].bits:
            a.plot(ps, [t.bits[bits].bytes / MB for t in tensors], **style("tensor", bits))
            b.plot(ps, [(t.time_s or {})[bits] * 1e3 for t in tensors], **style("tensor", bits))
        c, d = axes[1]
        for mode in first.modes:
            c.plot(ps, [r.vol.feature_bytes_max[mode] / MB for r in runs], **style(mode, 32))
        c.plot(ps, [t.feature_bytes_max / MB for t in tensors], **style("tensor", 32))
        d.plot(ps, [r.vol.flops_max_over_mean for r in runs], **style("partition", 32))
        d.plot(ps, [t.flops_max_over_mean for t in tensors], **style("tensor", 32))
        titles += [
            (c, "feature memory of the largest rank", "MB per rank"),
            (d, "aggregation work, busiest rank over mean", "max / mean"),
        ]
    for ax, title, ylab in titles:
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ps, [str(p) for p in ps])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlabel("parts P")
        ax.set_ylabel(ylab)
        ax.set_title(title)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{first.dataset}: {first.model} hidden {first.hidden}, {first.layers} layers")
    fig.tight_layout()
    path = Path(path)
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------- JSON
def _side(volume: DirectionVolume | None, times: ExchangeTime | None) -> dict[str, Any] | None:
    """One exchange's volume with its projected time under ``model``."""
    return None if volume is None else {**volume.to_dict(), "model": None if times is None else times.to_dict()}


def _merge(vol_bits: BitsVolume, proj_bits: Projection) -> dict[str, Any]:
    """Volumes and projected times of one mode and bit width in one tree."""
    layers = []
    for v, t in zip(vol_bits.layers, proj_bits.layers):
        forward, backward = _side(v.forward, t.forward), _side(v.backward, t.backward)
        layers.append({"layer": v.layer, "width": v.width, "forward": forward, "backward": backward})
    extra = {k: v for k, v in proj_bits.to_dict().items() if k not in ("layers", "epoch")}
    return {"layers": layers, "epoch": {**vol_bits.epoch.to_dict(), "model": proj_bits.epoch.to_dict()}, **extra}


def run_json(run: SimulatedRun, layer: int = 0) -> dict[str, Any]:
    """One run as JSON: the partition volumes with each mode's projected times merged in, the
    Table-5-style comparison of ``layer``, and the tensor volumes, plan and hybrid volumes the run
    has."""
    modes = {}
    for mode, per_mode in run.vol.modes.items():
        bits = {str(b): _merge(v, run.proj[mode][b]) for b, v in per_mode.bits.items()}
        modes[mode] = {**{k: v for k, v in per_mode.to_dict().items() if k != "bits"}, "bits": bits}
    out = {**run.vol.to_dict(), "modes": modes, "table5": table5(run, layer).to_dict()}
    if run.tensor is not None:
        out["tensor"] = run.tensor.to_dict()
    if run.plan is not None:
        out["plan"] = {**run.plan.to_dict(), **({} if run.check is None else {"check": run.check.to_dict()})}
    if run.hybrid:
        out["hybrid"] = [h.to_dict() for h in run.hybrid]
    return out


def to_json(runs: list[SimulatedRun], model: CommModel, plot: str | None = None, layer: int = 0) -> str:
    """Every number of the tables (and per exchange detail) as JSON."""
    doc = {"model": model.to_dict(), "runs": [run_json(run, layer) for run in runs], "plot": plot}
    return json.dumps(doc, indent=1, sort_keys=False)


# ---------------------------------------------------------------------------------------- plans
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_plan(rec: Plan, title: str = "") -> str:
    """Each layer's candidates of a plan with its layers and constants (``tessera.planner.plan``):
    modelled terms (Algorithm 1's padding idle and cache-reuse saving among them) and total,
    measured time and its ratio to the model, and the choice; then each candidate's Algorithm 1
    terms (M, S, pad, G, r, T_comp, T_mem, T_idle, T_saved)."""
    r = rec.rates
    if r is None or rec.layers is None:
        raise ValueError("format_plan needs a plan with its layers and constants")
    lines = [
        f"plan for {rec.world} ranks{': ' + title if title else ''} ({rec.source or '?'}, "
        f"{rec.planning_s or 0.0:.2f} s)",
        f"constants: aggregation {r.edge_s * 1e9:.2f} ns/edge + {r.value_s * 1e9:.3f} ns/value, "
        f"GEMM {r.gemm_flops / 1e9:.1f} GFLOP/s, fresh writes {r.fresh_value_s * 1e9:.2f} ns/value, "
        f"link {r.bandwidth_gbps:.2f} GB/s, latency {r.latency_us:.1f} us",
        f"memory: cache {r.cache_gbps:.1f} GB/s, main {r.dram_gbps:.1f} GB/s, r = {r.cache_ratio:.2f}",
    ]
    if r.hosts:
        lines.insert(
            2,
            f"hosts: {len(set(r.hosts))} (rank -> host {list(r.hosts)}); the link above is within a host, each "
            f"host's shared link to the others {r.inter_gbps:.3f} GB/s, latency {r.inter_latency_us:.1f} us",
        )
    head = (
        f"{'layer':>5}  {'candidate':<40} {'width':>5} {'bwd':>3} {'dense':>8} {'aggr':>8} {'comm':>8} {'memory':>8} "
        f"{'idle':>8} {'saved':>8} {'model ms':>9} {'measured':>9} {'meas/mod':>8}"
    )
    lines += [head, "-" * len(head)]
    for la in rec.layers:
        for c in la.candidates:
            m = c.model_ms
            mark = "*" if c.label == la.choice else (" " if c.survived else "-")
            ratio = c.measured_ms / c.modelled_ms if c.measured_ms and c.modelled_ms else None
            lines.append(
                f"{la.layer:>5} {mark}{c.label:<40} {c.width:>5} {'y' if c.backward else 'n':>3} "
                f"{m.dense:>8.2f} {m.aggregate:>8.2f} {m.comm:>8.2f} {m.memory:>8.2f} {m.idle:>8.2f} "
                f"{-m.saved:>8.2f} {c.modelled_ms:>9.2f} {_ms(c.measured_ms):>9} {_fmt_x(ratio):>8}"
            )
    lines.append("* the choice; - pruned by the model (not measured); times per training step of the layer")
    lines += _algorithm1_lines(rec.layers)
    lines.append(f"--strategy {','.join(rec.choices)}")
    return "\n".join(lines)


def _algorithm1_lines(layers: tuple[LayerPlan, ...]) -> list[str]:
    """The Algorithm 1 table of :func:`format_plan` (nothing when no candidate has its terms)."""
    rows = [(la.layer, c) for la in layers for c in la.candidates if c.alg1 is not None]
    if not rows:
        return []
    head = (
        f"{'layer':>5}  {'candidate':<40} {'M':>3} {'S':>5} {'pad':>3} {'G':>3} {'r':>6} "
        f"{'T_comp':>8} {'T_mem':>8} {'T_idle':>8} {'T_saved':>8} {'idle-saved':>10}"
    )
    out = ["NeutronAscend Algorithm 1 terms (ms; T_idle = pad/S T_comp, T_saved = T_mem (1 - 1/(1+(G-1)(r-1))))"]
    out += [head, "-" * len(head)]
    for layer, c in rows:
        a = c.alg1
        assert a is not None
        out.append(
            f"{layer:>5}  {c.label:<40} {a.M:>3} {a.S:>5} {a.pad:>3} {a.G:>3} {a.r:>6.2f} "
            f"{a.comp:>8.3f} {a.mem:>8.3f} {a.idle:>8.3f} {a.saved:>8.3f} {a.idle - a.saved:>10.3f}"
        )
    return out
