"""Text tables, a SuperGCN-Table-5-style comparison, a PNG plot and JSON of simulated runs.

A *run* is ``{"vol": simulate_volumes(...), "proj": project(vol, model)}`` for one P.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tessera.files import atomic_write
from tessera.planner.model import CommModel

MB = 1e6


def _public(d: dict[str, Any]) -> dict[str, Any]:
    """``d`` without its ``_``-prefixed (non-JSON) keys."""
    return {k: v for k, v in d.items() if not k.startswith("_")}


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt_x(r: float | None) -> str:
    return "-" if r is None else f"{r:.2f}x"


# ---------------------------------------------------------------------------------------- tables
def format_table(runs: list[dict[str, Any]]) -> str:
    """Per P, mode and bits: MB per training epoch (all ranks), the busiest sender's MB, projected
    communication time per epoch and its speedup over fp32 post."""
    head = f"{'P':>5}  {'mode':<8} {'bits':>4}  {'total MB/epoch':>14}  {'busiest rank MB':>15}  {'comm ms/epoch':>13}  {'vs fp32 post':>12}"
    lines = [head, "-" * len(head)]
    for run in runs:
        vol, proj = run["vol"], run["proj"]
        for mode, per_mode in vol["modes"].items():
            for bits, v in per_mode["bits"].items():
                t = proj[mode][bits]
                lines.append(
                    f"{vol['parts']:>5}  {mode:<8} {bits:>4}  {v['epoch']['bytes'] / MB:>14.3f}  "
                    f"{v['epoch']['max_rank_bytes'] / MB:>15.3f}  {t['epoch']['time_s'] * 1e3:>13.3f}  "
                    f"{_fmt_x(t['speedup_vs_fp32_post']):>12}"
                )
    return "\n".join(lines)


def table5(run: dict[str, Any], layer: int = 0) -> dict[str, Any]:
    """SuperGCN Table 5 for one layer's forward exchange: pre / post / prepost at fp32 and prepost
    at the lowest simulated bit width (data and parameters apart), with reduction factors."""
    vol, proj = run["vol"], run["proj"]
    modes = vol["modes"]
    low = min(min(m["bits"]) for m in modes.values())
    out: dict[str, Any] = {"parts": vol["parts"], "layer": layer, "width": vol["widths"][layer], "rows": {}}
    for mode, per_mode in modes.items():
        for bits in sorted({32, low} & set(per_mode["bits"])):
            d = per_mode["bits"][bits]["layers"][layer]["forward"]
            t = proj[mode][bits]["layers"][layer]["forward"]
            if d is None:  # the layer aggregates its constant input once: no exchange per epoch
                continue
            out["rows"][f"{mode}/{bits}"] = {
                "rows": d["rows"],
                "data_MB": d["data_bytes"] / MB,
                "params_MB": d["param_bytes"] / MB,
                "MB": d["bytes"] / MB,
                "time_ms": t["time_s"] * 1e3,
            }
    r = out["rows"]
    get = lambda key, f="MB": r[key][f] if key in r else None  # noqa: E731
    pp = get("prepost/32")
    out["low_bits"] = low
    out["pre_over_prepost"] = _ratio(get("pre/32"), pp)
    out["post_over_prepost"] = _ratio(get("post/32"), pp)
    if low < 32:
        q = get(f"prepost/{low}")
        out["prepost_fp32_over_quant"] = _ratio(pp, q)
        out["pre_fp32_over_prepost_quant"] = _ratio(get("pre/32"), q)
    epoch = {}
    for mode, per_mode in modes.items():
        if 32 in per_mode["bits"] and low < 32:
            a, b = per_mode["bits"][32]["epoch"]["bytes"], per_mode["bits"][low]["epoch"]["bytes"]
            epoch[mode] = {"fp32_MB": a / MB, "quant_MB": b / MB, "ratio": _ratio(a, b)}
    out["epoch"] = epoch
    return out


def format_table5(run: dict[str, Any], layer: int = 0) -> str:
    """:func:`table5` as text, laid out like SuperGCN's Table 5."""
    t = table5(run, layer)
    vol = run["vol"]
    low = t["low_bits"]
    lines = [
        f"Table-5-style: {vol['dataset']}, P={t['parts']}, layer {layer} forward exchange (width {t['width']})",
        f"{'method':<28} {'rows':>10} {'volume MB':>12} {'time ms':>10}",
    ]
    if not t["rows"]:
        lines.append("(none per epoch: the layer aggregates its constant input once, in the first epoch)")
    for key, row in t["rows"].items():
        mode, bits = key.split("/")
        if bits == "32":
            lines.append(f"{mode + ' (fp32)':<28} {row['rows']:>10,} {row['MB']:>12.3f} {row['time_ms']:>10.3f}")
    q = t["rows"].get(f"prepost/{low}") if low < 32 else None
    if q is not None:
        name = f"prepost + Int{low}"
        lines.append(f"{name + ' data':<28} {q['rows']:>10,} {q['data_MB']:>12.3f} {'':>10}")
        lines.append(f"{name + ' params':<28} {'':>10} {q['params_MB']:>12.3f} {'':>10}")
        lines.append(f"{name + ' total':<28} {'':>10} {q['MB']:>12.3f} {q['time_ms']:>10.3f}")
    red = [("pre/prepost", t["pre_over_prepost"]), ("post/prepost", t["post_over_prepost"])]
    if q is not None:
        red += [
            (f"prepost fp32 / prepost+Int{low} (params included)", t["prepost_fp32_over_quant"]),
            (f"pre fp32 / prepost+Int{low}", t["pre_fp32_over_prepost_quant"]),
        ]
    shown = [f"{name} {_fmt_x(r)}" for name, r in red if r is not None]
    if shown:
        lines.append("bytes reduction: " + "; ".join(shown))
    if t["epoch"]:
        lines.append(
            f"per training epoch, fp32 -> Int{low} (params included): "
            + "; ".join(
                f"{m} {e['fp32_MB']:.2f} -> {e['quant_MB']:.2f} MB ({_fmt_x(e['ratio'])})"
                for m, e in t["epoch"].items()
            )
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------- plot
def write_plot(runs: list[dict[str, Any]], path: str | Path) -> Path:
    """PNG of total MB per epoch and projected communication ms per epoch versus P (log axes), one
    line per mode and bit width; with tensor volumes (``runs[i]["tensor"]``) also tensor
    parallelism's lines and two more panels, per-rank feature memory and the busiest rank's
    aggregation work over the mean (MixGCN Figs. 9-11 analogues). Written atomically."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullLocator

    runs = sorted(runs, key=lambda r: r["vol"]["parts"])
    ps = [r["vol"]["parts"] for r in runs]
    tensor = all("tensor" in r for r in runs)
    fig, axes = plt.subplots(2 if tensor else 1, 2, figsize=(11, 8.4 if tensor else 4.2), squeeze=False)
    a, b = axes[0]
    first = runs[0]["vol"]
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

    for mode, per_mode in first["modes"].items():
        for bits in per_mode["bits"]:
            a.plot(
                ps, [r["vol"]["modes"][mode]["bits"][bits]["epoch"]["bytes"] / MB for r in runs], **style(mode, bits)
            )
            b.plot(ps, [r["proj"][mode][bits]["epoch"]["time_s"] * 1e3 for r in runs], **style(mode, bits))
    titles = [
        (a, "volume per training epoch", "MB (all ranks)"),
        (b, "projected comm time (Eq. 6)", "ms per epoch"),
    ]
    if tensor:
        for bits in runs[0]["tensor"]["bits"]:
            a.plot(ps, [r["tensor"]["bits"][bits]["bytes"] / MB for r in runs], **style("tensor", bits))
            b.plot(ps, [r["tensor"]["time_s"][bits] * 1e3 for r in runs], **style("tensor", bits))
        c, d = axes[1]
        for mode in first["modes"]:
            c.plot(ps, [r["vol"]["feature_bytes_max"][mode] / MB for r in runs], **style(mode, 32))
        c.plot(ps, [r["tensor"]["feature_bytes_max"] / MB for r in runs], **style("tensor", 32))
        d.plot(ps, [r["vol"]["flops_max_over_mean"] for r in runs], **style("partition", 32))
        d.plot(ps, [r["tensor"]["flops_max_over_mean"] for r in runs], **style("tensor", 32))
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
    fig.suptitle(f"{first['dataset']}: {first['model']} hidden {first['hidden']}, {first['layers']} layers")
    fig.tight_layout()
    path = Path(path)
    try:
        atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110))
    finally:
        plt.close(fig)
    return path


# ---------------------------------------------------------------------------------------- JSON
def _merge(vol_bits: dict[str, Any], proj_bits: dict[str, Any]) -> dict[str, Any]:
    """Volumes and projected times of one mode and bit width in one tree."""
    layers = []
    for v, t in zip(vol_bits["layers"], proj_bits["layers"]):
        la = {"layer": v["layer"], "width": v["width"]}
        for d in ("forward", "backward"):
            la[d] = None if v[d] is None else {**v[d], "model": t[d]}
        layers.append(la)
    extra = {k: v for k, v in proj_bits.items() if k not in ("layers", "epoch")}
    return {"layers": layers, "epoch": {**vol_bits["epoch"], "model": proj_bits["epoch"]}, **extra}


def to_json(runs: list[dict[str, Any]], model: CommModel, plot: str | None = None, layer: int = 0) -> str:
    """Every number of the tables (and per exchange detail) as JSON."""
    out = []
    for run in runs:
        vol, proj = run["vol"], run["proj"]
        modes = {}
        for mode, per_mode in vol["modes"].items():
            bits = {str(b): _merge(v, proj[mode][b]) for b, v in per_mode["bits"].items()}
            modes[mode] = {**{k: v for k, v in per_mode.items() if k != "bits"}, "bits": bits}
        out.append({**_public(vol), "modes": modes, "table5": table5(run, layer)})
    doc = {"model": model.to_dict(), "runs": out, "plot": plot}
    return json.dumps(doc, indent=1, sort_keys=False)


# ---------------------------------------------------------------------------------------- plans
def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def format_plan(rec: dict[str, Any], title: str = "") -> str:
    """Each layer's candidates of a planner record (``tessera.planner.plan``): modelled terms and
    total, measured time and its ratio to the model, and the choice."""
    r = rec["rates"]
    lines = [
        f"plan for {rec.get('world', '?')} ranks{': ' + title if title else ''} ({rec.get('source', '?')}, "
        f"{rec.get('planning_s', 0.0):.2f} s)",
        f"constants: aggregation {r['edge_s'] * 1e9:.2f} ns/edge + {r['value_s'] * 1e9:.3f} ns/value, "
        f"GEMM {r['gemm_flops'] / 1e9:.1f} GFLOP/s, fresh writes {r.get('fresh_value_s', 0.0) * 1e9:.2f} ns/value, "
        f"link {r['bandwidth_gbps']:.2f} GB/s, latency {r['latency_us']:.1f} us",
    ]
    head = (
        f"{'layer':>5}  {'candidate':<40} {'width':>5} {'bwd':>3} {'dense':>8} {'aggr':>8} {'comm':>8} {'memory':>8} "
        f"{'model ms':>9} {'measured':>9} {'meas/mod':>8}"
    )
    lines += [head, "-" * len(head)]
    for la in rec["layers"]:
        for c in la["candidates"]:
            m = c["model_ms"]
            mark = "*" if c["label"] == la["choice"] else (" " if c["survived"] else "-")
            ratio = c["measured_ms"] / c["modelled_ms"] if c["measured_ms"] and c["modelled_ms"] else None
            lines.append(
                f"{la['layer']:>5} {mark}{c['label']:<40} {c['width']:>5} {'y' if c['backward'] else 'n':>3} "
                f"{m['dense']:>8.2f} {m['aggregate']:>8.2f} {m['comm']:>8.2f} {m.get('memory', 0.0):>8.2f} {c['modelled_ms']:>9.2f} "
                f"{_ms(c['measured_ms']):>9} {_fmt_x(ratio):>8}"
            )
    lines.append("* the choice; - pruned by the model (not measured); times per training step of the layer")
    lines.append(f"--strategy {','.join(rec['choices'])}")
    return "\n".join(lines)
