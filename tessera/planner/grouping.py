"""How many tensor-parallel groups M a layer splits its P workers into (NeutronAscend §5.3).

:func:`algorithm1` is the paper's Algorithm 1 as printed: for ``M`` in ``{1, 2, 4, ..., N}``
dividing ``N``, ``S = D / M``, ``pad = (16 - S mod 16) mod 16``, ``T_idle = pad / S * T_comp``,
``G = N / M``, ``T_saved = T_mem (1 - 1 / (1 + (G - 1)(r - 1)))`` and the cost ``T_idle - T_saved``;
the first ``M`` of least cost wins. With ``T_comp`` and ``T_mem`` the same for every ``M`` it
always returns 1: ``ceil(S / 16) 16 M`` is a whole number at least ``D``, so ``pad / S`` is
smallest at ``M = 1``, where ``G = N`` also saves the most. The paper's garbled sentence after the
formulas suggests ``T_comp(M)`` and ``T_mem(M)`` depend on ``M``, so both may be given per ``M``.

:func:`rank_grouping` carries the trade-off over to ranks (``hybrid(M)``: M column groups of
G = P / M ranks; a halo exchange among the G ranks of a column group at width ``D / M``, and
the row <-> column all-to-all among the M ranks of a row group): per M, padding idle (16 fp32
lanes of an AVX-512 register) + load imbalance (the G-way partition's in-edge balance) + halo
time (SuperGCN Eq. 2 over the exact pair rows) + all-to-all time, for M whose per-rank feature
memory fits ``memory_limit``.

:func:`idle_time` and :func:`saved_time` are Algorithm 1's two terms; the planner's candidates
charge them (:class:`Algorithm1Terms`) with ``T_comp``, ``T_mem`` and ``r`` from measured rates
(:mod:`tessera.planner.candidates`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from tessera.planner.model import CommModel, exchange_time, sender_time
from tessera.planner.records import Record
from tessera.planner.volume.tensor import tensor_exchanges

LANES = 16  # the Cube unit's 16 x 16 tiles in the paper; 16 fp32 lanes of AVX-512 here

Estimate = float | Callable[[int], float]


@dataclass(frozen=True)
class Algorithm1Row(Record):
    """One ``M`` of Algorithm 1: the slice width ``S``, its padding, ``G``, ``T_idle``,
    ``T_saved`` and the cost."""

    M: int
    S: float
    pad: float
    G: float
    T_idle: float
    T_saved: float
    cost: float


@dataclass(frozen=True)
class GroupingRow(Record):
    """One ``M`` of :func:`rank_grouping`: ``G``, the widest slice ``S``, the modelled terms
    (seconds), the per-rank feature memory, whether it fits, and the cost."""

    M: int
    G: int
    S: int
    idle_s: float
    imbalance_s: float
    halo_s: float
    all_to_all_s: float
    memory_bytes: float
    fits: bool
    cost_s: float


def group_counts(n: int) -> list[int]:
    """``{1, 2, 4, ..., N}`` of Algorithm 1: the powers of two up to ``n`` that divide it, and ``n``."""
    out, m = [], 1
    while m <= n:
        if n % m == 0:
            out.append(m)
        m *= 2
    return out if out[-1] == n else [*out, n]


def padding(s: float, lanes: int = LANES) -> float:
    """``(16 - (S mod 16)) mod 16``: the padded columns of a slice of width ``S``."""
    return (lanes - (s % lanes)) % lanes


def idle_time(s: float, t_comp: float, lanes: int = LANES) -> float:
    """``T_idle = pad / S * T_comp``: the compute a slice of width ``S`` spends on padded lanes."""
    return padding(s, lanes) / s * t_comp if s > 0 else 0.0


def saved_time(g: float, r: float, t_mem: float) -> float:
    """``T_saved = T_mem (1 - 1 / (1 + (G - 1)(r - 1)))``: memory time ``G`` sharers of one slice
    save at fast/slow bandwidth ratio ``r``."""
    return t_mem * (1 - 1 / (1 + (g - 1) * (r - 1)))


@dataclass(frozen=True)
class Algorithm1Terms(Record):
    """Algorithm 1's terms of one candidate: ``M`` column groups, the widest slice ``S``, its
    padding, ``G`` ranks per group, the ratio ``r``, ``T_comp``, ``T_mem``, ``T_idle`` and
    ``T_saved`` (the times in the unit their holder names)."""

    M: int
    S: int
    pad: int
    G: int
    r: float
    comp: float
    mem: float
    idle: float
    saved: float

    @classmethod
    def of(cls, m: int, s: int, g: int, r: float, t_comp: float, t_mem: float) -> Algorithm1Terms:
        """The terms of ``M`` = ``m`` groups of ``g`` at slice width ``s``, from ``T_comp`` and ``T_mem``."""
        return cls(m, s, int(padding(s)), g, r, t_comp, t_mem, idle_time(s, t_comp), saved_time(g, r, t_mem))

    def scaled(self, factor: float) -> Algorithm1Terms:
        """The times times ``factor`` (a change of unit)."""
        f = factor
        return replace(self, comp=f * self.comp, mem=f * self.mem, idle=f * self.idle, saved=f * self.saved)


def algorithm1(n: int, d: int, r: float, t_comp: Estimate, t_mem: Estimate) -> tuple[int, list[Algorithm1Row]]:
    """Algorithm 1: ``(M*, rows)`` for ``n`` cores, feature width ``d``, fast/slow memory bandwidth
    ratio ``r`` and the estimates ``t_comp``, ``t_mem`` (numbers, or functions of M); ``rows`` hold
    every candidate's S, pad, G, T_idle, T_saved and cost."""
    best, min_cost, rows = 1, float("inf"), []
    for m in group_counts(n):
        tc = t_comp(m) if callable(t_comp) else t_comp
        tm = t_mem(m) if callable(t_mem) else t_mem
        s = d / m
        pad = padding(s)
        t_idle = idle_time(s, tc)
        g = n / m
        t_saved = saved_time(g, r, tm)
        cost = t_idle - t_saved
        rows.append(Algorithm1Row(m, s, pad, g, t_idle, t_saved, cost))
        if cost < min_cost:
            min_cost, best = cost, m
    return best, rows


def all_to_all_time(counts, width: int, bits: int, comm: CommModel, stages: int = 1) -> float:
    """Modelled seconds of one tensor-parallel aggregation's all-to-alls at ``width`` (to the
    feature split and back) among ranks holding ``counts`` rows: Eq. 2/4 per all-to-all, its
    slowest sender."""
    return sum(all_to_all_times(counts, width, bits, comm, stages))


def all_to_all_times(counts, width: int, bits: int, comm: CommModel, stages: int = 1) -> list[float]:
    """Modelled seconds of each all-to-all of :func:`all_to_all_time`, in order."""
    out = []
    for data, params, values in tensor_exchanges(counts, width, bits, stages):
        t, q = sender_time(data, params, values.sum(axis=1), data.sum(axis=1), bits, comm)
        out.append(float((t + q).max()) if t.size else 0.0)
    return out


def _edges_per_part(indptr: np.ndarray, indices: np.ndarray, part: np.ndarray, parts: int) -> np.ndarray:
    dst_part = np.repeat(part, np.diff(indptr))
    return np.bincount(dst_part, minlength=parts).astype(np.float64)


def rank_grouping(
    indptr: np.ndarray,
    indices: np.ndarray,
    parts_of: Callable[[int], np.ndarray],
    world: int,
    width: int,
    agg_flops: float,
    comm: CommModel,
    bits: int = 32,
    memory_limit: float = float("inf"),
    halo_rows: Callable[[np.ndarray, int], np.ndarray] | None = None,
) -> tuple[int | None, list[GroupingRow]]:
    """The M of least modelled time for one aggregation at ``width`` over ``world`` ranks, and
    every M's terms (seconds): ``idle`` (padding of the widest slice), ``imbalance`` (the busiest
    rank's edges over the mean, at the aggregation rate ``agg_flops``), ``halo`` (Eq. 2/6 over
    the G-way partition ``parts_of(G)``'s prepost pair rows), ``all_to_all`` (row <-> column
    split among the M ranks of a row group, both ways). M whose feature memory per rank (its
    part's rows and halo at width ``S``, its own rows at ``width``, fp32) exceeds ``memory_limit``
    is left out; None when none fits."""
    from tessera.graph.partition.halo import pair_rows

    if halo_rows is None:

        def halo_rows(part: np.ndarray, g: int) -> np.ndarray:
            return pair_rows(indptr, indices, part, g, ("prepost",))["prepost"]

    rows_out = []
    for m in group_counts(world):
        g = world // m
        s = -(-width // m)  # the widest column slice
        part = parts_of(g)
        edges = _edges_per_part(indptr, indices, part, g)
        compute = 2.0 * edges.mean() * s / agg_flops
        idle = padding(s) / s * compute
        imbalance = 2.0 * (edges.max() - edges.mean()) * s / agg_flops
        halo = exchange_time(halo_rows(part, g), s, bits, comm).time_s if g > 1 else 0.0
        counts = np.bincount(part, minlength=g)  # a G-part's rows, split among its M ranks
        row_counts = [int(counts.max()) * (k + 1) // m - int(counts.max()) * k // m for k in range(m)]
        a2a = all_to_all_time(row_counts, width, bits, comm) if m > 1 else 0.0
        recv = halo_rows(part, g).sum(axis=0).max() if g > 1 else 0
        memory = 4.0 * ((counts.max() + recv) * s + counts.max() / m * width)
        cost = idle + imbalance + halo + a2a + compute
        rows_out.append(GroupingRow(m, g, s, idle, imbalance, halo, a2a, memory, bool(memory <= memory_limit), cost))
    fitting = [r for r in rows_out if r.fits]
    return (min(fitting, key=lambda r: r.cost_s).M if fitting else None), rows_out
