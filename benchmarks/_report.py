"""Machine facts and the markdown tables of ``bench_train.py`` (stdlib only)."""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from _runner import ROOT

LABELS = {
    "tessera": "tessera",
    "pyg-edge_index": "PyG edge_index",
    "pyg-csr": "PyG CSR",
    "dgl": "DGL",
}
QUIET_LOAD = 0.2  # same threshold as _child.QUIET_LOAD
MIN_QUIET = 3
SHORT = {"tessera": "tessera", "pyg-edge_index": "PyG-ei", "pyg-csr": "PyG-CSR", "dgl": "DGL"}
# framework name of another tessera source tree (``bench_train.py --tessera-tree LABEL=PATH``)
TREE_PREFIX = "tessera@"


def label(framework: str) -> str:
    """Table label of a framework (``tessera@LABEL`` columns keep their name)."""
    return LABELS.get(framework, framework)


# ---------------------------------------------------------------------------------- facts
def cpu_facts() -> dict[str, Any]:
    """CPU model, logical cores (online and usable), SIMD flags of interest, memory, kernel."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model == "unknown":
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    mem_kib = 0
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kib = int(line.split()[1])
    except OSError:
        pass
    return {
        "cpu": model,
        "cores_online": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "simd": " ".join(sorted(f for f in flags if f in ("avx2", "avx512f", "avx512bw", "avx512_vnni", "amx_tile"))),
        "mem_gib": round(mem_kib / 2**20, 1),
        "kernel": platform.release(),
    }


_PROBE = r"""
import json, importlib
out = {}
for m in ("torch", "torch_geometric", "torch_sparse", "pyg_lib", "torch_scatter", "numba", "numpy", "dgl"):
    try:
        mod = importlib.import_module(m)
        out[m] = getattr(mod, "__version__", "?")
    except Exception as e:
        out[m] = None
try:
    from tessera.backends import available_backends

    out["tessera_backends"] = available_backends()
except Exception:
    pass
print(json.dumps(out))
"""


def probe_python(python: str, timeout: float = 120.0) -> dict[str, Any]:
    """Library versions importable by interpreter ``python`` (``{"error": ...}`` if it fails)."""
    try:
        r = subprocess.run(
            [python, "-c", _PROBE], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=_probe_env()
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(r.stdout.strip().splitlines()[-1])


def _probe_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH", "")]))
    return env


def git_state() -> dict[str, Any]:
    """Commit of the working tree and whether ``tessera/`` has uncommitted changes."""

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", *args], capture_output=True, text=True, cwd=ROOT, timeout=30).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            return ""

    return {
        "commit": git("rev-parse", "--short", "HEAD"),
        "tessera_dirty": bool(git("status", "--porcelain", "tessera")),
    }


# ---------------------------------------------------------------------------------- aggregation
def combine(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge repeats of one (graph, model, framework, allocator): pooled epoch times, max RSS, and
    ``time_ms`` = median over quiet epochs (interference < ``QUIET_LOAD`` cores), or over all epochs
    with ``noisy = True`` when fewer than ``MIN_QUIET`` epochs were quiet."""
    ok = [r for r in records if r.get("status") == "ok"]
    if not ok:
        return dict(records[-1])
    out = dict(ok[-1])
    times = [t for r in ok for t in r["epoch_s"]]
    loads = [o for r in ok for o in r.get("interference", r.get("other_load", [0.0] * len(r["epoch_s"])))]
    quiet = [t for t, o in zip(times, loads) if o < QUIET_LOAD]
    out["median_ms"] = statistics.median(times) * 1e3
    out["min_ms"], out["max_ms"] = min(times) * 1e3, max(times) * 1e3
    out["quiet_epochs"] = len(quiet)
    out["quiet_median_ms"] = statistics.median(quiet) * 1e3 if quiet else None
    out["noisy"] = len(quiet) < min(MIN_QUIET, len(times))
    out["time_ms"] = out["median_ms"] if out["noisy"] else out["quiet_median_ms"]
    out["repeat_medians_ms"] = [round(r["median_ms"], 2) for r in ok]
    out["peak_rss_mib"] = max(r["peak_rss_mib"] for r in ok)
    out["repeats_ok"] = len(ok)
    out["interference_mean"] = statistics.fmean(loads) if loads else 0.0
    return out


def group(runs: Iterable[dict[str, Any]]) -> dict[tuple[str, str, str, str], dict[str, Any]]:
    """``(graph, model, framework, allocator) -> combined record``."""
    buckets: dict[tuple[str, str, str, str], list[dict[str, Any]]] = {}
    for r in runs:
        buckets.setdefault((r["graph_key"], r["model"], r["framework"], r["allocator"]), []).append(r)
    return {k: combine(v) for k, v in buckets.items()}


def best_of(cells: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest ``ok`` record among a framework's allocators, or ``None``."""
    ok = [r for r in cells.values() if r.get("status") == "ok"]
    return min(ok, key=lambda r: r["time_ms"]) if ok else None


# ---------------------------------------------------------------------------------- formatting
def fmt_ms(v: float) -> str:
    """Milliseconds with 3-4 significant digits."""
    return f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def status_text(r: dict[str, Any] | None, cap_gib: float, timeout_s: float) -> str:
    """Short text for a record that has no time."""
    if r is None:
        return "—"
    s = r.get("status")
    if s == "oom":
        return f"OOM (>{cap_gib:g} GiB)"
    if s == "timeout":
        return f"timeout (>{timeout_s:g} s)"
    if s == "na":
        return "n/a"
    if s == "skipped":
        return "skipped"
    return "error"


def cell(
    cells: dict[str, dict[str, Any]], allocators: list[str], cap_gib: float, timeout_s: float
) -> tuple[str, dict[str, Any] | None]:
    """``"best (default / jemalloc)"`` for one framework, and its best record."""
    best = best_of(cells)
    parts = []
    for a in allocators:
        r = cells.get(a)
        parts.append(fmt_ms(r["time_ms"]) if r and r.get("status") == "ok" else status_text(r, cap_gib, timeout_s))
    if best is None:
        # every allocator failed: show the first distinct failure(s)
        return " / ".join(dict.fromkeys(parts)), None
    detail = f" ({' / '.join(parts)})" if len(allocators) > 1 else ""
    return f"**{fmt_ms(best['time_ms'])}**{detail}", best


def ratio(a: dict[str, Any] | None, b: dict[str, Any] | None) -> str:
    """``a`` time divided by ``b`` time, e.g. ``0.42×``; ``—`` when either is missing."""
    if a is None or b is None:
        return "—"
    return f"{a['time_ms'] / b['time_ms']:.2f}×"


def headline_table(
    graph_key: str,
    models: list[str],
    frameworks: list[str],
    grouped: dict[tuple[str, str, str, str], dict[str, Any]],
    cap_gib: float,
    timeout_s: float,
    ours_label: str = "tessera",
) -> list[str]:
    """What a user gets: tessera in the default environment (no ``LD_PRELOAD``, no ``MALLOC_CONF``)
    against every peer's best allocator, time and peak RSS, with both ratios; ``ours_label`` names
    tessera's column (its precision when not fp32)."""
    peers = [f for f in frameworks if f != "tessera" and not f.startswith(TREE_PREFIX)]
    head = ["model", f"{ours_label} default ms", "RSS MiB"]
    for f in peers:
        head += [f"{label(f)} best ms (allocator)", "RSS MiB", "time ratio", "RSS ratio"]
    lines = [
        "tessera in the **default environment** against each peer's **best allocator**: median training-step ms "
        "and peak RSS of the same runs; ratios are tessera ÷ peer (< 1: tessera faster or smaller).",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|",
    ]
    for m in models:
        ours = _ok(grouped.get((graph_key, m, "tessera", "default")))
        row = [m]
        row += [fmt_ms(ours["time_ms"]), f"{ours['peak_rss_mib']:.0f}"] if ours else [
            status_text(grouped.get((graph_key, m, "tessera", "default")), cap_gib, timeout_s), "—"
        ]  # fmt: skip
        for f in peers:
            cells = {k[3]: r for k, r in grouped.items() if k[:3] == (graph_key, m, f)}
            best = best_of(cells)
            if best is None:
                failed = " / ".join(dict.fromkeys(status_text(r, cap_gib, timeout_s) for r in cells.values())) or "—"
                row += [failed, "—", "—", "—"]
                continue
            rss = "—" if ours is None else f"{ours['peak_rss_mib'] / best['peak_rss_mib']:.2f}×"
            row += [
                f"{fmt_ms(best['time_ms'])} ({best['allocator']})",
                f"{best['peak_rss_mib']:.0f}",
                ratio(ours, best),
                rss,
            ]
        lines.append("| " + " | ".join(row) + " |")
    return lines


def graph_table(
    graph_key: str,
    models: list[str],
    frameworks: list[str],
    allocators: list[str],
    grouped: dict[tuple[str, str, str, str], dict[str, Any]],
    cap_gib: float,
    timeout_s: float,
) -> list[str]:
    """The main markdown table for one graph."""
    alloc_hint = " / ".join(allocators)
    head = ["model"] + [f"{label(f)} ms" for f in frameworks]
    peers_pyg = [f for f in frameworks if f.startswith("pyg")]
    show_pyg = "tessera" in frameworks and peers_pyg
    show_dgl = "tessera" in frameworks and "dgl" in frameworks
    if show_pyg:
        head.append("tessera/PyG-best")
    if show_dgl:
        head.append("tessera/DGL")
    trees = [f for f in frameworks if f.startswith(TREE_PREFIX)] if "tessera" in frameworks else []
    head += [f"tessera/{f}" for f in trees]
    head.append("peak RSS MiB (" + " / ".join(SHORT.get(f, f) for f in frameworks) + ")")
    tree_hint = (
        " tessera/tessera@LABEL: this tree's best time ÷ that tree's best time (< 1: this tree faster)"
        + (f"; per allocator ({alloc_hint}) in parentheses." if len(allocators) > 1 else ".")
        if trees
        else ""
    )
    lines = [
        f"Median training-step ms: **best allocator** ({alloc_hint}). Ratios are tessera's best time ÷ the "
        "peer's best time (< 1: tessera faster). Peak RSS is that of each framework's best-allocator run. "
        "⚠: fewer than 3 quiet epochs even after retries, so the median over all (disturbed) epochs is shown."
        + tree_hint,
        "",
        "| " + " | ".join(head) + " |",
        "|" + "|".join("---" if i == 0 else "---:" for i in range(len(head))) + "|",
    ]
    for m in models:
        if not any(k[0] == graph_key and k[1] == m for k in grouped):
            lines.append("| " + " | ".join([m, "not run"] + [""] * (len(head) - 2)) + " |")
            continue
        row, bests = [m], {}
        for f in frameworks:
            cells = {a: grouped[(graph_key, m, f, a)] for a in allocators if (graph_key, m, f, a) in grouped}
            text, bests[f] = cell(cells, allocators, cap_gib, timeout_s)
            if bests[f] is not None and bests[f].get("info", {}).get("note"):
                text += " †"
            if bests[f] is not None and bests[f].get("noisy"):
                text += " ⚠"
            row.append(text)
        if show_pyg:
            pyg_ok = [bests[f] for f in peers_pyg if bests.get(f)]
            pyg_best = min(pyg_ok, key=lambda r: r["time_ms"]) if pyg_ok else None
            row.append(ratio(bests.get("tessera"), pyg_best))
        if show_dgl:
            row.append(ratio(bests.get("tessera"), bests.get("dgl")))
        for f in trees:
            text = ratio(bests.get("tessera"), bests.get(f))
            if len(allocators) > 1:
                per = [
                    ratio(_ok(grouped.get((graph_key, m, "tessera", a))), _ok(grouped.get((graph_key, m, f, a))))
                    for a in allocators
                ]
                text += f" ({' / '.join(per)})"
            row.append(text)
        row.append(" / ".join(f"{bests[f]['peak_rss_mib']:.0f}" if bests.get(f) else "—" for f in frameworks))
        lines.append("| " + " | ".join(row) + " |")
    return lines


def detail_table(
    runs_grouped: dict[tuple[str, str, str, str], dict[str, Any]], cap_gib: float, timeout_s: float
) -> list[str]:
    """Every (graph, model, framework, allocator) with its status, spread, RSS and losses."""
    lines = [
        "| graph | model | framework | allocator | status | quiet median ms (n) | all-epoch median ms | min–max ms "
        "| peak RSS MiB | load+build s | child wall s | interference (cores) | attempts | loss first→last |",
        "|---|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for (gk, m, f, a), r in runs_grouped.items():
        if r.get("status") == "ok":
            lines.append(
                f"| {gk} | {m} | {label(f)} | {a} ({r.get('allocator_in_use', '?')}) | ok "
                f"| {fmt_ms(r['quiet_median_ms']) if r['quiet_median_ms'] else '—'} ({r['quiet_epochs']}) "
                f"| {fmt_ms(r['median_ms'])} "
                f"| {fmt_ms(r['min_ms'])}–{fmt_ms(r['max_ms'])} | {r['peak_rss_mib']:.0f} "
                f"| {r['load_s'] + r['build_s']:.1f} | {r.get('wall_s', 0):.0f} "
                f"| {r.get('interference_mean', 0):.2f} | {_attempts(r)} "
                f"| {r['loss_first']:.3f}→{r['loss_last']:.3f} |"
            )
        else:
            why = status_text(r, cap_gib, timeout_s)
            err = str(r.get("error", "")).replace("|", "\\|")[:160]
            lines.append(
                f"| {gk} | {m} | {label(f)} | {a} | {why} | — | — | — "
                f"| {r.get('poll_peak_rss_mib', 0):.0f} (polled) | — | {r.get('wall_s', 0):.0f} | — | — | {err} |"
            )
    return lines


def _attempts(r: dict[str, Any]) -> str:
    """``1`` or, after noisy retries, each attempt's all-epoch median ms and quiet-epoch count."""
    att = r.get("attempts") or []
    if len(att) <= 1:
        return "1"
    return ", ".join(
        f"{fmt_ms(x['median_ms'])} ({x['quiet_epochs']}q)" if x.get("median_ms") else str(x.get("status")) for x in att
    )


def _ok(r: dict[str, Any] | None) -> dict[str, Any] | None:
    return r if r is not None and r.get("status") == "ok" else None


def tree_table(
    graphs: list[str],
    models: list[str],
    frameworks: list[str],
    allocators: list[str],
    runs: list[dict[str, Any]],
    facts: dict[str, Any],
) -> list[str]:
    """tessera (this tree) against each ``tessera@LABEL`` tree, per graph, model and allocator:
    every repeat's all-epoch median (repeats ran interleaved, so repeat i of both ran back to
    back), the per-repeat ratios, the pooled table times and their ratio, and which tessera sources
    the children ran (``versions.tessera_src_sha1``, checked against each tree's own digest)."""
    lines = [
        "Each child's all-epoch median ms, in repeat order (ran interleaved); ratio = tessera ÷ the tree, "
        "per repeat, then for the pooled table times (quiet-epoch medians over all repeats). sources: the "
        "tessera source digest the children reported (✓ = the tree's own digest).",
        "",
        "| graph | model | allocator | tree | tessera ms per repeat | tree ms per repeat | ratio per repeat "
        "| table ms tessera / tree | ratio | sources tessera / tree |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---|",
    ]
    for f in [f for f in frameworks if f.startswith(TREE_PREFIX)]:
        want = facts.get("tessera_trees", {}).get(f, {}).get("src_sha1")
        for g in graphs:
            for m in models:
                for a in allocators:
                    cur, old = _repeats(runs, (g, m, "tessera", a)), _repeats(runs, (g, m, f, a))
                    if all(r.get("status") == "na" for r in [*cur.values(), *old.values()]):
                        continue  # not run (e.g. jemalloc not installed), or not at all
                    keys = sorted(set(cur) | set(old))
                    per = ", ".join(
                        f"{cur[k]['median_ms'] / old[k]['median_ms']:.3f}"
                        for k in keys
                        if _ok(cur.get(k)) and _ok(old.get(k))
                    )
                    pc = _ok(combine(list(cur.values()))) if cur else None
                    po = _ok(combine(list(old.values()))) if old else None
                    table = " / ".join(fmt_ms(r["time_ms"]) if r else "—" for r in (pc, po))
                    pooled = f"{pc['time_ms'] / po['time_ms']:.3f}" if pc and po else "—"
                    lines.append(
                        f"| {g} | {m} | {a} | {f} | {_per_repeat(cur, keys)} | {_per_repeat(old, keys)} "
                        f"| {per or '—'} | {table} | {pooled} "
                        f"| {_sources(cur.values(), None)} / {_sources(old.values(), want)} |"
                    )
    return lines


def _repeats(runs: list[dict[str, Any]], key: tuple[str, str, str, str]) -> dict[int, dict[str, Any]]:
    """``repeat -> record`` of one (graph, model, framework, allocator)."""
    return {
        r.get("repeat", i): r
        for i, r in enumerate(runs)
        if (r["graph_key"], r["model"], r["framework"], r["allocator"]) == key
    }


def _per_repeat(records: dict[int, dict[str, Any]], keys: list[int]) -> str:
    """Each repeat's all-epoch median ms (its status when it has no time)."""
    return ", ".join(
        fmt_ms(records[k]["median_ms"]) if _ok(records.get(k)) else str((records.get(k) or {}).get("status", "—"))
        for k in keys
    )


def _sources(records: Iterable[dict[str, Any]], want: str | None) -> str:
    """The distinct ``tessera_src_sha1`` of ok children; ``✓`` when it is exactly ``want``."""
    got = sorted({r.get("versions", {}).get("tessera_src_sha1") or "?" for r in records if _ok(r)})
    if not got:
        return "—"
    if want is not None and got == [want]:
        return f"{want} ✓"
    return ", ".join(got) + (f" (expected {want})" if want is not None else "")
