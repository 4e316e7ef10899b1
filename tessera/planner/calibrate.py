"""The machine constants the planner's cost model runs on, measured where the job runs.

Every rank measures at once, as they compute during training (sharing the cores), and each
constant is the slowest rank's: the aggregation cost per edge and per edge-value (forward and
transposed products at two widths on this rank's share of the graph's rows, by default the
narrowest and widest the model aggregates at), the dense transform's FLOP rate, the cost of
writing one value of a freshly allocated tensor (under glibc's allocator a large block comes
back from the OS on every allocation, so its first write page-faults and costs several times an
in-place write: docs/design/planner-calibration.md), the latency and
bandwidth of an ``all_to_all`` among the ranks (SuperGCN Eq. 2's ``L`` and ``BW``; where the ranks
sit on several hosts and some host holds more than one, apart for pairs on one host and for a
host's shared link to the others: :func:`measure_links`), and the
streaming-read bandwidth of the last-level cache and of main memory (NeutronAscend Alg. 1's
fast and slow memory, whose ratio is its ``r``): a sum over a buffer that fits the rank's share of
the cache, read repeatedly, against one over a buffer four times the cache. On CPU ranks the
cache is the largest data cache ``/sys/devices/system/cpu/cpu0/cache`` lists, and the ranks on one
host share it; on a CUDA device it is the device's L2 (against HBM; that path is untested). Where
the size cannot be read, both bandwidths are 0 and ``r`` is 1: no reuse is modelled.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

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
    """Seconds per aggregated edge and per edge-value, dense FLOP/s, the link model, seconds per
    value written into a fresh tensor, and the streaming-read bandwidths (GB/s) of the
    last-level cache and of main memory (0: not measured)."""

    edge_s: float
    value_s: float
    gemm_flops: float
    bandwidth_gbps: float
    latency_us: float
    fresh_value_s: float = 0.0
    cache_gbps: float = 0.0
    dram_gbps: float = 0.0
    hosts: tuple[int, ...] = ()  # each rank's host; empty: one link for all pairs
    inter_gbps: float = 0.0  # a host's shared link to the other hosts (0: not measured apart)
    inter_latency_us: float = 0.0

    def comm(self) -> CommModel:
        """SuperGCN's model with these links."""
        return CommModel(
            self.bandwidth_gbps,
            self.latency_us,
            DEFAULT_QUANT_GBPS,
            tuple(self.hosts),
            self.inter_gbps,
            self.inter_latency_us,
        )

    def aggregate_s(self, edges: float, width: int) -> float:
        """Seconds to aggregate ``edges`` edges at ``width``."""
        return edges * (self.edge_s + self.value_s * width)

    @property
    def cache_ratio(self) -> float:
        """Algorithm 1's ``r``: the cache's bandwidth over main memory's (1 when not measured)."""
        if not (self.cache_gbps > 0 and self.dram_gbps > 0):
            return 1.0
        # a cache read slower than main memory is a measurement disturbed by other work: no reuse
        return max(self.cache_gbps / self.dram_gbps, 1.0)

    def memory_read_s(self, nbytes: float) -> float:
        """Seconds to stream ``nbytes`` from main memory (0 when not measured)."""
        return nbytes / (self.dram_gbps * 1e9) if self.dram_gbps > 0 else 0.0


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


_CPU_CACHES = Path("/sys/devices/system/cpu/cpu0/cache")
_SIZE_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def last_level_cache_bytes(device: torch.device | None = None) -> int:
    """Bytes of the last-level cache ranks on ``device`` read through: a CUDA device's L2, else
    the highest-level data or unified cache of CPU 0 in sysfs (0 when it cannot be read)."""
    if device is not None and device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).L2_cache_size)
    best_level, size = -1, 0
    try:
        for entry in _CPU_CACHES.glob("index*"):
            if (entry / "type").read_text().strip() not in ("Data", "Unified"):
                continue
            level, text = int((entry / "level").read_text()), (entry / "size").read_text().strip()
            scale = _SIZE_UNITS.get(text[-1:], 1)
            value = int(text[:-1] if text[-1:] in _SIZE_UNITS else text) * scale
            if level > best_level:
                best_level, size = level, value
    except (OSError, ValueError):
        return 0
    return size


def measure_memory(
    comm: Comm | None = None, sharing: int = 1, device: torch.device | None = None
) -> tuple[float, float]:
    """``(cache GB/s, main memory GB/s)`` of streaming reads on this rank (the slowest rank's,
    all ranks of ``comm`` measuring at once): a sum over a buffer of a quarter of the cache's
    share of each of ``sharing`` ranks, read until it has moved as many bytes as one sum over a
    buffer four times the cache (at most 128 MiB, at least twice the cache), on this rank's
    threads. ``(0, 0)`` when the cache's size is
    unknown."""
    llc = last_level_cache_bytes(device)
    if llc <= 0:
        return 0.0, 0.0
    dev = device or torch.device("cpu")
    small_n = max(llc // (4 * max(sharing, 1)) // 4, 1024)
    # four times the cache (at least twice it, at most 128 MiB): a transient allocation at set-up
    large_n = max(2 * llc, min(4 * llc, 1 << 27)) // 4
    reps = max(large_n // small_n, 1)
    # one reduction over a stride-0 view reads the small buffer ``reps`` times without a call per read
    small = torch.full((small_n,), 0.5, device=dev).expand(reps, small_n)
    large = torch.full((large_n,), 0.5, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)

    def read_small() -> None:
        small.sum()
        sync()

    def read_large() -> None:
        large.sum()
        sync()

    cache = 4.0 * small_n * reps / _best(read_small, comm)
    dram = 4.0 * large_n / _best(read_large, comm)
    return cache / 1e9, dram / 1e9


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


def two_links(hosts: list[int]) -> bool:
    """Whether ranks on ``hosts`` have two kinds of pairs: on one host, and across hosts."""
    return 1 < len(set(hosts)) < len(hosts)


def measure_links(comm: Comm, hosts: list[int], values: int = 1 << 20) -> tuple[float, float, float, float]:
    """``(bandwidth GB/s, latency us, inter-host bandwidth GB/s, inter-host latency us)``: with
    :func:`two_links`, an ``all_to_all`` among each rank's peers on its host, then one among its
    peers on other hosts, each with one value and ``values`` values per peer; the inter-host
    bandwidth is per host (the bytes all its ranks send off it over the time: one shared link).
    Otherwise one ``all_to_all`` among all ranks (:func:`measure_link`) and zeros."""
    if not two_links(hosts):
        return (*measure_link(comm, values), 0.0, 0.0)
    me, p = comm.rank, comm.world
    on_host = [hosts[q] == hosts[me] for q in range(p)]

    def a2a(n: int, local: bool) -> Callable[[], None]:
        splits = [n if q != me and on_host[q] == local else 0 for q in range(p)]  # symmetric: send = receive
        src = torch.ones(sum(splits), device=comm.device)
        dst = torch.empty(sum(splits), device=comm.device)
        return lambda: dist.all_to_all_single(dst, src, splits, splits, group=comm.group)

    sizes = [hosts.count(h) for h in range(max(hosts) + 1)]
    local_peers = max(sizes) - 1
    remote_peers = max(p - n for n in sizes)
    leaving = max(n * (p - n) for n in sizes)  # values per message leaving the busiest host
    latency = _best(a2a(1, True), comm) / local_peers
    bandwidth = 4.0 * values * local_peers / _best(a2a(values, True), comm)
    inter_latency = _best(a2a(1, False), comm) / remote_peers
    inter_bandwidth = 4.0 * values * leaving / _best(a2a(values, False), comm)
    return bandwidth / 1e9, latency * 1e6, inter_bandwidth / 1e9, inter_latency * 1e6


def calibrate(
    graph: Graph, comm: Comm, backend: str = "auto", widths: tuple[int, int] = _WIDTHS, hosts: list[int] | None = None
) -> Rates:
    """Every constant of :class:`Rates`, measured on all ranks of ``comm`` (a collective), the
    aggregation's at ``widths``; ``hosts`` (each rank's host, default :meth:`Comm.host_indices`)
    decides whether the links are measured apart (:func:`measure_links`)."""
    edge_s, value_s, gemm, fresh = measure_compute(graph, comm.rank, comm.world, backend, comm, widths)
    hosts = comm.host_indices() if hosts is None else hosts
    bw, lat, inter_bw, inter_lat = measure_links(comm, hosts)
    cache, dram = measure_memory(comm, hosts.count(hosts[comm.rank]), comm.device)  # its host's ranks share a cache
    kept = tuple(hosts) if two_links(hosts) else ()
    return Rates(edge_s, value_s, gemm, bw, lat, fresh, cache, dram, kept, inter_bw, inter_lat)


def local_rates(
    graph: Graph, world: int, link: CommModel, backend: str = "auto", widths: tuple[int, int] = _WIDTHS
) -> Rates:
    """:class:`Rates` without other processes (``tessera plan --model-only``, the simulator): the
    compute and memory constants timed here on rank 0's share of ``graph`` for ``world`` ranks
    (the cache's share of one of ``world`` ranks), the link's from ``link``."""
    edge_s, value_s, gemm, fresh = measure_compute(graph, 0, world, backend, widths=widths)
    cache, dram = measure_memory(sharing=world)
    return Rates(edge_s, value_s, gemm, link.bandwidth_gbps, link.latency_us, fresh, cache, dram)
