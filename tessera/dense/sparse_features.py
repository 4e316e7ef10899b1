"""``dropout(x) @ W^T + b`` over the non-zeros of a mostly-zero feature matrix.

Bag-of-words inputs (Cora's 2708 x 1433 and CiteSeer's 3327 x 3703 binary word vectors) are about
1 % non-zero. A dense first layer multiplies every zero, and draws a dropout hash for every zero,
in both directions: on Cora it is most of a GCN step. Here the matrix's non-zeros are found once
per feature tensor (:func:`feature_nonzeros`, kept while the tensor lives unmodified), and each step
visits only them: the forward adds ``kept * scale * x[i, k] * W[:, k]`` into row ``i``, the
weight gradient sums ``kept * scale * x[i, k] * g[i]`` down column ``k``. The dropout test of a
non-zero is the hashed dropout's test of the same element
(:func:`~tessera.kernels.dropout.element_kept`, keyed by ``rows`` the same way), and a dropped zero
is zero either way, so the values are those of ``linear(dropout(x, p, rows=rows), W, b)`` up to
the order the products are summed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from tessera import workspace
from tessera.bfloat16 import BF16
from tessera.kernels.dropout import draw_seed, element_kept, keep_threshold
from tessera.kernels.placement import host_kernels
from tessera.memo import TensorMemo
from tessera.threads import sync_numba_threads

#: the largest fraction of non-zeros taken on this path; denser inputs stay dense. At 5 % the sparse
#: layer took well under the dense one's time on every shape measured; its advantage shrinks as the
#: density grows and is lost on some shapes by 20 % (python benchmarks/bench_sparse_features.py;
#: docs/design/fused-layers.md)
MAX_DENSITY = 0.05


@dataclass(frozen=True)
class SparseRows:
    """A matrix's non-zeros by row (CSR) and by column (CSC), with its width and storage dtype
    (float32 or bfloat16; the values are held in float32, exactly)."""

    indptr: np.ndarray  # (n + 1,) int64
    cols: np.ndarray  # (nnz,) int64
    vals: np.ndarray  # (nnz,) float32
    col_ptr: np.ndarray  # (width + 1,) int64
    col_rows: np.ndarray  # (nnz,) int64
    col_vals: np.ndarray  # (nnz,) float32
    width: int
    dtype: torch.dtype

    @property
    def num_rows(self) -> int:
        """Rows of the matrix."""
        return self.indptr.shape[0] - 1


def _build(x: np.ndarray, dtype: torch.dtype) -> SparseRows:
    r, c = np.nonzero(x)  # row-major order: the CSR order
    n, width = x.shape
    vals = x[r, c]
    indptr = np.zeros(n + 1, np.int64)
    np.cumsum(np.bincount(r, minlength=n), out=indptr[1:])
    order = np.argsort(c, kind="stable")  # by column, rows ascending within each
    col_ptr = np.zeros(width + 1, np.int64)
    np.cumsum(np.bincount(c, minlength=width), out=col_ptr[1:])
    return SparseRows(indptr, c.astype(np.int64), vals, col_ptr, r[order].astype(np.int64), vals[order], width, dtype)


_memo: TensorMemo[SparseRows | None] = TensorMemo()


def feature_nonzeros(x: torch.Tensor) -> SparseRows | None:
    """``x``'s non-zeros when it is a float32 or bfloat16 CPU matrix that needs no gradient and is
    at most :data:`MAX_DENSITY` non-zero, else None; found once per tensor and version."""
    if x.requires_grad or x.dtype not in (torch.float32, BF16) or not host_kernels(x):
        return None
    if x.dim() != 2 or not x.numel():
        return None
    hit = _memo.find(x)
    if hit is not None:
        return hit[0]
    # a 64 x 64 grid of entries first: a dense matrix (a hidden layer's activations, evaluated
    # without gradients) is turned away without a pass over it, and nothing is kept for it
    n, k = x.shape
    grid = x.detach()[:: max(1, n // 64), :: max(1, k // 64)].float().numpy()
    if np.count_nonzero(grid) > 4 * MAX_DENSITY * grid.size:
        return None
    xn = x.detach().float().contiguous().numpy()  # bfloat16 values widen exactly
    found = _build(xn, x.dtype) if np.count_nonzero(xn) <= MAX_DENSITY * xn.size else None
    return _memo.put(x, found)


@numba.njit(parallel=True, cache=True, nogil=True)
def _forward(indptr, cols, vals, rows, has_rows, width, wt, bias, out, seed_lo, seed_hi, threshold, scale, masked):
    # out[i] = bias + sum over row i's kept non-zeros of (x[i, k] * scale) * wt[k]
    n, m = out.shape
    for i in numba.prange(n):
        o = out[i]
        for j in range(m):
            o[j] = bias[j]
        g0 = (rows[i] if has_rows else np.int64(i)) * width
        for e in range(indptr[i], indptr[i + 1]):
            k = cols[e]
            if masked and not element_kept(g0 + k, seed_lo, seed_hi, threshold):
                continue
            v = vals[e] * scale
            w = wt[k]
            for j in range(m):
                o[j] += v * w[j]


@numba.njit(parallel=True, cache=True, nogil=True)
def _weight_grad(
    col_ptr, col_rows, col_vals, rows, has_rows, width, g, gwt, seed_lo, seed_hi, threshold, scale, masked
):
    # gwt[k] = sum over column k's kept non-zeros of (x[i, k] * scale) * g[i]: columns apart, no races
    nk, m = gwt.shape
    for k in numba.prange(nk):
        acc = gwt[k]
        for j in range(m):
            acc[j] = 0.0
        for e in range(col_ptr[k], col_ptr[k + 1]):
            i = col_rows[e]
            if masked and not element_kept((rows[i] if has_rows else i) * width + k, seed_lo, seed_hi, threshold):
                continue
            v = col_vals[e] * scale
            gi = g[i]
            for j in range(m):
                acc[j] += v * gi[j]


_NO_ROWS = np.zeros(1, np.int64)


def _draw_args(seed: int, p: float, rows: torch.Tensor | None) -> tuple:
    ids = _NO_ROWS if rows is None else rows.to(torch.int64).contiguous().numpy()
    threshold = keep_threshold(p)
    return (
        ids,
        rows is not None,
        np.uint64(seed & 0xFFFFFFFF),
        np.uint64(seed >> 32),
        threshold,
        np.float32(1.0 / (1.0 - p)),
        p > 0.0,
    )


class _SparseDropoutLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, bias, weight, sr, p, seed, rows):
        ids, has_rows, lo, hi, threshold, scale, masked = _draw_args(seed, p, rows)
        m = weight.shape[0]
        # a bfloat16 input's product takes its weights rounded to bfloat16, as sparse.linear does
        wt = weight.detach().to(sr.dtype).float().t().contiguous().numpy()  # (width, m): a non-zero's row
        b = np.zeros(m, np.float32) if bias is None else bias.detach().to(sr.dtype).float().numpy()
        out = workspace.empty((sr.num_rows, m), torch.float32)
        sync_numba_threads()
        _forward(sr.indptr, sr.cols, sr.vals, ids, has_rows, np.int64(sr.width), wt, b, out.numpy(), lo, hi,
                 threshold, scale, masked)  # fmt: skip
        ctx.sr, ctx.p, ctx.seed, ctx.rows = sr, p, seed, rows
        return out if sr.dtype == torch.float32 else out.to(sr.dtype)  # summed in float32, rounded once

    @staticmethod
    def backward(ctx, g):
        need_b, need_w = ctx.needs_input_grad[:2]
        g = g.float().contiguous()  # a bfloat16 gradient widens exactly; weight gradients in float32
        gw = None
        if need_w:
            sr = ctx.sr
            ids, has_rows, lo, hi, threshold, scale, masked = _draw_args(ctx.seed, ctx.p, ctx.rows)
            gwt = torch.empty((sr.width, g.shape[1]), dtype=torch.float32)
            sync_numba_threads()
            _weight_grad(sr.col_ptr, sr.col_rows, sr.col_vals, ids, has_rows, np.int64(sr.width), g.numpy(),
                         gwt.numpy(), lo, hi, threshold, scale, masked)  # fmt: skip
            gw = gwt.t().contiguous()
        gb = g.sum(0) if need_b else None
        return gb, gw, None, None, None, None


def sparse_dropout_linear(
    sr: SparseRows,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    p: float,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """``linear(dropout(x, p, rows=rows), weight, bias)`` for the matrix ``x`` whose non-zeros are
    ``sr`` (``p`` = 0: no dropout, no draw), drawing the seed where :func:`~tessera.kernels.dropout`
    draws it. Float32 ``weight`` and ``bias``; ``x`` gets no gradient. Over a bfloat16 ``x`` the
    output is bfloat16 (float32 sums rounded once) and the dropped values are not rounded to
    bfloat16 before their products (exact at p = 0.5)."""
    if weight.dtype != torch.float32 or (bias is not None and bias.dtype != torch.float32):
        raise ValueError("sparse_dropout_linear takes float32 weights")
    if weight.dim() != 2 or weight.shape[1] != sr.width:
        raise ValueError(f"weight of shape {tuple(weight.shape)} for {sr.width} features")
    if not 0.0 <= p < 1.0 or keep_threshold(p) is None:
        raise ValueError(f"dropout probability {p} must keep something (0 <= p < 1)")
    if rows is not None and rows.numel() != sr.num_rows:
        raise ValueError(f"rows has {rows.numel()} ids for {sr.num_rows} rows")
    seed = draw_seed() if p > 0.0 else 0
    return _SparseDropoutLinear.apply(bias, weight, sr, p, seed, rows)
