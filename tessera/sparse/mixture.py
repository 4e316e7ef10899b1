"""MixGCN's mixture of accelerators for one layer (§3.2, with its fine-grained pipeline §3.2.2):
``update(diag(s) A h, h)`` with the sparse product on the host's CPU kernels and the row-wise
dense update on another device.

The rows are cut into fixed *tiles*, the unit of arithmetic: each tile is aggregated by its own
row block of ``A``, updated by its own call of ``update``, and the update's weight gradients are
summed tile by tile in tile order. *Stages* group consecutive tiles into the unit of transfer: the
CPU aggregates a stage's tiles into a pinned host buffer, one non-blocking copy takes them to the
device on the host-to-device stream, and the device updates them on its own stream while the CPU
aggregates the next stage (kernel launches return at once); the updated rows come back on the
device-to-host stream when the next layer aggregates on the host. In backward the device runs
each tile's update backward while the gradient of the stage before travels to the host; the
transposed product needs every row's gradient (any vertex may feed any row), so the CPU starts it
once the last stage has arrived. Since tiles, not stages, fix the arithmetic, every stage count
gives the same bits. With the device being the CPU the same code runs, copies and streams being
no-ops, which is how the suite tests its exactness and ordering."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.sparse.operand import Operand

#: the tiles a layer's rows are cut into when the caller names none: the most stages a plan may use
DEFAULT_TILES = 8

Update = Callable[..., torch.Tensor]  # update(z, root_or_None, *params) -> rows of the output


@dataclass(frozen=True)
class MixturePlan:
    """Where and in what pieces a layer's two halves run: ``tiles`` are row ranges (the unit of
    arithmetic), ``stages`` ranges of tile indices (the unit of transfer), ``device`` the one that
    runs the updates (the aggregation runs on the host)."""

    tiles: tuple[tuple[int, int], ...]
    stages: tuple[tuple[int, int], ...]
    device: torch.device
    _streams: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)
    _pinned: dict[tuple, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_rows(self) -> int:
        """The rows the tiles cover."""
        return self.tiles[-1][1] if self.tiles else 0

    def stage_rows(self, s: int) -> tuple[int, int]:
        """The row range of stage ``s``."""
        a, b = self.stages[s]
        return self.tiles[a][0], self.tiles[b - 1][1]

    @property
    def on_cuda(self) -> bool:
        """Whether the updates run on a CUDA device (copies and streams are then real)."""
        return self.device.type == "cuda"

    def stream(self, name: str) -> Any:
        """This plan's CUDA stream ``name`` (one per copy direction), made on first use."""
        if name not in self._streams:
            self._streams[name] = torch.cuda.Stream(self.device)
        return self._streams[name]

    def host_buffer(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A host buffer kept per (key, shape, dtype), pinned when the device is a GPU (so copies
        from and to it are asynchronous); reused across steps, never returned to a caller."""
        k = (key, shape, dtype)
        buf = self._pinned.get(k)
        if buf is None:
            buf = self._pinned[k] = torch.empty(shape, dtype=dtype, pin_memory=self.on_cuda)
        return buf


def mixture_plan(num_rows: int, stages: int, device: torch.device | str, tiles: int | None = None) -> MixturePlan:
    """Rows ``0..num_rows`` in ``tiles`` (default :data:`DEFAULT_TILES`, at least ``stages``)
    near-equal tiles grouped into ``stages`` near-equal stages, updates on ``device``."""
    if stages < 1:
        raise ValueError(f"a mixture pipeline needs at least one stage, got {stages}")
    t = max(tiles or DEFAULT_TILES, stages)
    t = max(1, min(t, num_rows))  # no empty tiles
    stages = min(stages, t)
    bounds = [round(i * num_rows / t) for i in range(t + 1)]
    groups = [round(i * t / stages) for i in range(stages + 1)]
    return MixturePlan(tuple(zip(bounds[:-1], bounds[1:])), tuple(zip(groups[:-1], groups[1:])), torch.device(device))


@dataclass(frozen=True)
class HostAggregation:
    """A layer's aggregation as the host computes it: ``operand`` (rows = outputs), its row tiles
    (``operand.rows_of`` of each tile's rows, kept), and an optional per-row scale (a mean's
    ``1 / in_degree``)."""

    operand: Operand
    tiles: tuple[Operand, ...]
    row_scale: torch.Tensor | None = None


def host_aggregation(operand: Operand, plan: MixturePlan, row_scale: torch.Tensor | None = None) -> HostAggregation:
    """``operand`` cut into ``plan``'s row tiles (an operand that cannot select rows is refused)."""
    tiles = []
    for lo, hi in plan.tiles:
        t = operand.rows_of(torch.arange(lo, hi))
        if t is None:
            raise ValueError(f"{type(operand).__name__} cannot select rows; the mixture needs a host operand")
        tiles.append(t)
    return HostAggregation(operand, tuple(tiles), row_scale)


@dataclass
class _Call:
    agg: HostAggregation
    update: Update
    plan: MixturePlan
    root: bool  # update reads the input's rows besides the aggregate
    out_on_device: bool  # else the output comes back to the host
    build: bool  # record the updates for backward


def _event(plan: MixturePlan, stream: Any = None) -> Any:
    if not plan.on_cuda:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def _wait(plan: MixturePlan, ev: Any, stream: Any = None) -> None:
    if ev is not None:
        (stream or torch.cuda.current_stream(plan.device)).wait_event(ev)


def _to_device(plan: MixturePlan, host: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """``host`` on the plan's device, copied on the host-to-device stream; returns it and the event
    the computing stream must wait for (None where the device is the CPU: a plain copy, as the
    host buffer is reused)."""
    if not plan.on_cuda:
        return host.to(plan.device, copy=True), None
    stream = plan.stream("h2d")
    with torch.cuda.stream(stream):
        dev = host.to(plan.device, non_blocking=True)
    dev.record_stream(torch.cuda.current_stream(plan.device))
    return dev, _event(plan, stream)


def _to_host(plan: MixturePlan, dev: torch.Tensor, host: torch.Tensor) -> Any:
    """Copy ``dev`` into ``host`` on the device-to-host stream once the computing stream has made
    it; returns the event that says it has arrived (None on the CPU, where it is done)."""
    if not plan.on_cuda:
        host.copy_(dev)
        return None
    made = _event(plan)
    stream = plan.stream("d2h")
    _wait(plan, made, stream)
    with torch.cuda.stream(stream):
        host.copy_(dev, non_blocking=True)
    dev.record_stream(stream)
    return _event(plan, stream)


def _arrived(events: list[Any]) -> None:
    for ev in events:
        if ev is not None:
            ev.synchronize()


class _AggregateUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, call: _Call, h: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        agg, plan = call.agg, call.plan
        n, f = plan.num_rows, h.shape[1]
        z_host = plan.host_buffer("z", (n, f), h.dtype)
        records: list[tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]] = []
        pieces: list[torch.Tensor] = []
        out_host: torch.Tensor | None = None
        back: list[Any] = []
        for s in range(len(plan.stages)):
            a, b = plan.stages[s]
            lo, hi = plan.stage_rows(s)
            for t in range(a, b):
                tlo, thi = plan.tiles[t]
                z = z_host[tlo:thi]
                z.copy_(agg.tiles[t].spmm(h))
                if agg.row_scale is not None:
                    z.mul_(agg.row_scale[tlo:thi].view(-1, 1))
            z_dev, ready = _to_device(plan, z_host[lo:hi])
            r_dev = None
            if call.root:
                r_dev, r_ready = _to_device(plan, h[lo:hi])
                _wait(plan, r_ready)
            _wait(plan, ready)
            outs = []
            for t in range(a, b):
                tlo, thi = plan.tiles[t]
                zt = z_dev[tlo - lo : thi - lo]
                rt = None if r_dev is None else r_dev[tlo - lo : thi - lo]
                if call.build:
                    zt = zt.detach().requires_grad_()
                    rt = None if rt is None else rt.detach().requires_grad_()
                    with torch.enable_grad():
                        yt = call.update(zt, rt, *params)
                    records.append((zt, rt, yt))
                else:
                    yt = call.update(zt, rt, *params)
                outs.append(yt.detach())
            y = outs[0] if len(outs) == 1 else torch.cat(outs)
            if call.out_on_device:
                pieces.append(y)
            else:
                if out_host is None:
                    out_host = torch.empty((n, y.shape[1]), dtype=y.dtype)
                back.append(_to_host(plan, y, out_host[lo:hi]))
        ctx.call, ctx.records, ctx.params = call, records, params
        if call.out_on_device:
            return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        _arrived(back)
        assert out_host is not None
        return out_host

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> tuple[Any, ...]:  # type: ignore[override]
        call: _Call = ctx.call
        agg, plan, records = call.agg, call.plan, ctx.records
        n = plan.num_rows
        width = records[0][0].shape[1]
        dz_host = plan.host_buffer("dz", (n, width), g.dtype)
        dr_host = torch.empty((n, width), dtype=g.dtype) if call.root else None
        grads: list[torch.Tensor | None] | None = None
        arrived: list[Any] = []
        for s in range(len(plan.stages)):
            a, b = plan.stages[s]
            lo, hi = plan.stage_rows(s)
            if g.device == plan.device:
                g_dev = g[lo:hi]
            else:
                g_dev, ready = _to_device(plan, g[lo:hi])
                _wait(plan, ready)
            dzs, drs = [], []
            for t in range(a, b):
                tlo, thi = plan.tiles[t]
                zt, rt, yt = records[t]
                inputs = [zt] + ([rt] if rt is not None else []) + list(ctx.params)
                # the gradient of <y, g> is g itself: a scalar root keeps autograd from importing
                # sympy to check a gradient's shape (0.9 s on a first call)
                with torch.enable_grad():
                    dot = (yt * g_dev[tlo - lo : thi - lo]).sum()
                got = torch.autograd.grad(dot, inputs, allow_unused=True)
                dzs.append(got[0])
                k = 1
                if rt is not None:
                    drs.append(got[1])
                    k = 2
                tile_params = got[k:]
                if grads is None:
                    grads = [None if d is None else d.clone() for d in tile_params]
                else:
                    for i, d in enumerate(tile_params):
                        acc = grads[i]
                        if d is not None:
                            grads[i] = d.clone() if acc is None else acc.add_(d)
            arrived.append(_to_host(plan, dzs[0] if len(dzs) == 1 else torch.cat(dzs), dz_host[lo:hi]))
            if dr_host is not None:
                arrived.append(_to_host(plan, drs[0] if len(drs) == 1 else torch.cat(drs), dr_host[lo:hi]))
        _arrived(arrived)
        dh = None
        if ctx.needs_input_grad[1]:
            dz = dz_host if agg.row_scale is None else dz_host * agg.row_scale.view(-1, 1)
            dh = agg.operand.spmm_t(dz)
            if dr_host is not None:
                dh = dh + dr_host
        assert grads is not None
        return (None, dh, *grads)


def aggregate_update(
    h: torch.Tensor,
    agg: HostAggregation,
    update: Update,
    params: Sequence[torch.Tensor],
    plan: MixturePlan,
    *,
    root: bool = False,
    out_on_device: bool = False,
) -> torch.Tensor:
    """``update(diag(s) A h, h, *params)`` row by row (``h`` on the host; ``h`` itself is passed
    only when ``root``), the product on the host and ``update`` on ``plan.device``, pipelined as
    the module says. ``update`` must be row-wise (row ``i`` of its output reads only row ``i`` of
    its inputs). The output is on ``plan.device`` when ``out_on_device``, else on the host."""
    if h.device.type != "cpu":
        raise ValueError(f"the mixture aggregates on the host: h is on {h.device}")
    build = torch.is_grad_enabled() and (h.requires_grad or any(p.requires_grad for p in params))
    call = _Call(agg, update, plan, root, out_on_device, build)
    return _AggregateUpdate.apply(call, h, *params)
