"""Training configuration: defaults, TOML files, and command-line overrides."""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tessera.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


@dataclass
class TrainConfig:
    """Every setting of a training run; field names match the CLI flags (``-`` for ``_``)."""

    dataset: str = "synthetic:small"
    name: str | None = None
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
    feature_norm: str = "auto"
    out: str | None = None
    resume: bool = False
    plot: bool = False
    checkpoint_every: int = 10
    progress: bool = True
    nprocs: int = 1
    strategy: str = "partition"
    remote_agg: str = "prepost"
    partition: str = "metis"
    parts_dir: str | None = None
    timeout: float = 300.0
    comm_bits: int = 32
    pipeline_stages: int = 1
    norm: str = "none"
    label_prop: float = 0.0
    reorder: str = "auto"
    s_spmm: bool = False

    def validate(self) -> TrainConfig:
        """Raise :class:`ConfigError` for out-of-range values; returns self."""
        checks = [
            (self.hidden >= 1, f"--hidden must be >= 1, got {self.hidden}"),
            (self.layers >= 1, f"--layers must be >= 1, got {self.layers}"),
            (0.0 <= self.dropout < 1.0, f"--dropout must be in [0, 1), got {self.dropout}"),
            (self.heads >= 1, f"--heads must be >= 1, got {self.heads}"),
            (self.lr > 0, f"--lr must be positive, got {self.lr}"),
            (self.weight_decay >= 0, f"--weight-decay must be >= 0, got {self.weight_decay}"),
            (self.epochs >= 1, f"--epochs must be >= 1, got {self.epochs}"),
            (self.patience >= 0, f"--patience must be >= 0 (0 disables early stopping), got {self.patience}"),
            (self.threads is None or self.threads >= 1, f"--threads must be >= 1, got {self.threads}"),
            (
                self.feature_norm in ("auto", "row", "none"),
                f"--feature-norm must be auto, row or none, got {self.feature_norm!r}",
            ),
            (self.checkpoint_every >= 1, f"--checkpoint-every must be >= 1, got {self.checkpoint_every}"),
            (self.nprocs >= 1, f"--nprocs must be >= 1, got {self.nprocs}"),
            (
                self.strategy in ("partition", "tensor"),
                f"--strategy must be partition or tensor, got {self.strategy!r}",
            ),
            (
                self.remote_agg in ("post", "pre", "prepost"),
                f"--remote-agg must be post, pre or prepost, got {self.remote_agg!r}",
            ),
            (
                self.partition in ("metis", "range", "random"),
                f"--partition must be metis, range or random, got {self.partition!r}",
            ),
            (self.timeout > 0, f"--timeout must be positive seconds, got {self.timeout}"),
            (self.comm_bits in (32, 8, 4, 2), f"--comm-bits must be 32, 8, 4 or 2, got {self.comm_bits}"),
            (self.norm in ("none", "layer"), f"--norm must be none or layer, got {self.norm!r}"),
            (0.0 <= self.label_prop < 1.0, f"--label-prop must be in [0, 1), got {self.label_prop}"),
            (
                self.reorder in ("auto", "none", "rcm", "metis", "degree"),
                f"--reorder must be auto, none, rcm, metis or degree, got {self.reorder!r}",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ConfigError(msg)
        return self

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of every field (JSON- and checkpoint-safe)."""
        return dataclasses.asdict(self)


FIELDS = {f.name: f for f in dataclasses.fields(TrainConfig)}


def read_toml(path: str | Path) -> dict[str, Any]:
    """Settings from a TOML file: top-level keys or a ``[train]`` table, named like the flags."""
    p = Path(path)
    try:
        data = tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"config file {p} is not valid TOML: {e}") from None
    data = data.get("train", data)
    out: dict[str, Any] = {}
    for key, value in data.items():
        k = key.replace("-", "_")
        if k not in FIELDS:
            raise ConfigError(f"unknown setting {key!r} in {p}; known: {', '.join(sorted(FIELDS))}")
        out[k] = value
    return out


def make_config(file_values: dict[str, Any], flag_values: dict[str, Any]) -> TrainConfig:
    """Defaults, overridden by the file, overridden by flags given on the command line."""
    merged = {**file_values, **{k: v for k, v in flag_values.items() if v is not None}}
    cfg = TrainConfig()
    for k, v in merged.items():
        default = getattr(cfg, k)
        kind = type(default) if default is not None else (int if k == "threads" else str)
        if kind is float and isinstance(v, int) and not isinstance(v, bool):
            v = float(v)
        try:
            if kind is bool and not isinstance(v, bool):
                raise ValueError
            if kind is float and isinstance(v, bool):
                raise ValueError
            setattr(cfg, k, kind(v) if v is not None else None)
        except (TypeError, ValueError):
            raise ConfigError(f"setting {k!r} must be {kind.__name__}, got {v!r}") from None
    return cfg.validate()
