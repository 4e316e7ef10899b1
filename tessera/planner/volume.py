"""Bytes a partition-parallel training epoch moves between P ranks, from the partition alone.

Per layer and direction rank ``p`` sends rank ``q`` one block of ``rows[p, q]`` rows of the layer's
exchange width (the runtime's ``RankPlan.send_counts``; SuperGCN §5.2–5.3), costing
``tessera.comm.wire.block_bytes(rows[p, q], width, bits)`` data and parameter bytes (below 32 bits
one scale and zero point per group of ``GROUP_ROWS`` rows, a block's last group possibly short).
Backward sends the same rows the other way: pair ``(q, p)`` carries ``rows[p, q]``. A training
epoch is the forward and backward exchange of every layer, except that layer 0 has no backward
exchange when its aggregated input needs no gradient (autograd skips it: raw features aggregated
before the linear map, no LayerNorm, no label embedding). Evaluation forwards exchange the forward
volumes again; they are reported apart (``eval_forward_bytes``), as the runtime's log counts
training passes only.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from tessera.comm.wire import COMM_BITS, block_bytes
from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.graph.partition import partition
from tessera.graph.partition.halo import pair_rows
from tessera.sparse import LayerSpec

DIRECTIONS = ("forward", "backward")


# ---------------------------------------------------------------------------------------- layers
def exchange_layers(specs: list[LayerSpec], norm: str = "none", label_prop: float = 0.0) -> list[tuple[int, bool]]:
    """``(width, has_backward)`` per layer, from the layers' own descriptions: every layer
    exchanges rows of its aggregated width; layer 0 exchanges gradients only when its aggregated
    input needs one (LayerNorm or label embedding before it, or the layer transforming first)."""
    if norm not in ("none", "layer"):
        raise ConfigError(f"--norm must be none or layer, got {norm!r}")
    if any(s.edge_values for s in specs):
        raise ConfigError(
            "the simulator models gcn, sage and gin exchanges; gat's (every remote source's features and "
            "attention terms, post-mode whatever --remote-agg) is measured by training with --nprocs"
        )
    first_grad = norm == "layer" or label_prop > 0
    return [(s.aggregate_width, i > 0 or s.aggregates_input_grad(first_grad)) for i, s in enumerate(specs)]


# ---------------------------------------------------------------------------------------- bytes
def pair_bytes(rows: np.ndarray, width: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(data, parameter) bytes per ordered pair of one exchange whose sender x receiver row matrix
    is ``rows``: each pair's rows are one block on the wire (``tessera.comm.wire.block_bytes``)."""
    return block_bytes(np.asarray(rows), width, bits)


def _direction(rows: np.ndarray, width: int, bits: int) -> dict[str, Any]:
    """Totals of one exchange whose sender x receiver row matrix is ``rows``."""
    data, params = pair_bytes(rows, width, bits)
    sent = (data + params).sum(axis=1)
    r = int(np.argmax(sent)) if sent.size else 0
    return {
        "rows": int(rows.sum()),
        "data_bytes": int(data.sum()),
        "param_bytes": int(params.sum()),
        "bytes": int(sent.sum()),
        "max_rank_bytes": int(sent[r]) if sent.size else 0,
        "max_rank": r,
        "active_pairs": int(np.count_nonzero(rows)),
    }


def _bits_summary(rows: np.ndarray, plan: list[tuple[int, bool]], bits: int) -> dict[str, Any]:
    """Per layer and direction, and per epoch, bytes of one mode at ``bits``."""
    per_rank = np.zeros(rows.shape[0], dtype=np.int64)
    layers, eval_fwd = [], 0
    for i, (width, back) in enumerate(plan):
        pair = sum(pair_bytes(rows, width, bits))  # bytes p sends q forward; q sends p backward
        fwd = _direction(rows, width, bits)
        bwd = _direction(rows.T, width, bits) if back else None
        per_rank += pair.sum(axis=1) + (pair.sum(axis=0) if back else 0)
        eval_fwd += fwd["bytes"]
        layers.append({"layer": i, "width": width, "forward": fwd, "backward": bwd})
    exchanges = [d for la in layers for d in (la["forward"], la["backward"]) if d is not None]
    epoch = {k: sum(d[k] for d in exchanges) for k in ("rows", "data_bytes", "param_bytes", "bytes")}
    epoch["max_rank_bytes"] = int(per_rank.max()) if per_rank.size else 0
    epoch["max_rank"] = int(np.argmax(per_rank)) if per_rank.size else 0
    epoch["eval_forward_bytes"] = eval_fwd
    return {"layers": layers, "epoch": epoch}


def summarize(rows: dict[str, np.ndarray], plan: list[tuple[int, bool]], bits=(32, 2)) -> dict[str, dict[str, Any]]:
    """Per mode: rows per exchange (total, busiest sender, active pairs) and bytes per bit width."""
    for b in bits:
        if b not in COMM_BITS:
            raise ConfigError(f"comm bits must be among {', '.join(map(str, COMM_BITS))}, got {b}")
    out = {}
    for mode, r in rows.items():
        sent = r.sum(axis=1)
        out[mode] = {
            "rows_total": int(r.sum()),
            "rows_max_rank": int(sent.max()) if sent.size else 0,
            "active_pairs": int(np.count_nonzero(r)),
            "bits": {b: _bits_summary(r, plan, b) for b in bits},
        }
    return out


def simulate_volumes(
    graph: Graph,
    parts: int,
    specs: list[LayerSpec],
    modes=("pre", "post", "prepost"),
    bits=(32, 2),
    method: str = "metis",
    seed: int = 0,
    norm: str = "none",
    label_prop: float = 0.0,
    model: str = "",
) -> dict[str, Any]:
    """Bytes per layer, direction, mode and bit width for ``parts`` ranks, without starting any,
    for the layers ``specs`` describe (``model`` names them in the report): totals, data vs
    parameter bytes and the busiest sender. Keys starting with ``_`` hold the row matrices (for
    :func:`pair_detail` and :func:`runtime_bytes`) and are not JSON."""
    plan = exchange_layers(specs, norm, label_prop)
    t0 = time.perf_counter()
    part = partition(graph, parts, method, seed)
    t1 = time.perf_counter()
    rows = pair_rows(graph.indptr.numpy(), graph.indices.numpy(), part, int(parts), tuple(modes))
    t2 = time.perf_counter()
    summary = summarize(rows, plan, tuple(bits))
    t3 = time.perf_counter()
    owned = np.bincount(part, minlength=int(parts)).astype(np.int64)
    dst_part = np.repeat(part, np.diff(graph.indptr.numpy()))
    return {
        "dataset": graph.name,
        "vertices": int(graph.num_nodes),
        "edges": int(graph.num_edges),
        "parts": int(parts),
        "model": model,
        "hidden": specs[0].out_width if len(specs) > 1 else None,
        "layers": len(specs),
        "in_dim": specs[0].in_width,
        "out_dim": specs[-1].out_width,
        "norm": norm,
        "label_prop": label_prop,
        "method": method,
        "seed": seed,
        "widths": [w for w, _ in plan],
        "backward": [b for _, b in plan],
        "layer_inputs": [s.in_width for s in specs],
        "cut_edges": int(np.count_nonzero(part[graph.indices.numpy()] != dst_part)),
        "owned_max": int(owned.max()),
        "modes": summary,
        "timing_s": {"partition": t1 - t0, "rows": t2 - t1, "bytes": t3 - t2},
        "_rows": rows,
        "_owned": owned,
    }


# ---------------------------------------------------------------------------------------- per pair
def _layer_rows(vol: dict[str, Any], mode: str, layer: int, direction: str) -> np.ndarray | None:
    """Sender x receiver rows of one exchange (None where the layer has no backward exchange)."""
    if direction not in DIRECTIONS:
        raise ConfigError(f"direction must be forward or backward, got {direction!r}")
    rows = vol["_rows"][mode]
    if direction == "forward":
        return rows
    return rows.T if vol["backward"][layer] else None


def pair_detail(
    vol: dict[str, Any], mode: str, bits: int, layer: int, direction: str = "forward"
) -> dict[tuple[int, int], tuple[int, int, int]]:
    """``(rows, data bytes, parameter bytes)`` per ordered pair ``(src, dst)`` with traffic."""
    rows = _layer_rows(vol, mode, layer, direction)
    if rows is None:
        return {}
    data, params = pair_bytes(rows, vol["widths"][layer], bits)
    src, dst = np.nonzero(rows)
    return {(int(p), int(q)): (int(rows[p, q]), int(data[p, q]), int(params[p, q])) for p, q in zip(src, dst)}


def runtime_bytes(vol: dict[str, Any], mode: str, bits: int) -> dict[str, list]:
    """The runtime log's layout (``CommLog.gather``): ``bytes_data[layer][direction][src][dst]`` and
    ``bytes_params``, direction 0 forward, 1 backward. Quadratic in P: for checks on small P."""
    out: dict[str, list] = {"bytes_data": [], "bytes_params": []}
    for layer, width in enumerate(vol["widths"]):
        per_dir = [_layer_rows(vol, mode, layer, d) for d in DIRECTIONS]
        zero = np.zeros_like(vol["_rows"][mode])
        mats = [pair_bytes(zero if r is None else r, width, bits) for r in per_dir]
        out["bytes_data"].append([m[0].tolist() for m in mats])
        out["bytes_params"].append([m[1].tolist() for m in mats])
    return out


# ---------------------------------------------------------------------------------------- tensor
def tensor_exchanges(counts, width: int, bits: int, stages: int = 1) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per all-to-all of one ``--strategy tensor`` aggregation at ``width`` (into the feature split
    and, per pipeline stage, back; :func:`~tessera.parallel.tensor.exchange_blocks`): (data bytes,
    parameter bytes, values) per ordered pair ``[src, dst]`` as the wire sends them. The diagonal
    stays on the rank."""
    from tessera.parallel.tensor import exchange_blocks

    n = len(counts)
    out = []
    for rows, widths in exchange_blocks(counts, width, stages):
        data, params = np.zeros((n, n), dtype=np.int64), np.zeros((n, n), dtype=np.int64)
        for w in np.unique(widths):
            d, p = block_bytes(np.where(widths == w, rows, 0), int(w), bits)
            data += d
            params += p
        values = rows * widths
        for m in (data, params, values):
            np.fill_diagonal(m, 0)
        out.append((data, params, values))
    return out


def tensor_pair_bytes(counts, width: int, bits: int, stages: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(data, parameter) bytes per ordered pair ``[src, dst]`` of one ``--strategy tensor``
    aggregation at ``width``: the sum of its :func:`tensor_exchanges`."""
    ex = tensor_exchanges(counts, width, bits, stages)
    return sum(d for d, _, _ in ex), sum(p for _, p, _ in ex)


def _tensor_bits(counts: np.ndarray, plan: list[tuple[int, bool]], bits: int, stages: int) -> dict[str, Any]:
    """Bytes of a ``--strategy tensor`` training epoch at ``bits``: per layer and direction (data
    and parameters, as the runtime's log totals them), in all and of the busiest sender."""
    sent = np.zeros(counts.size, dtype=np.int64)
    layers = []
    for i, (width, back) in enumerate(plan):
        data, params = tensor_pair_bytes(counts, width, bits, stages)
        one = {"data_bytes": int(data.sum()), "param_bytes": int(params.sum())}
        layers.append({"layer": i, "width": width, "forward": one, "backward": one if back else None})
        sent += (2 if back else 1) * (data + params).sum(axis=1)
    exchanges = [d for la in layers for d in (la["forward"], la["backward"]) if d is not None]
    data_bytes, param_bytes = (sum(d[k] for d in exchanges) for k in ("data_bytes", "param_bytes"))
    return {
        "bytes": data_bytes + param_bytes,
        "data_bytes": data_bytes,
        "param_bytes": param_bytes,
        "max_rank_bytes": int(sent.max()),
        "layers": layers,
    }


def tensor_volumes(
    graph: Graph,
    parts: int,
    specs: list[LayerSpec],
    method: str = "metis",
    seed: int = 0,
    norm: str = "none",
    label_prop: float = 0.0,
    bits=(32,),
    stages: int = 1,
) -> dict[str, Any]:
    """Per training epoch of ``--strategy tensor`` on ``parts`` ranks (the runtime's row split and
    its :func:`~tessera.parallel.tensor.exchange_blocks`, ``stages`` pipeline stages): fp32 bytes
    in all and of the busiest sender, the same per bit width of ``bits`` (``bits[b]``, with data and
    parameter bytes per layer and direction), the largest per-rank feature memory (its rows plus
    its column slice of every vertex), and the aggregation FLOPs of the busiest rank over the mean."""
    for b in bits:
        if b not in COMM_BITS:
            raise ConfigError(f"comm bits must be among {', '.join(map(str, COMM_BITS))}, got {b}")
    if stages < 1:
        raise ConfigError(f"pipeline stages must be at least 1, got {stages}")
    plan = exchange_layers(specs, norm, label_prop)
    part = partition(graph, parts, method, seed)
    counts = np.bincount(part, minlength=int(parts)).astype(np.int64)
    flops = np.zeros(int(parts), dtype=np.float64)
    memory = 0
    for width, back in plan:
        slices = np.diff([width * i // int(parts) for i in range(int(parts) + 1)])
        flops += (2 if back else 1) * 2.0 * graph.num_edges * slices
        memory = max(memory, int((4 * (graph.num_nodes * slices + counts * width)).max()))
    fp32 = _tensor_bits(counts, plan, 32, stages)
    return {
        "parts": int(parts),
        "stages": int(stages),
        "bytes": fp32["bytes"],
        "max_rank_bytes": fp32["max_rank_bytes"],
        "bits": {int(b): fp32 if b == 32 else _tensor_bits(counts, plan, int(b), stages) for b in bits},
        "feature_bytes_max": memory,
        "flops_max_over_mean": float(flops.max() / flops.mean()) if flops.mean() > 0 else 1.0,
    }
