"""Each layer's modelled optimum, with every candidate's communication from the simulator's blocks.

:mod:`tessera.planner.candidates` models a candidate's communication from the context's pair
rows and per-group shortcuts. Here it is derived apart, from the blocks the simulator counts
bytes from (and so the bytes the runtime logs), over all P ranks of ``simulate_volumes``' row
split: partition, its mode's pair rows (transposed backward); tensor, ``exchange_blocks`` of the
ranks' row counts, per pass (as ``project_tensor``); hybrid, :func:`~tessera.planner.volume.hybrid.hybrid_blocks`
of the row counts and the G-parts' halo rows (transposed backward). Each is at the width and
with the backward exchange the simulator gives the layer (``exchange_layers``: a layer 0 that
aggregates constant raw features at ``--dropout 0`` exchanges nothing), timed by SuperGCN's model
over blocks: per exchange, its slowest sender (:func:`~tessera.planner.model.blocks_sender_s`).
A hybrid exchange's senders are its row groups' (all-to-all) or its column groups' (halo), each
group timed apart, so no P x P matrix is built. With the candidate's other terms (dense,
aggregate, memory: the same rates), a layer's candidate of least total is its modelled optimum,
which the model-only plan must choose (``tessera simulate --plan`` prints whether it does).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from tessera.errors import ConfigError
from tessera.parallel.base import StrategyOptions
from tessera.parallel.hybrid import hybrid_layout
from tessera.parallel.mixed import LayerChoice
from tessera.parallel.tensor import column_bounds, exchange_blocks
from tessera.planner.candidates import Context, partition_work, pipelined_s
from tessera.planner.model import CommModel, blocks_sender_s
from tessera.planner.plan import LayerProbe, Plan, model_layers
from tessera.planner.records import Record
from tessera.planner.volume.common import exchange_layers
from tessera.planner.volume.hybrid import group_halo_rows
from tessera.planner.volume.partition import PartitionVolumes

TOLERANCE = 1e-9  # relative: the same sums in another order


@dataclass(frozen=True)
class SimulatedCandidate(Record):
    """A candidate's modelled communication, its communication from the simulator's blocks, and
    its total with the latter (milliseconds)."""

    label: str
    kind: str
    comm_ms: float
    simulated_comm_ms: float
    simulated_ms: float


@dataclass(frozen=True)
class OptimumLayer(Record):
    """One layer's candidates with simulated communication, and the label and total of the least."""

    layer: int
    optimum: str
    optimum_ms: float
    candidates: tuple[SimulatedCandidate, ...]


@dataclass(frozen=True)
class ChoiceCheck(Record):
    """Whether each layer's choice is its modelled optimum, the optima, and the largest relative
    difference between a candidate's modelled and simulated communication."""

    matches: tuple[bool, ...]
    optimum: tuple[str, ...]
    comm_rel_diff: float


def _slowest(rows: np.ndarray, widths, bits: int, m: CommModel) -> float:
    t = blocks_sender_s(rows, widths, bits, m)
    return float(t.max()) if t.size else 0.0


def _partition_s(sim: _Simulated, o: StrategyOptions, width: int, back: bool) -> float:
    rows = sim.vol.rows[o.remote_agg]
    m = sim.link
    return _slowest(rows, width, o.comm_bits, m) + (_slowest(rows.T, width, o.comm_bits, m) if back else 0.0)


def _tensor_s(sim: _Simulated, o: StrategyOptions, width: int, back: bool) -> float:
    into, *returns = [_slowest(r, w, o.comm_bits, sim.link) for r, w in exchange_blocks(sim.vol.owned, width, o.pipeline_stages)]  # fmt: skip
    aggregate = sim.ctx.rates.aggregate_s(sim.ctx.graph.num_edges, -(-width // sim.world))
    return (1 + back) * (into + pipelined_s(aggregate, returns) - aggregate)  # the planner's overlap


def _hybrid_s(sim: _Simulated, o: StrategyOptions, width: int, back: bool) -> float:
    into, *returns = sim.memo(
        ("a2a", o.groups, width, o.comm_bits, o.pipeline_stages), lambda: _row_groups_s(sim, o, width)
    )
    sub = sim.ctx.grouped(o.groups)
    work = partition_work(sub, o.remote_agg).max()
    aggregate = sim.ctx.rates.aggregate_s(work, int(np.diff(column_bounds(width, o.groups)).max()))
    a2a = into + pipelined_s(aggregate, returns) - aggregate  # the planner's overlap
    halo = sim.halo_rows(o.groups, o.remote_agg)
    # the halo exchange of every column group at once, each at its column slice's width
    slices = {int(w) for w in np.diff(column_bounds(width, o.groups)) if w}
    total = 0.0
    for rows in (halo, halo.T) if back else (halo,):
        total += a2a + max((_slowest(rows, w, o.comm_bits, sim.link) for w in slices), default=0.0)
    return total


def _row_groups_s(sim: _Simulated, o: StrategyOptions, width: int) -> list[float]:
    """Every row group's all-to-alls at once, one after another: each the slowest sender of all
    groups (groups of the same row counts send the same), in order."""
    groups = np.unique(sim.vol.owned[hybrid_layout(sim.world, o.groups)], axis=0)
    per = [
        [_slowest(r, w, o.comm_bits, sim.link) for r, w in exchange_blocks(c, width, o.pipeline_stages)] for c in groups
    ]
    return np.max(per, axis=0).tolist()


#: strategy -> its candidates' communication seconds from the simulator's blocks
SIMULATED: dict[str, Callable[[_Simulated, StrategyOptions, int, bool], float]] = {
    "partition": _partition_s,
    "tensor": _tensor_s,
    "hybrid": _hybrid_s,
}


class _Simulated:
    """The simulator's row split, pair rows and row counts for one world size, and the G-parts'
    halo rows of each hybrid M (computed on first use)."""

    def __init__(self, ctx: Context, vol: PartitionVolumes) -> None:
        self.ctx, self.vol, self.world, self.link = ctx, vol, int(vol.parts), ctx.rates.comm()
        self._memo: dict[tuple, Any] = {}

    def halo_rows(self, groups: int, mode: str) -> np.ndarray:
        """Rows G-part ``g`` sends G-part ``h`` per halo exchange of hybrid(``groups``) in ``mode``."""
        every_mode = self.memo(
            ("halo", groups), lambda: group_halo_rows(self.ctx.graph, self.vol.part, self.world, groups)
        )
        return every_mode[mode]

    def memo(self, key: tuple, make: Callable[[], Any]) -> Any:
        """``make()``, computed once per ``key``."""
        if key not in self._memo:
            self._memo[key] = make()
        return self._memo[key]


def simulated_comm_s(sim: _Simulated, choice: LayerChoice, width: int, back: bool) -> float:
    """Seconds of one training step's exchanges of a layer under ``choice`` at exchange
    ``width`` (0: none), backward too where ``back``, from the simulator's blocks."""
    if not width:
        return 0.0
    if choice.strategy not in SIMULATED:
        raise ConfigError(f"no simulated communication for strategy {choice.strategy!r}")
    return SIMULATED[choice.strategy](sim, choice.options(sim.ctx.options), width, back)


def optimum_layers(ctx: Context, probe: LayerProbe, vol: PartitionVolumes) -> list[OptimumLayer]:
    """Per layer, every candidate the planner models (:func:`~tessera.planner.plan.model_layers`)
    with its modelled and its simulated communication and total (milliseconds), and the label of
    the least simulated total (``optimum``). ``vol`` is ``simulate_volumes``' result for
    ``ctx``'s graph, world size and row split, every ``--remote-agg`` mode simulated; its norm,
    label propagation and dropout give each layer's exchange width and backward exchange."""
    if vol.parts != ctx.world or not np.array_equal(vol.part, ctx.part):
        raise ConfigError("the simulated volumes are of another row split than the planner's")
    sim = _Simulated(ctx, vol)
    natural = [probe.spec(i, places[0]) for i, places in enumerate(probe.placements)]
    out = []
    for i, cands in enumerate(model_layers(ctx, probe)):
        places = probe.placements[i]
        exchange = {}
        for p in places:
            specs = [*natural[:i], probe.spec(i, p), *natural[i + 1 :]]
            exchange[p] = exchange_layers(specs, vol.norm, vol.label_prop, vol.dropout)[i]
        rows = []
        for c in cands:
            choice = c.choice
            width, back = exchange[places[0] if choice.aggregate_first is None else choice.aggregate_first]
            comm = float(simulated_comm_s(sim, choice, width, back))
            rows.append(
                SimulatedCandidate(
                    label=c.label,
                    kind=c.kind,
                    comm_ms=1e3 * c.model_s.comm,
                    simulated_comm_ms=1e3 * comm,
                    simulated_ms=1e3 * (c.modelled_s - c.model_s.comm + comm),
                )
            )
        best = min(rows, key=lambda r: r.simulated_ms)
        out.append(OptimumLayer(i, best.label, best.simulated_ms, tuple(rows)))
    return out


def check_choices(plan: Plan, optimum: list[OptimumLayer]) -> ChoiceCheck:
    """Whether each of ``plan``'s layer choices is its layer's modelled optimum (of least simulated
    total, ties within :data:`TOLERANCE` counting as equal), and the largest relative difference
    between a candidate's modelled and simulated communication."""
    matches, worst = [], 0.0
    for choice, layer in zip(plan.choices, optimum, strict=True):
        by_label = {c.label: c for c in layer.candidates}
        matches.append(bool(by_label[choice].simulated_ms <= layer.optimum_ms * (1 + TOLERANCE)))
        for c in layer.candidates:
            scale = max(abs(c.simulated_comm_ms), abs(c.comm_ms), 1e-300)
            worst = max(worst, abs(c.comm_ms - c.simulated_comm_ms) / scale)
    return ChoiceCheck(tuple(matches), tuple(la.optimum for la in optimum), float(worst))
