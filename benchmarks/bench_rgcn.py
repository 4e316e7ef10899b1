"""RGCN benchmarks: training-epoch time of tessera vs PyG ``RGCNConv`` / ``FastRGCNConv`` and DGL
``RelGraphConv``; an ablation of tessera's RGCN (WiseGraph Figs. 17-19 analogues); RGCN vs GCN
test accuracy on the typed synthetic presets.

``epochs``: every (graph, framework) runs in its own child process, ``--rounds`` rounds
interleaved per graph, each child timing ``--warmup + --epochs`` full-graph training steps
(zero_grad, forward, cross entropy on the training vertices, backward, Adam lr 0.01). The table
gives the median over all rounds' timed epochs, each round's median, the child's peak RSS
(``ru_maxrss``) and tessera / the fastest peer per graph; ``--md PATH`` also writes it with the
machine facts. Same model everywhere: 2 layers, hidden ``--hidden``, dropout 0.5 before each layer,
ReLU between them, per-relation mean aggregation, root (self-loop) weight, bias.

* ``tessera``, ``pyg``, ``pyg-fast``: children of this interpreter that generate the seeded graph
  ``synthetic:<graph>`` themselves. ``FastRGCNConv`` materialises one ``in x out`` matrix per
  edge; it is reported as skipped when that would not fit in ``--mem-gib``.
* ``dgl``: DGL 2.1 needs an older torch, so it runs under ``--dgl-python`` (its own venv, where
  tessera is not imported): the parent loads the graph with tessera and writes its arrays (source,
  destination, edge type, features, labels, training mask) to an ``.npz`` that the child reads.
  ``RelGraphConv(self_loop=True, bias=True)`` with the per-edge norm ``1 / |N_r(v)|`` (``v`` the
  edge's destination, ``r`` its relation) computes ``W_0 x_v + sum_r mean_{u in N_r(v)} W_r x_u +
  b``, PyG ``RGCNConv``'s (and tessera's) mean aggregation with root weight and bias. By default
  the DGL graph's edges are sorted by relation and passed with ``presorted=True``
  (``segment_mm``, one GEMM per relation, instead of ``gather_mm``): measured interleaved in one
  process (2 threads, hidden 256, loaded machine, median process CPU s per epoch) it took 1.87 vs
  2.95 s unsorted on small-rel and 4.73 vs 6.47 s on small-rel32; ``--no-dgl-presorted`` gives
  the unsorted run.

``ablation``: on one typed graph, per layer of the 2-layer model (its real weights; layer 2's
input a random ReLU'd, dropped-out hidden matrix that needs a gradient, layer 1's the dropped-out
features, which do not), the forward + backward time of the whole layer (relational sum, root,
bias) with

(a) every relational variant forced (:data:`tessera.relational.plan.VARIANTS`; run only
    ``--variants``) and its relational GEMM FLOPs: rows multiplied x ``2 fi fo`` (forward;
    backward adds up to twice that), so the FLOPs unique-value extraction removes
    (``unique_source`` vs ``transform_first``) and the time it saves are visible (Fig. 17);
(b) the ``gtask`` variant's throughput vs K in ``uniq(Src.ID)=K & uniq(Edge.Type)=1`` (Fig. 18a;
    K = inf is one gTask per relation, the tensor-centric schedule), and vs the rows per batched
    product (``OutlierPolicy.batch_rows``) on the variant's own plan;
(c) the time of each gTask category's products, uniform vs with outlier handling, for the
    ``gtask`` variant's plan and for ``--outlier-plan`` (Fig. 19; ``bench_gtask.py`` does the same
    for the raw typed message sum, and its code is reused here);

then the whole-epoch time and peak RSS (``VmHWM`` from before that variant's epochs) with ``auto``
and with each variant forced. A variant (or an outlier
schedule) whose estimated intermediates exceed ``--mem-gib`` is skipped (its FLOPs are still
listed). Layer times are the median process CPU seconds (all threads, ``OMP_WAIT_POLICY=PASSIVE``
so idle threads do not count) of ``--repeats`` runs after a warm-up, interleaved, with the median
and minimum wall times beside them (``bench_gtask.median_times``); epochs are wall seconds.

    python benchmarks/bench_rgcn.py epochs --graphs arxiv-rel8 arxiv-rel32 --threads 2 --rounds 3 --md out.md
    python benchmarks/bench_rgcn.py ablation --graph arxiv-rel8 --threads 2
    python benchmarks/bench_rgcn.py accuracy --graph arxiv-rel --seeds 0 1 2 3 4 --epochs 100
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

from _child import peak_rss_mib

FRAMEWORKS = ("tessera", "pyg", "pyg-fast", "dgl")
LABELS = {"tessera": "tessera", "pyg": "PyG RGCNConv", "pyg-fast": "PyG FastRGCNConv", "dgl": "DGL RelGraphConv"}
DROPOUT = 0.5


def _set_threads(threads: int) -> None:
    import torch

    from tessera.threads import set_num_threads

    torch.set_num_threads(threads)
    set_num_threads(threads)


def _reset_peak() -> None:
    """Start this process's peak RSS (``VmHWM``) again from its current RSS (Linux ``clear_refs``;
    elsewhere nothing happens and :func:`_peak_since_reset` gives the whole run's peak)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_since_reset() -> float | str:
    """Peak RSS in MiB since :func:`_reset_peak` (``VmHWM``; ``ru_maxrss`` where there is none)."""
    try:
        with open("/proc/self/status") as f:
            return round(next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024.0, 1)
    except (OSError, StopIteration):
        return f"{peak_rss_mib():.1f} (run)"


def train_times(model, forward, y, train, warmup: int, epochs: int) -> list[float]:
    """Seconds of each full-graph training step after ``warmup`` untimed ones: zero_grad,
    ``forward()``, cross entropy on the ``train`` vertices, backward, Adam (lr 0.01) step."""
    import torch
    import torch.nn.functional as F

    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model.train()
    times = []
    for i in range(warmup + epochs):
        t0 = time.perf_counter()
        opt.zero_grad()
        F.cross_entropy(forward()[train], y[train]).backward()
        opt.step()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def _result(times: list[float], **extra) -> dict:
    return {"median_s": statistics.median(times), "times_s": times, "peak_rss_mib": round(peak_rss_mib(), 1), **extra}


def _model(framework: str, g, hidden: int):
    """``(model, forward)``: tessera's RGCN, or PyG's convolutions in the same stack, on ``g``."""
    fi, r, c = g.num_features, g.num_relations, g.num_classes
    if framework == "tessera":
        from tessera.nn import build_model

        model = build_model("rgcn", fi, hidden, c, 2, DROPOUT, num_relations=r)
        return model, lambda: model(g.x, g)
    import torch_geometric.nn as pyg
    from _peers import Stack

    conv = pyg.RGCNConv if framework == "pyg" else pyg.FastRGCNConv
    ei, et = g.edge_index(), g.edge_type
    model = Stack([conv(fi, hidden, r), conv(hidden, c, r)], DROPOUT, "relu", lambda conv, x: conv(x, ei, et))
    return model, lambda: model(g.x)


def _auto_variant(g, rel, fi: int, fo: int) -> str | None:
    """The variant ``auto`` chose for a layer of these widths on ``g`` (None: not decided yet)."""
    from tessera.backends.relational import decision_key
    from tessera.backends.select import lookup
    from tessera.relational.plan import VARIANTS

    return lookup(g, decision_key(rel, fi, fo, "mean"), list(VARIANTS))


def child(args: argparse.Namespace) -> None:
    """Time tessera or PyG on one graph (generated here); print one JSON line."""
    import torch

    from tessera.datasets import load

    _set_threads(args.threads)
    g = load(f"synthetic:{args.graph}")
    fi, e = g.num_features, g.num_edges
    need = 4.0 * e * max(fi * args.hidden, args.hidden * g.num_classes) * 2
    if args.framework == "pyg-fast" and need > args.mem_gib * 2**30:
        print(json.dumps({"skipped": f"per-edge weights need {need / 2**30:.0f} GiB > {args.mem_gib} GiB"}))
        return
    torch.manual_seed(0)
    model, forward = _model(args.framework, g, args.hidden)
    out = _result(train_times(model, forward, g.y, g.train_mask, args.warmup, args.epochs))
    if args.framework == "tessera":
        from tessera.sparse import as_operand

        rel = as_operand(g).relations()
        out["variants"] = [_auto_variant(g, rel, a, b) for a, b in [(fi, args.hidden), (args.hidden, g.num_classes)]]
    print(json.dumps(out))


def dgl_child(args: argparse.Namespace) -> None:
    """Time DGL ``RelGraphConv`` on the graph arrays in ``--data`` (imports only numpy, torch, dgl)."""
    import dgl
    import numpy as np
    import torch
    from _child import _set_threads as set_framework_threads
    from _peers import Stack
    from dgl.nn import RelGraphConv

    set_framework_threads("dgl", args.threads)
    d = dict(np.load(args.data))
    src, dst, etype = d["src"], d["dst"], d["edge_type"]
    n, r, c = int(d["num_nodes"]), int(d["num_relations"]), int(d["num_classes"])
    if args.dgl_presorted:
        order = np.argsort(etype, kind="stable")
        src, dst, etype = src[order], dst[order], etype[order]
    key = dst * r + etype
    norm = torch.from_numpy(1.0 / np.bincount(key)[key]).float().unsqueeze(1)  # 1 / |N_r(v)|
    g = dgl.graph((torch.from_numpy(src), torch.from_numpy(dst)), num_nodes=n)
    g.create_formats_()
    et = torch.from_numpy(etype)
    x, y, train = (torch.from_numpy(d[k]) for k in ("x", "y", "train"))
    torch.manual_seed(0)
    convs = [RelGraphConv(x.shape[1], args.hidden, r, self_loop=True), RelGraphConv(args.hidden, c, r, self_loop=True)]
    model = Stack(convs, DROPOUT, "relu", lambda conv, h: conv(g, h, et, norm, presorted=args.dgl_presorted))
    times = train_times(model, lambda: model(x), y, train, args.warmup, args.epochs)
    print(json.dumps(_result(times, presorted=args.dgl_presorted, dgl=dgl.__version__)))


def _dump(graph: str, path: Path) -> None:
    """Write ``synthetic:<graph>``'s arrays for the DGL child (edges in tessera's CSR order)."""
    import numpy as np

    from tessera.datasets import load

    g = load(f"synthetic:{graph}")
    np.savez(path, src=g.src_index().numpy().astype(np.int64), dst=g.dst_index().numpy().astype(np.int64),
             edge_type=g.edge_type.numpy().astype(np.int64),
             x=g.x.numpy(), y=g.y.numpy(), train=g.train_mask.numpy(), num_nodes=g.num_nodes,
             num_relations=g.num_relations, num_classes=g.num_classes)  # fmt: skip


def _run_child(cmd: list[str], threads: int) -> dict:
    from _runner import thread_env

    p = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **thread_env(threads)})
    try:
        return json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return {"skipped": f"failed (exit {p.returncode}): {p.stderr.strip().splitlines()[-1:]}"}


def _child_cmd(args: argparse.Namespace, graph: str, fw: str, data: Path | None) -> list[str]:
    common = ["--threads", str(args.threads), "--hidden", str(args.hidden), "--epochs", str(args.epochs),
              "--warmup", str(args.warmup)]  # fmt: skip
    if fw == "dgl":
        presort = "--dgl-presorted" if args.dgl_presorted else "--no-dgl-presorted"
        return [args.dgl_python, __file__, "dgl-child", "--data", str(data), presort, *common]
    fw_args = ["--graph", graph, "--framework", fw, "--mem-gib", str(args.mem_gib)]
    return [sys.executable, __file__, "child", *fw_args, *common]


def epochs(args: argparse.Namespace) -> None:
    """Run every (graph, framework) child ``--rounds`` times, interleaved per graph; print (and
    with ``--md`` write) the table."""
    started = time.perf_counter()
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for graph in args.graphs:
            data = Path(tmp) / f"{graph}.npz"
            if "dgl" in args.frameworks:
                _dump(graph, data)
            for rnd in range(args.rounds):
                for fw in args.frameworks:
                    res = _run_child(_child_cmd(args, graph, fw, data), args.threads)
                    runs.setdefault((graph, fw), []).append(res)
                    print(f"round {rnd}", graph, fw, json.dumps(res), flush=True)
    text = "\n".join(_epoch_tables(args, runs))
    print("\n" + text)
    if args.md:
        from tessera.files import atomic_write

        md = "\n".join([*_facts(args, time.perf_counter() - started), "", text, ""])
        atomic_write(args.md, lambda p: p.write_text(md))
        print(f"wrote {args.md}")


def _epoch_tables(args: argparse.Namespace, runs: dict[tuple[str, str], list[dict]]) -> list[str]:
    """The per-framework table and the per-graph ratio table (markdown lines)."""
    lines = [
        "| graph | framework | median epoch (s) | round medians (s) | peak RSS (MiB) | note |",
        "|---|---|---|---|---|---|",
    ]
    ratio = ["| graph | tessera (s) | fastest peer | its epoch (s) | tessera / fastest peer |", "|---|---|---|---|---|"]
    for graph in args.graphs:
        med = {}
        for fw in args.frameworks:
            ok = [r for r in runs[(graph, fw)] if "median_s" in r]
            notes = sorted({r["skipped"] for r in runs[(graph, fw)] if "skipped" in r})
            if ok:
                med[fw] = statistics.median([t for r in ok for t in r["times_s"]])
                notes += sorted({", ".join(map(str, r["variants"])) for r in ok if "variants" in r})
            rounds = ", ".join(f"{r['median_s']:.3f}" for r in ok)
            rss = max((r["peak_rss_mib"] for r in ok), default=None)
            lines.append(f"| {graph} | {LABELS[fw]} | {f'{med[fw]:.3f}' if fw in med else '-'} | {rounds} | "
                         f"{rss if rss is not None else '-'} | {'; '.join(notes)} |")  # fmt: skip
        peers = {fw: t for fw, t in med.items() if fw != "tessera"}
        if "tessera" in med and peers:
            best = min(peers, key=peers.get)
            ratio.append(f"| {graph} | {med['tessera']:.3f} | {LABELS[best]} | {peers[best]:.3f} | "
                         f"{med['tessera'] / peers[best]:.3f} |")  # fmt: skip
    note = (f"Median over all rounds' timed epochs ({args.rounds} round(s) x {args.epochs} epochs after "
            f"{args.warmup} warm-up, one child per round); tessera's note: the variant auto chose per layer.")  # fmt: skip
    return [*lines, "", note, "", *ratio]


def _facts(args: argparse.Namespace, wall_s: float) -> list[str]:
    """Markdown lines: date, command, machine, threads, library versions, commit, model."""
    from _report import cpu_facts, git_state, probe_python

    cpu, git, vm = cpu_facts(), git_state(), probe_python(sys.executable)
    lines = [
        f"# RGCN training-epoch benchmark ({datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC)",
        "",
        f"- command: `python {' '.join(sys.argv)}`",
        f"- machine: {cpu['cpu']}, {cpu['cores_usable']} usable cores ({cpu['cores_online']} online), {cpu['simd']}, "
        f"{cpu['mem_gib']} GiB RAM, Linux {cpu['kernel']}",
        f"- threads: {args.threads} (torch / tessera / DGL set_num_threads, OMP/MKL/NUMBA_NUM_THREADS)",
        f"- tessera/PyG env: torch {vm.get('torch')}, torch_geometric {vm.get('torch_geometric')}, numba "
        f"{vm.get('numba')}, numpy {vm.get('numpy')}; git {git['commit']}"
        + (" (tessera/ has uncommitted changes)" if git["tessera_dirty"] else ""),
    ]
    if "dgl" in args.frameworks:
        vd = probe_python(args.dgl_python)
        lines.append(f"- DGL env ({args.dgl_python}): dgl {vd.get('dgl')}, torch {vd.get('torch')}, numpy "
                     f"{vd.get('numpy')}; edges {'sorted by relation, presorted=True' if args.dgl_presorted else 'unsorted'}")  # fmt: skip
    lines.append(f"- model: 2 layers, hidden {args.hidden}, dropout {DROPOUT} before each, ReLU, mean per relation, "
                 f"root weight, bias; Adam lr 0.01; total wall {wall_s:.0f} s")  # fmt: skip
    return lines


# ---------------------------------------------------------------------------------------- ablation
class _Layer:
    """One layer of the ablation's model: its conv, input, widths, name and estimated memory per variant."""

    def __init__(self, index: int, conv, x, est: dict[str, float]) -> None:
        self.conv, self.x, self.est = conv, x, est
        self.fi, self.fo = conv.in_channels, conv.out_channels
        self.name = f"layer {index + 1} ({self.fi} -> {self.fo})"

    def forward(self, agg):
        """RGCNConv.forward with ``agg(x, W)`` as its relational sum: a callable computing the output."""
        from tessera.dense import linear

        conv, x = self.conv, self.x
        return lambda: agg(x, conv.relation_weights()) + linear(x, conv.root.t()) + conv.bias

    def step(self, agg):
        """:meth:`forward` followed by its backward pass."""
        from bench_gtask import with_backward

        return with_backward(self.forward(agg))


class _Ablation:
    """The ablation's graph, its relational structures and the 2-layer model (module docstring)."""

    def __init__(self, args: argparse.Namespace) -> None:
        import torch
        import torch.nn.functional as F

        from tessera.datasets import load
        from tessera.nn import build_model
        from tessera.relational.gtask_kernels import OutlierPolicy, build_execution
        from tessera.relational.plan import VARIANTS
        from tessera.sparse import as_operand

        _set_threads(args.threads)
        self.args = args
        self.g = g = load(f"synthetic:{args.graph}")
        self.rel = as_operand(g).relations()
        self.st = st = self.rel.stats()
        self.plan, self.norm = self.rel.gtasks("mean")
        self.gtask_rows = build_execution(self.plan, OutlierPolicy()).stats["padded_rows"]
        unknown = set(args.variants or ()) - set(VARIANTS)
        if unknown:
            raise SystemExit(f"--variants: unknown {', '.join(sorted(unknown))}; choose from {', '.join(VARIANTS)}")
        self.variants = [v for v in VARIANTS if args.variants is None or v in args.variants]
        torch.manual_seed(0)
        self.model = build_model("rgcn", g.num_features, args.hidden, g.num_classes, 2, DROPOUT, num_relations=st.relations)  # fmt: skip
        n = g.num_nodes
        inputs = [F.dropout(g.x, DROPOUT), F.dropout(torch.relu(torch.randn(n, args.hidden)), DROPOUT).requires_grad_()]
        self.layers = []
        for i, (conv, x) in enumerate(zip(self.model.convs, inputs, strict=True)):
            fi, fo = conv.in_channels, conv.out_channels
            self.layers.append(_Layer(i, conv, x, {v: self._estimate_gib(v, fi, fo) for v in VARIANTS}))

    def gemm_rows(self, variant: str) -> int:
        """Rows the variant multiplies by a relation weight (:mod:`tessera.relational.variants`)."""
        st = self.st
        return {
            "transform_first": st.relations * st.cols,
            "unique_source": st.source_pairs,
            "aggregate_first": st.destination_pairs,
            "edge_wise": st.edges,
            "gtask": self.gtask_rows,
        }[variant]

    def _estimate_gib(self, variant: str, fi: int, fo: int) -> float:
        """Rough size of a layer's row-sized intermediates and their gradients (float32)."""
        rows = self.gemm_rows(variant)
        if variant == "transform_first":  # x W_r for every relation and vertex, its gradient, the broadcast x gradient
            nbytes = 4.0 * rows * (2 * fo + fi)
        elif variant == "edge_wise":  # gathered inputs, messages, scaled messages and gradients
            nbytes = 4.0 * rows * (2 * fi + 3 * fo)
        else:
            nbytes = 8.0 * rows * (fi + fo)
        return nbytes / 2**30

    def check(self, layer: _Layer) -> None:
        """The benchmark's layer formula equals the model's layer (``auto``, which also makes or loads its decision)."""
        import torch

        from tessera.relational.variants import run_variant

        ref = layer.conv(layer.x, self.g).detach()
        out = layer.forward(lambda h, w: run_variant(self.rel, "unique_source", h, w, "mean"))().detach()
        torch.testing.assert_close(out, ref)

    def variants_table(self, layer: _Layer) -> None:
        """(a) every variant forced: rows and GEMM FLOPs, time (Fig. 17)."""
        from bench_gtask import WALL, WALL_MEDIAN, median_times, table

        from tessera.relational.plan import VARIANTS, model_seconds
        from tessera.relational.variants import run_variant

        fi, fo, mem = layer.fi, layer.fo, self.args.mem_gib
        run = [v for v in self.variants if layer.est[v] <= mem]
        fns = {v: layer.step(lambda h, w, v=v: run_variant(self.rel, v, h, w, "mean")) for v in run}
        t = median_times(fns, self.args.repeats)
        base = self.gemm_rows("transform_first")
        rows = []
        for v in VARIANTS:
            gr = self.gemm_rows(v)
            note = "not run" if v not in self.variants else "skipped (est. memory)"
            timed = [t[v] * 1e3, WALL_MEDIAN[v] * 1e3, WALL[v] * 1e3] if v in t else [note, "", ""]
            rows.append([v, gr, 2.0 * gr * fi * fo / 1e9, f"{100 * (1 - gr / base):.1f}%", *timed,
                         model_seconds(self.st, fi, fo, v, self.args.threads) * 1e3, layer.est[v]])  # fmt: skip
        table(
            f"{layer.name}: variants forced, whole layer forward + backward (Fig. 17); auto chose "
            f"{_auto_variant(self.g, self.rel, fi, fo)}; the root GEMM adds "
            f"{2.0 * self.st.rows * fi * fo / 1e9:.3g} GFLOP to each",
            ["variant", "rows x W_r", "relational GEMM GFLOP (fwd)", "removed vs transform_first", "CPU ms",
             "median wall ms", "min wall ms", "cost model ms", "est. GiB"],
            rows,
        )  # fmt: skip
        if "transform_first" in t and "unique_source" in t:
            saved = t["transform_first"] - t["unique_source"]
            print(f"\nunique-value extraction (unique_source vs transform_first): "
                  f"{100 * (1 - self.st.source_pairs / base):.1f}% of the relational GEMM FLOPs removed, "
                  f"{saved * 1e3:.1f} CPU ms saved ({100 * saved / t['transform_first']:.1f}% of the layer)")  # fmt: skip

    def throughput_table(self, layer: _Layer, title: str, runs: dict) -> None:
        """Time the gtask layer for each ``label -> (plan, policy)`` and print throughput (Fig. 18)."""
        import torch
        from bench_gtask import THROUGHPUT_HEADER, median_times, table, throughput_rows

        from tessera.relational.gtask_kernels import build_execution, typed_message_sum
        from tessera.relational.variants import run_variant

        x, w, norm = layer.x.detach(), layer.conv.relation_weights().detach(), self.norm
        ref = run_variant(self.rel, "unique_source", x, w, "mean")
        fns, info = {}, {}
        for label, (p, pol) in runs.items():
            torch.testing.assert_close(typed_message_sum(x, w, p, pol, edge_weight=norm), ref, rtol=1e-4, atol=1e-4)
            fns[label] = layer.step(lambda h, wr, p=p, pol=pol: typed_message_sum(h, wr, p, pol, edge_weight=norm))
            info[label] = build_execution(p, pol).stats
        t = median_times(fns, self.args.repeats)
        table(f"{layer.name}: {title}, whole layer forward + backward", THROUGHPUT_HEADER, throughput_rows(t, info, self.st.edges))  # fmt: skip

    def outlier_tables(self, layer: _Layer, plans: dict) -> None:
        """(c) each gTask category's products, uniform vs handled, per plan (Fig. 19); a schedule
        whose gathered rows and their gradients would exceed ``--mem-gib`` is skipped."""
        from bench_gtask import OUTLIER_HEADER, outlier_rows, table

        from tessera.relational.gtask_kernels import OutlierPolicy, build_execution, typed_message_sum

        norm, x, w = self.norm, layer.x, layer.conv.relation_weights()
        for text, p in plans.items():
            gib = {}
            for handle in (False, True):
                padded = build_execution(p, OutlierPolicy(handle=handle)).stats["padded_rows"]
                gib[handle] = 8.0 * padded * (layer.fi + layer.fo) / 2**30
            handles = tuple(k for k, v in gib.items() if v <= self.args.mem_gib)
            rows = outlier_rows(
                p, x, w, self.args.repeats, edge_weight=norm, backward=True, handles=handles,
                total=lambda pol, p=p: layer.forward(lambda h, wr: typed_message_sum(h, wr, p, pol, edge_weight=norm)),
            )  # fmt: skip
            rows += [[f"{'handled' if k else 'uniform'}: skipped (est. {v:.1f} GiB)"] for k, v in gib.items() if k not in handles]  # fmt: skip
            table(
                f"{layer.name}: differentiated outlier execution (Fig. 19), {text}: forward + backward CPU ms per "
                "category (units); total = the whole layer",
                OUTLIER_HEADER,
                rows,
            )

    def epoch_table(self) -> None:
        """Whole training epochs with ``auto`` and with each variant forced in both layers."""
        from bench_gtask import table

        args, g = self.args, self.g
        rows, auto = [], None
        for v in ("auto", *self.variants):
            if v != "auto" and any(layer.est[v] > args.mem_gib for layer in self.layers):
                rows.append([v, "skipped (est. memory)", "", "", ""])
                continue
            for conv in self.model.convs:
                conv.variant = v
            _reset_peak()
            times = train_times(self.model, lambda: self.model(g.x, g), g.y, g.train_mask, args.warmup, args.epochs)
            med = statistics.median(times)
            auto = auto or med
            rows.append([v, med, min(times), f"{med / auto:.2f}x", _peak_since_reset()])
            print(v, [round(s, 3) for s in times], flush=True)
        table(
            f"whole epoch, variant forced in both layers ({args.warmup} warm-up + {args.epochs} timed; wall s)",
            ["variant", "median epoch s", "min epoch s", "vs auto", "peak RSS MiB (its epochs)"],
            rows,
        )


def ablation(args: argparse.Namespace) -> None:
    """WiseGraph Figs. 17-19 analogues for RGCN, per layer, then whole epochs per variant (module docstring)."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as bench_gtask (whose timer this uses), before torch loads
    import dataclasses

    from bench_gtask import K_PLAN, k_plans

    from tessera.relational.gtask import build_plan
    from tessera.relational.gtask_kernels import OutlierPolicy
    from tessera.relational.plan import GTASK_RESTRICTIONS

    ab = _Ablation(args)
    st = ab.st
    print(f"## RGCN ablation, synthetic:{args.graph}: {st.rows} vertices, {st.edges} edges, {st.relations} relations, "
          f"{st.source_pairs} distinct (relation, source) and {st.destination_pairs} (relation, destination) pairs; "
          f"hidden {args.hidden}, {args.threads} threads, median of {args.repeats} after one warm-up", flush=True)  # fmt: skip
    k_runs = (
        {label: (p, OutlierPolicy()) for label, p in k_plans(ab.g, args.ks).items()} if "k" not in args.skip else {}
    )
    batch_runs = {
        f"batch_rows={b}": (ab.plan, dataclasses.replace(OutlierPolicy(), batch_rows=b)) for b in args.batch_rows
    }
    outlier_plans = {GTASK_RESTRICTIONS: ab.plan, args.outlier_plan: build_plan(ab.g, args.outlier_plan)}
    for layer in ab.layers:
        ab.check(layer)
        if "variants" not in args.skip:
            ab.variants_table(layer)
        if k_runs:
            ab.throughput_table(layer, f"throughput vs K, {K_PLAN.format(k='K')}, outliers handled (Fig. 18a)", k_runs)
        if "batch" not in args.skip:
            ab.throughput_table(layer, f"throughput vs gTasks per batched product, {GTASK_RESTRICTIONS}", batch_runs)
        if "outliers" not in args.skip:
            ab.outlier_tables(layer, outlier_plans)
    if "epoch" not in args.skip:
        ab.epoch_table()


# ---------------------------------------------------------------------------------------- accuracy
def accuracy(args: argparse.Namespace) -> None:
    """Test accuracy of RGCN and GCN (tessera's trainer) per seed, and the mean margin."""
    from tessera.datasets import load
    from tessera.train.config import TrainConfig
    from tessera.train.loop import train

    _set_threads(args.threads)
    g = load(f"synthetic:{args.graph}")
    acc: dict[str, list[float]] = {"rgcn": [], "gcn": []}
    for seed in args.seeds:
        for model in acc:
            cfg = TrainConfig(
                dataset=f"synthetic:{args.graph}", model=model, hidden=args.hidden, epochs=args.epochs, seed=seed,
                threads=args.threads, progress=False, out=f"{args.out}/{model}-s{seed}", checkpoint_every=10**6,
            )  # fmt: skip
            acc[model].append(train(cfg.validate(), g)["test_acc"])
            print(model, seed, acc[model][-1], flush=True)
    margin = [a - b for a, b in zip(acc["rgcn"], acc["gcn"], strict=True)]
    print(json.dumps({k: [round(v, 4) for v in vs] for k, vs in acc.items()}))
    print(
        f"rgcn {statistics.mean(acc['rgcn']):.4f}, gcn {statistics.mean(acc['gcn']):.4f}, "
        f"margin mean {statistics.mean(margin):.4f} min {min(margin):.4f} over {len(margin)} seeds"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("epochs", "child", "dgl-child", "ablation"):
        s = sub.add_parser(name)
        s.add_argument("--threads", type=int, default=2)
        s.add_argument("--hidden", type=int, default=256)
        s.add_argument("--epochs", type=int, default=5)
        s.add_argument("--warmup", type=int, default=2)
        if name != "dgl-child":
            s.add_argument("--mem-gib", type=float, default=12.0 if name == "ablation" else 16.0)
        if name in ("epochs", "dgl-child"):
            s.add_argument("--dgl-presorted", action=argparse.BooleanOptionalAction, default=True)
    sub.choices["epochs"].add_argument("--graphs", nargs="+", default=["arxiv-rel8", "arxiv-rel32"])
    sub.choices["epochs"].add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    sub.choices["epochs"].add_argument("--rounds", type=int, default=1)
    sub.choices["epochs"].add_argument("--md", help="also write the table and machine facts to this markdown file")
    sub.choices["epochs"].add_argument("--dgl-python", default="/work/dgl-venv/bin/python")
    sub.choices["child"].add_argument("--graph", required=True)
    sub.choices["child"].add_argument("--framework", required=True, choices=FRAMEWORKS[:3])
    sub.choices["dgl-child"].add_argument("--data", required=True)
    ab = sub.choices["ablation"]
    ab.add_argument("--graph", default="arxiv-rel8")
    ab.add_argument("--repeats", type=int, default=3)
    ab.add_argument("--ks", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 0], help="0 means inf")
    ab.add_argument("--outlier-plan", default="uniq(Dst.ID)=8 & uniq(Edge.Type)=1")
    ab.add_argument(
        "--batch-rows",
        type=int,
        nargs="+",
        default=[256, 1024, 4096, 16384],
        help="OutlierPolicy.batch_rows values: rows per batched product (gTasks per product = this / 64)",
    )
    ab.add_argument(
        "--variants",
        nargs="+",
        help="the variants to force in (a) and in the epochs (default all; all are listed with their FLOPs)",
    )
    ab.add_argument("--skip", nargs="*", default=[], choices=["variants", "k", "batch", "outliers", "epoch"])
    a = sub.add_parser("accuracy")
    a.add_argument("--graph", default="arxiv-rel")
    a.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    a.add_argument("--epochs", type=int, default=100)
    a.add_argument("--hidden", type=int, default=64)
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--out", default="/tmp/tessera-rgcn-accuracy")
    args = p.parse_args()
    {"epochs": epochs, "child": child, "dgl-child": dgl_child, "ablation": ablation, "accuracy": accuracy}[args.cmd](
        args
    )


if __name__ == "__main__":
    main()
