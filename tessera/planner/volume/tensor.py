"""Bytes a tensor-parallel (MixGCN MoP) training epoch moves between P ranks.

``--strategy tensor`` aggregates every layer over the whole graph, each rank a slice of the
feature columns: per aggregation an all-to-all of every rank's rows into the column split and,
per pipeline stage, one back (:func:`~tessera.parallel.tensor.exchange_blocks`). An attention
layer also all-gathers its per-vertex terms forward and reduce-scatters them backward, float32
whatever the bit width (:func:`~tessera.parallel.tensor_attention.term_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.comm.wire import block_bytes
from tessera.graph import Graph
from tessera.graph.partition import partition
from tessera.planner.records import Record, optional, private
from tessera.planner.volume.common import aggregated_layers, blocks_bytes, check_bits
from tessera.sparse import LayerSpec


@dataclass(frozen=True)
class TensorSide(Record):
    """Data and parameter bytes of one direction of a layer's exchanges, all ranks."""

    data_bytes: int
    param_bytes: int


@dataclass(frozen=True)
class TensorLayer(Record):
    """One layer's exchanges at one bit width (None: no such direction; width 0: none per steady
    epoch)."""

    layer: int
    width: int
    forward: TensorSide | None
    backward: TensorSide | None


@dataclass(frozen=True)
class TensorBits(Record):
    """A training epoch at one bit width: in all (data and parameters), of the busiest sender, and
    per layer."""

    bytes: int
    data_bytes: int
    param_bytes: int
    max_rank_bytes: int
    layers: tuple[TensorLayer, ...]


@dataclass(frozen=True, kw_only=True)
class TensorVolumes(Record):
    """:func:`tensor_volumes`' result; ``time_s`` (projected seconds per bit width) is the caller's
    to add; ``counts`` (private) holds the rows per rank."""

    parts: int
    stages: int
    bytes: int
    max_rank_bytes: int
    bits: dict[int, TensorBits]
    feature_bytes_max: int
    flops_max_over_mean: float
    widths: tuple[int, ...]
    backward: tuple[bool, ...]
    terms: tuple[int, ...]
    counts: np.ndarray = private()
    time_s: dict[int, float] | None = optional()


def tensor_exchanges(counts, width: int, bits: int, stages: int = 1) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per all-to-all of one ``--strategy tensor`` aggregation at ``width`` (into the feature split
    and, per pipeline stage, back; :func:`~tessera.parallel.tensor.exchange_blocks`): (data bytes,
    parameter bytes, values) per ordered pair ``[src, dst]`` as the wire sends them. The diagonal
    stays on the rank."""
    from tessera.parallel.tensor import exchange_blocks

    return [blocks_bytes(rows, widths, bits) for rows, widths in exchange_blocks(counts, width, stages)]


def tensor_pair_bytes(counts, width: int, bits: int, stages: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(data, parameter) bytes per ordered pair ``[src, dst]`` of one ``--strategy tensor``
    aggregation at ``width``: the sum of its :func:`tensor_exchanges`."""
    n = len(counts)
    data, params = np.zeros((n, n), dtype=np.int64), np.zeros((n, n), dtype=np.int64)
    for d, p, _ in tensor_exchanges(counts, width, bits, stages):
        data += d
        params += p
    return data, params


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
    counts: np.ndarray, plan: list[tuple[int, bool]], terms: tuple[int, ...], bits: int, stages: int
) -> TensorBits:
    """Bytes of a ``--strategy tensor`` training epoch at ``bits``: per layer and direction (data
    and parameters, as the runtime's log totals them), in all and of the busiest sender. Layer
    ``i``'s exchanges also carry ``terms[i]`` attention terms per vertex (0: none)."""
    sent = np.zeros(counts.size, dtype=np.int64)
    layers = []
    for i, ((width, back), k) in enumerate(zip(plan, terms, strict=True)):
        if not width:  # aggregated once (constant input): nothing per steady epoch
            layers.append(TensorLayer(i, 0, None, None))
            continue
        data, params = tensor_pair_bytes(counts, width, bits, stages)
        one = [data + e for e in term_pair_bytes(counts, k)[: 2 if back else 1]] if k else [data] * (1 + back)
        sides = [TensorSide(int(d.sum()), int(params.sum())) for d in one]
        layers.append(TensorLayer(i, width, sides[0], sides[1] if back else None))
        for d in one:
            sent += (d + params).sum(axis=1)
    done = [d for la in layers for d in (la.forward, la.backward) if d is not None]
    data_bytes, param_bytes = sum(d.data_bytes for d in done), sum(d.param_bytes for d in done)
    return TensorBits(
        bytes=data_bytes + param_bytes,
        data_bytes=data_bytes,
        param_bytes=param_bytes,
        max_rank_bytes=int(sent.max()),
        layers=tuple(layers),
    )


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
) -> TensorVolumes:
    """Per (steady) training epoch of ``--strategy tensor`` on ``parts`` ranks (the runtime's row split and
    its :func:`~tessera.parallel.tensor.exchange_blocks`, ``stages`` pipeline stages): fp32 bytes
    in all and of the busiest sender, the same per bit width of ``bits`` (``bits[b]``, with data and
    parameter bytes per layer and direction), the largest per-rank feature memory (its rows plus
    its column slice of every vertex), and the aggregation FLOPs of the busiest rank over the mean.
    Attention layers add their terms' all-gather and reduce-scatter (float32 at every bit width)."""
    from tessera.parallel.tensor import check_layers

    check_bits(bits)
    check_layers(specs, stages)
    plan = aggregated_layers(specs, norm, label_prop, dropout)
    terms = tuple(2 * s.edge_terms if s.edge_values else 0 for s in specs)
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
    return TensorVolumes(
        parts=int(parts),
        stages=int(stages),
        bytes=fp32.bytes,
        max_rank_bytes=fp32.max_rank_bytes,
        bits={int(b): fp32 if b == 32 else _tensor_bits(counts, plan, terms, int(b), stages) for b in bits},
        feature_bytes_max=memory,
        flops_max_over_mean=float(flops.max() / flops.mean()) if flops.mean() > 0 else 1.0,
        widths=tuple(w for w, _ in plan),
        backward=tuple(b for _, b in plan),
        terms=terms,
        counts=counts,
    )
