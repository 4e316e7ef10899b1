"""Where a one-process run aggregates: on its device beside the update, or on the host's CPU with
the update on the device (MixGCN's mixture of accelerators, §3.2), modelled from measured rates.

Per layer, with ``E`` edges, ``n`` rows, aggregated width ``f``, update ``f_in -> f_out`` and
``S`` stages:

* device only: ``E f / r_dev_agg`` (forward, and again backward) plus the update's GEMMs
  (``2 n f_in f_out`` FLOPs forward, twice that backward) at ``r_gemm``;
* mixture, forward: the CPU aggregation, the copies (``n f`` up, ``n f_out`` down, at the
  host-device bandwidth) and the device GEMM overlap stage by stage, so the step takes the slowest
  of the three plus the others' share of one stage (the pipeline's fill and drain):
  ``max(a, c, u) + (a + c + u - max) / S``;
* mixture, backward: the device's update backward overlaps the gradient's copy to the host the
  same way, and the CPU's transposed product follows once every row has arrived.

The rates are measured on the machine (:func:`measure_rates`): a CPU aggregation, a device
aggregation, a device GEMM and a pinned host-to-device copy of the run's own sizes."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tessera.sparse import Operand, as_operand


@dataclass(frozen=True)
class Rates:
    """Measured throughputs: CPU and device aggregation (edge x column products per second),
    device GEMM (FLOP/s) and host-device copies (bytes per second)."""

    host_aggregation: float
    device_aggregation: float
    device_gemm: float
    link: float


@dataclass(frozen=True)
class LayerShape:
    """What a layer's cost depends on: edges, rows, aggregated width, update widths."""

    edges: int
    rows: int
    aggregated: int
    width_in: int
    width_out: int


@dataclass(frozen=True)
class Choice:
    """The side chosen and the modelled seconds per training step of each."""

    aggregate_on: str  # "device" or "cpu"
    device_s: float
    mixture_s: float
    stages: int


def _pipelined(parts: list[float], stages: int) -> float:
    slowest = max(parts)
    return slowest + (sum(parts) - slowest) / stages


def device_only_time(layers: list[LayerShape], rates: Rates) -> float:
    """Modelled seconds of one training step (forward and backward) with every part on the device."""
    total = 0.0
    for s in layers:
        agg = s.edges * s.aggregated / rates.device_aggregation
        gemm = 2.0 * s.rows * s.width_in * s.width_out / rates.device_gemm
        total += 2 * agg + 3 * gemm
    return total


def mixture_time(layers: list[LayerShape], rates: Rates, stages: int) -> float:
    """Modelled seconds of one training step with aggregations on the CPU and updates on the device."""
    total = 0.0
    for s in layers:
        agg = s.edges * s.aggregated / rates.host_aggregation
        gemm = 2.0 * s.rows * s.width_in * s.width_out / rates.device_gemm
        up = 4.0 * s.rows * s.aggregated / rates.link
        down = 4.0 * s.rows * s.width_out / rates.link
        forward = _pipelined([agg, up + down, gemm], stages)
        backward = _pipelined([2 * gemm, up + down], stages) + agg
        total += forward + backward
    return total


def choose(layers: list[LayerShape], rates: Rates, stages: int) -> Choice:
    """The faster side by the model (the device on a tie: it moves nothing over the link)."""
    dev, mix = device_only_time(layers, rates), mixture_time(layers, rates, stages)
    return Choice("cpu" if mix < dev else "device", dev, mix, stages)


def _seconds(fn: Callable[[], object], sync: Callable[[], None], repeats: int = 3) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_rates(operand: Operand, device_operand: Operand, width: int, device: torch.device) -> Rates:
    """The four rates on this machine, with ``width`` columns: ``operand`` multiplied on the host,
    ``device_operand`` (the same matrix) on ``device``."""
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    host_x = torch.randn(operand.num_cols, width)
    dev_x = host_x.to(device)
    edges = max(int(operand.in_degree().sum()), 1)
    host_s = _seconds(lambda: as_operand(operand).spmm(host_x), lambda: None)
    dev_s = _seconds(lambda: device_operand.spmm(dev_x), sync)
    a = torch.randn(operand.num_rows, width, device=device)
    w = torch.randn(width, width, device=device)
    gemm_s = _seconds(lambda: a @ w, sync)
    pinned = torch.empty(operand.num_rows, width, pin_memory=device.type == "cuda")
    link_s = _seconds(lambda: pinned.to(device, non_blocking=True), sync)
    return Rates(
        host_aggregation=edges * width / max(host_s, 1e-9),
        device_aggregation=edges * width / max(dev_s, 1e-9),
        device_gemm=2.0 * operand.num_rows * width * width / max(gemm_s, 1e-9),
        link=4.0 * operand.num_rows * width / max(link_s, 1e-9),
    )
