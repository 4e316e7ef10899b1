"""The machine constants the planner's cost model runs on, measured where the job runs.

Every rank measures at once, as they compute during training (sharing the cores), and each
constant is the slowest rank's: the aggregation cost per edge and per edge-value (forward and
transposed products at two widths on this rank's share of the graph's rows, by default the
narrowest and widest the model aggregates at), the dense transform's FLOP rate, the cost of
writing one value of a freshly allocated tensor (under glibc's allocator a large block comes
back from the OS on every allocation, so its first write page-faults and costs several times an
in-place write: docs/design/planner-calibration.md), and the latency and
bandwidth of an ``all_to_all`` among the ranks (SuperGCN Eq. 2's ``L`` and ``BW``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from tessera.backends import local_operand, select
from tessera.comm.group import Comm
from tessera.graph import Graph
from tessera.graph.csr import CSRMatrix
from tessera.planner.model import DEFAULT_QUANT_GBPS, CommModel
from tessera.planner.records import Record

_WIDTHS = (8, 64)
# least of 2 after a warm-up: a third repeat costs a noticeable share of calibration, and planning
# must stay a small share of a run (docs/design/planner-calibration.md)
_REPS = 2


@dataclass(frozen=True)
class Rates(Record):
    """Seconds per aggregated edge and per edge-value, dense FLOP/s, the link model, and seconds
    per value written into a fresh tensor."""

    edge_s: float
    value_s: float
    gemm_flops: float
    bandwidth_gbps: float
    latency_us: float
    fresh_value_s: float = 0.0

    def comm(self) -> CommModel:
        """SuperGCN's model with this link."""
        return CommModel(self.bandwidth_gbps, self.latency_us, DEFAULT_QUANT_GBPS)

    def aggregate_s(self, edges: float, width: int) -> float:
        """Seconds to aggregate ``edges`` edges at ``width``."""
        return edges * (self.edge_s + self.value_s * width)


def _best(fn: Callable[[], object], comm: Comm | None = None) -> float:
    """Least of a few timed calls after one warm-up; with ``comm``, the slowest rank's."""
    fn()
    times = []
    for _ in range(_REPS):
        if comm is not None:
            comm.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    t = torch.tensor([min(times)], dtype=torch.float64)
    if comm is not None:
        comm.all_reduce_max(t)
    return float(t[0])


def _rows_block(graph: Graph, world: int, rank: int) -> CSRMatrix:
    """Rank ``rank``'s ``1 / world`` of the graph's rows (by position), all its columns."""
    n = graph.num_nodes
    lo, hi = n * rank // world, n * (rank + 1) // world
    indptr = graph.indptr.numpy()
    sub = indptr[lo : hi + 1] - indptr[lo]
    return CSRMatrix.from_numpy(sub, graph.indices.numpy()[indptr[lo] : indptr[hi]], None, hi - lo, n)


def measure_compute(
    graph: Graph,
    rank: int,
    world: int,
    backend: str = "auto",
    comm: Comm | None = None,
    widths: tuple[int, int] = _WIDTHS,
) -> tuple[float, float, float, float]:
    """``(edge_s, value_s, gemm_flops, fresh_value_s)`` from products on rank ``rank``'s share of
    ``graph`` (the slowest rank's, all ranks of ``comm`` measuring at once): the aggregation's
    rates from the mean of a forward and a transposed product at the two ``widths``."""
    gen = torch.Generator().manual_seed(rank)
    block = _rows_block(graph, world, rank)
    op = local_operand(block, backend)
    edges = max(block.num_edges, 1)
    lo, hi = min(widths), max(widths)
    hi = hi if hi > lo else lo + 8
    t = {}
    # constant inputs: a product's time does not depend on the values, and drawing N x 256
    # random floats on every rank would cost more than the products timed; both widths view
    # the front of one buffer each
    xs, gs = torch.full((graph.num_nodes * hi,), 0.5), torch.full((block.num_rows * hi,), 0.5)
    for w in (lo, hi):
        x = xs[: graph.num_nodes * w].view(graph.num_nodes, w)
        g = gs[: block.num_rows * w].view(block.num_rows, w)
        # the block stands in for the runtime's matrices: a backend trial on it would decide
        # nothing anything reuses, so ``auto`` runs the selection model's favourite
        with select.modelled_only():
            t[w] = (_best(partial(op.spmm, x), comm) + _best(partial(op.spmm_t, g), comm)) / (2 * edges)
    value_s = max((t[hi] - t[lo]) / (hi - lo), 1e-13)
    edge_s = max(t[lo] - value_s * lo, 0.0)
    rows = max(block.num_rows, 256)
    a, b = torch.rand(rows, 128, generator=gen), torch.rand(128, 128, generator=gen)
    gemm = 2.0 * rows * 128 * 128 / _best(lambda: a @ b, comm)
    wide = torch.full((rows, hi), 0.5)  # the size the widest layer allocates per row tensor
    fresh = _best(lambda: wide * 2.0, comm) / wide.numel()
    return edge_s, value_s, gemm, fresh


def measure_link(comm: Comm, values: int = 1 << 20) -> tuple[float, float]:
    """``(bandwidth GB/s, latency us)`` of an ``all_to_all`` among the ranks: a one-value message
    per peer gives the latency, ``values`` fp32 values per peer the bandwidth."""
    p = comm.world
    if p == 1:
        return float("inf"), 0.0

    def a2a(n: int) -> Callable[[], None]:
        src = torch.ones(n * p, device=comm.device)
        dst = torch.empty(n * p, device=comm.device)
        return lambda: dist.all_to_all_single(dst, src, group=comm.group)

    small = _best(a2a(1), comm)
    large = _best(a2a(values), comm)
    latency = small / (p - 1)
    # the whole large exchange's time, latency included: on a loaded machine the small one's time
    # is noise of the same size, and their difference can vanish
    bandwidth = 4.0 * values * (p - 1) / large
    return bandwidth / 1e9, latency * 1e6


def calibrate(graph: Graph, comm: Comm, backend: str = "auto", widths: tuple[int, int] = _WIDTHS) -> Rates:
    """Every constant of :class:`Rates`, measured on all ranks of ``comm`` (a collective), the
    aggregation's at ``widths``."""
    edge_s, value_s, gemm, fresh = measure_compute(graph, comm.rank, comm.world, backend, comm, widths)
    bw, lat = measure_link(comm)
    return Rates(edge_s, value_s, gemm, bw, lat, fresh)


def local_rates(
    graph: Graph, world: int, link: CommModel, backend: str = "auto", widths: tuple[int, int] = _WIDTHS
) -> Rates:
    """:class:`Rates` without other processes (``tessera plan --model-only``, the simulator): the
    compute constants timed here on rank 0's share of ``graph`` for ``world`` ranks, the link's
    from ``link``."""
    edge_s, value_s, gemm, fresh = measure_compute(graph, 0, world, backend, widths=widths)
    return Rates(edge_s, value_s, gemm, link.bandwidth_gbps, link.latency_us, fresh)
