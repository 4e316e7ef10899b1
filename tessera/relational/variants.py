"""Relational aggregation ``out = sum_r A_r x W_r`` (RGCN's neighbour term) and the segment matrix
product it is built from, with autograd.

``A_r`` holds relation ``r``'s edges with value 1 (``sum``) or ``1 / |N_r(i)|`` (``mean``, PyG's
per-relation mean). Four variants compute the same sum (WiseGraph §5.2, Fig. 9; the structures
are :mod:`tessera.graph.relations`'):

* ``transform_first``: ``H = x W_r`` for every relation and vertex in one batched GEMM, then one
  SpMM over the ``N x (R N)`` matrix (FLOPs ``2 R N fi fo``);
* ``unique_source``: ``W_r x_j`` only for the distinct (relation, source) pairs (unique-value
  extraction; FLOPs ``2 P_src fi fo``), then one SpMM over the ``N x P`` matrix;
* ``aggregate_first``: ``A_r x`` for the distinct (relation, destination) pairs (one SpMM), a
  segment GEMM per pair, then a scatter into the destinations (the indexing swap: the SpMM
  gathers rows of width ``fi`` instead of ``fo``);
* ``edge_wise``: ``W_r x_j`` per edge, scattered into the destinations (FLOPs ``2 E fi fo``);
* ``gtask``: the edges cut into gTasks (WiseGraph §4, :mod:`tessera.relational.gtask`) of one
  relation and at most 64 distinct sources, each one dense product of its unique sources' rows,
  batched (a relation's adjacent batches as one GEMM), with the outlier gTasks handled
  (:func:`~tessera.relational.gtask_kernels.typed_message_sum`).

The cost model (:mod:`tessera.relational.plan`) gives each one's FLOPs and bytes; an
operand's :class:`~tessera.relational.plan.Relations` picks
the variant (``auto``) from that model, measuring the ones the model cannot tell apart.
"""

from __future__ import annotations

import torch

from tessera.errors import ConfigError
from tessera.kernels.placement import host_kernels
from tessera.memo import TensorMemo
from tessera.relational.block_matmul import block_matmul, gather_block_matmul, segment_blocks
from tessera.relational.gtask_kernels import typed_message_sum
from tessera.relational.operand import relational
from tessera.relational.plan import GTASK_RESTRICTIONS, Relations, split_variant
from tessera.sparse.aggregate import aggregate, check_reduce
from tessera.sparse.operand import Operand


# ---------------------------------------------------------------------------------------- segment GEMM
def segment_matmul_reference(x: torch.Tensor, ptr: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``out[p] = x[p] @ weight[r]`` for rows ``p`` in ``ptr[r]:ptr[r+1]`` (plain torch, for tests)."""
    return torch.cat([x[int(ptr[r]) : int(ptr[r + 1])] @ weight[r] for r in range(weight.shape[0])], 0)


def segment_matmul(x: torch.Tensor, ptr: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x`` ``(M, fi)`` whose rows ``ptr[r]:ptr[r+1]`` belong to segment ``r``, times ``weight[r]``
    ``(R, fi, fo)``; rows outside every segment give zeros. Autograd for ``x`` and ``weight``."""
    if weight.dim() != 3 or x.dim() != 2 or x.shape[1] != weight.shape[1] or ptr.numel() != weight.shape[0] + 1:
        raise ValueError(
            f"segment_matmul needs x (M, fi), ptr (R+1,), weight (R, fi, fo); got {tuple(x.shape)}, "
            f"{tuple(ptr.shape)}, {tuple(weight.shape)}"
        )
    return block_matmul(x, weight, segment_blocks(ptr.tolist()))


# ---------------------------------------------------------------------------------------- variants
_copies: TensorMemo[torch.Tensor] = TensorMemo()  # a host index array's copy on a device


def _on(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``t`` (a relation structure, built on the host) on ``like``'s device, copied there once."""
    return t if t.device == like.device else _copies.get(t, lambda: t.to(like.device), key=like.device)


def _transform_first(rel: Relations, x, weight, reduce):
    h = torch.matmul(x, weight)  # (R, N, fo): one batched GEMM
    return aggregate(rel.all_pairs(reduce), h.reshape(-1, h.shape[-1]), "sum")


def _unique_source(rel: Relations, x, weight, reduce):
    a, p = rel.pairs("source", reduce)
    # the (relation, source) rows are gathered and multiplied a chunk at a time, forward and backward
    y = gather_block_matmul(x, _on(p.vertex, x), weight, segment_blocks(p.ptr.tolist()))
    return aggregate(a, y, "sum")


def _aggregate_first(rel: Relations, x, weight, reduce):
    a, p = rel.pairs("destination", reduce)
    m = segment_matmul(aggregate(a, x, "sum"), p.ptr, weight)
    return m.new_zeros(rel.matrix.num_rows, m.shape[1]).index_add(0, _on(p.vertex, m), m)


def _edge_wise(rel: Relations, x, weight, reduce):
    e = rel.edges(reduce)
    m = segment_matmul(x.index_select(0, _on(e.src, x)), e.ptr, weight)
    if e.norm is not None:
        m = m * _on(e.norm, m).unsqueeze(1)
    return m.new_zeros(rel.matrix.num_rows, m.shape[1]).index_add(0, _on(e.dst, m), m)


def _gtask(rel: Relations, x, weight, reduce, restrictions=GTASK_RESTRICTIONS):
    if not host_kernels(x):
        raise ConfigError(
            f"--rgcn-variant gtask runs on the CPU's kernels, not on {x.device.type} tensors or under --backend torch; "
            "use --rgcn-variant auto or another variant"
        )
    plan, norm = rel.gtasks(reduce, restrictions)
    return typed_message_sum(x, weight, plan, edge_weight=norm)


_RUN = {
    "transform_first": _transform_first,
    "unique_source": _unique_source,
    "aggregate_first": _aggregate_first,
    "edge_wise": _edge_wise,
    "gtask": _gtask,
}


def run_variant(rel: Relations, variant: str, x: torch.Tensor, weight: torch.Tensor, reduce: str) -> torch.Tensor:
    """``sum_r A_r x W_r`` by ``variant`` (one of :data:`VARIANTS`, or ``gtask:RESTRICTIONS``)."""
    name, restrictions = split_variant(variant)
    if name == "gtask":
        return _gtask(rel, x, weight, reduce, restrictions)
    return _RUN[name](rel, x, weight, reduce)


def relational_aggregate(
    operand: Operand, x: torch.Tensor, weight: torch.Tensor, reduce: str = "mean", variant: str = "auto"
) -> torch.Tensor:
    """``out[i] = sum_r reduce_{j in N_r(i)} x[j] @ weight[r]`` over ``operand``'s typed edges
    (``mean``: divided by ``|N_r(i)|``, PyG ``RGCNConv``'s per-relation mean); ``weight`` is
    ``(R, fi, fo)``. ``variant`` is one of :data:`VARIANTS`, ``gtask:RESTRICTIONS`` (the gTask
    plan those restrictions cut), or ``auto`` (the operand chooses; its ``gtask`` is
    :data:`~tessera.relational.plan.GTASK_RESTRICTIONS`)."""
    check_reduce(reduce)
    rel = relational(operand).relations()
    if weight.dim() != 3 or weight.shape[0] != rel.num_relations or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"weight must be (num_relations={rel.num_relations}, {x.shape[1]}, fo), got {tuple(weight.shape)}"
        )
    if x.shape[0] != operand.num_cols:
        raise ValueError(f"x has {x.shape[0]} rows but the operand has {operand.num_cols} source vertices")
    if variant == "auto":
        variant = rel.choose(x, weight, reduce)
    return run_variant(rel, variant, x, weight, reduce)


def relational_sum(
    operand: Operand, x: torch.Tensor, weight: torch.Tensor, reduce: str = "mean", variant: str = "auto"
) -> torch.Tensor:
    """:func:`relational_aggregate` for ``operand``'s rows from ``x``, the inputs of its rows
    (not of its columns): the operand brings in its remote sources, as their input rows or as
    their owners' ``W_r x_j`` rows (:meth:`~tessera.relational.operand.RelationalOperand.relational_sources`)."""
    check_reduce(reduce)
    x_src, remote = relational(operand).relational_sources(x, weight, reduce)
    out = relational_aggregate(operand, x_src, weight, reduce, variant)
    return out if remote is None else out + remote


def relational_aggregate_reference(
    edge_index: torch.Tensor,
    edge_type: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    reduce: str,
    num_nodes: int,
) -> torch.Tensor:
    """The per-relation loop of the definition (plain torch, for tests): for each relation, the
    sum or mean of ``x[j] @ weight[r]`` over ``i``'s in-edges of that relation."""
    out = x.new_zeros(num_nodes, weight.shape[2])
    for r in range(weight.shape[0]):
        keep = edge_type == r
        src, dst = edge_index[0, keep], edge_index[1, keep]
        msg = x[src] @ weight[r]
        s = x.new_zeros(num_nodes, weight.shape[2]).index_add(0, dst, msg)
        if reduce == "mean":
            cnt = torch.bincount(dst, minlength=num_nodes).clamp(min=1).to(x.dtype)
            s = s / cnt.unsqueeze(1)
        out = out + s
    return out
