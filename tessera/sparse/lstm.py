"""LSTM neighbourhood aggregation (GraphSAGE-LSTM, DGL semantics): each row's in-neighbours, in
ascending source id, are one sequence; the LSTM's final hidden state is the row's summary.

Order: a row's in-edges sorted by the global id of their source (``source_ids``), parallel edges
in CSR order. For a graph built by :meth:`~tessera.graph.Graph.from_edge_index` (every loader)
this is the CSR order itself; sorting by global id keeps it the same on every rank of a partition.

Every sequence runs exactly its own length; rows without in-edges get ``h = 0``. Rows are batched
by degree as packed sequences: rows sorted by descending in-degree, so at step ``t`` the rows with
more than ``t`` in-edges are a prefix of that order and one batched step advances all of them
(degree buckets advancing in lockstep: ``max degree`` steps, not the sum of the distinct degrees
that one batch per bucket would take).

Three ways compute the same value:

- ``reference``: a per-row loop of :func:`torch.lstm_cell` (the oracle; slow).
- ``packed``: torch's fused LSTM over a packed sequence of the gathered source rows (``E x F``
  inputs, the input projection ``W_ih x_j`` computed once per edge).
- ``hoisted``: WiseGraph's unique-value extraction: ``x W_ih^T + b`` once per source vertex (one
  GEMM over ``N`` rows instead of ``E``), gathered per step; only ``h W_hh^T`` runs per step.
  The recurrence is one autograd function with a hand-written backward: forward activates the
  gathered ``(E, 4H)`` gate buffer in place (gates reordered i, f, o, g: one sigmoid and one
  tanh per step) and keeps it with every step's ``c`` and incoming ``h`` (O(E x 6H) floats);
  backward runs the steps in reverse, then takes ``W_hh``'s gradient as one GEMM over all
  (row, step) pairs and the projections' gradient as one ``index_add`` over the edges. The
  nonlinearities stay torch's vectorised ops; the rest of each step's cell update and its gate
  gradients are single-pass numba kernels (:mod:`tessera.sparse.lstm_kernels`), which take less
  CPU time per aggregation than the same arithmetic as ~20 torch ops a step.

``auto`` is ``hoisted``: ``packed``'s CPU backward is oneDNN's RNN backward, several times slower
than ``hoisted`` even written as per-step autograd ops. The steps run on one torch thread whatever
the caller's count: most of them advance few rows, and with more threads each small op waits at an
OpenMP barrier (for a descheduled thread, on a loaded machine). Denormals are flushed while the
recurrence runs: gradients decaying along long sequences reach the denormal range, where they make
the per-step GEMMs several times slower. Figures: ``docs/design/sage-lstm.md``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tessera.errors import ConfigError
from tessera.graph.csr import CSRStructure
from tessera.kernels.placement import host_kernels
from tessera.sparse import lstm_kernels as kernels
from tessera.threads import flush_denormals, torch_threads

IMPLS = ("auto", "reference", "packed", "hoisted")
# torch threads of the per-step ops (see the module docstring)
_STEP_THREADS = 1


@dataclass(frozen=True)
class SequencePlan:
    """Every row's in-neighbour sequence as packed sequences over a CSR's rows.

    ``order``: rows with in-edges by descending in-degree (ties: ascending row). ``batch[t]``: how
    many of them have more than ``t`` in-edges (the rows active at step ``t``, a prefix of
    ``order``). ``steps[ptr[t]:ptr[t + 1]]``: the source column each active row reads at step ``t``.
    ``sources``: every row's sources in sequence order, row-major (CSR layout, for the reference)."""

    num_rows: int
    order: torch.Tensor
    batch: list[int]
    ptr: list[int]
    steps: torch.Tensor
    indptr: torch.Tensor
    sources: torch.Tensor
    _copies: dict = field(default_factory=dict, repr=False, compare=False)

    def on(self, device: torch.device) -> SequencePlan:
        """This plan with its index tensors on ``device`` (itself on the CPU), copied there once."""
        if device.type == "cpu":
            return self
        if device not in self._copies:
            self._copies[device] = replace(self, order=self.order.to(device), steps=self.steps.to(device), _copies={})
        return self._copies[device]


def sequence_plan(edges: CSRStructure, source_ids: torch.Tensor | None = None) -> SequencePlan:
    """The packed neighbour sequences of ``edges``' rows, each row's sources ordered by
    ``source_ids`` (the global id of every column; None: the column index), ties in CSR order."""
    indptr = edges.indptr.numpy().astype(np.int64)
    src = edges.src_index().numpy()
    dst = edges.dst_index().numpy()
    key = src if source_ids is None else source_ids.numpy().astype(np.int64)[src]
    # np.lexsort is stable: parallel edges keep their CSR order
    src = src[np.lexsort((key, dst))]
    deg = np.diff(indptr)
    nz = np.flatnonzero(deg)
    order = nz[np.argsort(-deg[nz], kind="stable")]
    max_deg = int(deg.max()) if deg.size else 0
    # batch[t] = rows with degree > t
    hist = np.bincount(deg[order], minlength=max_deg + 1)
    batch = (order.size - np.cumsum(hist)[:max_deg]).astype(np.int64)
    ptr = np.zeros(max_deg + 1, np.int64)
    np.cumsum(batch, out=ptr[1:])
    # edge k of row r (k-th in sequence order) goes to step k at r's rank in ``order``
    rank = np.empty(edges.num_rows, np.int64)
    rank[order] = np.arange(order.size)
    pos = np.arange(src.size) - np.repeat(indptr[:-1], deg)
    slot = ptr[pos] + rank[np.repeat(np.arange(edges.num_rows), deg)]
    steps = np.empty_like(src)
    steps[slot] = src
    return SequencePlan(
        edges.num_rows,
        torch.from_numpy(order),
        batch.tolist(),
        ptr.tolist(),
        torch.from_numpy(steps),
        torch.from_numpy(indptr),
        torch.from_numpy(src),
    )


def lstm_aggregate(
    plan: SequencePlan,
    x: torch.Tensor,
    weight_ih: torch.Tensor,
    weight_hh: torch.Tensor,
    bias_ih: torch.Tensor | None = None,
    bias_hh: torch.Tensor | None = None,
    impl: str = "auto",
) -> torch.Tensor:
    """``(num_rows, H)``: the final hidden state of a one-layer LSTM (torch's gate order i, f, g,
    o; zero initial state) run over each row's sequence of source rows of ``x`` (``(num_cols, F)``);
    zero for rows without in-edges. Differentiable in ``x`` and every weight."""
    if impl not in IMPLS:
        raise ConfigError(f"unknown LSTM aggregation {impl!r}; choose from {', '.join(IMPLS)}")
    hidden = weight_hh.shape[1]
    if weight_ih.shape != (4 * hidden, x.shape[1]) or weight_hh.shape != (4 * hidden, hidden):
        raise ValueError(
            f"LSTM weights {tuple(weight_ih.shape)}, {tuple(weight_hh.shape)} do not fit input width {x.shape[1]}"
        )
    plan = plan.on(x.device)
    run = {"reference": _reference, "packed": _packed}.get(impl, _hoisted)  # auto: measured, see module docstring
    h = run(plan, x, weight_ih, weight_hh, bias_ih, bias_hh)
    return x.new_zeros(plan.num_rows, hidden).index_copy(0, plan.order, h)


def _reference(plan, x, w_ih, w_hh, b_ih, b_hh) -> torch.Tensor:
    """Final hidden state per row of ``plan.order``, one row and one step at a time."""
    hidden, out = w_hh.shape[1], []
    for r in plan.order.tolist():
        h = c = x.new_zeros(1, hidden)
        for j in plan.sources[plan.indptr[r] : plan.indptr[r + 1]].tolist():
            h, c = torch.lstm_cell(x[j : j + 1], (h, c), w_ih, w_hh, b_ih, b_hh)
        out.append(h)
    return torch.cat(out) if out else x.new_zeros(0, hidden)


def _packed(plan, x, w_ih, w_hh, b_ih, b_hh) -> torch.Tensor:
    """torch's fused LSTM over the packed sequences of gathered source rows."""
    hidden, rows = w_hh.shape[1], plan.order.numel()
    if not rows:
        return x.new_zeros(0, hidden)
    params = [w_ih, w_hh] + ([b_ih, b_hh] if b_ih is not None else [])
    zeros = x.new_zeros(1, rows, hidden)
    batch = torch.tensor(plan.batch, dtype=torch.int64)
    _, h, _ = torch.lstm(
        x.index_select(0, plan.steps), batch, (zeros, zeros), params, b_ih is not None, 1, 0.0, True, False
    )
    return h[0]


def _hoisted(plan, x, w_ih, w_hh, b_ih, b_hh) -> torch.Tensor:
    """Input projection once per source vertex (gates reordered i, f, o, g), then the recurrence."""
    hidden, rows = w_hh.shape[1], plan.order.numel()
    if not rows:
        return x.new_zeros(0, hidden)
    perm = torch.cat(
        [torch.arange(2 * hidden), torch.arange(3 * hidden, 4 * hidden), torch.arange(2 * hidden, 3 * hidden)]
    ).to(x.device)
    proj = x @ w_ih[perm].t()
    if b_ih is not None:
        proj = proj + (b_ih + b_hh)[perm]
    return _Recurrence.apply(proj, w_hh[perm], plan)


class _Recurrence(torch.autograd.Function):
    """The LSTM recurrence over ``plan``'s packed steps from the per-vertex input projections
    ``proj`` (``(num_cols, 4H)``, gates i, f, o, g), with a hand-written backward.

    Forward gathers every step's projections into one ``(E, 4H)`` buffer and activates it in
    place, step by step; ``hs`` holds at step ``t``'s slots the ``h_{t-1}`` its rows read, so
    backward's ``W_hh`` gradient is one GEMM over all steps, and ``proj``'s gradient one
    ``index_add`` over the edges. The output is in ``plan.order``: the rows finishing at step
    ``t`` are ``order[batch[t+1]:batch[t]]``."""

    @staticmethod
    def forward(ctx, proj, w_hh, plan):
        with flush_denormals():
            return _Recurrence._forward(ctx, proj, w_hh, plan)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        with flush_denormals():
            return _Recurrence._backward(ctx, dout)

    @staticmethod
    def _forward(ctx, proj, w_hh, plan):
        hid, (rows, *_), ptr = w_hh.shape[1], plan.batch, plan.ptr
        gates = proj.index_select(0, plan.steps)
        hs = proj.new_empty(gates.shape[0], hid)
        cs = proj.new_empty(gates.shape[0], hid)
        out = proj.new_empty(rows, hid)
        tc = proj.new_empty(rows, hid)
        w_t = w_hh.t()
        if host_kernels(proj):  # numba's cell kernels over NumPy views
            cell_state, cell_output = kernels.cell_state, kernels.cell_output
            g_np, cs_np, tc_np, hs_np, out_np = (a.numpy() for a in (gates, cs, tc, hs, out))
        else:
            cell_state, cell_output = kernels.cell_state_torch, kernels.cell_output_torch
            g_np, cs_np, tc_np, hs_np, out_np = gates, cs, tc, hs, out
        with torch_threads(_STEP_THREADS):
            for t, (b, nb) in enumerate(_steps(plan.batch)):
                g = gates[ptr[t] : ptr[t] + b]
                if t:
                    g.addmm_(hs[ptr[t] : ptr[t] + b], w_t)
                g[:, : 3 * hid].sigmoid_()
                g[:, 3 * hid :].tanh_()
                cell_state(g_np, cs_np, ptr[t], ptr[t - 1] if t else -1, b)
                torch.tanh(cs[ptr[t] : ptr[t] + b], out=tc[:b])
                cell_output(g_np, tc_np, hs_np, out_np, ptr[t], ptr[t + 1], b, nb)
        ctx.save_for_backward(gates, hs, cs, w_hh)
        ctx.plan, ctx.num_cols = plan, proj.shape[0]
        return out

    @staticmethod
    def _backward(ctx, dout):
        gates, hs, cs, w_hh = ctx.saved_tensors
        plan, hid = ctx.plan, w_hh.shape[1]
        (rows, *_), ptr = plan.batch, plan.ptr
        dout = dout.contiguous()
        dgates = torch.empty_like(gates)
        dh, dc, tc = (gates.new_empty(rows, hid) for _ in range(3))
        arrays = [gates, cs, tc, dgates, dh, dc, dout]
        if host_kernels(gates):
            cell_backward, arrays = kernels.cell_backward, [a.numpy() for a in arrays]
        else:
            cell_backward = kernels.cell_backward_torch
        with torch_threads(_STEP_THREADS):
            for t, (b, nb) in reversed(list(enumerate(_steps(plan.batch)))):
                torch.tanh(cs[ptr[t] : ptr[t] + b], out=tc[:b])
                cell_backward(*arrays, ptr[t], ptr[t - 1] if t else -1, b, nb)
                if t:
                    torch.mm(dgates[ptr[t] : ptr[t] + b], w_hh, out=dh[:b])
        dw = dgates[rows:].t().mm(hs[rows:]) if ctx.needs_input_grad[1] else None
        dproj = None
        if ctx.needs_input_grad[0]:
            # torch splits each index_add row over the threads, which costs several times the CPU time
            with torch_threads(1):
                dproj = gates.new_zeros(ctx.num_cols, gates.shape[1]).index_add_(0, plan.steps, dgates)
        return dproj, dw, None


def _steps(batch: list[int]) -> list[tuple[int, int]]:
    """(rows active at step t, rows still active at t + 1) for every step."""
    return list(zip(batch, batch[1:] + [0], strict=True))
