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
  GEMM over ``N`` rows instead of ``E``); only ``h W_hh^T`` runs per step. The recurrence is one
  autograd function with a hand-written backward over an ``(E, 4H)`` gate buffer (gates reordered
  i, f, o, g) kept with every step's ``c`` and incoming ``h`` (``6 E H`` floats).

On the CPU (:class:`_HostRecurrence`) each step is one ``h W_hh^T`` GEMM written into the step's
slots of the gate buffer and one fused numba kernel that adds the sources' projections (gathered
there, not in a separate ``(E, 4H)`` pass), applies the nonlinearities and writes ``c`` and ``h``
(:mod:`tessera.sparse.lstm_kernels`: tanh as a rational function evaluated in float64, which LLVM
vectorises; torch's float32 tanh took 6x its sigmoid's time). Backward turns the gate buffer into
the gates' gradients in place (one fused kernel and one ``dgates W_hh`` GEMM per step, in
reverse), then takes ``W_hh``'s gradient as one GEMM over all slots and the projections' as one
deterministic sum per source vertex. The rows are split round-robin by degree into one part per
torch thread (where each part gets at least ``MIN_PART_EDGES`` edges), each part's steps run on
its own thread at one torch thread: no OpenMP barrier per step, and both cores busy. The buffers
are kept on the plan's layout between a backward and the next forward: allocating ``6 E H``
fresh floats costs more in page faults than the step kernels' work. Off the CPU (and under
``--backend torch``) :class:`_Recurrence` runs the same steps as torch ops.

``auto`` is ``hoisted``: ``packed``'s CPU backward is oneDNN's RNN backward, several times slower.
Denormals are flushed while the recurrence runs: gradients decaying along long sequences reach
the denormal range, where they make the per-step GEMMs several times slower. Figures:
``docs/design/sage-lstm.md``.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from tessera.errors import ConfigError
from tessera.graph.csr import CSRStructure
from tessera.kernels.placement import host_kernels
from tessera.sparse import lstm_kernels as kernels
from tessera.threads import flush_denormals, sync_numba_threads, torch_threads

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
    if impl in ("auto", "hoisted") and host_kernels(x):
        return _hoisted_host(plan, x, weight_ih, weight_hh, bias_ih, bias_hh)
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
    ``proj`` (``(num_cols, 4H)``, gates i, f, o, g), with a hand-written backward, in torch ops
    (tensors off the CPU, ``--backend torch``; the CPU runs :class:`_HostRecurrence`).

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


# ---- the host recurrence: fused numba steps, rows split over threads ----

# edges per part below which the recurrence does not split its rows over threads
MIN_PART_EDGES = 16384
_POOL: list[ThreadPoolExecutor] = []
_POOL_PID = [0]


@dataclass(frozen=True)
class _Part:
    """One thread's rows: ``order[roff:roff + rows]`` of the layout; at step ``t`` the first
    ``batch[t]`` of them are active, in slots ``ptr[t]:ptr[t] + batch[t]``."""

    roff: int
    rows: int
    batch: list[int]
    ptr: list[int]


@dataclass(frozen=True)
class _Layout:
    """A plan's steps laid out for ``len(parts)`` threads: each part a disjoint range of slots and
    rows (rows dealt round-robin in descending degree, so every part has about the same edges and
    steps). ``steps[slot]``: the source column; ``by_src[src_ptr[v]:src_ptr[v + 1]]``: the slots
    reading column ``v``, in CSR edge order (so the projections' gradient does not depend on the split)."""

    order: np.ndarray
    steps: np.ndarray
    parts: list[_Part]
    by_src: np.ndarray
    src_ptr: np.ndarray
    # (gates, hs, cs) buffers a finished backward gave back, for the next forward: a fresh
    # (E, 6H) allocation costs more in page faults than the recurrence's elementwise work
    free: list = field(default_factory=list, repr=False, compare=False)

    def buffers(self, hid: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gate, ``h`` and ``c`` buffers for ``hid`` wide rows: given-back ones if they fit."""
        for i, bufs in enumerate(self.free):
            if bufs[1].shape[1] == hid and bufs[0].dtype == like.dtype:
                return self.free.pop(i)
        edges = self.steps.size
        return like.new_empty(edges, 4 * hid), like.new_empty(edges, hid), like.new_empty(edges, hid)

    def give_back(self, bufs: tuple[torch.Tensor, ...]) -> None:
        """Keep ``bufs`` (no longer read by anyone) for the next forward; one set per width."""
        self.free[:] = [b for b in self.free if b[1].shape[1] != bufs[1].shape[1]] + [bufs]


def _layout(plan: SequencePlan, parts: int, num_cols: int) -> _Layout:
    """``plan`` split over ``parts`` threads (made once per plan, part count and column count)."""
    key = ("layout", parts, num_cols)
    if key in plan._copies:
        return plan._copies[key]
    indptr, src = plan.indptr.numpy(), plan.sources.numpy()
    deg = np.diff(indptr)
    order = plan.order.numpy()
    steps = np.empty(src.size, np.int64)
    edge = np.empty(src.size, np.int64)
    out, base, roff = [], 0, 0
    for p in range(parts):
        rows = order[p::parts]
        d = deg[rows]
        max_deg = int(d[0]) if d.size else 0
        batch = (rows.size - np.cumsum(np.bincount(d, minlength=max_deg + 1))[:max_deg]).astype(np.int64)
        ptr = np.full(max_deg + 1, base, np.int64)
        np.cumsum(batch, out=ptr[1:])
        ptr[1:] += base
        # the k-th edge of the row at rank q goes to slot ptr[k] + q
        rank = np.repeat(np.arange(rows.size), d)
        k = np.arange(int(d.sum())) - np.repeat(np.cumsum(d) - d, d)
        pos = np.repeat(indptr[rows], d) + k
        slot = ptr[k] + rank
        steps[slot], edge[slot] = src[pos], pos
        out.append(_Part(roff, rows.size, batch.tolist(), ptr.tolist()))
        base, roff = base + int(d.sum()), roff + rows.size
    by_src = np.lexsort((edge, steps))
    src_ptr = np.zeros(num_cols + 1, np.int64)
    np.cumsum(np.bincount(steps, minlength=num_cols), out=src_ptr[1:])
    lay = _Layout(np.concatenate([order[p::parts] for p in range(parts)]), steps, out, by_src, src_ptr)
    plan._copies[key] = lay
    return lay


def _num_parts(plan: SequencePlan) -> int:
    """Threads for the recurrence: the caller's count, fewer where a part would get too few edges (or no row)."""
    return max(1, min(torch.get_num_threads(), plan.sources.numel() // MIN_PART_EDGES, plan.order.numel()))


def _hoisted_host(plan, x, w_ih, w_hh, b_ih, b_hh) -> torch.Tensor:
    """``hoisted`` on the CPU: input projection once per source vertex (gates reordered i, f, o, g),
    then :class:`_HostRecurrence`; returns all ``plan.num_rows`` rows."""
    hidden = w_hh.shape[1]
    if not plan.order.numel():
        return x.new_zeros(plan.num_rows, hidden)
    perm = torch.cat(
        [torch.arange(2 * hidden), torch.arange(3 * hidden, 4 * hidden), torch.arange(2 * hidden, 3 * hidden)]
    )
    proj = x @ w_ih[perm].t()
    if b_ih is not None:
        proj = proj + (b_ih + b_hh)[perm]
    lay = _layout(plan, _num_parts(plan), x.shape[0])
    return _HostRecurrence.apply(proj, w_hh[perm], lay, plan.num_rows)


def _in_parts(lay: _Layout, fn, *args) -> None:
    """``fn(part, *args)`` for every part of ``lay``: part 0 on this thread, the others on pool
    threads, every one at one torch thread with denormals flushed and without autograd."""
    futures = []
    if len(lay.parts) > 1:
        if _POOL and _POOL_PID[0] != os.getpid():  # a forked child: the parent's threads are not here
            _POOL.clear()
        _POOL_PID[0] = os.getpid()
        while len(_POOL) < len(lay.parts) - 1:
            _POOL.append(ThreadPoolExecutor(1, thread_name_prefix="tessera-lstm"))
        futures = [_POOL[i - 1].submit(_on_worker, fn, part, *args) for i, part in enumerate(lay.parts) if i]
    with torch_threads(1), flush_denormals(), torch.no_grad():
        fn(lay.parts[0], *args)
        for f in futures:  # before this thread's count is restored: a worker sets the global one
            f.result()


def _on_worker(fn, *args) -> None:
    torch.set_num_threads(1)  # this thread's OpenMP and MKL counts
    with flush_denormals(), torch.no_grad():  # grad mode is per thread
        fn(*args)


class _HostRecurrence(torch.autograd.Function):
    """The recurrence on the CPU: per step one ``h W_hh^T`` GEMM into the step's slots of the
    ``(E, 4H)`` gate buffer, then one fused numba kernel for the whole cell; each part of the
    layout (a disjoint set of rows) runs on its own thread. Keeps the activated gates, every
    slot's ``c`` and incoming ``h`` (``6 E H`` floats). Backward turns the gates into their
    gradients in place, step by step in reverse, then takes ``W_hh``'s gradient as one GEMM over
    all slots and the projections' as one deterministic sum per source column."""

    @staticmethod
    def forward(ctx, proj, w_hh, lay, num_rows):
        hid = w_hh.shape[1]
        gates, hs, cs = lay.buffers(hid, proj)
        out = proj.new_zeros(num_rows, hid)
        proj = proj.contiguous()
        w_t = w_hh.t()
        g_np, p_np, cs_np, hs_np, out_np = gates.numpy(), proj.detach().numpy(), cs.numpy(), hs.numpy(), out.numpy()

        def run(part: _Part) -> None:
            ptr, batch = part.ptr, part.batch
            hs[ptr[0] : ptr[0] + batch[0]] = 0.0  # no h before the first step (W_hh's gradient reads it)
            for t, (b, nb) in enumerate(_steps(batch)):
                a, prev = ptr[t], ptr[t - 1] if t else -1
                if t:
                    torch.mm(hs[a : a + b], w_t, out=gates[a : a + b])
                kernels.step_forward(
                    g_np, p_np, lay.steps, cs_np, hs_np, out_np, lay.order, a, prev, ptr[t + 1], b, nb, part.roff
                )

        _in_parts(lay, run)
        if not any(ctx.needs_input_grad[:2]):  # no backward will read them
            lay.give_back((gates, hs, cs))
        ctx.save_for_backward(gates, hs, cs, w_hh)
        ctx.lay, ctx.num_cols, ctx.done = lay, proj.shape[0], False
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        gates, hs, cs, w_hh = ctx.saved_tensors
        if ctx.done:
            raise RuntimeError("the LSTM aggregation's backward turns its saved gates into gradients: it runs once")
        ctx.done = True
        lay, hid = ctx.lay, w_hh.shape[1]
        dout = dout.contiguous()
        g_np, cs_np, dout_np = gates.numpy(), cs.numpy(), dout.numpy()

        def run(part: _Part) -> None:
            ptr, batch = part.ptr, part.batch
            dh, dc = gates.new_empty(batch[0], hid), gates.new_zeros(batch[0], hid)
            dh_np, dc_np = dh.numpy(), dc.numpy()
            for t, (b, nb) in reversed(list(enumerate(_steps(batch)))):
                a = ptr[t]
                kernels.step_backward(
                    g_np, cs_np, dh_np, dc_np, dout_np, lay.order, a, ptr[t - 1] if t else -1, b, nb, part.roff
                )
                if t:
                    torch.mm(gates[a : a + b], w_hh, out=dh[:b])

        _in_parts(lay, run)
        with torch.no_grad():
            dw = gates.t().mm(hs) if ctx.needs_input_grad[1] else None
            dproj = None
            if ctx.needs_input_grad[0]:
                dproj = gates.new_empty(ctx.num_cols, gates.shape[1])
                threads = torch.get_num_threads()
                sync_numba_threads()  # its first call starts numba's pool, which resets torch's count
                torch.set_num_threads(threads)
                kernels.sum_by_source(g_np, lay.by_src, lay.src_ptr, dproj.numpy())
        lay.give_back((gates, hs, cs))
        return dproj, dw, None, None
