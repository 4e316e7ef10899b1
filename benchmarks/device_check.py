"""The Python side of ``benchmarks/device_check.sh``: CUDA losses against the CPU's, and training
epochs of tessera and PyG on one GPU, each written as JSON that survives a failing part.

    python benchmarks/device_check.py losses --device cuda --out cuda_vs_cpu.json
    python benchmarks/device_check.py train --device cuda --graph synthetic:products --out train_gpu.json

``losses``: per model (gcn, sage, gin, gat, rgcn on ``<dataset>-rel``, sage-lstm), ``--steps``
training steps with dropout 0.5 through ``tessera.train.loop.Trainer`` on the CPU (default
backend) and on ``--device`` (with ``--backend``), and their largest relative difference; the
issue's bar is 1e-4. ``train``: per model and framework, the median of ``--epochs`` training
epochs after ``--warmup`` (zero_grad, forward, cross entropy on the training vertices, backward,
Adam) and the peak memory the device's allocator held (``torch.cuda.max_memory_allocated``, from
a reset at the cell's start; ``baseline_mib`` is what was allocated then). tessera trains as
``tessera train --device`` does (its ``Trainer``, ``--reorder none``); PyG is
``benchmarks/_peers.py``'s model (the one ``bench_train.py`` times) with its adjacency, features
and weights on the device, on the edge index (``pyg-edge_index``) and on a ``torch.sparse_csr``
``adj_t`` (``pyg-csr``); same graph, widths, heads and dropout.

Robustness: the cells run in a child process that appends one JSON line per finished cell; the
parent rewrites ``--out`` after every line, so a cell that fails leaves the others' results. An
exception is recorded as that cell's error and the child goes on; a CUDA error that spoils the
context (or a crash, or a hang past the budget) ends the child, the parent records the cell that
was running and starts a fresh child for the rest. ``--budget-s`` bounds the whole section: cells
that would start after it are recorded as skipped, a cell stops its timed epochs early (marked
``partial``) rather than overrun it. To test these paths, ``DEVICE_CHECK_FAULT=KIND:CELL`` (CELL
is ``<framework>/<model>``, or ``losses/<model>``) makes that cell exit hard (``crash``), hang
(``hang``) or raise a CUDA-like error (``error``).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
LOSS_MODELS = ("gcn", "sage", "gin", "gat", "rgcn", "sage-lstm")
TRAIN_MODELS = ("gcn", "sage", "gat", "gin")  # the goal of issue 43 is on the first three
FRAMEWORKS = ("tessera", "pyg-edge_index", "pyg-csr", "tessera-mixture")
# tessera-mixture: --aggregate-on cpu (MixGCN's mixture of accelerators: CPU aggregation, GPU update)
MIXTURE_MODELS = ("gcn", "sage", "gin")
MIN_CELL_S = 5.0  # a cell is not started with less than this left of the budget
KILL_GRACE_S = 3.0
RESTART_RC = 3  # a child's exit status after an error that spoils the CUDA context: start a fresh one
LOSS_BAR = 1e-4


# ------------------------------------------------------------------------------------ parent
def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _write_json(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str) + "\n")
    os.replace(tmp, path)


def _read_lines(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:  # a line cut short by a crash
            pass
    return out


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _kill(proc: subprocess.Popen) -> None:
    """SIGTERM the child's process group, SIGKILL it after a grace period."""
    for sig, wait in ((signal.SIGTERM, KILL_GRACE_S), (signal.SIGKILL, KILL_GRACE_S)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(wait)
            return
        except subprocess.TimeoutExpired:
            continue


def run_cells(
    kind: str,
    cells: list[dict[str, Any]],
    common: dict[str, Any],
    doc: dict[str, Any],
    out: Path,
    deadline: float,
    cell_timeout: float,
) -> None:
    """Run ``cells`` in children (a fresh one after each crash or hang), filling ``doc["cells"]``
    in order and rewriting ``out`` whenever a result arrives. A child that reports nothing for
    ``cell_timeout`` seconds, or runs past ``deadline``, is killed and its cell marked ``timeout``."""
    logs = out.parent / "logs"
    logs.mkdir(exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    order = [c["id"] for c in cells]

    def publish() -> None:
        doc["cells"] = [results[i] for i in order if i in results]
        names = [r["device_name"] for r in doc["cells"] if r.get("device_name")]
        if names:
            doc["device_name"] = names[0]
        doc["updated"] = _now()
        _write_json(out, doc)

    pending = list(cells)
    launch = 0
    with tempfile.TemporaryDirectory(prefix="device_check_") as tmp:
        while pending:
            if deadline - time.time() < MIN_CELL_S:
                for c in pending:
                    results[c["id"]] = {**c, "status": "skipped", "reason": "time budget spent"}
                break
            launch += 1
            lines = Path(tmp) / f"{kind}-{launch}.jsonl"
            log = logs / f"{kind}-{launch}.txt"
            spec = {"kind": kind, "cells": pending, "common": common, "deadline": deadline - 1.0,
                    "cell_timeout": cell_timeout}  # fmt: skip
            with open(log, "w") as lf:
                proc = subprocess.Popen(
                    [sys.executable, str(Path(__file__).resolve()), "_child", json.dumps(spec), str(lines)],
                    stdout=lf, stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT,
                )  # fmt: skip
                seen, killed, last = 0, False, time.time()
                while proc.poll() is None:
                    now = time.time()
                    if now > deadline + KILL_GRACE_S or now > last + cell_timeout + KILL_GRACE_S:
                        _kill(proc)
                        killed = True
                        break
                    time.sleep(0.25)
                    got = _read_lines(lines)
                    if len(got) > seen:
                        seen, last = len(got), time.time()
                        results.update({r["id"]: r for r in got})
                        publish()
                proc.wait()
            results.update({r["id"]: r for r in _read_lines(lines)})
            pending = [c for c in pending if c["id"] not in results]
            if pending and (killed or proc.returncode != RESTART_RC):
                # the child died in (or hung on) the first cell it did not report
                c = pending.pop(0)
                results[c["id"]] = {
                    **c, "status": "timeout" if killed else "crash", "rc": proc.returncode,
                    "log": str(log.relative_to(out.parent)), "log_tail": _tail(log),
                }  # fmt: skip
            publish()
    publish()


def _base_doc(a: argparse.Namespace, section: str) -> dict[str, Any]:
    return {
        "section": section,
        "started": _now(),
        "argv": sys.argv[1:],
        "python": sys.executable,
        "device_requested": a.device,
        "budget_s": a.budget_s,
        "commit": os.environ.get("DEVICE_CHECK_COMMIT", "unknown"),
    }


def cmd_losses(a: argparse.Namespace) -> int:
    deadline = time.time() + a.budget_s
    out = Path(a.out)
    doc = _base_doc(a, "losses")
    doc.update(dataset=a.dataset, steps=a.steps, backend=a.backend, bar_rel=LOSS_BAR, cells=[])
    _write_json(out, doc)
    cells = [{"id": f"losses/{m}", "model": m} for m in a.models]
    # the mixture of accelerators on the device against the same one-process CPU run
    cells += [{"id": f"losses/mixture-{m}", "model": m, "aggregate_on": "cpu"} for m in a.models if m in MIXTURE_MODELS]
    common = {"device": a.device, "dataset": a.dataset, "steps": a.steps, "backend": a.backend, "hidden": a.hidden}
    try:
        run_cells("losses", cells, common, doc, out, deadline, a.cell_timeout_s)
    except Exception as e:  # the parent itself: keep what is there
        doc["error"] = f"{type(e).__name__}: {e}"
    ok = [c for c in doc["cells"] if c.get("status") == "ok"]
    doc["summary"] = {
        "models": len(cells),
        "ran": len(ok),
        "equal_within_bar": sum(1 for c in ok if c["within_bar"]),
        "max_rel_diff": max((c["max_rel_diff"] for c in ok), default=None),
    }
    doc["finished"] = _now()
    _write_json(out, doc)
    print(json.dumps(doc["summary"]))
    return 0


def cmd_train(a: argparse.Namespace) -> int:
    deadline = time.time() + a.budget_s
    out = Path(a.out)
    doc = _base_doc(a, "train")
    settings = {
        k: getattr(a, k) for k in ("graph", "hidden", "layers", "heads", "dropout", "epochs", "warmup", "backend")
    }
    doc.update(settings=settings, cells=[])
    _write_json(out, doc)
    try:  # generate (and cache on disk) the graph once, so no cell pays for it
        t0 = time.perf_counter()
        from tessera.datasets import load

        g = load(a.graph)
        doc["graph"] = {
            "spec": a.graph, "num_nodes": int(g.num_nodes), "num_edges": int(g.num_edges),
            "num_features": int(g.num_features), "num_classes": int(g.num_classes),
            "num_train": int(g.train_mask.sum()), "load_s": round(time.perf_counter() - t0, 2),
        }  # fmt: skip
        del g
    except Exception as e:
        doc["graph"] = {"spec": a.graph, "error": f"{type(e).__name__}: {e}"}
    _write_json(out, doc)
    # interleaved per model: a budget that runs out leaves whole models, each beside its peers
    # interleaved per model (the mixture's cells last: they are the extra, not the goal)
    plain = [fw for fw in a.frameworks if fw != "tessera-mixture"]
    cells = [{"id": f"{fw}/{m}", "framework": fw, "model": m} for m in a.models for fw in plain]
    if "tessera-mixture" in a.frameworks:
        cells += [{"id": f"tessera-mixture/{m}", "framework": "tessera-mixture", "model": m}
                  for m in a.models if m in MIXTURE_MODELS]  # fmt: skip
    common = {**settings, "device": a.device}
    try:
        run_cells("train", cells, common, doc, out, deadline, a.cell_timeout_s)
    except Exception as e:
        doc["error"] = f"{type(e).__name__}: {e}"
    doc["summary"] = _train_summary(doc["cells"], a.models, a.frameworks)
    doc["finished"] = _now()
    _write_json(out, doc)
    md = out.with_suffix(".md")
    md.write_text(_train_markdown(doc))
    print(md.read_text())
    return 0


def _train_summary(cells: list[dict[str, Any]], models: list[str], frameworks: list[str]) -> list[dict[str, Any]]:
    rows = []
    for m in models:
        row: dict[str, Any] = {"model": m}
        for fw in frameworks:
            c = next((c for c in cells if c.get("model") == m and c.get("framework") == fw), None)
            ok = c is not None and c.get("status") == "ok"
            row[f"{fw}_ms"] = round(c["median_ms"], 2) if ok else None
            row[f"{fw}_peak_mib"] = c.get("peak_mib") if ok else None
            if not ok:
                row[f"{fw}_status"] = "missing" if c is None else c.get("status")
        peers = [row[f"{fw}_ms"] for fw in frameworks if fw.startswith("pyg") and row.get(f"{fw}_ms")]
        if row.get("tessera_ms") and peers:
            row["tessera_over_best_pyg"] = round(row["tessera_ms"] / min(peers), 3)
        rows.append(row)
    return rows


def _train_markdown(doc: dict[str, Any]) -> str:
    fws = [fw for fw in FRAMEWORKS if any(c.get("framework") == fw for c in doc["cells"])]
    g = doc.get("graph", {})
    lines = [
        f"# device_check train: {g.get('spec')} ({g.get('num_nodes')} vertices, {g.get('num_edges')} edges), "
        f"device {doc.get('device_name', doc['device_requested'])}",
        "",
        f"settings: {json.dumps(doc['settings'])}; median epoch ms and peak MiB allocated on the device",
        "",
        "| model | " + " | ".join(f"{fw} ms | {fw} MiB" for fw in fws) + " | tessera / best PyG |",
        "|---|" + "---:|---:|" * len(fws) + "---:|",
    ]
    for row in doc["summary"]:
        cells = []
        for fw in fws:
            ms, mib = row.get(f"{fw}_ms"), row.get(f"{fw}_peak_mib")
            cells += [
                f"{ms:.1f}" if ms is not None else row.get(f"{fw}_status", "-"),
                "-" if mib is None else f"{mib:.0f}",
            ]
        ratio = row.get("tessera_over_best_pyg")
        lines.append(f"| {row['model']} | " + " | ".join(cells) + f" | {'-' if ratio is None else f'{ratio:.2f}x'} |")
    bad = [c for c in doc["cells"] if c.get("status") != "ok"]
    if bad:
        lines += ["", "Not measured:"]
        lines += [f"- {c['id']}: {c.get('status')}: {c.get('error') or c.get('reason') or c.get('rc')}" for c in bad]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------ child
def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _memory_start(device: Any) -> float | None:
    import torch

    gc.collect()
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    return torch.cuda.memory_allocated(device) / 2**20


def _memory_peak(device: Any) -> dict[str, float | None]:
    import torch

    if device.type != "cuda":
        return {"peak_mib": None, "peak_reserved_mib": None}
    return {
        "peak_mib": round(torch.cuda.max_memory_allocated(device) / 2**20, 1),
        "peak_reserved_mib": round(torch.cuda.max_memory_reserved(device) / 2**20, 1),
    }


def _timed_epochs(step, device, warmup: int, epochs: int, deadline: float) -> dict[str, Any]:
    """``warmup + epochs`` calls of ``step`` (returning the loss), each timed between device
    synchronisations; the timed ones stop early (``partial``) rather than run past ``deadline``."""
    times, losses, partial = [], [], False
    for i in range(warmup + epochs):
        if i > warmup and time.time() + times[-1] > deadline:
            partial = True
            break
        _sync(device)
        t0 = time.perf_counter()
        loss = step()
        _sync(device)
        times.append(time.perf_counter() - t0)
        losses.append(float(loss))
    timed = times[warmup:] or times[-1:]
    return {
        "median_ms": statistics.median(timed) * 1e3,
        "min_ms": min(timed) * 1e3,
        "epoch_ms": [round(t * 1e3, 3) for t in timed],
        "warmup_ms": [round(t * 1e3, 3) for t in times[:warmup]],
        "epochs_timed": len(timed),
        "partial": partial,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }


def _trainer(
    dataset: str, model: str, device: str, backend: str, c: dict[str, Any], out: str, aggregate_on: str = "device"
):
    from tessera.datasets import load
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    cfg = TrainConfig(
        dataset=dataset, model=model, hidden=c["hidden"], layers=c.get("layers", 2), heads=c.get("heads", 2),
        dropout=c.get("dropout", 0.5), lr=0.01, weight_decay=5e-4, seed=0, device=device, backend=backend,
        reorder="none", progress=False, out=out, checkpoint_every=10**6, aggregate_on=aggregate_on,
    )  # fmt: skip
    return Trainer(cfg.validate(), load(dataset))


def _loss_cell(cell: dict[str, Any], c: dict[str, Any], deadline: float) -> dict[str, Any]:
    model = cell["model"]
    dataset = f"{c['dataset']}-rel" if model == "rgcn" else c["dataset"]  # RGCN needs typed edges
    runs: dict[str, list[float]] = {}
    setups: dict[str, str] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        side = cell.get("aggregate_on", "device")
        for label, device, backend, on in (
            ("cpu", "cpu", "auto", "device"), ("device", c["device"], c["backend"], side)
        ):  # fmt: skip
            t = _trainer(dataset, model, device, backend, c, f"{tmp}/{label}", on)
            setups[label] = f"{t.device} backend={backend} aggregate_on={on}"
            runs[label] = [t.train_step() for _ in range(c["steps"])]
            del t
    rel = max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(runs["device"], runs["cpu"], strict=True))
    return {
        "status": "ok", "dataset": dataset, "cpu_run": setups["cpu"], "device_run": setups["device"],
        "losses_cpu": runs["cpu"], "losses_device": runs["device"], "max_rel_diff": rel,
        "within_bar": rel <= LOSS_BAR, "seconds": round(time.perf_counter() - t0, 2),
    }  # fmt: skip


def _tessera_cell(model: str, c: dict[str, Any], deadline: float, aggregate_on: str = "device") -> dict[str, Any]:
    import torch

    device = torch.device(c["device"])
    base = _memory_start(device)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        t = _trainer(c["graph"], model, c["device"], c["backend"], c, tmp, aggregate_on)
        _sync(device)
        setup_s = time.perf_counter() - t0
        res = _timed_epochs(t.train_step, device, c["warmup"], c["epochs"], deadline)
        info = {
            "device": str(t.device),
            "x_dtype": str(t.x.dtype),
            "backend": c["backend"],
            "aggregate_on": aggregate_on,
        }
        del t
    return {
        "status": "ok",
        **res,
        **_memory_peak(device),
        "baseline_mib": base,
        "setup_s": round(setup_s, 2),
        "info": info,
    }


def _pyg_cell(framework: str, model: str, c: dict[str, Any], deadline: float) -> dict[str, Any]:
    """``_peers.build_pyg``'s model with its adjacency, features and weights on the device."""
    import _peers
    import torch
    from _graphdata import dst_of_edges
    from torch_geometric.utils import to_torch_csr_tensor

    from tessera.datasets import load

    device = torch.device(c["device"])
    g = load(c["graph"])
    arrays = {"indptr": g.indptr.numpy(), "indices": g.indices.numpy()}
    meta = {"num_nodes": g.num_nodes, "num_features": g.num_features, "num_classes": g.num_classes, "name": g.name}
    pcfg = {"hidden": c["hidden"], "layers": c["layers"], "heads": c["heads"], "dropout": c["dropout"]}
    layout = framework.split("-", 1)[1]
    base = _memory_start(device)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    net, forward, info = _peers.build_pyg(model, arrays, meta, pcfg, layout)
    src = torch.from_numpy(arrays["indices"]).to(device)
    dst = torch.from_numpy(dst_of_edges(arrays["indptr"])).to(device)
    n = g.num_nodes
    adj = (
        torch.stack([src, dst]) if layout == "edge_index" else to_torch_csr_tensor(torch.stack([dst, src]), size=(n, n))
    )
    del src, dst
    net._apply_conv = lambda conv, x: conv(x, adj)  # the Stack's convolutions on the device's adjacency
    net.to(device)
    x, y = g.x.to(device), g.y.to(device)
    train_idx = g.train_mask.nonzero().view(-1).to(device)
    opt = torch.optim.Adam(net.parameters(), lr=0.01, weight_decay=5e-4)
    loss_fn = _peers.train_loss(framework)
    net.train()

    def step() -> float:
        opt.zero_grad(set_to_none=True)
        logits, rows = forward(net, x, train_idx)
        loss = loss_fn(logits, rows, y[train_idx])
        loss.backward()
        opt.step()
        return float(loss.detach())

    _sync(device)
    setup_s = time.perf_counter() - t0
    res = _timed_epochs(step, device, c["warmup"], c["epochs"], deadline)
    info = {**info, "device": str(device), "layout": layout}
    return {
        "status": "ok",
        **res,
        **_memory_peak(device),
        "baseline_mib": base,
        "setup_s": round(setup_s, 2),
        "info": info,
    }


def _fatal_cuda(e: BaseException) -> bool:
    """An error after which the CUDA context cannot be trusted (an out-of-memory error can)."""
    import torch

    if isinstance(e, torch.cuda.OutOfMemoryError):
        return False
    text = str(e)
    return any(
        s in text for s in ("CUDA error", "illegal memory access", "device-side assert", "CUBLAS_STATUS", "cuDNN error")
    )


def _simulate(fault: str) -> None:
    """The fault ``DEVICE_CHECK_FAULT`` asks for."""
    if fault == "crash":
        os._exit(7)
    if fault == "hang":
        time.sleep(10**6)
    if fault == "error":
        raise RuntimeError("CUDA error: an illegal memory access was encountered (simulated)")
    raise ValueError(f"DEVICE_CHECK_FAULT: unknown kind {fault!r}; use crash, hang or error")


def child(spec: dict[str, Any], lines: Path) -> int:
    import torch

    kind, c, deadline, cell_timeout = spec["kind"], spec["common"], spec["deadline"], spec["cell_timeout"]
    fault, _, fault_cell = os.environ.get("DEVICE_CHECK_FAULT", "").partition(":")
    if c["device"].startswith("cuda") and torch.cuda.is_available():
        name = torch.cuda.get_device_name(torch.device(c["device"]))
    else:
        name = c["device"]
    # every cell starts from the process's float32 matmul settings (a framework may change them)
    tf32 = (
        torch.get_float32_matmul_precision(),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
    )
    for cell in spec["cells"]:
        rec: dict[str, Any] = {**cell, "device_name": name}
        torch.set_float32_matmul_precision(tf32[0])
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32[1:]
        fatal = False
        if time.time() + MIN_CELL_S > deadline:
            rec.update(status="skipped", reason="time budget spent")
        else:
            t0 = time.perf_counter()
            # the timed epochs stop early rather than let the parent kill the cell
            stop = min(deadline, time.time() + cell_timeout - 2 * KILL_GRACE_S)
            try:
                if fault_cell == cell["id"]:
                    _simulate(fault)
                if kind == "losses":
                    rec.update(_loss_cell(cell, c, stop))
                elif cell["framework"] == "tessera":
                    rec.update(_tessera_cell(cell["model"], c, stop))
                elif cell["framework"] == "tessera-mixture":
                    rec.update(_tessera_cell(cell["model"], c, stop, aggregate_on="cpu"))
                else:
                    rec.update(_pyg_cell(cell["framework"], cell["model"], c, stop))
            except Exception as e:
                oom = isinstance(e, (MemoryError, torch.cuda.OutOfMemoryError))
                rec.update(status="oom" if oom else "error", error=f"{type(e).__name__}: {str(e)[:500]}",
                           traceback=traceback.format_exc()[-3000:])  # fmt: skip
                traceback.print_exc()
                fatal = _fatal_cuda(e)
            rec["cell_s"] = round(time.perf_counter() - t0, 2)
            rec["float32_matmul"] = {  # as the cell left them (tessera's set-up or PyG's may set them)
                "precision": torch.get_float32_matmul_precision(),
                "cuda_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
                "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
            }
        with open(lines, "a") as f:
            f.write(json.dumps(rec, default=str) + "\n")
        print(f"[device_check] {cell['id']}: {rec['status']} ({rec.get('cell_s', 0)} s)", flush=True)
        if fatal:
            return RESTART_RC  # the parent starts a fresh process (a fresh CUDA context) for the rest
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return 0


# ------------------------------------------------------------------------------------ CLI
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="cmd", required=True)
    for name in ("losses", "train"):
        s = sub.add_parser(name)
        s.add_argument("--device", default="cuda", help="the device under test (cpu for a dry run)")
        s.add_argument("--backend", default="auto", help="tessera backend on the device under test")
        s.add_argument("--out", required=True, help="JSON file to write")
        s.add_argument("--budget-s", type=float, default=120.0, help="seconds for the whole section")
        s.add_argument("--cell-timeout-s", type=float, default=90.0, help="seconds for one model (and framework)")
        s.add_argument("--hidden", type=int, default=16 if name == "losses" else 256)
        if name == "losses":
            s.add_argument("--dataset", default="synthetic:small", help="RGCN takes <dataset>-rel")
            s.add_argument("--steps", type=int, default=3)
            s.add_argument("--models", nargs="+", default=list(LOSS_MODELS), choices=LOSS_MODELS)
        else:
            s.add_argument("--graph", default="synthetic:products")
            s.add_argument("--layers", type=int, default=2)
            s.add_argument("--heads", type=int, default=8, help="GAT's hidden heads (hidden // heads wide each)")
            s.add_argument("--dropout", type=float, default=0.5)
            s.add_argument("--epochs", type=int, default=10)
            s.add_argument("--warmup", type=int, default=2)
            s.add_argument("--models", nargs="+", default=list(TRAIN_MODELS), choices=TRAIN_MODELS)
            s.add_argument("--frameworks", nargs="+", default=list(FRAMEWORKS), choices=FRAMEWORKS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_child"]:
        return child(json.loads(argv[1]), Path(argv[2]))
    a = parse_args(argv)
    if a.cmd == "losses":
        return cmd_losses(a)
    return cmd_train(a)


if __name__ == "__main__":
    sys.exit(main())
