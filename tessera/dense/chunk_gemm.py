"""The products of the fused nodes' row chunks, on this CPU's :func:`~tessera.dense.gemm_path.chunk_library`.

A fused node (:mod:`~tessera.dense.linear_act`, :mod:`~tessera.dense.dropout_linear`,
:mod:`~tessera.dense.deferred`'s owed products) walks its rows a few megabytes at a time and
multiplies each chunk by a small weight. float32 chunks go to oneDNN where it measured faster on
such blocks (into the chunk's own buffer, through :func:`~tessera.dense.gemm_path.onednn_add_`,
and the weight gradient through :func:`~tessera.dense.gemm_path.onednn_weight_grad`); others to
:mod:`~tessera.dense.widened`'s products (MKL, or bfloat16 ones).
"""

from __future__ import annotations

import torch

from tessera import workspace
from tessera.dense import widened
from tessera.dense.gemm_path import chunk_library, kept_onednn_fits, onednn_add_, onednn_weight_grad

# bytes of the gradient per product of a whole weight gradient's row chunks: a sum of oneDNN
# products over 4 MB chunks ran faster than one product over every row (MKL's or oneDNN's) and than
# larger or smaller chunks (docs/design/chunk-sizes.md)
WEIGHT_GRAD_BYTES = 4 << 20
# the row chunks a weight gradient is summed over are whole multiples of this many rows: oneDNN runs
# the weight gradient of such chunks fastest (docs/design/chunk-sizes.md)
WEIGHT_GRAD_ROWS = 4096


def weight_grad_rows(width: int, element_size: int, n: int, chunk_bytes: int) -> int:
    """Rows per chunk of a walk whose chunks take weight-gradient products: about ``chunk_bytes``
    of ``width``-wide rows (:func:`~tessera.workspace.chunk_rows`), rounded down to a multiple of
    :data:`WEIGHT_GRAD_ROWS` when at least that many."""
    rows = workspace.chunk_rows(width, element_size, n, chunk_bytes)
    return rows if rows >= n or rows < WEIGHT_GRAD_ROWS else rows - rows % WEIGHT_GRAD_ROWS


def _onednn(*ts: torch.Tensor) -> bool:
    return all(t.dtype == torch.float32 for t in ts) and chunk_library() == "onednn"


def _onednn_into(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether ``out`` (+)= ``a @ w.T`` goes to oneDNN's in-place product."""
    return _onednn(out, a, w) and out.is_contiguous() and kept_onednn_fits(a, w)


def product(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``out = a @ w.T + bias`` (``out`` a contiguous block of rows, ``w`` shaped ``(out's width, a's width)``)."""
    if _onednn_into(out, a, w):
        return onednn_add_(out.zero_(), a, w, bias)
    return widened.mm(a, w.t(), out=out) if bias is None else widened.addmm(bias, a, w.t(), out=out)


def add_product_(out: torch.Tensor, a: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``out += a @ w.T`` in place."""
    if _onednn_into(out, a, w):
        return onednn_add_(out, a, w)
    return widened.addmm_(out, a, w.t())


# oneDNN's weight gradient is a fresh tensor per chunk: at most this many bytes (a 512 x 512 float32
# weight), so that it stays in glibc's heap; a larger one (hidden 2560: 26 MB a chunk) was mapped and
# page-faulted in anew for each chunk, and goes to MKL's in-place product instead
FRESH_WEIGHT_GRAD_BYTES = 1 << 20


def _onednn_weight_grad_fits(d: torch.Tensor, x: torch.Tensor) -> bool:
    return (
        d.is_contiguous()
        and x.is_contiguous()
        and min(d.shape[0], d.shape[1], x.shape[1]) > 1
        and d.shape[1] * x.shape[1] * 4 <= FRESH_WEIGHT_GRAD_BYTES
    )


def add_weight_grad_(gw: torch.Tensor, d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``gw += d.T @ x`` in place (``d`` and ``x`` the same rows; float32 ``gw``)."""
    if _onednn(gw, d, x) and _onednn_weight_grad_fits(d, x):
        return gw.add_(onednn_weight_grad(d, x))
    if d.dtype != gw.dtype:  # no mixed-dtype addmm on CPU: the chunk's product rounded once
        return gw.add_(widened.mm(d.t(), x))
    return gw.addmm_(d.t(), x)


def weight_grad(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``g.T @ x`` over all rows: on oneDNN a sum over row chunks, on which it runs at full
    speed; else one product."""
    if not (_onednn(g, x) and _onednn_weight_grad_fits(g, x)):
        return widened.mm(g.t(), x)
    n = g.shape[0]
    step = weight_grad_rows(g.shape[1], g.element_size(), n, WEIGHT_GRAD_BYTES)
    gw = onednn_weight_grad(g[:step], x[:step])
    for r0 in range(step, n, step):
        r1 = min(n, r0 + step)
        if r1 - r0 > 1:
            gw.add_(onednn_weight_grad(g[r0:r1], x[r0:r1]))
        else:
            gw.addmm_(g[r0:r1].t(), x[r0:r1])
    return gw


class WeightGrads:
    """The weight gradients ``sum over row chunks of d^T x_i`` of a node's inputs ``x_i``, which
    share each chunk's output gradient ``d``. Several inputs' chunks are copied side by side into
    one small block and take one product, which reads ``d`` once, faster than one product per input
    (docs/design/chunk-sizes.md)."""

    def __init__(self, xs: list[torch.Tensor], needed: list[bool], width: int, dtype: torch.dtype, step: int) -> None:
        self.xs, self.widths = xs, [x.shape[1] for x in xs]
        self.stacked = len(xs) > 1 and all(needed) and len({x.dtype for x in xs}) == 1
        self.sums: list[torch.Tensor | None] = []  # unstacked: per input, None where not needed
        if self.stacked:
            self.stacked_sum = torch.zeros((width, sum(self.widths)), dtype=dtype)  # the inputs side by side
            self.buf = torch.empty((step, sum(self.widths)), dtype=xs[0].dtype)
        else:
            self.sums = [torch.zeros((width, k), dtype=dtype) if nw else None for k, nw in zip(self.widths, needed)]

    def add(self, d: torch.Tensor, r0: int, r1: int) -> None:
        """Add rows ``r0:r1``'s terms, ``d`` being those rows of the output gradient."""
        if self.stacked:
            block, col = self.buf[: r1 - r0], 0
            for x, k in zip(self.xs, self.widths):
                block[:, col : col + k].copy_(x[r0:r1])
                col += k
            add_weight_grad_(self.stacked_sum, d, block)
            return
        for x, gw in zip(self.xs, self.sums):
            if gw is not None:
                add_weight_grad_(gw, d, x[r0:r1])

    def result(self) -> list[torch.Tensor | None]:
        """Each input's weight gradient (None where it was not needed)."""
        if self.stacked:
            return [part.contiguous() for part in self.stacked_sum.split(self.widths, dim=1)]
        return self.sums
