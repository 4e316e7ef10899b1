"""Fused GAT attention coefficients: ``softmax_row(leaky_relu(a_src[j] + a_dst[i]))`` per edge, with autograd.

Forward writes the scores into the output and normalises them in place, so the only ``(E, H)``
array is ``alpha`` itself (saved for backward). Backward writes one ``(E, H)`` buffer of score
gradients and reduces it twice: along destination rows for ``a_dst`` and along the transposed
(source-major) CSR for ``a_src``, so every sum has a fixed order and no atomics are needed.

Work is split into row blocks of about equal edge count. Rows longer than ``2 * _CHUNK`` edges
(power-law hubs) are instead cut into fixed ``_CHUNK``-edge pieces processed in parallel and
combined in piece order, so a hub cannot stall one thread and results do not depend on the
thread count.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numba
import numpy as np
import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from tessera import workspace
from tessera.graph.csr import CSRStructure, rows_of
from tessera.kernels.placement import host_kernels
from tessera.kernels.vector_math import exp
from tessera.memo import PlanCache
from tessera.sparse.attention import edge_score, edge_softmax
from tessera.threads import sync_numba_threads

_CHUNK = 4096
_BLOCKS_PER_THREAD = 8
_JIT: dict[str, Any] = {"fastmath": True, "cache": True, "nogil": True}


@dataclass(frozen=True)
class _Plan:
    """Row blocks of light rows plus the fixed-size pieces of heavy rows, for one CSR."""

    blocks: np.ndarray  # row boundaries, len nblocks + 1
    heavy: int  # rows with more edges than this are split into pieces
    rows: np.ndarray  # heavy row ids
    piece_ptr: np.ndarray  # pieces of heavy row r are piece_ptr[r]:piece_ptr[r + 1]
    piece_owner: np.ndarray  # index into rows of each piece
    piece_row: np.ndarray  # row id of each piece
    piece_lo: np.ndarray
    piece_hi: np.ndarray


def _make_plan(indptr: torch.Tensor, threads: int, chunk: int) -> _Plan:
    ip = indptr.numpy().astype(np.int64)
    n = ip.size - 1
    deg = np.diff(ip)
    heavy = 2 * chunk
    is_heavy = deg > heavy
    rows = np.flatnonzero(is_heavy)
    counts = (deg[rows] + chunk - 1) // chunk
    piece_ptr = np.zeros(rows.size + 1, np.int64)
    np.cumsum(counts, out=piece_ptr[1:])
    owner = rows_of(piece_ptr)
    lo = ip[rows][owner] + (np.arange(owner.size) - piece_ptr[owner]) * chunk
    hi = np.minimum(lo + chunk, ip[rows + 1][owner])
    # +1 per row: empty rows still cost a visit.
    cum = np.concatenate([[0], np.cumsum(np.where(is_heavy, 0, deg) + 1)])
    nblocks = max(1, min(n, threads * _BLOCKS_PER_THREAD))
    cuts = np.searchsorted(cum, cum[-1] * np.arange(1, nblocks) / nblocks)
    blocks = np.concatenate([[0], cuts, [n]]).astype(np.int64)
    return _Plan(blocks, heavy, rows.astype(np.int64), piece_ptr, owner.astype(np.int64), rows[owner], lo, hi)


_plans = PlanCache()


def _plan(graph: CSRStructure, transposed: bool) -> _Plan:
    """The destination-major (or source-major) plan for the current thread count, made once per graph."""
    threads = numba.get_num_threads()
    key = (transposed, threads, _CHUNK)
    return _plans.get(
        graph, key, lambda: _make_plan(graph.transpose().indptr if transposed else graph.indptr, threads, _CHUNK)
    )


# ---------------------------------------------------------------------------------- row passes
# Helpers take (2-D array, row) pairs rather than row views: LLVM vectorises explicit 2-D
# indexing and keeps the accumulators in registers, about 2x faster when measured.
_INLINE: dict[str, Any] = {"fastmath": True, "cache": True, "inline": "always"}


@numba.njit(**_INLINE)
def _score_max(indices, a_src, a_dst, i, lo, hi, slope, out, m, r):
    """Write leaky-relu scores of edges lo:hi of row i into out; m[r] gets their per-head max."""
    heads = a_src.shape[1]
    j = indices[lo]
    for h in range(heads):
        v = a_src[j, h] + a_dst[i, h]
        v = v if v > 0 else v * slope
        out[lo, h] = v
        m[r, h] = v
    for e in range(lo + 1, hi):
        j = indices[e]
        for h in range(heads):
            v = a_src[j, h] + a_dst[i, h]
            v = v if v > 0 else v * slope
            out[e, h] = v
            m[r, h] = max(m[r, h], v)


@numba.njit(**_INLINE)
def _exp_sum(lo, hi, out, m, mr, s, sr):
    """Replace out[lo:hi] by exp(out - m[mr]); s[sr] gets the per-head sums."""
    heads = out.shape[1]
    for h in range(heads):
        s[sr, h] = 0
    for e in range(lo, hi):
        for h in range(heads):
            v = exp(out[e, h] - m[mr, h])
            out[e, h] = v
            s[sr, h] += v


@numba.njit(**_INLINE)
def _scale(lo, hi, out, f, fr):
    for e in range(lo, hi):
        for h in range(out.shape[1]):
            out[e, h] *= f[fr, h]


@numba.njit(**_INLINE)
def _dot(lo, hi, alpha, grad, d, r):
    """d[r] gets the per-head sum of alpha * grad over edges lo:hi."""
    heads = alpha.shape[1]
    for h in range(heads):
        d[r, h] = 0
    for e in range(lo, hi):
        for h in range(heads):
            d[r, h] += alpha[e, h] * grad[e, h]


# _dot, _d_pre and _gather_sum share a zero-then-accumulate shape but sum different things;
# each is inlined into its kernel, where a shared helper would need a callable argument.
@numba.njit(**_INLINE)
def _d_pre(indices, a_src, a_dst, i, lo, hi, slope, alpha, grad, d, dr, dpre, acc, ar):
    """Gradient w.r.t. the pre-activation score of edges lo:hi of row i; acc[ar] gets its per-head sum."""
    heads = alpha.shape[1]
    for h in range(heads):
        acc[ar, h] = 0
    for e in range(lo, hi):
        j = indices[e]
        for h in range(heads):
            v = alpha[e, h] * (grad[e, h] - d[dr, h])
            if not a_src[j, h] + a_dst[i, h] > 0:
                v *= slope
            dpre[e, h] = v
            acc[ar, h] += v


@numba.njit(**_INLINE)
def _gather_sum(lo, hi, perm, dpre, acc, r):
    heads = dpre.shape[1]
    for h in range(heads):
        acc[r, h] = 0
    for k in range(lo, hi):
        e = perm[k]
        for h in range(heads):
            acc[r, h] += dpre[e, h]


@numba.njit(**_INLINE)
def _reduce_pieces(part, pptr, use_max):
    """Per heavy row, the max or the in-order sum of its pieces' partials (scalar loops: numba would
    turn array expressions into one parallel region per piece)."""
    heads = part.shape[1]
    red = np.empty((pptr.size - 1, heads), part.dtype)
    for r in range(pptr.size - 1):
        for h in range(heads):
            acc = part[pptr[r], h]
            for p in range(pptr[r] + 1, pptr[r + 1]):
                acc = max(acc, part[p, h]) if use_max else acc + part[p, h]
            red[r, h] = acc
    return red


# ---------------------------------------------------------------------------------- kernels
@numba.njit(parallel=True, **_JIT)
def _forward_kernel(indptr, indices, a_src, a_dst, slope, blocks, heavy, rows, pptr, powner, prow, plo, phi, out):
    heads = a_src.shape[1]
    for b in numba.prange(blocks.size - 1):
        ms = np.empty((2, heads), out.dtype)  # row max, then reciprocal row sum
        for i in range(blocks[b], blocks[b + 1]):
            lo, hi = indptr[i], indptr[i + 1]
            if hi == lo or hi - lo > heavy:
                continue
            _score_max(indices, a_src, a_dst, i, lo, hi, slope, out, ms, 0)
            _exp_sum(lo, hi, out, ms, 0, ms, 1)
            for h in range(heads):
                ms[1, h] = 1 / ms[1, h]
            _scale(lo, hi, out, ms, 1)
    # Heavy rows: per-piece max, combine, per-piece exp-sum, combine, per-piece scale.
    npieces = plo.size
    if npieces == 0:
        return
    part = np.empty((npieces, heads), out.dtype)
    for p in numba.prange(npieces):
        _score_max(indices, a_src, a_dst, prow[p], plo[p], phi[p], slope, out, part, p)
    red = _reduce_pieces(part, pptr, True)
    for p in numba.prange(npieces):
        _exp_sum(plo[p], phi[p], out, red, powner[p], part, p)
    red = _reduce_pieces(part, pptr, False)
    for r in range(rows.size):
        for h in range(heads):
            red[r, h] = 1 / red[r, h]
    for p in numba.prange(npieces):
        _scale(plo[p], phi[p], out, red, powner[p])


@numba.njit(parallel=True, **_JIT)
def _backward_dst_kernel(
    indptr, indices, a_src, a_dst, slope, alpha, grad, blocks, heavy, rows, pptr, powner, prow, plo, phi, dpre, gdst
):
    heads = a_src.shape[1]
    for b in numba.prange(blocks.size - 1):
        d = np.empty((1, heads), alpha.dtype)
        for i in range(blocks[b], blocks[b + 1]):
            lo, hi = indptr[i], indptr[i + 1]
            if hi - lo <= heavy:
                _dot(lo, hi, alpha, grad, d, 0)
                _d_pre(indices, a_src, a_dst, i, lo, hi, slope, alpha, grad, d, 0, dpre, gdst, i)
    npieces = plo.size
    if npieces == 0:
        return
    part = np.empty((npieces, heads), alpha.dtype)
    for p in numba.prange(npieces):
        _dot(plo[p], phi[p], alpha, grad, part, p)
    red = _reduce_pieces(part, pptr, False)
    for p in numba.prange(npieces):
        _d_pre(indices, a_src, a_dst, prow[p], plo[p], phi[p], slope, alpha, grad, red, powner[p], dpre, part, p)
    red = _reduce_pieces(part, pptr, False)
    for r in range(rows.size):
        for h in range(heads):
            gdst[rows[r], h] = red[r, h]


@numba.njit(parallel=True, **_JIT)
def _backward_src_kernel(tindptr, perm, dpre, blocks, heavy, rows, pptr, powner, prow, plo, phi, gsrc):
    heads = dpre.shape[1]
    for b in numba.prange(blocks.size - 1):
        for j in range(blocks[b], blocks[b + 1]):
            lo, hi = tindptr[j], tindptr[j + 1]
            if hi - lo <= heavy:
                _gather_sum(lo, hi, perm, dpre, gsrc, j)
    npieces = plo.size
    if npieces == 0:
        return
    part = np.empty((npieces, heads), dpre.dtype)
    for p in numba.prange(npieces):
        _gather_sum(plo[p], phi[p], perm, dpre, part, p)
    red = _reduce_pieces(part, pptr, False)
    for r in range(rows.size):
        for h in range(heads):
            gsrc[rows[r], h] = red[r, h]


def _plan_args(plan: _Plan) -> tuple:
    p = plan
    return p.blocks, p.heavy, p.rows, p.piece_ptr, p.piece_owner, p.piece_row, p.piece_lo, p.piece_hi


def _scalar(value: float, dtype: torch.dtype):
    return np.float32(value) if dtype == torch.float32 else np.float64(value)


# ---------------------------------------------------------------------------------- entry points
def gat_attention_forward(
    graph: CSRStructure, a_src: torch.Tensor, a_dst: torch.Tensor, negative_slope: float = 0.2
) -> torch.Tensor:
    """``alpha`` ``(E, H)`` from contiguous float32/float64 ``(N, H)`` scores, without autograd."""
    sync_numba_threads()
    out = workspace.empty((graph.num_edges, a_src.shape[1]), a_src.dtype)
    if graph.num_edges:
        _forward_kernel(
            graph.indptr.numpy(),
            graph.indices.numpy(),
            a_src.numpy(),
            a_dst.numpy(),
            _scalar(negative_slope, a_src.dtype),
            *_plan_args(_plan(graph, False)),
            out.numpy(),
        )
    return out


def gat_attention_backward(
    graph: CSRStructure,
    a_src: torch.Tensor,
    a_dst: torch.Tensor,
    alpha: torch.Tensor,
    grad_alpha: torch.Tensor,
    negative_slope: float = 0.2,
    need_src: bool = True,
    overwrite_grad: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor]:
    """Fused softmax, leaky-relu and edge-score backward: ``(grad_a_src, grad_a_dst)`` from
    ``grad_alpha``. ``overwrite_grad``: the caller owns ``grad_alpha`` and lets the per-edge score
    gradient be written over it (or over its contiguous copy in ``alpha``'s dtype) instead of a new
    E x H block (each edge's is computed from its own entry, after its row's sum has read them all)."""
    sync_numba_threads()
    dtype = alpha.dtype
    a_src, a_dst, alpha, grad_alpha = (t.to(dtype).contiguous() for t in (a_src, a_dst, alpha, grad_alpha))
    gdst = torch.empty(a_dst.shape, dtype=dtype)
    gsrc = torch.empty(a_src.shape, dtype=dtype) if need_src else None
    if not graph.num_edges:
        return (gsrc.zero_() if gsrc is not None else None), gdst.zero_()
    dpre = grad_alpha if overwrite_grad else workspace.empty_like(alpha)
    _backward_dst_kernel(
        graph.indptr.numpy(),
        graph.indices.numpy(),
        a_src.numpy(),
        a_dst.numpy(),
        _scalar(negative_slope, dtype),
        alpha.numpy(),
        grad_alpha.numpy(),
        *_plan_args(_plan(graph, False)),
        dpre.numpy(),
        gdst.numpy(),
    )
    if gsrc is not None:
        t = graph.transpose(with_perm=True)
        _backward_src_kernel(
            t.indptr.numpy(), t.perm.numpy(), dpre.numpy(), *_plan_args(_plan(graph, True)), gsrc.numpy()
        )
    return gsrc, gdst


class _GATAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a_src, a_dst, graph: CSRStructure, negative_slope: float):
        alpha = gat_attention_forward(graph, a_src, a_dst, negative_slope)
        ctx.graph, ctx.negative_slope = graph, negative_slope
        ctx.save_for_backward(a_src, a_dst, alpha)
        return alpha

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        need_src, need_dst = ctx.needs_input_grad[:2]
        if not (need_src or need_dst):
            return None, None, None, None
        a_src, a_dst, alpha = ctx.saved_tensors
        gsrc, gdst = gat_attention_backward(ctx.graph, a_src, a_dst, alpha, grad, ctx.negative_slope, need_src)
        return gsrc, (gdst if need_dst else None), None, None


def check_terms(graph: CSRStructure, a_src: torch.Tensor, a_dst: torch.Tensor) -> None:
    """Raise ValueError unless ``a_src`` and ``a_dst`` are ``(num_cols, H)`` and ``(num_rows, H)`` (or 1-D)."""
    n_dst, n_src = graph.num_rows, graph.num_cols
    if a_src.dim() not in (1, 2) or a_src.shape[1:] != a_dst.shape[1:] or (len(a_src), len(a_dst)) != (n_src, n_dst):
        raise ValueError(
            f"a_src and a_dst must have shapes ({n_src}, H) and ({n_dst}, H) (or 1-D), "
            f"got {tuple(a_src.shape)} and {tuple(a_dst.shape)}"
        )


def gat_attention(
    graph: CSRStructure, a_src: torch.Tensor, a_dst: torch.Tensor, negative_slope: float = 0.2
) -> torch.Tensor:
    """``alpha[e, h]``: softmax over row ``i``'s in-edges of ``leaky_relu(a_src[j, h] + a_dst[i, h])``, ``(E, H)``."""
    check_terms(graph, a_src, a_dst)
    dtype = torch.promote_types(a_src.dtype, a_dst.dtype)
    if not host_kernels(a_src) or dtype not in (torch.float32, torch.float64):
        return edge_softmax(graph, F.leaky_relu(edge_score(graph, a_src, a_dst), negative_slope))
    flat = a_src.dim() == 1
    a_src, a_dst = ((a.unsqueeze(1) if flat else a).to(dtype).contiguous() for a in (a_src, a_dst))
    alpha = _GATAttention.apply(a_src, a_dst, graph, float(negative_slope))
    return alpha.squeeze(1) if flat else alpha
