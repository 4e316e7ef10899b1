"""Bytes a partition-parallel training epoch moves between P ranks, from the partition alone.

Per layer and direction rank ``p`` sends rank ``q`` one block of ``rows[p, q]`` rows of the layer's
exchange width (the runtime's ``RankPlan.send_counts``; SuperGCN §5.2–5.3), costing
``tessera.comm.wire.block_bytes(rows[p, q], width, bits)`` (:mod:`~tessera.planner.volume.common`).
Backward sends the same rows the other way: pair ``(q, p)`` carries ``rows[p, q]``. Evaluation
forwards exchange the forward volumes again; they are reported apart (``eval_forward_bytes``), as
the runtime's log counts training passes only. An attention layer (GAT) gathers its remote
sources' rows in post mode whatever the mode, each row its features and its ``edge_terms``
attention terms; so do SAGE-LSTM (its input rows, for the neighbour sequences) and RGCN placed to
gather (its input rows, once per layer for all relations: ``LayerSpec.edge_values`` marks all
three). RGCN placed transform first sends instead one ``out``-wide row per distinct remote
(relation, source) pair (:func:`~tessera.graph.partition.relation_halo.relation_pair_rows`),
forward and, for its weights' gradients, always backward; with no placement fixed each layer takes
the placement whose forward exchange moves fewer bytes at each bit width, as the runtime does at
its ``--comm-bits`` (:func:`~tessera.parallel.halo_relational.transform_first_wins`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.graph.partition import partition
from tessera.graph.partition.halo import pair_rows
from tessera.graph.partition.relation_halo import relation_pair_rows
from tessera.parallel.halo_relational import exchange_bytes, transform_first_wins
from tessera.planner.records import Record, field_sums, optional, private
from tessera.planner.volume.common import (
    DIRECTIONS,
    PLACEMENTS,
    LayerExchange,
    check_bits,
    exchange_layers,
    first_input_constant,
    pair_bytes,
)
from tessera.sparse import LayerSpec


# ---------------------------------------------------------------------------------------- records
@dataclass(frozen=True)
class ByteTotals(Record):
    """Rows and bytes of exchanges summed over all ranks, and the busiest sender's bytes."""

    rows: int
    data_bytes: int
    param_bytes: int
    bytes: int
    max_rank_bytes: int
    max_rank: int


@dataclass(frozen=True)
class DirectionVolume(ByteTotals):
    """Totals of one exchange over all ranks, and of its busiest sender."""

    active_pairs: int


@dataclass(frozen=True)
class LayerVolume(Record):
    """One layer's exchanges at one bit width (None: no such exchange; width 0: none per steady
    epoch), and a relational layer's placement."""

    layer: int
    width: int
    forward: DirectionVolume | None
    backward: DirectionVolume | None
    placement: str | None = optional()


@dataclass(frozen=True)
class EpochVolume(ByteTotals):
    """A steady training epoch's exchanges summed; the busiest sender over the epoch; the bytes
    of an evaluation forward."""

    eval_forward_bytes: int


@dataclass(frozen=True)
class BitsVolume(Record):
    """One mode at one bit width: per layer and per epoch."""

    layers: tuple[LayerVolume, ...]
    epoch: EpochVolume


@dataclass(frozen=True)
class ModeVolume(Record):
    """One ``--remote-agg`` mode: rows per exchange (total, busiest sender, active pairs) and the
    bytes per bit width."""

    rows_total: int
    rows_max_rank: int
    active_pairs: int
    bits: dict[int, BitsVolume]


@dataclass(frozen=True)
class PlacementBytes(Record):
    """A relational layer's forward bytes over all ranks under both placements, the one taken, and
    whether the layer fixed it."""

    layer: int
    gather_bytes: int
    transform_first_bytes: int
    placement: str | None
    fixed: bool


@dataclass(frozen=True, kw_only=True)
class VolumeTiming(Record):
    """Seconds spent partitioning, counting pair rows and bytes, and (filled by the caller)
    projecting times and in all."""

    partition: float
    rows: float
    bytes: float
    model: float | None = optional()
    total: float | None = optional()


@dataclass(frozen=True, kw_only=True)
class PartitionVolumes(Record):
    """:func:`simulate_volumes`' result. ``widths`` and ``backward`` are the layers' at the first
    simulated bit width; ``placements`` holds, per bit width, both placements' forward bytes of
    each relational layer. The private fields (not JSON) hold the row matrices: ``rows`` per mode,
    ``exchanges`` per mode and bit width each layer's :class:`LayerExchange`, ``owned`` the rows
    per rank and ``part`` the row split."""

    dataset: str
    vertices: int
    edges: int
    parts: int
    model: str
    hidden: int | None
    layers: int
    in_dim: int
    out_dim: int
    norm: str
    label_prop: float
    method: str
    seed: int
    widths: tuple[int, ...]
    backward: tuple[bool, ...]
    placements: dict[int, tuple[PlacementBytes, ...]]
    layer_inputs: tuple[int, ...]
    cut_edges: int
    owned_max: int
    # MixGCN Figs. 9 and 11 for partition parallelism: a rank's rows plus the rows it receives at
    # each exchange width (the largest over layers), and its aggregation work (edges into its rows)
    # over the mean
    feature_bytes_max: dict[str, int]
    flops_max_over_mean: float
    modes: dict[str, ModeVolume]
    timing_s: VolumeTiming
    dropout: float
    rows: dict[str, np.ndarray] = private()
    exchanges: dict[str, dict[int, list[LayerExchange]]] = private()
    owned: np.ndarray = private()
    part: np.ndarray = private()


# ---------------------------------------------------------------------------------------- layers
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
        if not (first or s.choose_placement):
            out.append(LayerExchange(width, back, rows, PLACEMENTS[0]))
            continue
        if pairs is None:
            raise ConfigError("a relational layer that may transform first needs the (relation, source) pair rows")
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
) -> tuple[PlacementBytes, ...]:
    """Per relational layer: the forward bytes over all ranks of both placements at ``bits``, the
    one taken, and whether the layer fixed it."""
    out = []
    for i, (s, la) in enumerate(zip(specs, layers)):
        if s.relations:
            out.append(
                PlacementBytes(
                    layer=i,
                    gather_bytes=exchange_bytes(rows, s.in_width, bits),
                    transform_first_bytes=exchange_bytes(pairs, s.out_width, bits),
                    placement=la.placement,
                    fixed=not s.choose_placement,
                )
            )
    return tuple(out)


# ---------------------------------------------------------------------------------------- bytes
def _direction(rows: np.ndarray, width: int, bits: int) -> DirectionVolume:
    """Totals of one exchange whose sender x receiver row matrix is ``rows``."""
    data, params = pair_bytes(rows, width, bits)
    sent = (data + params).sum(axis=1)
    r = int(np.argmax(sent)) if sent.size else 0
    return DirectionVolume(
        rows=int(rows.sum()),
        data_bytes=int(data.sum()),
        param_bytes=int(params.sum()),
        bytes=int(sent.sum()),
        max_rank_bytes=int(sent[r]) if sent.size else 0,
        max_rank=r,
        active_pairs=int(np.count_nonzero(rows)),
    )


def _bits_summary(exchanges: list[LayerExchange], bits: int, eval_first: bool = True) -> BitsVolume:
    """Per layer and direction, and per epoch, bytes of one mode at ``bits`` (a layer of width 0
    exchanges nothing); ``eval_first``: whether evaluation forwards exchange layer 0's rows."""
    per_rank = np.zeros(exchanges[0].rows.shape[0] if exchanges else 0, dtype=np.int64)
    layers, eval_fwd = [], 0
    for i, (width, back, rows, placement) in enumerate(exchanges):
        if not width:
            layers.append(LayerVolume(i, 0, None, None, placement))
            continue
        data, params = pair_bytes(rows, width, bits)
        pair = data + params  # bytes p sends q forward; q sends p backward
        fwd = _direction(rows, width, bits)
        bwd = _direction(rows.T, width, bits) if back else None
        per_rank += pair.sum(axis=1)
        if back:
            per_rank += pair.sum(axis=0)
        eval_fwd += fwd.bytes if i > 0 or eval_first else 0
        layers.append(LayerVolume(i, width, fwd, bwd, placement))
    done = [d for la in layers for d in (la.forward, la.backward) if d is not None]
    epoch = EpochVolume(
        **field_sums(done, "rows", "data_bytes", "param_bytes", "bytes"),
        max_rank_bytes=int(per_rank.max()) if per_rank.size else 0,
        max_rank=int(np.argmax(per_rank)) if per_rank.size else 0,
        eval_forward_bytes=eval_fwd,
    )
    return BitsVolume(tuple(layers), epoch)


def summarize(
    rows: dict[str, np.ndarray], plan: list[tuple[int, bool]], bits=(32, 2), eval_first: bool = True
) -> dict[str, ModeVolume]:
    """Per mode: rows per exchange (total, busiest sender, active pairs) and bytes per bit width,
    every layer exchanging the mode's rows as ``plan`` says."""
    exchanges = {m: {b: layer_exchanges(plan, r, b) for b in check_bits(bits)} for m, r in rows.items()}
    return _summarize(rows, exchanges, eval_first)


def _summarize(
    rows: dict[str, np.ndarray], exchanges: dict[str, dict[int, list[LayerExchange]]], eval_first: bool
) -> dict[str, ModeVolume]:
    """:func:`summarize` of each mode's exchanges per bit width."""
    out = {}
    for mode, r in rows.items():
        sent = r.sum(axis=1)
        out[mode] = ModeVolume(
            rows_total=int(r.sum()),
            rows_max_rank=int(sent.max()) if sent.size else 0,
            active_pairs=int(np.count_nonzero(r)),
            bits={b: _bits_summary(ex, b, eval_first) for b, ex in exchanges[mode].items()},
        )
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
) -> PartitionVolumes:
    """Bytes per layer, direction, mode and bit width for ``parts`` ranks, without starting any,
    for the layers ``specs`` describe (``model`` names them in the report): totals, data vs
    parameter bytes and the busiest sender, per steady training epoch (with ``dropout`` 0, layer
    0's constant input is aggregated in the first epoch only). Relational layers may take another
    placement, and so width, at another bit width (each bit width's layers give their own).
    The row matrices ride along in the private fields (for :func:`pair_detail` and
    :func:`runtime_bytes`)."""
    plan = exchange_layers(specs, norm, label_prop, dropout)
    bits = check_bits(bits)
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
        assert graph.edge_type is not None
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
    return PartitionVolumes(
        dataset=graph.name,
        vertices=int(graph.num_nodes),
        edges=int(graph.num_edges),
        parts=int(parts),
        model=model,
        hidden=specs[0].out_width if len(specs) > 1 else None,
        layers=len(specs),
        in_dim=specs[0].in_width,
        out_dim=specs[-1].out_width,
        norm=norm,
        label_prop=label_prop,
        method=method,
        seed=seed,
        widths=tuple(la.width for la in first),
        backward=tuple(la.backward for la in first),
        placements=placements,
        layer_inputs=tuple(s.in_width for s in specs),
        cut_edges=int(np.count_nonzero(part[graph.indices.numpy()] != dst_part)),
        owned_max=int(owned.max()),
        feature_bytes_max={mode: _feature_bytes(specs, exchanges[mode][bits[0]], owned) for mode in rows},
        flops_max_over_mean=float(edges.max() / edges.mean()) if edges.mean() > 0 else 1.0,
        modes=summary,
        timing_s=VolumeTiming(partition=t1 - t0, rows=t2 - t1, bytes=t3 - t2),
        dropout=dropout,
        rows=rows,
        exchanges=exchanges,
        owned=owned,
        part=part,
    )


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
def _layer_rows(vol: PartitionVolumes, mode: str, bits: int, layer: int, direction: str) -> np.ndarray | None:
    """Sender x receiver rows of one exchange (None where the layer has no backward exchange)."""
    if direction not in DIRECTIONS:
        raise ConfigError(f"direction must be forward or backward, got {direction!r}")
    la = vol.exchanges[mode][bits][layer]
    if not la.width:
        return None
    if direction == "forward":
        return la.rows
    return la.rows.T if la.backward else None


def pair_detail(
    vol: PartitionVolumes, mode: str, bits: int, layer: int, direction: str = "forward"
) -> dict[tuple[int, int], tuple[int, int, int]]:
    """``(rows, data bytes, parameter bytes)`` per ordered pair ``(src, dst)`` with traffic."""
    rows = _layer_rows(vol, mode, bits, layer, direction)
    if rows is None:
        return {}
    data, params = pair_bytes(rows, vol.exchanges[mode][bits][layer].width, bits)
    src, dst = np.nonzero(rows)
    return {(int(p), int(q)): (int(rows[p, q]), int(data[p, q]), int(params[p, q])) for p, q in zip(src, dst)}


def runtime_bytes(vol: PartitionVolumes, mode: str, bits: int) -> dict[str, list]:
    """The runtime log's layout (``CommLog.gather``): ``bytes_data[layer][direction][src][dst]`` and
    ``bytes_params``, direction 0 forward, 1 backward. Quadratic in P: for checks on small P."""
    out: dict[str, list] = {"bytes_data": [], "bytes_params": []}
    for layer, la in enumerate(vol.exchanges[mode][bits]):
        per_dir = [_layer_rows(vol, mode, bits, layer, d) for d in DIRECTIONS]
        zero = np.zeros_like(vol.rows[mode])
        mats = [pair_bytes(zero if r is None else r, la.width, bits) for r in per_dir]
        out["bytes_data"].append([m[0].tolist() for m in mats])
        out["bytes_params"].append([m[1].tolist() for m in mats])
    return out
