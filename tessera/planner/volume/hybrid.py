"""Bytes a hybrid (NeutronAscend groups) training epoch moves between P ranks.

``--strategy hybrid --groups M`` splits the P ranks into G = P / M row groups of M ranks; each
row group's rows form a G-part of the graph. Per aggregation every row group runs the tensor
strategy's all-to-all into its column split (:func:`~tessera.parallel.tensor.exchange_blocks`
over its members' rows), every column group (the ranks holding one column slice, one per row
group) exchanges the G-parts' halo rows at the slice's width as partition parallelism does, and
the all-to-alls go back (:func:`hybrid_blocks`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tessera.graph import Graph
from tessera.graph.partition import partition
from tessera.graph.partition.halo import MODES, pair_rows
from tessera.planner.records import Record, private
from tessera.planner.volume.common import blocks_bytes, exchange_layers
from tessera.sparse import LayerSpec


@dataclass(frozen=True)
class HybridBits(Record):
    """A training epoch at one bit width: in all, apart for the row groups' all-to-alls and the
    column groups' halo exchanges, and of the busiest sender."""

    bytes: int
    alltoall_bytes: int
    halo_bytes: int
    max_rank_bytes: int


@dataclass(frozen=True, kw_only=True)
class HybridVolumes(Record):
    """:func:`hybrid_volumes`' result; ``runtime`` (private) holds each bit width's epoch in the
    runtime log's layout (:func:`hybrid_runtime_bytes`)."""

    parts: int
    groups: int
    mode: str
    widths: tuple[int, ...]
    backward: tuple[bool, ...]
    bits: dict[int, HybridBits]
    runtime: dict[int, dict[str, np.ndarray]] = private()


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
    nothing: see :func:`~tessera.planner.volume.common.exchange_layers`)."""
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
) -> HybridVolumes:
    """Per (steady) training epoch of ``--strategy hybrid --groups M`` on ``parts`` ranks (the runtime's row
    split, its G-parts ``part // M`` and their ``mode`` halo rows): bytes per bit width in all, of
    the busiest sender, and apart for the row groups' all-to-alls and the column groups' halo
    exchanges; ``runtime`` holds the log layout of each bit width (:func:`hybrid_runtime_bytes`)."""
    from tessera.parallel.hybrid import check_groups, refuse_attention

    refuse_attention(specs)
    check_groups(int(parts), int(groups))
    plan = exchange_layers(specs, norm, label_prop, dropout)
    part = partition(graph, parts, method, seed)
    counts = np.bincount(part, minlength=int(parts)).astype(np.int64)
    halo = group_halo_rows(graph, part, int(parts), int(groups), (mode,))[mode]
    per_bits, runtime = {}, {}
    same_row_group = (np.arange(int(parts))[:, None] // int(groups)) == (np.arange(int(parts))[None, :] // int(groups))
    for b in bits:
        rt = hybrid_runtime_bytes(counts, halo, int(groups), plan, int(b), stages)
        pairs = (rt["bytes_data"] + rt["bytes_params"]).sum(axis=(0, 1))  # [src, dst] over layers and directions
        per_bits[int(b)] = HybridBits(
            bytes=int(pairs.sum()),
            alltoall_bytes=int(pairs[same_row_group].sum()),
            halo_bytes=int(pairs[~same_row_group].sum()),
            max_rank_bytes=int(pairs.sum(axis=1).max()),
        )
        runtime[int(b)] = rt
    return HybridVolumes(
        parts=int(parts),
        groups=int(groups),
        mode=mode,
        widths=tuple(w for w, _ in plan),
        backward=tuple(b for _, b in plan),
        bits=per_bits,
        runtime=runtime,
    )
