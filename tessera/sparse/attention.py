"""Edge-wise primitives for attention layers: SDDMM-style edge scores and per-destination softmax."""

from __future__ import annotations

import torch

from tessera.graph.csr import CSRStructure


def edge_score(graph: CSRStructure, a_src: torch.Tensor, a_dst: torch.Tensor) -> torch.Tensor:
    """Per-edge ``a_src[j] + a_dst[i]`` for every edge ``j -> i`` in CSR order (``(E,)`` or ``(E, H)``)."""
    g = graph.on(a_src.device)
    return a_src.index_select(0, g.src_index()) + a_dst.index_select(0, g.dst_index())


def edge_softmax(graph: CSRStructure, scores: torch.Tensor) -> torch.Tensor:
    """Softmax of edge scores over the in-edges of each destination vertex."""
    dst = graph.on(scores.device).dst_index()
    shape = (graph.num_rows, *scores.shape[1:])
    # The max only stabilises the exponent; detaching it leaves the softmax's gradient unchanged.
    rowmax = scores.new_full(shape, float("-inf")).scatter_reduce(
        0, dst.view(-1, *([1] * (scores.dim() - 1))).expand_as(scores), scores.detach(), "amax", include_self=True
    )
    ex = torch.exp(scores - rowmax.index_select(0, dst))
    denom = scores.new_zeros(shape).index_add_(0, dst, ex)
    return ex / denom.index_select(0, dst)


def edge_keys(graph: CSRStructure, row_ids: torch.Tensor, col_ids: torch.Tensor) -> torch.Tensor:
    """A global key per edge ``j -> i``, ``row_ids[i] * 2**32 + col_ids[j]`` in CSR order: random
    draws keyed by it (attention dropout) are the same for any split and order of the vertices.
    Parallel copies of an edge share a key (and so a draw)."""
    g = graph.on(row_ids.device)
    return (row_ids.to(torch.int64).index_select(0, g.dst_index()) << 32) + col_ids.to(torch.int64).index_select(
        0, g.src_index()
    )
