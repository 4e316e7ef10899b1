"""Attention (GAT) under tensor parallelism: the per-vertex terms every rank needs, and products
of a column slice with per-head edge values.

An attention coefficient ``alpha_ij = softmax_j(leaky_relu(s_src[j] + s_dst[i]))`` needs both
ends' terms and a softmax over all of ``i``'s in-edges, but only ``heads`` scalars per vertex and
end. So each rank computes its rows' terms in the node split, one all-gather gives every rank
every vertex's (``N x 2 heads`` values, O(N heads) whatever the edge count), and every rank
computes every edge's coefficient and its attention dropout (keyed by the global ids of the
edge's ends, so each rank draws the mask one process draws), redundantly, without communicating.
The features go to the feature split as for any aggregation; a feature is ``heads x C`` values
and a rank's columns of the flattened ``heads * C`` may cut across heads, so each column is
multiplied by its own head's coefficients (:func:`slice_spmm`).

Backward: ``d alpha_ij = <g_i, h_j>`` summed over a head's columns is a sum over the column
slices, and the softmax, LeakyReLU and edge-score backward and the per-vertex sums that give the
terms' gradients are linear in it. So each rank computes its slice's share of ``d alpha``
(:func:`slice_sddmm`) and carries it through that backward to per-vertex shares, and the
all-gather's transpose, a reduce-scatter, adds the shares at each vertex's owner: the exact
gradient, for ``N x 2 heads`` values. The terms and their gradients are exchanged in float32
whatever ``--comm-bits`` says (they are few; the features' all-to-alls are quantized as usual).
"""

from __future__ import annotations

import numpy as np
import torch

from tessera.comm.accounting import BACKWARD, FORWARD
from tessera.comm.exchange import BlockExchange, Blocks
from tessera.comm.group import Comm
from tessera.sparse import Operand


def term_blocks(counts: list[int] | np.ndarray, width: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """``(rows, widths)``, int64 ``P x P`` (``[i, j]`` the block rank ``i`` sends rank ``j``), of
    the terms' all-gather at ``width`` (every rank its ``n_i`` rows to every rank) and of its
    transpose, the reduce-scatter (rank ``i`` sends rank ``j`` its share of ``j``'s ``n_j`` rows).
    The diagonal stays on the rank. The runtime and the simulator size them from this function."""
    n = np.asarray(counts, dtype=np.int64)
    rows = np.repeat(n[:, None], n.size, axis=1)
    widths = np.full((n.size, n.size), int(width), dtype=np.int64)
    return [(rows, widths), (rows.T.copy(), widths)]


class TermExchange:
    """The all-gather of per-vertex terms (rank-block order) and its transpose, in float32."""

    def __init__(self, comm: Comm, counts: list[int], log) -> None:
        self.exchange = BlockExchange(comm)
        self.exchange.configure(32, log)
        self.counts, self.rank = [int(c) for c in counts], comm.rank
        self._blocks: dict[int, list[tuple[Blocks, Blocks]]] = {}

    def blocks(self, width: int) -> list[tuple[Blocks, Blocks]]:
        """(send, receive) blocks of this rank in the all-gather and the reduce-scatter at ``width``."""
        if width not in self._blocks:
            me = self.rank
            self._blocks[width] = [
                (Blocks.of(r[me], w[me]), Blocks.of(r[:, me], w[:, me])) for r, w in term_blocks(self.counts, width)
            ]
        return self._blocks[width]

    def gather(self, terms: torch.Tensor, layer: int, direction: int) -> torch.Tensor:
        """Every vertex's rows of ``terms`` (this rank's rows, ``(n_me, k)``): ``(N, k)``."""
        (send, recv), _ = self.blocks(terms.shape[1])
        ex = self.exchange
        pending = ex.start_blocks([terms] * len(self.counts), send, recv, layer, direction)
        return ex.finish_blocks(pending).view(sum(self.counts), terms.shape[1])

    def scatter_add(self, shares: torch.Tensor, layer: int, direction: int) -> torch.Tensor:
        """This rank's rows of the sum over ranks of ``shares`` (``(N, k)`` on every rank)."""
        _, (send, recv) = self.blocks(shares.shape[1])
        ex = self.exchange
        got = ex.finish_blocks(ex.start_blocks(shares.contiguous(), send, recv, layer, direction))
        return got.view(len(self.counts), self.counts[self.rank], shares.shape[1]).sum(0)


class _GatherTerms(torch.autograd.Function):
    @staticmethod
    def forward(ctx, terms: torch.Tensor, exchange: TermExchange, layer: int) -> torch.Tensor:
        ctx.exchange, ctx.layer = exchange, layer
        return exchange.gather(terms.contiguous(), layer, FORWARD)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return ctx.exchange.scatter_add(grad, ctx.layer, BACKWARD), None, None


def gather_terms(exchange: TermExchange, layer: int, *terms: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Every vertex's rows of each of ``terms`` (this rank's rows), in one all-gather; backward
    adds every rank's gradient share at the owner (see the module docstring)."""
    n = terms[0].shape[0]
    widths = [int(np.prod(t.shape[1:])) for t in terms]
    flat = torch.cat([t.reshape(n, w) for t, w in zip(terms, widths, strict=True)], 1)
    parts = torch.split(_GatherTerms.apply(flat, exchange, layer), widths, dim=1)
    return tuple(p.reshape(-1, *t.shape[1:]) for p, t in zip(parts, terms, strict=True))


def head_runs(lo: int, hi: int, head: int) -> list[tuple[int, int, int, int]]:
    """Columns ``[lo, hi)`` of rows of ``head``-wide heads, cut where the head changes:
    ``(first column, end column, first head, end head)`` per run, consecutive whole heads in one
    run and a part of a head alone."""
    runs, c = [], lo
    while c < hi:
        h = c // head
        if c == h * head and hi >= (h + 1) * head:
            end = hi // head  # whole heads h .. end - 1
            runs.append((c, end * head, h, end))
            c = end * head
        else:
            e = min(hi, (h + 1) * head)
            runs.append((c, e, h, h + 1))
            c = e
    return runs


def _run_operands(cols: torch.Tensor, run: tuple[int, int, int, int], lo: int, head: int) -> torch.Tensor:
    """The run's columns of ``cols`` (which start at column ``lo``): ``(N, heads, head)`` for whole
    heads, ``(N, columns)`` for part of one."""
    c0, c1, h0, h1 = run
    x = cols[:, c0 - lo : c1 - lo]
    return x.reshape(x.shape[0], h1 - h0, head) if c1 - c0 == (h1 - h0) * head else x


def slice_spmm(
    local: Operand, cols: torch.Tensor, weight: torch.Tensor, lo: int, head: int, transposed: bool
) -> torch.Tensor:
    """``A cols`` (``A^T`` when ``transposed``) for columns ``lo ..`` of ``head``-wide heads, each
    column weighted by its head's column of ``weight`` (``(E, heads)``, or ``(E,)`` for one head)."""
    w = weight.view(weight.shape[0], -1)
    outs = []
    for run in head_runs(lo, lo + cols.shape[1], head):
        x = _run_operands(cols, run, lo, head)
        h0, h1 = run[2], run[3]
        v = (w[:, h0:h1] if x.dim() == 3 else w[:, h0]).contiguous()
        y = local.spmm_t(x, v) if transposed else local.spmm(x, v)
        outs.append(y.reshape(y.shape[0], -1))
    n = local.num_cols if transposed else local.num_rows
    return torch.cat(outs, 1) if outs else cols.new_zeros(n, 0)


def slice_sddmm(local: Operand, g: torch.Tensor, x: torch.Tensor, lo: int, head: int, heads: int) -> torch.Tensor:
    """``(E, heads)``: per edge ``j -> i`` and head, ``<g[i], x[j]>`` over this rank's columns of
    the head (``g`` and ``x`` hold columns ``lo ..`` of ``head``-wide heads); zero for heads it has none of."""
    out = g.new_zeros(local.edge_structure().num_edges, heads)
    for run in head_runs(lo, lo + g.shape[1], head):
        d = local.sddmm_dot(_run_operands(g, run, lo, head), _run_operands(x, run, lo, head))
        out[:, run[2] : run[3]] += d.view(d.shape[0], -1)
    return out
