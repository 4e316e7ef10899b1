"""Per-layer strategies: ``--strategy tensor,partition:prepost`` runs each layer under its own.

Every strategy starts and ends a layer on the same row split (:func:`~tessera.parallel.base.row_split`)
and the same local row order, so the layers of one model can switch strategy with no traffic in
between. :class:`MixedStrategy` shards once per distinct sub-strategy, checks that all of them
give this rank the same rows in the same order, and hands each layer the operand of its own
strategy; the byte and time counters of all of them are summed into one log.

An entry is ``NAME[:ARG...][@aggregate-first|@transform-first]``: ``partition`` (the run's
``--remote-agg`` and ``--comm-bits``), ``partition:MODE`` or ``partition:MODE:BITS``, ``tensor``,
``tensor:BITS`` or ``tensor:BITS:STAGES``, ``hybrid`` (the run's ``--groups``), ``hybrid:M``,
``hybrid:M:MODE``, ``hybrid:M:MODE:BITS`` or ``hybrid:M:MODE:BITS:STAGES``, where ``BITS`` is one
width for both directions or the forward and backward exchanges' widths, ``8/32``, and ``STAGES``
the layer's ``--pipeline-stages``. The suffix fixes WiseGraph's operation placement for that layer (which side
of the dense transform aggregates, and so the exchanged width); without it the layer aggregates
the narrower side. A strategy adds its entry syntax with :func:`register_entry`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from tessera.comm.group import Comm
from tessera.comm.wire import COMM_BITS
from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.parallel.base import Shard, Strategy, StrategyOptions
from tessera.sparse import LayerSpec, Operand

PLACEMENTS = {"aggregate-first": True, "transform-first": False}
_MODES = ("post", "pre", "prepost")


def _bits(text: str, entry: str) -> dict[str, int]:
    """``BITS`` (both directions) or ``FORWARD/BACKWARD`` bits as the options they set."""
    widths = text.split("/")
    if len(widths) > 2 or not all(w.isdigit() and int(w) in COMM_BITS for w in widths):
        raise ConfigError(
            f"bits in --strategy entry {entry!r} must be one of {', '.join(map(str, COMM_BITS))}, "
            "or forward/backward bits such as 8/32"
        )
    fwd, bwd = int(widths[0]), int(widths[-1])
    return {"comm_bits": fwd} if fwd == bwd else {"comm_bits": fwd, "grad_bits": bwd}


def bits_text(options: dict[str, Any]) -> str:
    """The ``BITS`` argument of an entry whose options are ``options``: ``8``, or ``8/32`` where the
    backward exchange's width differs."""
    fwd, bwd = options["comm_bits"], options.get("grad_bits")
    return str(fwd) if bwd is None or bwd == fwd else f"{fwd}/{bwd}"


def _partition_args(args: list[str], entry: str) -> dict[str, Any]:
    if len(args) > 2 or (args and args[0] not in _MODES):
        raise ConfigError(
            f"--strategy entry {entry!r}: write partition, partition:MODE or partition:MODE:BITS (MODE post, pre or prepost)"
        )
    out: dict[str, Any] = {"remote_agg": args[0]} if args else {}
    if len(args) == 2:
        out.update(_bits(args[1], entry))
    return out


def _stages(text: str, entry: str) -> dict[str, int]:
    if not text.isdigit() or not 1 <= int(text) <= 1024:
        raise ConfigError(f"pipeline stages in --strategy entry {entry!r} must be a whole number from 1 to 1024")
    return {"pipeline_stages": int(text)}


def _tensor_args(args: list[str], entry: str) -> dict[str, Any]:
    if len(args) > 2:
        raise ConfigError(f"--strategy entry {entry!r}: write tensor, tensor:BITS or tensor:BITS:STAGES")
    out: dict[str, Any] = _bits(args[0], entry) if args else {}
    if len(args) == 2:
        out.update(_stages(args[1], entry))
    return out


def _hybrid_args(args: list[str], entry: str) -> dict[str, Any]:
    if len(args) > 4 or (args and not args[0].isdigit()) or (len(args) > 1 and args[1] not in _MODES):
        raise ConfigError(
            f"--strategy entry {entry!r}: write hybrid, hybrid:M, hybrid:M:MODE, hybrid:M:MODE:BITS or "
            "hybrid:M:MODE:BITS:STAGES (M column groups dividing --nprocs, MODE post, pre or prepost)"
        )
    out: dict[str, Any] = {"groups": int(args[0])} if args else {}
    if len(args) > 1:
        out["remote_agg"] = args[1]
    if len(args) > 2:
        out.update(_bits(args[2], entry))
    if len(args) == 4:
        out.update(_stages(args[3], entry))
    return out


#: strategy name -> (the StrategyOptions fields its entry's ``:`` arguments set, in order; their parser)
ENTRIES: dict[str, tuple[tuple[str, ...], Callable[[list[str], str], dict[str, Any]]]] = {
    "partition": (("remote_agg", "comm_bits"), _partition_args),
    "tensor": (("comm_bits", "pipeline_stages"), _tensor_args),
    "hybrid": (("groups", "remote_agg", "comm_bits", "pipeline_stages"), _hybrid_args),
}


def register_entry(name: str, fields: tuple[str, ...], parse: Callable[[list[str], str], dict[str, Any]]) -> None:
    """Let ``--strategy`` lists name strategy ``name``: ``parse(args, entry)`` returns the
    :class:`StrategyOptions` ``fields`` its arguments set, in that order (or raises ConfigError)."""
    ENTRIES[name] = (fields, parse)


@dataclass(frozen=True)
class LayerChoice:
    """One layer's strategy: its registered name, the options it overrides, and the placement."""

    strategy: str
    overrides: tuple[tuple[str, Any], ...] = ()
    aggregate_first: bool | None = None

    def options(self, base: StrategyOptions) -> StrategyOptions:
        """``base`` with this choice's overrides."""
        return dataclasses.replace(base, **dict(self.overrides))

    def key(self, base: StrategyOptions) -> tuple:
        """What tells sub-strategies apart: the strategy and every option it runs with."""
        return (self.strategy, self.options(base))

    def label(self, base: StrategyOptions) -> str:
        """The entry as ``--strategy`` takes it: the arguments it sets (earlier ones it leaves
        to the run's options filled in from ``base``), then its placement."""
        fields, o = ENTRIES[self.strategy][0], dict(self.overrides)
        given = [i for i, f in enumerate(fields) if f in o or (f == "comm_bits" and "grad_bits" in o)]
        options = dataclasses.asdict(self.options(base))
        args = [bits_text(options) if f == "comm_bits" else str(options[f]) for f in fields[: given[-1] + 1]] if given else []  # fmt: skip
        text = ":".join([self.strategy, *args])
        if self.aggregate_first is not None:
            text += "@" + ("aggregate-first" if self.aggregate_first else "transform-first")
        return text


def parse_entry(entry: str) -> LayerChoice:
    """One ``--strategy`` list entry as a :class:`LayerChoice`."""
    text, _, place = entry.strip().partition("@")
    if place and place not in PLACEMENTS:
        raise ConfigError(
            f"--strategy entry {entry!r}: the placement after @ must be aggregate-first or transform-first"
        )
    name, *args = text.split(":")
    if name not in ENTRIES:
        raise ConfigError(
            f"unknown --strategy entry {entry!r}; each layer's entry is one of "
            f"{', '.join(sorted(ENTRIES))} (e.g. tensor,partition:prepost or partition:post:8)"
        )
    overrides = ENTRIES[name][1](args, entry)
    return LayerChoice(name, tuple(sorted(overrides.items())), PLACEMENTS[place] if place else None)


def parse_strategy(text: str, layers: int | None = None) -> list[LayerChoice] | None:
    """``--strategy``: None for ``auto``, else one :class:`LayerChoice` per layer (a single entry
    serves every layer; a list must name ``layers`` entries)."""
    text = str(text).strip()
    if text == "auto":
        return None
    entries = [e for e in text.split(",")]
    if any(not e.strip() for e in entries):
        raise ConfigError(f"--strategy {text!r} has an empty entry; separate one entry per layer by commas")
    choices = [parse_entry(e) for e in entries]
    if layers is not None and len(choices) not in (1, layers):
        raise ConfigError(
            f"--strategy lists {len(choices)} entries for a model of {layers} layers; "
            f"give one entry per layer or a single entry for all"
        )
    return choices * layers if layers is not None and len(choices) == 1 else choices


class MergedLog:
    """The counters of several strategies' exchanges as one :class:`~tessera.comm.accounting.CommLog`:
    every pass is started on each, and a gather sums theirs (each layer is one strategy's)."""

    def __init__(self, logs: list) -> None:
        self.logs = logs

    def start_forward(self, phase: str) -> None:
        """Start a forward pass on every log."""
        for log in self.logs:
            log.start_forward(phase)

    def gather(self, comm: Comm) -> dict:
        """Every log's :meth:`CommLog.gather` (same order on every rank), padded to the most
        layers and summed."""
        parts = [log.gather(comm) for log in self.logs]
        out: dict[str, list] = {}
        for name in parts[0]:
            tensors = [torch.tensor(p[name]) for p in parts]
            layers = max(t.shape[0] for t in tensors)
            total = torch.zeros((layers, *tensors[0].shape[1:]), dtype=tensors[0].dtype)
            for t in tensors:
                total[: t.shape[0]] += t
            out[name] = total.tolist()
        return out


class StrategyPool:
    """Sub-strategies by :meth:`LayerChoice.key`, each made and sharded once: the planner measures
    with them and the run it plans trains with the same ones."""

    def __init__(self, comm: Comm, options: StrategyOptions) -> None:
        self.comm, self.options = comm, options
        self._made: dict[tuple, Strategy] = {}
        self._shards: dict[tuple, Shard] = {}

    def get(self, choice: LayerChoice) -> Strategy:
        """The strategy of ``choice`` (made on first use)."""
        from tessera.parallel import make_strategy

        key = choice.key(self.options)
        if key not in self._made:
            self._made[key] = make_strategy(choice.strategy, self.comm, choice.options(self.options))
        return self._made[key]

    def shard(self, choice: LayerChoice, graph: Graph) -> Shard:
        """This rank's rows under ``choice``'s strategy (sharded on first use)."""
        key = choice.key(self.options)
        if key not in self._shards:
            self._shards[key] = self.get(choice).shard(graph)
        return self._shards[key]

    def keep(self, choices: list[LayerChoice]) -> None:
        """Drop every strategy but those of ``choices`` (and their memory)."""
        keys = {c.key(self.options) for c in choices}
        for d in (self._made, self._shards):
            for k in [k for k in d if k not in keys]:
                del d[k]


class MixedStrategy(Strategy):
    """Each layer under its own strategy (a :class:`LayerChoice` per layer), on one row split;
    ``pool`` may hold sub-strategies already sharded (the planner's)."""

    name = "mixed"

    def __init__(
        self, comm: Comm, options: StrategyOptions, choices: list[LayerChoice], pool: StrategyPool | None = None
    ) -> None:
        super().__init__(comm, options)
        self.choices = list(choices)
        self.pool = pool or StrategyPool(comm, options)

    def check(self, specs: list[LayerSpec]) -> None:
        if len(specs) != len(self.choices):
            raise ConfigError(f"--strategy names {len(self.choices)} layers but the model has {len(specs)}")
        for choice, spec in zip(self.choices, specs):
            self.pool.get(choice).check([spec])

    def shard(self, graph: Graph) -> Shard:
        distinct = list(dict.fromkeys(LayerChoice(c.strategy, c.overrides) for c in self.choices))
        shards = [self.pool.shard(c, graph) for c in distinct]
        for s in shards[1:]:
            if not torch.equal(s.ids, shards[0].ids):
                raise RuntimeError("sub-strategies disagree on this rank's rows; every strategy must use row_split")
        logs = [self.pool.get(c).log for c in distinct]
        # read by the training loop as a CommLog is, through start_forward and gather only
        self.log = MergedLog([log for log in logs if log is not None])  # type: ignore[assignment]
        return shards[0]

    def operand(self, spec: LayerSpec, layer: int) -> Operand:
        return self.pool.get(self.choices[layer]).operand(spec, layer)


def make_layer_strategy(
    comm: Comm, options: StrategyOptions, choices: list[LayerChoice], pool: StrategyPool | None = None
) -> Strategy:
    """One strategy for ``choices``: the plain registered one when every layer uses the same
    strategy and options and nothing is sharded yet, else a :class:`MixedStrategy`."""
    first = choices[0]
    if pool is None and all(c.key(options) == first.key(options) for c in choices):
        return StrategyPool(comm, options).get(first)
    return MixedStrategy(comm, options, choices, pool)
