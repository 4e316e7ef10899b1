"""Training configuration: defaults, TOML files, and command-line overrides."""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.devices import check_device_setting
from tessera.errors import ConfigError
from tessera.parallel.mixed import parse_strategy
from tessera.relational.plan import split_variant

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class TrainConfig:
    """Every setting of a training run; field names match the CLI flags (``-`` for ``_``)."""

    dataset: str = "synthetic:small"
    name: str | None = None
    split: str | None = None
    model: str = "gcn"
    hidden: int = 64
    layers: int = 2
    dropout: float = 0.5
    heads: int = 8
    lr: float = 0.01
    weight_decay: float = 5e-4
    epochs: int = 200
    patience: int = 100
    seed: int = 0
    threads: int | None = None
    backend: str = "auto"
    device: str = "auto"
    aggregate_on: str = "device"
    mixture_stages: int = 4
    feature_norm: str = "auto"
    out: str | None = None
    resume: bool = False
    overwrite: bool = False
    plot: bool = False
    checkpoint_every: int = 10
    progress: bool = True
    tensorboard: str | None = None
    nprocs: int = 1
    strategy: str = "auto"
    remote_agg: str = "prepost"
    partition: str = "metis"
    parts_dir: str | None = None
    timeout: float = 300.0
    comm_bits: int | str = 32
    pipeline_stages: int | str = 1
    groups: int = 1
    norm: str = "none"
    label_prop: float = 0.0
    reorder: str = "auto"
    s_spmm: bool = False
    num_bases: int | None = None
    num_blocks: int | None = None
    rgcn_variant: str = "auto"
    precision: str = "fp32"
    memory: str = "fast"

    def validate(self) -> TrainConfig:
        """Raise :class:`ConfigError` for mistyped or out-of-range values; returns self."""
        for name in FIELDS:
            v = getattr(self, name)
            if v is not None or not _optional(name):
                setattr(self, name, typed(name, v))
        for name in INT_RANGES:
            if getattr(self, name) is not None and getattr(self, name) != "auto":
                check_range(name, getattr(self, name))
        for name in ("dropout", "lr", "weight_decay", "timeout", "label_prop"):
            if not math.isfinite(getattr(self, name)):
                raise ConfigError(f"--{name.replace('_', '-')} must be a finite number, got {getattr(self, name)}")
        checks = [
            (0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout}"),
            (self.lr > 0, f"--lr must be positive, got {self.lr}"),
            (self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}"),
            (
                self.feature_norm in ("auto", "row", "none"),
                f"--feature-norm must be auto, row or none, got {self.feature_norm!r}",
            ),
            (
                self.remote_agg in ("post", "pre", "prepost"),
                f"--remote-agg must be post, pre or prepost, got {self.remote_agg!r}",
            ),
            (
                self.partition in ("metis", "range", "random"),
                f"--partition must be metis, range or random, got {self.partition!r}",
            ),
            (
                0 < self.timeout <= MAX_TIMEOUT_S,
                f"--timeout must be positive seconds up to {MAX_TIMEOUT_S:,} (a week), got {self.timeout}",
            ),
            (self.comm_bits in (32, 8, 4, 2, "auto"), f"--comm-bits must be 32, 8, 4, 2 or auto, got {self.comm_bits}"),
            (
                self.comm_bits != "auto" or self.nprocs == 1 or parse_strategy(self.strategy, self.layers) is None,
                f"--comm-bits auto lets the planner choose each layer's bits, but --strategy {self.strategy} "
                "fixes the layers: use --strategy auto, or give the bits in the entries (partition:prepost:8/32)",
            ),
            (
                self.pipeline_stages != "auto"
                or self.nprocs == 1
                or parse_strategy(self.strategy, self.layers) is None,
                f"--pipeline-stages auto lets the planner choose each layer's stages, but --strategy {self.strategy} "
                "fixes the layers: use --strategy auto, or give the stages in the entries (tensor:32:4)",
            ),
            (self.norm in ("none", "layer"), f"--norm must be none or layer, got {self.norm!r}"),
            (self.memory in MEMORY_MODES, f"--memory must be {' | '.join(MEMORY_MODES)}, got {self.memory!r}"),
            (0.0 <= self.label_prop < 1.0, f"--label-prop must be in [0, 1), got {self.label_prop}"),
            (
                not (self.resume and self.overwrite),
                "--resume continues the run in the run directory and --overwrite replaces it; give one of them",
            ),
            (
                self.reorder in ("auto", "none", "rcm", "metis", "degree"),
                f"--reorder must be auto, none, rcm, metis or degree, got {self.reorder!r}",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        check_device_setting(self.device)
        check_precision(self)
        check_aggregate_on(self)
        split_variant(self.rgcn_variant)  # a gTask restriction that does not parse fails here
        parse_strategy(self.strategy, self.layers)  # auto, one entry, or one per layer
        if self.strategy == "hybrid" and self.nprocs > 1:
            from tessera.parallel.hybrid import check_groups

            check_groups(self.nprocs, self.groups)
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (JSON- and checkpoint-safe)."""
        return dataclasses.asdict(self)

    def to_toml(self) -> str:
        """The settings as a TOML file ``--config`` reads back: every field but
        :data:`NOT_IN_TOML` and those left unset (None), named like the flags."""
        lines = ["# the settings of this run: `tessera train --config <this file>` trains it again"]
        defaults = TrainConfig()
        for name, value in self.to_dict().items():
            # a strategy's setting at its default is left out: given, it is refused where no layer reads it
            unread = name in STRATEGY_FLAGS and value == getattr(defaults, name)
            unread = unread or (name == "mixture_stages" and self.aggregate_on == "device")
            if name not in NOT_IN_TOML and value is not None and not unread:
                lines.append(f"{name.replace('_', '-')} = {_toml_value(value)}")
        return "\n".join(lines) + "\n"


#: fields ``config.toml`` leaves out: where the run went, and what one command did to it
NOT_IN_TOML = ("out", "resume", "overwrite")


def _toml_value(value: bool | int | float | str) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # a float's repr always has "." or "e": TOML reads it back as a float
    # a basic string: TOML requires escaping quotes, backslashes and control characters (tab aside)
    escaped = "".join(
        "\\" + c if c in '"\\' else f"\\u{ord(c):04x}" if (ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F else c
        for c in value
    )
    return f'"{escaped}"'


PRECISIONS = ("fp32", "bf16")
# bfloat16 storage covers the models whose every op has a bfloat16 kernel, on one process
BF16_MODELS = ("gcn", "sage", "gin", "gat")


def check_precision(cfg: TrainConfig) -> None:
    """Raise :class:`ConfigError` for a ``precision`` that is unknown or not available with the other settings."""
    if cfg.precision not in PRECISIONS:
        raise ConfigError(f"--precision must be fp32 or bf16, got {cfg.precision!r}")
    if cfg.precision == "fp32":
        return
    refusals = [
        (cfg.model not in BF16_MODELS, f"--model {cfg.model}", f"use --model {', '.join(BF16_MODELS)}"),
        (cfg.nprocs > 1, f"--nprocs {cfg.nprocs}", "train on one process (--nprocs 1)"),
        (cfg.norm != "none", f"--norm {cfg.norm}", "use --norm none"),
    ]
    for refused, what, fix in refusals:
        if refused:
            raise ConfigError(f"--precision bf16 is not available with {what}: {fix}, or --precision fp32")


#: the models whose layers split into a host aggregation and a row-wise update (tessera.nn.mixture)
MIXTURE_MODELS = ("gcn", "sage", "gin")


def check_aggregate_on(cfg: TrainConfig) -> None:
    """Raise :class:`ConfigError` for an ``--aggregate-on`` the other settings cannot run."""
    if cfg.aggregate_on not in ("device", "cpu", "auto"):
        raise ConfigError(f"--aggregate-on must be device, cpu or auto, got {cfg.aggregate_on!r}")
    if cfg.aggregate_on == "device":
        return
    refusals = [
        (cfg.nprocs > 1, f"--nprocs {cfg.nprocs}", "train on one process (--nprocs 1)"),
        (cfg.model.lower() not in MIXTURE_MODELS, f"--model {cfg.model}", f"use --model {', '.join(MIXTURE_MODELS)}"),
        (cfg.norm != "none", f"--norm {cfg.norm}", "use --norm none"),
        (cfg.label_prop > 0, "--label-prop", "drop --label-prop"),
        (cfg.precision != "fp32", f"--precision {cfg.precision}", "use --precision fp32"),
        (cfg.s_spmm, "--s-spmm", "drop --s-spmm"),
    ]
    for refused, what, fix in refusals:
        if refused:
            raise ConfigError(f"--aggregate-on {cfg.aggregate_on} is not available with {what}: {fix}")


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}
#: ``--memory``: fast keeps every activation backward reads; lean keeps each hidden layer's input
#: only and runs the layer again in backward; auto is lean when a model of 3+ layers would not fit fast
MEMORY_MODES = ("fast", "lean", "auto")

#: The settings ``--resume`` may change, each with why: they do not change the numbers the run
#: trains (or, for ``epochs``, only extend them). Every other setting changes them and must match
#: the checkpoint's (:data:`NUMBER_SETTINGS`); a setting added later is compared unless listed here.
RESUME_EXEMPT: dict[str, str] = {
    "epochs": "more epochs extend the run (the epochs before are the same)",
    "dataset": "the graph itself is compared, by its fingerprint",
    "name": "the graph itself is compared, by its fingerprint",
    "out": "where the run is written",
    "resume": "what this command does with the run directory",
    "overwrite": "what this command does with the run directory",
    "progress": "display only",
    "plot": "display only",
    "tensorboard": "display only",
    "threads": "speed only",
    "timeout": "how long ranks wait for each other",
    "checkpoint_every": "how often the state is saved: a resumed run equals an uninterrupted one",
    "nprocs": "--nprocs N trains the same model as one process (dropout keyed by global vertex ids)",
    "strategy": "how ranks split the work; the same model",
    "remote_agg": "how ranks split the work; the same model",
    "partition": "how ranks split the work; the same model",
    "parts_dir": "how ranks split the work; the same model",
    "pipeline_stages": "how ranks split the work; the same model (bit-identical stages)",
    "groups": "how ranks split the work; the same model",
    "reorder": "the vertex order in memory; draws are keyed by original ids, outputs in the original order",
    "backend": "which kernel computes the same aggregation",
    "device": "where the same computation runs",
    "aggregate_on": "where the same aggregation runs (MixGCN's mixture trains the same model)",
    "mixture_stages": "how the mixture pipelines the same work (the same bits for any stage count)",
    "s_spmm": "skips only outputs that dropout or ReLU zero anyway: the same values",
    "rgcn_variant": "the same relational sum computed in another order",
    "memory": "lean runs hidden layers again in backward with the same draws: the same values",
}
#: the settings that change the numbers a run trains: a resumed run must have the checkpoint's
NUMBER_SETTINGS = tuple(k for k in FIELDS if k not in RESUME_EXEMPT)
# Integer settings: (lowest, highest, why the bound). The caps keep a typo from asking for absurd
# memory or processes before anything checks it.
INT_RANGES: dict[str, tuple[int, int, str]] = {
    "hidden": (1, 65_536, " (each hidden layer holds vertices x hidden x 4 bytes: 256 GiB at 65,536 on 1M vertices)"),
    "layers": (1, 1024, ""),
    "heads": (1, 256, ""),
    "epochs": (1, 10**9, ""),
    "patience": (0, 10**9, " (0 disables early stopping)"),
    "seed": (0, 2**32 - 1, ""),
    "threads": (1, 1024, ""),
    "checkpoint_every": (1, 10**9, ""),
    "nprocs": (1, 1024, ""),
    "pipeline_stages": (1, 1024, ""),
    "mixture_stages": (1, 64, ""),
    "num_bases": (1, 4096, ""),
    "num_blocks": (1, 4096, ""),
    "groups": (1, 1024, ""),
}


def check_range(name: str, value: int, bounds: tuple[int, int, str] | None = None) -> int:
    """``value`` of the flag ``--name`` if it lies in ``bounds`` (default: the setting's
    :data:`INT_RANGES` entry), else a :class:`ConfigError` naming the range."""
    lo, hi, why = bounds or INT_RANGES[name]
    if not lo <= value <= hi:
        raise ConfigError(f"--{name.replace('_', '-')} must be in [{lo}, {hi}]{why}, got {value}")
    return value


MAX_TIMEOUT_S = 7 * 24 * 3600
MAX_CONFIG_BYTES = 1 << 20
_KINDS = {"int": int, "float": float, "str": str, "bool": bool}
_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}


def _kind(name: str) -> type:
    # Annotations are strings here (postponed evaluation): "int", "str | None", ...
    return _KINDS[str(FIELDS[name].type).split("|")[0].strip()]


def _optional(name: str) -> bool:
    return "None" in str(FIELDS[name].type)


#: integer settings that also take the word ``auto`` (the planner chooses)
AUTO_INTS = ("comm_bits", "pipeline_stages")


def typed(name: str, value: Any, where: str = "") -> Any:
    """``value`` as setting ``name`` holds it (an int for a float setting becomes a float), or a
    ConfigError naming the key, ``where`` it came from and the type it needs."""
    if name in AUTO_INTS and value == "auto":
        return value
    kind = _kind(name)
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        ok, value = True, float(value)
    if not ok:
        what = _KIND_NAMES[kind] + (' or "auto"' if name in AUTO_INTS else "")
        raise ConfigError(f"setting {name!r}{where} must be {what}, got {value!r} ({type(value).__name__})")
    return value


def read_toml(path: str | Path) -> dict[str, Any]:
    """Settings from a TOML file: all at the top level or all in a ``[train]`` table, named like
    the flags and typed like them; anything else is a ConfigError naming the key and the file."""
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"--config {p} is a directory; name a TOML file")
    if p.exists() and not p.is_file():
        raise ConfigError(f"--config {p} is not a regular file; name a TOML file")
    try:
        with open(p, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except OSError as e:
        raise ConfigError(f"cannot read config file {p}: {e.strerror or e}") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {p} is larger than {MAX_CONFIG_BYTES:,} bytes; it cannot be a settings file")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    if "train" in data:
        if not isinstance(data["train"], dict):
            raise ConfigError(f"'train' in {p} must be the [train] table of settings, got {data['train']!r}")
        others = [k for k in data if k != "train"]
        if others:
            raise ConfigError(
                f"{p} has top-level keys ({', '.join(others)}) beside its [train] table; "
                "put every setting in [train] or none"
            )
        data = data["train"]
    out: dict[str, Any] = {}
    for key, value in data.items():
        k = key.replace("-", "_")
        if isinstance(value, dict):
            raise ConfigError(f"{p} has a table [{key}]; settings go at the top level or in one [train] table")
        if k not in FIELDS:
            raise ConfigError(f"unknown setting {key!r} in {p}; known settings: {', '.join(sorted(FIELDS))}")
        out[k] = typed(k, value, f" in {p}")
    return out


def make_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """Defaults, overridden by the file, overridden by flags given on the command line."""
    merged = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
    cfg = TrainConfig()
    for k, v in merged.items():
        if k not in FIELDS:
            raise ConfigError(f"unknown setting {k!r}; known settings: {', '.join(sorted(FIELDS))}")
        setattr(cfg, k, typed(k, v))
    cfg.validate()
    check_strategy_flags(cfg, merged)
    if "mixture_stages" in merged and cfg.aggregate_on == "device":
        raise ConfigError(
            "--mixture-stages pipelines the CPU's aggregation with the device's update; it needs "
            "--aggregate-on cpu or auto"
        )
    return cfg


#: settings only some strategies read, refused where the run's strategies all leave them unread
STRATEGY_FLAGS = ("pipeline_stages", "groups")
#: of those, what ``--strategy auto`` reads: its tensor and hybrid candidates use the run's
#: pipeline stages, but each hybrid candidate names its own M
AUTO_READS = ("pipeline_stages",)


def check_strategy_flags(cfg: TrainConfig, given: Iterable[str]) -> None:
    """Raise :class:`ConfigError` for a setting of :data:`STRATEGY_FLAGS` that is ``given``
    (on the command line or in the file) but that no layer's strategy reads: ``--groups`` sets M
    only for hybrid entries that name none. ``auto`` reads :data:`AUTO_READS`, but not from part
    files, where it runs partition parallelism."""
    from tessera.parallel import STRATEGIES

    choices = parse_strategy(cfg.strategy, cfg.layers)
    for name in STRATEGY_FLAGS:
        if name not in given:
            continue
        if choices is None:
            used = name in AUTO_READS and not cfg.parts_dir
        else:
            used = any(name in STRATEGIES[c.strategy].reads and name not in dict(c.overrides) for c in choices)
        if not used:
            flag = f"--{name.replace('_', '-')}"
            names = [k for k, s in sorted(STRATEGIES.items()) if name in s.reads]
            readers = " and ".join(names) + (" strategies" if len(names) > 1 else " strategy")
            if choices is not None:
                why = f"no layer of --strategy {cfg.strategy} uses it"
                why += " (hybrid:M entries name their own M)" if name == "groups" else ""
            elif cfg.parts_dir:
                why = "from part files --strategy auto runs partition parallelism"
            else:
                why = "--strategy auto picks each layer's M itself"
            raise ConfigError(
                f"{flag} is read by the {readers} only, and {why}; drop {flag} or choose a strategy that uses it"
            )
