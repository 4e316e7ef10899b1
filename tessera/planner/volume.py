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
training passes only. An attention layer (GAT) gathers its remote sources' rows in post mode
whatever the mode, each row its features and its ``edge_terms`` attention terms; so do SAGE-LSTM
(its input rows, for the neighbour sequences) and RGCN placed to gather (its input rows, once per
layer for all relations: ``LayerSpec.edge_values`` marks all three). RGCN placed transform first
sends instead one ``out``-wide row per distinct remote (relation, source) pair
(:func:`~tessera.graph.partition.relation_halo.relation_pair_rows`), forward and, for its weights'
gradients, always backward; with no placement fixed each layer takes the placement whose forward
exchange moves fewer bytes at each bit width, as the runtime does at its ``--comm-bits``
(:func:`~tessera.parallel.halo_relational.transform_first_wins`).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np

from tessera.comm.wire import COMM_BITS, block_bytes
from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.graph.partition import partition
from tessera.graph.partition.halo import MODES, pair_rows
from tessera.graph.partition.relation_halo import relation_pair_rows
from tessera.parallel.halo_relational import exchange_bytes, transform_first_wins
from tessera.sparse import LayerSpec

DIRECTIONS = ("forward", "backward")
PLACEMENTS = ("gather", "transform-first")  # a relational layer's exchange


class LayerExchange(NamedTuple):
    """One layer's exchange at one bit width: its row width (0: none in a steady epoch), whether
    it has a backward exchange, the rows each rank sends each rank forward (sender x receiver;
    backward sends the transpose), and a relational layer's placement (None for other layers)."""

    width: int
    backward: bool
    rows: np.ndarray
    placement: str | None = None


# ---------------------------------------------------------------------------------------- layers
def exchange_layers(
    specs: list[LayerSpec], norm: str = "none", label_prop: float = 0.0, dropout: float = 0.5
) -> list[tuple[int, bool]]:
    """``(width, has_backward)`` per layer of partition parallelism, from the layers' own
    descriptions: every layer exchanges rows of its aggregated width; layer 0 exchanges gradients
    only when its aggregated input needs one (LayerNorm or label embedding before it, or the layer
    transforming first). An attention layer's rows also carry its sources' terms (``edge_terms``).
    Width 0: no exchange in a steady training epoch (:func:`first_input_constant`)."""
    return [(row_width(s) if w else 0, b) for (w, b), s in zip(_layers(specs, norm, label_prop, dropout), specs)]


def row_width(spec: LayerSpec) -> int:
    """Values per row partition parallelism exchanges for a layer: its aggregated width, plus its
    sources' ``edge_terms`` attention terms where it has per-edge values."""
    return spec.aggregate_width + spec.edge_terms if spec.edge_values else spec.aggregate_width


def first_input_constant(specs: list[LayerSpec], norm: str = "none", label_prop: float = 0.0) -> bool:
    """Whether layer 0 aggregates the raw features themselves, with no LayerNorm or label embedding
    before it: its aggregation is then computed once and reused (``LayerHints.constant_input``) by
    evaluation forwards, and by training ones too when dropout is 0. Attention is never constant."""
    s = specs[0]
    return norm == "none" and label_prop == 0 and s.aggregates_first and not s.edge_values


def _layers(specs: list[LayerSpec], norm: str, label_prop: float, dropout: float = 0.5) -> list[tuple[int, bool]]:
    """``(aggregated width, has_backward)`` per layer (see :func:`exchange_layers`)."""
    if norm not in ("none", "layer"):
        raise ConfigError(f"--norm must be none or layer, got {norm!r}")
    first_grad = norm == "layer" or label_prop > 0
    out = [(s.aggregate_width, i > 0 or s.aggregates_input_grad(first_grad)) for i, s in enumerate(specs)]
    if dropout == 0 and first_input_constant(specs, norm, label_prop):
        out[0] = (0, False)
    return out


def _exchange_modes(specs: list[LayerSpec], modes: tuple[str, ...]) -> tuple[str, ...]:
    """The plan each mode's exchanges follow: layers with per-edge work on their sources' rows
    (``edge_values``: GAT, SAGE-LSTM, RGCN) gather them in post mode whatever ``--remote-agg``
    says (models mixing them with other layers are not modelled)."""
    attention = {s.edge_values for s in specs}
    if attention == {True, False}:
        raise ConfigError("the simulator models all-attention or attention-free models, not a mix")
    return ("post",) * len(modes) if True in attention else modes


def layer_exchanges(
    plan: list[tuple[int, bool]],
    rows: np.ndarray,
    bits: int,
    specs: list[LayerSpec] | None = None,
    pairs: np.ndarray | None = None,
) -> list[LayerExchange]:
    """Each layer's exchange at ``bits``: the ``plan``'s width and backward over ``rows`` (the
    mode's halo rows), except relational layers (``specs``) placed transform first, which send
    ``pairs`` (the (relation, source) pair rows) ``out`` wide with a backward exchange. A layer
    with ``choose_placement`` transforms first where that moves fewer forward bytes."""
    out = []
    for i, (width, back) in enumerate(plan):
        s = specs[i] if specs is not None else None
        if s is None or not s.relations:
            out.append(LayerExchange(width, back, rows))
            continue
        first = not s.aggregates_first
        if s.choose_placement:
            gather, paired = exchange_bytes(rows, s.in_width, bits), exchange_bytes(pairs, s.out_width, bits)
            first = transform_first_wins(gather, paired)
        out.append(
            LayerExchange(s.out_width, True, pairs, PLACEMENTS[1])
            if first
            else LayerExchange(width, back, rows, PLACEMENTS[0])
        )
    return out


def placement_report(
    specs: list[LayerSpec], layers: list[LayerExchange], rows: np.ndarray, pairs: np.ndarray, bits: int
) -> list[dict[str, Any]]:
    """Per relational layer: the forward bytes over all ranks of both placements at ``bits``, the
    one taken, and whether the layer fixed it."""
    out = []
    for i, (s, la) in enumerate(zip(specs, layers)):
        if s.relations:
            out.append(
                {
                    "layer": i,
                    "gather_bytes": exchange_bytes(rows, s.in_width, bits),
                    "transform_first_bytes": exchange_bytes(pairs, s.out_width, bits),
                    "placement": la.placement,
                    "fixed": not s.choose_placement,
                }
            )
    return out


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


def _bits_summary(exchanges: list[LayerExchange], bits: int, eval_first: bool = True) -> dict[str, Any]:
    """Per layer and direction, and per epoch, bytes of one mode at ``bits`` (a layer of width 0
    exchanges nothing); ``eval_first``: whether evaluation forwards exchange layer 0's rows."""
    per_rank = np.zeros(exchanges[0].rows.shape[0] if exchanges else 0, dtype=np.int64)
    layers, eval_fwd = [], 0
    for i, (width, back, rows, placement) in enumerate(exchanges):
        where = {} if placement is None else {"placement": placement}
        if not width:
            layers.append({"layer": i, "width": 0, "forward": None, "backward": None, **where})
            continue
        pair = sum(pair_bytes(rows, width, bits))  # bytes p sends q forward; q sends p backward
        fwd = _direction(rows, width, bits)
        bwd = _direction(rows.T, width, bits) if back else None
        per_rank += pair.sum(axis=1) + (pair.sum(axis=0) if back else 0)
        eval_fwd += fwd["bytes"] if i > 0 or eval_first else 0
        layers.append({"layer": i, "width": width, "forward": fwd, "backward": bwd, **where})
    exchanges = [d for la in layers for d in (la["forward"], la["backward"]) if d is not None]
    epoch = {k: sum(d[k] for d in exchanges) for k in ("rows", "data_bytes", "param_bytes", "bytes")}
    epoch["max_rank_bytes"] = int(per_rank.max()) if per_rank.size else 0
    epoch["max_rank"] = int(np.argmax(per_rank)) if per_rank.size else 0
    epoch["eval_forward_bytes"] = eval_fwd
    return {"layers": layers, "epoch": epoch}


def summarize(
    rows: dict[str, np.ndarray], plan: list[tuple[int, bool]], bits=(32, 2), eval_first: bool = True
) -> dict[str, dict[str, Any]]:
    """Per mode: rows per exchange (total, busiest sender, active pairs) and bytes per bit width,
    every layer exchanging the mode's rows as ``plan`` says."""
    exchanges = {m: {b: layer_exchanges(plan, r, b) for b in _check_bits(bits)} for m, r in rows.items()}
    return _summarize(rows, exchanges, eval_first)


def _check_bits(bits) -> tuple[int, ...]:
    for b in bits:
        if b not in COMM_BITS:
            raise ConfigError(f"comm bits must be among {', '.join(map(str, COMM_BITS))}, got {b}")
    return tuple(bits)


def _summarize(
    rows: dict[str, np.ndarray], exchanges: dict[str, dict[int, list[LayerExchange]]], eval_first: bool
) -> dict[str, dict[str, Any]]:
    """:func:`summarize` of each mode's exchanges per bit width."""
    out = {}
    for mode, r in rows.items():
        sent = r.sum(axis=1)
        out[mode] = {
            "rows_total": int(r.sum()),
            "rows_max_rank": int(sent.max()) if sent.size else 0,
            "active_pairs": int(np.count_nonzero(r)),
            "bits": {b: _bits_summary(ex, b, eval_first) for b, ex in exchanges[mode].items()},
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
    dropout: float = 0.5,
) -> dict[str, Any]:
    """Bytes per layer, direction, mode and bit width for ``parts`` ranks, without starting any,
    for the layers ``specs`` describe (``model`` names them in the report): totals, data vs
    parameter bytes and the busiest sender, per steady training epoch (with ``dropout`` 0, layer
    0's constant input is aggregated in the first epoch only). ``widths`` and ``backward`` are the
    layers' at the first of ``bits``; relational layers may take another placement, and so width,
    at another bit width (each bit width's layers give their own, and ``placements`` both
    placements' forward bytes per relational layer). Keys starting with ``_`` hold the row
    matrices (``_exchanges``: per mode and bit width, each layer's :class:`LayerExchange`; for
    :func:`pair_detail` and :func:`runtime_bytes`), rows per rank and the row split, and are not
    JSON."""
    plan = exchange_layers(specs, norm, label_prop, dropout)
    bits = _check_bits(bits)
    t0 = time.perf_counter()
    part = partition(graph, parts, method, seed)
    t1 = time.perf_counter()
    follow = _exchange_modes(specs, tuple(modes))
    indptr, indices = graph.indptr.numpy(), graph.indices.numpy()
    plans = pair_rows(indptr, indices, part, int(parts), tuple(dict.fromkeys(follow)))
    rows = {m: plans[f] for m, f in zip(modes, follow)}
    pairs = None
    if any(s.relations for s in specs):
        graph.require("edge_type")
        pairs = relation_pair_rows(indptr, indices, graph.edge_type.numpy(), part, int(parts))
    exchanges = {m: {b: layer_exchanges(plan, r, b, specs, pairs) for b in bits} for m, r in rows.items()}
    t2 = time.perf_counter()
    summary = _summarize(rows, exchanges, not first_input_constant(specs, norm, label_prop))
    t3 = time.perf_counter()
    first = exchanges[modes[0]][bits[0]]
    placements = {}
    if pairs is not None:  # every mode gathers the post rows: the first mode's exchanges are all modes'
        placements = {b: placement_report(specs, exchanges[modes[0]][b], rows[modes[0]], pairs, b) for b in bits}
    owned = np.bincount(part, minlength=int(parts)).astype(np.int64)
    dst_part = np.repeat(part, np.diff(graph.indptr.numpy()))
    edges = np.bincount(dst_part, minlength=int(parts))
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
        "widths": [la.width for la in first],
        "backward": [la.backward for la in first],
        "placements": placements,
        "layer_inputs": [s.in_width for s in specs],
        "cut_edges": int(np.count_nonzero(part[graph.indices.numpy()] != dst_part)),
        "owned_max": int(owned.max()),
        # MixGCN Figs. 9 and 11 for partition parallelism: a rank's rows plus the rows it receives
        # at each exchange width (the largest over layers), and its aggregation work (edges into its
        # rows) over the mean
        "feature_bytes_max": {mode: _feature_bytes(specs, exchanges[mode][bits[0]], owned) for mode in rows},
        "flops_max_over_mean": float(edges.max() / edges.mean()) if edges.mean() > 0 else 1.0,
        "modes": summary,
        "timing_s": {"partition": t1 - t0, "rows": t2 - t1, "bytes": t3 - t2},
        "dropout": dropout,
        "_rows": rows,
        "_exchanges": exchanges,
        "_owned": owned,
        "_part": part,
    }


def _feature_bytes(specs: list[LayerSpec], layers: list[LayerExchange], owned: np.ndarray) -> int:
    """The largest float32 bytes a rank holds of one layer's aggregated rows: its own rows plus
    those it receives, at the layer's aggregated width (a layer aggregated once holds them in the
    first epoch; a relational layer placed transform first receives pair rows at ``out``)."""
    out = 0
    for s, la in zip(specs, layers):
        width = s.out_width if la.placement == PLACEMENTS[1] else s.aggregate_width
        out = max(out, int((4 * width * (owned + la.rows.sum(axis=0))).max()))
    return out


# ---------------------------------------------------------------------------------------- per pair
def _layer_rows(vol: dict[str, Any], mode: str, bits: int, layer: int, direction: str) -> np.ndarray | None:
    """Sender x receiver rows of one exchange (None where the layer has no backward exchange)."""
    if direction not in DIRECTIONS:
        raise ConfigError(f"direction must be forward or backward, got {direction!r}")
    la = vol["_exchanges"][mode][bits][layer]
    if not la.width:
        return None
    if direction == "forward":
        return la.rows
    return la.rows.T if la.backward else None


def pair_detail(
    vol: dict[str, Any], mode: str, bits: int, layer: int, direction: str = "forward"
) -> dict[tuple[int, int], tuple[int, int, int]]:
    """``(rows, data bytes, parameter bytes)`` per ordered pair ``(src, dst)`` with traffic."""
    rows = _layer_rows(vol, mode, bits, layer, direction)
    if rows is None:
        return {}
    data, params = pair_bytes(rows, vol["_exchanges"][mode][bits][layer].width, bits)
    src, dst = np.nonzero(rows)
    return {(int(p), int(q)): (int(rows[p, q]), int(data[p, q]), int(params[p, q])) for p, q in zip(src, dst)}


def runtime_bytes(vol: dict[str, Any], mode: str, bits: int) -> dict[str, list]:
    """The runtime log's layout (``CommLog.gather``): ``bytes_data[layer][direction][src][dst]`` and
    ``bytes_params``, direction 0 forward, 1 backward. Quadratic in P: for checks on small P."""
    out: dict[str, list] = {"bytes_data": [], "bytes_params": []}
    for layer, la in enumerate(vol["_exchanges"][mode][bits]):
        per_dir = [_layer_rows(vol, mode, bits, layer, d) for d in DIRECTIONS]
        zero = np.zeros_like(vol["_rows"][mode])
        mats = [pair_bytes(zero if r is None else r, la.width, bits) for r in per_dir]
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

    return [blocks_bytes(rows, widths, bits) for rows, widths in exchange_blocks(counts, width, stages)]


def blocks_bytes(rows: np.ndarray, widths: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data bytes, parameter bytes, values) per ordered pair ``[src, dst]`` of one exchange whose
    pair ``[i, j]`` sends a block of ``rows[i, j]`` rows ``widths[i, j]`` wide. The diagonal stays
    on the rank."""
    n = rows.shape[0]
    data, params = np.zeros((n, n), dtype=np.int64), np.zeros((n, n), dtype=np.int64)
    for w in np.unique(widths):
        d, p = block_bytes(np.where(widths == w, rows, 0), int(w), bits)
        data += d
        params += p
    values = rows * widths
    for m in (data, params, values):
        np.fill_diagonal(m, 0)
    return data, params, values


def tensor_pair_bytes(counts, width: int, bits: int, stages: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(data, parameter) bytes per ordered pair ``[src, dst]`` of one ``--strategy tensor``
    aggregation at ``width``: the sum of its :func:`tensor_exchanges`."""
    ex = tensor_exchanges(counts, width, bits, stages)
    return sum(d for d, _, _ in ex), sum(p for _, p, _ in ex)


def term_pair_bytes(counts, terms: int) -> list[np.ndarray]:
    """Bytes per ordered pair ``[src, dst]`` of an attention layer's ``terms`` per-vertex values
    under ``--strategy tensor``: their all-gather (forward) and reduce-scatter (backward), float32
    whatever the bit width, every block of :func:`~tessera.parallel.tensor_attention.term_blocks`."""
    from tessera.parallel.tensor_attention import term_blocks

    out = []
    for rows, _ in term_blocks(counts, terms):
        data = block_bytes(rows, terms, 32)[0]
        np.fill_diagonal(data, 0)
        out.append(data)
    return out


def _tensor_bits(
    counts: np.ndarray, plan: list[tuple[int, bool]], terms: list[int], bits: int, stages: int
) -> dict[str, Any]:
    """Bytes of a ``--strategy tensor`` training epoch at ``bits``: per layer and direction (data
    and parameters, as the runtime's log totals them), in all and of the busiest sender. Layer
    ``i``'s exchanges also carry ``terms[i]`` attention terms per vertex (0: none)."""
    sent = np.zeros(counts.size, dtype=np.int64)
    layers = []
    for i, ((width, back), k) in enumerate(zip(plan, terms, strict=True)):
        if not width:  # aggregated once (constant input): nothing per steady epoch
            layers.append({"layer": i, "width": 0, "forward": None, "backward": None})
            continue
        data, params = tensor_pair_bytes(counts, width, bits, stages)
        extra = term_pair_bytes(counts, k) if k else [0, 0]
        one = [data + e for e in extra[: 2 if back else 1]]
        sides = [{"data_bytes": int(d.sum()), "param_bytes": int(params.sum())} for d in one]
        layers.append({"layer": i, "width": width, "forward": sides[0], "backward": sides[1] if back else None})
        sent += sum((d + params).sum(axis=1) for d in one)
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
    dropout: float = 0.5,
) -> dict[str, Any]:
    """Per (steady) training epoch of ``--strategy tensor`` on ``parts`` ranks (the runtime's row split and
    its :func:`~tessera.parallel.tensor.exchange_blocks`, ``stages`` pipeline stages): fp32 bytes
    in all and of the busiest sender, the same per bit width of ``bits`` (``bits[b]``, with data and
    parameter bytes per layer and direction), the largest per-rank feature memory (its rows plus
    its column slice of every vertex), and the aggregation FLOPs of the busiest rank over the mean.
    Attention layers add their terms' all-gather and reduce-scatter (float32 at every bit width)."""
    from tessera.parallel.tensor import check_layers

    for b in bits:
        if b not in COMM_BITS:
            raise ConfigError(f"comm bits must be among {', '.join(map(str, COMM_BITS))}, got {b}")
    check_layers(specs, stages)
    plan = _layers(specs, norm, label_prop, dropout)
    terms = [2 * s.edge_terms if s.edge_values else 0 for s in specs]
    part = partition(graph, parts, method, seed)
    counts = np.bincount(part, minlength=int(parts)).astype(np.int64)
    flops = np.zeros(int(parts), dtype=np.float64)
    memory = 0
    for (width, back), spec in zip(plan, specs):
        w = spec.aggregate_width  # a layer aggregated once (width 0) holds its slices in the first epoch
        slices = np.diff([w * i // int(parts) for i in range(int(parts) + 1)])
        flops += (2 if back else 1) * 2.0 * graph.num_edges * slices * (width > 0)
        memory = max(memory, int((4 * (graph.num_nodes * slices + counts * w)).max()))
    fp32 = _tensor_bits(counts, plan, terms, 32, stages)
    return {
        "parts": int(parts),
        "stages": int(stages),
        "bytes": fp32["bytes"],
        "max_rank_bytes": fp32["max_rank_bytes"],
        "bits": {int(b): fp32 if b == 32 else _tensor_bits(counts, plan, terms, int(b), stages) for b in bits},
        "feature_bytes_max": memory,
        "flops_max_over_mean": float(flops.max() / flops.mean()) if flops.mean() > 0 else 1.0,
        "widths": [w for w, _ in plan],
        "backward": [b for _, b in plan],
        "terms": terms,
        "_counts": counts,
    }


# ---------------------------------------------------------------------------------------- hybrid
def group_halo_rows(graph: Graph, part: np.ndarray, world: int, groups: int, modes=MODES) -> dict[str, np.ndarray]:
    """Per mode, rows G-part ``g`` sends G-part ``h`` per halo exchange of ``--strategy hybrid
    --groups M`` over the ``world``-way row split ``part`` (its G-parts are ``part // M``)."""
    g = int(world) // int(groups)
    return pair_rows(graph.indptr.numpy(), graph.indices.numpy(), part // int(groups), g, tuple(modes))


def hybrid_blocks(counts, halo_rows: np.ndarray, groups: int, width: int, stages: int = 1) -> list:
    """The exchanges of one ``--strategy hybrid --groups M`` aggregation at ``width``, forward,
    over the P ranks, as :func:`~tessera.parallel.tensor.exchange_blocks` gives a tensor one's
    (``(rows, widths)``, sender x receiver): the all-to-all into the column split of every row
    group at once (its members' ``exchange_blocks`` over their row ``counts``), the halo exchange
    of every column group at once (``halo_rows[g, h]``: rows G-part ``g`` sends G-part ``h``, the
    plans' ``send_counts``, at the column slice's width; an empty slice sends nothing; pass the
    transpose for backward), then the all-to-alls back."""
    from tessera.parallel.hybrid import hybrid_layout
    from tessera.parallel.tensor import column_bounds, exchange_blocks

    counts = np.asarray(counts, dtype=np.int64)
    p, layout = counts.size, hybrid_layout(counts.size, groups)
    per_group = [exchange_blocks(counts[members], width, stages) for members in layout]
    out = []
    for k in range(len(per_group[0])):
        rows, widths = np.zeros((p, p), dtype=np.int64), np.zeros((p, p), dtype=np.int64)
        for members, blocks in zip(layout, per_group):
            idx = np.ix_(members, members)
            rows[idx], widths[idx] = blocks[k]
        out.append((rows, widths))
    rows, widths = np.zeros((p, p), dtype=np.int64), np.zeros((p, p), dtype=np.int64)
    for c, w in enumerate(np.diff(column_bounds(width, groups))):
        if w:
            idx = np.ix_(layout[:, c], layout[:, c])
            rows[idx], widths[idx] = halo_rows, w
    out.insert(1, (rows, widths))
    return out


def hybrid_pair_bytes(
    counts, halo_rows: np.ndarray, groups: int, width: int, bits: int, stages: int = 1
) -> tuple[np.ndarray, np.ndarray]:
    """(data, parameter) bytes per ordered pair ``[src, dst]`` of the P ranks in one
    ``--strategy hybrid --groups M`` aggregation at ``width``, forward: the sum over its
    :func:`hybrid_blocks` (``halo_rows`` as there)."""
    n = len(counts)
    data, params = np.zeros((n, n), dtype=np.int64), np.zeros((n, n), dtype=np.int64)
    for rows, widths in hybrid_blocks(counts, halo_rows, groups, width, stages):
        d, p, _ = blocks_bytes(rows, widths, bits)
        data += d
        params += p
    return data, params


def hybrid_runtime_bytes(
    counts, halo_rows: np.ndarray, groups: int, plan: list[tuple[int, bool]], bits: int, stages: int = 1
) -> dict[str, np.ndarray]:
    """One hybrid training epoch in the runtime log's layout (``CommLog.gather``), as int64 arrays:
    ``bytes_data[layer, direction, src, dst]`` and ``bytes_params`` (a layer of width 0 exchanges
    nothing: see :func:`exchange_layers`)."""
    n = len(counts)
    out = {k: np.zeros((len(plan), 2, n, n), dtype=np.int64) for k in ("bytes_data", "bytes_params")}
    for layer, (width, back) in enumerate(plan):
        if not width:
            continue
        for direction, rows in enumerate((halo_rows, halo_rows.T) if back else (halo_rows,)):
            data, params = hybrid_pair_bytes(counts, rows, groups, width, bits, stages)
            out["bytes_data"][layer, direction] = data
            out["bytes_params"][layer, direction] = params
    return out


def hybrid_volumes(
    graph: Graph,
    parts: int,
    groups: int,
    specs: list[LayerSpec],
    mode: str = "prepost",
    method: str = "metis",
    seed: int = 0,
    norm: str = "none",
    label_prop: float = 0.0,
    bits=(32,),
    stages: int = 1,
    dropout: float = 0.5,
) -> dict[str, Any]:
    """Per (steady) training epoch of ``--strategy hybrid --groups M`` on ``parts`` ranks (the runtime's row
    split, its G-parts ``part // M`` and their ``mode`` halo rows): bytes per bit width in all, of
    the busiest sender, and apart for the row groups' all-to-alls and the column groups' halo
    exchanges; ``_runtime`` holds the log layout of each bit width (:func:`hybrid_runtime_bytes`)."""
    from tessera.parallel.hybrid import check_groups, refuse_attention

    refuse_attention(specs)
    check_groups(int(parts), int(groups))
    plan = exchange_layers(specs, norm, label_prop, dropout)
    part = partition(graph, parts, method, seed)
    counts = np.bincount(part, minlength=int(parts)).astype(np.int64)
    halo = group_halo_rows(graph, part, int(parts), int(groups), (mode,))[mode]
    out: dict[str, Any] = {
        "parts": int(parts),
        "groups": int(groups),
        "mode": mode,
        "widths": [w for w, _ in plan],
        "backward": [b for _, b in plan],
        "bits": {},
        "_runtime": {},
    }
    same_row_group = (np.arange(int(parts))[:, None] // int(groups)) == (np.arange(int(parts))[None, :] // int(groups))
    for b in bits:
        rt = hybrid_runtime_bytes(counts, halo, int(groups), plan, int(b), stages)
        pairs = (rt["bytes_data"] + rt["bytes_params"]).sum(axis=(0, 1))  # [src, dst] over layers and directions
        out["bits"][int(b)] = {
            "bytes": int(pairs.sum()),
            "alltoall_bytes": int(pairs[same_row_group].sum()),
            "halo_bytes": int(pairs[~same_row_group].sum()),
            "max_rank_bytes": int(pairs.sum(axis=1).max()),
        }
        out["_runtime"][int(b)] = rt
    return out
