"""Where one tessera training step's time goes: products, aggregation, the fused nodes' own work.

Builds the model ``bench_train.py`` times (same graph, widths, dropout, Adam, the training rows as
targets), runs a few steps, then profiles two with torch's profiler and prints the ops by self
time and input shapes, and a summary per step in four groups:

- products: MKL's and oneDNN's dense products (``mm``, ``addmm``, ``addmm_``, oneDNN's linear
  and in-place 1x1 convolution), with the GFLOP/s they reach;
- aggregation: the sparse aggregation nodes, forward and backward;
- fused nodes: the own time of tessera's autograd nodes that run numba kernels and row-chunk
  loops (``_LinearAct``, ``_ActDropout``, ``_Dropout`` and their backwards);
- the rest: elementwise ops, copies, the loss, the optimiser, and the profiler's own cost.

The profiler adds a few microseconds to every op it records, so the profiled steps are slower
than the timed ones printed before them; compare groups within one run.

    python benchmarks/profile_step.py --graph synthetic:arxiv --model sage --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _graphdata  # noqa: E402
import _peers  # noqa: E402

PRODUCTS = (
    "aten::mm",
    "aten::addmm",
    "aten::addmm_",
    "mkldnn::_linear_pointwise",
    "mkldnn::_convolution_pointwise_",
    "aten::convolution_backward",
)
AGGREGATION = ("AggregateFn", "AggregateFnBackward")
FUSED = ("_LinearAct", "_LinearActBackward", "_ActDropout", "_ActDropoutBackward", "_Dropout", "_DropoutBackward")


def _product_flops(name: str, shapes: list[list[int]]) -> float:
    """Floating-point operations of one call of a product op, from its recorded input shapes."""
    if name == "aten::mm":
        (m, k), (_, n) = shapes[0], shapes[1]
    elif name in ("aten::addmm", "aten::addmm_"):
        (m, k), (_, n) = shapes[1], shapes[2]
    elif name == "mkldnn::_linear_pointwise":
        (m, k), (n, _) = shapes[0], shapes[1]
    elif name == "aten::convolution_backward":  # a weight gradient: 1 x N x M x 1 and 1 x K x M x 1 images
        m, k, n = shapes[0][2], shapes[1][1], shapes[0][1]
    else:  # a 1 x K x N x 1 image (the rows as pixels) times an out x K x 1 x 1 kernel
        m, k, n = shapes[1][2], shapes[1][1], shapes[2][0]
    return 2.0 * m * k * n


def _group(name: str) -> str:
    if name in PRODUCTS:
        return "products"
    if name in AGGREGATION:
        return "aggregation"
    if name in FUSED:
        return "fused nodes"
    return "rest"


def main(argv: list[str] | None = None) -> int:
    """Profile one model's training step; print the op table and the per-group summary."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", default="synthetic:arxiv", help="a tessera dataset spec")
    p.add_argument("--model", default="gcn", choices=("gcn", "sage", "gin", "gat"))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="timed steps before the two profiled ones")
    p.add_argument("--rows", type=int, default=25, help="ops listed in the table")
    a = p.parse_args(argv)

    from tessera.threads import set_num_threads

    set_num_threads(a.threads)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        _graphdata.dump(a.graph, tmp)
        arrays, meta = _graphdata.load_arrays(tmp)
    spec = dict(hidden=a.hidden, layers=2, heads=8, dropout=0.5, backend="auto", reorder="auto")
    model, forward, info = _peers.build_tessera(a.model, arrays, meta, spec)
    x, y = torch.from_numpy(arrays["x"]), torch.from_numpy(arrays["y"])
    idx = torch.from_numpy(arrays["train_mask"]).nonzero().view(-1)
    opt = torch.optim.Adam(model.parameters(), lr=0.01, weight_decay=5e-4)
    model.train()

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        logits, pick = forward(model, x, idx)
        F.cross_entropy(logits if pick is None else logits[pick], y[idx]).backward()
        opt.step()

    for _ in range(a.warmup):
        step()
    times = []
    for _ in range(a.steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
        step()
    events = prof.key_averages(group_by_input_shape=True)
    print(f"{a.model} on {a.graph}: {meta['num_nodes']:,} vertices, {meta['num_edges']:,} edges, "
          f"{info['vertex_order']} order, {a.threads} threads; timed steps ms "
          f"{[round(t * 1e3) for t in times]} (median {statistics.median(times) * 1e3:.0f})")  # fmt: skip
    print(events.table(sort_by="self_cpu_time_total", row_limit=a.rows, max_name_column_width=30,
                       max_shapes_column_width=70))  # fmt: skip
    ms = {"products": 0.0, "aggregation": 0.0, "fused nodes": 0.0, "rest": 0.0}
    flops = 0.0
    for e in events:
        group = _group(e.key)
        ms[group] += e.self_cpu_time_total / 1e3 / 2
        if group == "products" and e.input_shapes:
            flops += _product_flops(e.key, e.input_shapes) * e.count / 2
    total = sum(ms.values())
    print(f"per profiled step ({total:.0f} ms):")
    for group, t in ms.items():
        extra = f", {flops / 1e9:.1f} GFLOP at {flops / t / 1e6:.0f} GFLOP/s" if group == "products" and t else ""
        print(f"  {group:12s} {t:7.0f} ms{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
