"""Checkpoints: written atomically, read back with ``weights_only=True``, and checked field by
field against the run resuming from them before anything is restored.

A run whose layers ``--strategy auto`` planned also stores the plan (``plan``: the world size
and one ``--strategy`` entry per layer), so that resuming it trains under the same strategies
without planning again; checkpoints of other runs, and those written before plans were stored,
have ``plan`` None or no ``plan``.

A checkpoint holds two sets of weights: ``model``, the last epoch's (what ``--resume`` continues
from), and ``best``'s ``state``, the best-validation epoch's (what the run restores and reports
its accuracies with, and :func:`best_weights` returns)."""

from __future__ import annotations

import io
import math
import os
import stat
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, NoReturn

import torch

from tessera.comm.accounting import epoch_shape
from tessera.errors import ConfigError, TesseraError
from tessera.files import atomic_write
from tessera.nn.models import GNN
from tessera.parallel.hybrid import check_groups
from tessera.parallel.mixed import parse_entry
from tessera.train.optim import Adam
from tessera.train.rundir import write_error

FORMAT = 1
# Every top-level field Trainer.state writes, and its type.
_FIELDS: dict[str, type] = {
    "format": int,
    "config": dict,
    "graph": str,
    "epoch": int,
    "model": dict,
    "optimizer": dict,
    "rng": torch.Tensor,
    "best": dict,
    "bad_epochs": int,
    "history": list,
}
_OPTIONAL = ("plan",)  # fields a checkpoint may lack (written before they existed)
_RECORD_NUMBERS = ("train_loss", "train_acc", "val_acc", "test_acc", "val_loss", "epoch_time_s")
# a multi-label run's records: ROC-AUC where a single-label run has accuracy
_RECORD_NUMBERS_ROCAUC = ("train_loss", "train_rocauc", "val_rocauc", "test_rocauc", "val_loss", "epoch_time_s")
# the per-epoch numbers that are None where their split is empty (no test or validation vertices)
_MAYBE_EMPTY = frozenset({"val_acc", "test_acc", "val_rocauc", "test_rocauc", "val_loss"})
_ADAM_STATE = ("step", "exp_avg", "exp_avg_sq")
_ADAM_GROUP = ("params", "lr", "betas", "eps", "weight_decay")  # what Adam.step cannot do without
_SETTING = (type(None), bool, int, float, str)  # what a config value can be


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write a checkpoint (tensors, numbers, strings, lists and dicts only) atomically; a failed
    write (a full disk) is one :class:`TesseraError` naming the path, and the previous checkpoint
    stays whole."""

    def write(tmp: Path) -> None:
        try:
            torch.save(state, tmp)
        except RuntimeError:
            # torch's zip writer reports a failed write only as "unexpected pos": the same bytes
            # written through Python's I/O either succeed or raise the OSError (ENOSPC) that says why
            buf = io.BytesIO()
            torch.save(state, buf)
            with open(tmp, "wb") as f:
                f.write(buf.getbuffer())

    try:
        atomic_write(path, write)
    except OSError as e:
        raise write_error(path, e, "checkpoint") from None


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True``: no arbitrary code runs while loading. Only a
    regular file is read: a named pipe, device or directory is refused without being waited on."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:
        raise TesseraError(
            f"checkpoint {path} cannot be read ({e.strerror or e}); delete it or drop --resume"
        ) from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        what = "a directory" if stat.S_ISDIR(mode) else "a named pipe" if stat.S_ISFIFO(mode) else "a special file"
        raise TesseraError(f"checkpoint {path} is {what}, not a regular file; remove it or drop --resume")
    with os.fdopen(fd, "rb") as f:
        try:
            return torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # torch raises several types for corrupt or foreign files
            raise TesseraError(
                f"checkpoint {path} is unreadable ({type(e).__name__}); delete it or drop --resume"
            ) from None


def best_weights(ckpt: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The best-validation epoch's weights of ``ckpt`` (its last epoch's if none was recorded)."""
    best = ckpt["best"].get("state")
    return ckpt["model"] if best is None else best


class _Check:
    """Checks that raise a one-line :class:`TesseraError` naming the checkpoint field that is wrong."""

    def __init__(self, path: str | Path) -> None:
        self.path = path

    def fail(self, field: str, problem: str) -> NoReturn:
        raise TesseraError(f"checkpoint {self.path}: field {field} {problem}; delete the checkpoint or drop --resume")

    def keys(self, field: str, value: Any, required: Iterable[str], optional: Iterable[str] = ()) -> None:
        self.kind(field, value, dict)
        for k in required:
            if k not in value:
                self.fail(_join(field, k), "is missing")
        for k in value:
            if k not in required and k not in optional:
                self.fail(_join(field, k), "is not a checkpoint field (extra data)")

    def kind(self, field: str, value: Any, kind: type) -> None:
        if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
            self.fail(field, f"is a {type(value).__name__}, expected {kind.__name__}")

    def count(self, field: str, value: Any, low: int, high: int) -> None:
        self.kind(field, value, int)
        if not low <= value <= high:
            self.fail(field, f"is {value}, expected {low} to {high}")

    def number(self, field: str, value: Any) -> None:
        if not _is_number(value) or not math.isfinite(value):
            self.fail(field, f"is {_show(value)}, expected a finite number")

    def tensor(self, field: str, value: Any, like: torch.Tensor, owner: str) -> None:
        self.kind(field, value, torch.Tensor)
        if value.layout != torch.strided:
            self.fail(field, f"is a {value.layout} tensor, expected a dense one")
        if value.shape != like.shape:
            self.fail(field, f"has shape {tuple(value.shape)}, but {owner} needs {tuple(like.shape)}")
        if value.dtype != like.dtype:
            self.fail(field, f"has dtype {value.dtype}, but {owner} needs {like.dtype}")

    def state_dict(self, field: str, value: Any, expected: Mapping[str, torch.Tensor]) -> None:
        self.keys(field, value, expected)
        for k, t in expected.items():
            self.tensor(_join(field, k), value[k], t, "the model being built")


def _join(field: str, key: Any) -> str:
    return f"{field}[{_show(key)}]" if field else _show(key)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def check_layout(ckpt: Any, path: str | Path, config_keys: Iterable[str]) -> None:
    """Raise :class:`TesseraError` unless ``ckpt`` has exactly the top-level fields a tessera
    checkpoint has, with their types, and a config holding ``config_keys``."""
    c = _Check(path)
    if not isinstance(ckpt, dict):
        raise TesseraError(
            f"checkpoint {path} holds a {type(ckpt).__name__}, not a tessera checkpoint; "
            "delete the checkpoint or drop --resume"
        )
    c.keys("", ckpt, _FIELDS, _OPTIONAL)
    for k, kind in _FIELDS.items():
        c.kind(_show(k), ckpt[k], kind)
    if ckpt.get("plan") is not None:
        c.kind("'plan'", ckpt["plan"], dict)
    if ckpt["format"] != FORMAT:
        c.fail("'format'", f"is {ckpt['format']}, this tessera reads format {FORMAT}")
    for k in config_keys:
        if k not in ckpt["config"]:
            c.fail(_join("'config'", k), "is missing")
        if not isinstance(ckpt["config"][k], _SETTING):
            c.fail(_join("'config'", k), f"is a {type(ckpt['config'][k]).__name__}, expected a setting's value")


def check_contents(ckpt: dict[str, Any], path: str | Path, model: GNN, opt: Adam) -> None:
    """Raise :class:`TesseraError` unless every tensor in ``ckpt`` (laid out as
    :func:`check_layout` checks) fits ``model`` and ``opt``, counters and history are consistent,
    and its plan is one ``model`` can train with (:func:`check_plan`)."""
    c = _Check(path)
    check_plan(ckpt, path, model)
    epoch = ckpt["epoch"]
    c.count("'epoch'", epoch, 0, 2**62)
    c.count("'bad_epochs'", ckpt["bad_epochs"], 0, epoch)
    c.state_dict("'model'", ckpt["model"], model.state_dict())
    c.tensor("'rng'", ckpt["rng"], torch.get_rng_state(), "torch's generator")
    _check_optimizer(c, ckpt["optimizer"], opt)
    best = ckpt["best"]
    metric = checkpoint_metric(ckpt)
    c.keys("'best'", best, (f"val_{metric}", "val_loss", "epoch", "state"))
    c.number(f"'best'['val_{metric}']", best[f"val_{metric}"])
    c.number("'best'['val_loss']", best["val_loss"])
    c.count("'best'['epoch']", best["epoch"], 0, epoch)
    if best["state"] is not None:
        c.state_dict("'best'['state']", best["state"], model.state_dict())
    _check_history(c, ckpt["history"], epoch, _RECORD_NUMBERS_ROCAUC if metric == "rocauc" else _RECORD_NUMBERS)


def check_plan(ckpt: dict[str, Any], path: str | Path, model: GNN) -> dict[str, Any] | None:
    """The plan in ``ckpt`` (laid out as :func:`check_layout` checks), None when it has none;
    raise :class:`TesseraError` unless it names a world size of at least 2 and
    one ``--strategy`` entry per layer of ``model``, each in a placement its layer can run and
    with a hybrid M dividing the world size."""
    plan = ckpt.get("plan")
    if plan is None:
        return None
    c = _Check(path)
    c.keys("'plan'", plan, ("world", "choices"))
    c.count("'plan'['world']", plan["world"], 2, 2**31)
    entries = plan["choices"]
    c.kind("'plan'['choices']", entries, list)
    if len(entries) != len(model.convs):
        c.fail("'plan'['choices']", f"has {len(entries)} entries, but the model has {len(model.convs)} layers")
    for i, (entry, conv) in enumerate(zip(entries, model.layers)):
        field = f"'plan'['choices'][{i}]"
        c.kind(field, entry, str)
        try:
            choice = parse_entry(entry)
            if choice.strategy == "hybrid" and "groups" in dict(choice.overrides):
                check_groups(plan["world"], dict(choice.overrides)["groups"])
        except ConfigError as e:
            c.fail(field, f"is {_show(entry)}, not an entry for {plan['world']} ranks ({e})")
        if choice.aggregate_first is not None and choice.aggregate_first not in conv.placements():
            c.fail(field, f"is {_show(entry)}, a placement layer {i} cannot run")
    return plan


def _check_optimizer(c: _Check, value: Any, opt: Adam) -> None:
    c.keys("'optimizer'", value, ("state", "param_groups"))
    groups, ours = value["param_groups"], opt.state_dict()["param_groups"]
    c.kind("'optimizer'['param_groups']", groups, list)
    if len(groups) != len(ours):
        c.fail("'optimizer'['param_groups']", f"has {len(groups)} groups, this run's optimizer {len(ours)}")
    for i, (group, own) in enumerate(zip(groups, ours, strict=True)):
        field = f"'optimizer'['param_groups'][{i}]"
        c.keys(field, group, _ADAM_GROUP, own)
        for k, v in group.items():
            if not _same(v, own[k]):
                c.fail(_join(field, k), f"is {_show(v)}, but this run's optimizer has {_show(own[k])}")
    params = [p for g in opt.param_groups for p in g["params"]]
    c.kind("'optimizer'['state']", value["state"], dict)
    for index, state in value["state"].items():
        field = f"'optimizer'['state'][{_show(index)}]"
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(params):
            c.fail(field, f"names no parameter (the model has {len(params)})")
        c.keys(field, state, _ADAM_STATE)
        step = state["step"]
        c.kind(field + "['step']", step, torch.Tensor)
        if step.shape != () or not step.is_floating_point() or not 0 <= float(step) < math.inf:
            c.fail(field + "['step']", f"is {_show(step)}, expected a finite step count as a scalar tensor")
        for k in ("exp_avg", "exp_avg_sq"):
            c.tensor(f"{field}[{k!r}]", state[k], params[index], "the model being built")


def _same(value: Any, own: Any) -> bool:
    """Equal values of the same kind: numbers by value, tuples and lists element by element, never
    a tensor (whose ``==`` is not a bool)."""
    if isinstance(own, tuple | list):
        return type(value) is type(own) and len(value) == len(own) and all(map(_same, value, own))
    if _is_number(own) and _is_number(value):
        return value == own
    return type(value) is type(own) and value == own


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def checkpoint_metric(ckpt: dict[str, Any]) -> str:
    """The metric the checkpointed run selected its best epoch by: ``rocauc`` (a multi-label run)
    or ``acc``."""
    best = ckpt.get("best")
    return "rocauc" if isinstance(best, dict) and "val_rocauc" in best else "acc"


def _check_history(c: _Check, history: list[Any], epoch: int, numbers: tuple[str, ...] = _RECORD_NUMBERS) -> None:
    if len(history) != epoch:
        c.fail("'history'", f"has {len(history)} records for {epoch} epochs")
    layers = set()
    for i, rec in enumerate(history):
        field = f"'history'[{i}]"
        c.keys(field, rec, ("epoch", *numbers), ("comm",))
        c.count(field + "['epoch']", rec["epoch"], i + 1, i + 1)
        for k in numbers:
            if rec[k] is None and k in _MAYBE_EMPTY:  # a split without vertices has no score
                continue
            c.number(f"{field}[{k!r}]", rec[k])
        if "comm" in rec:
            try:
                layers.add(epoch_shape(rec["comm"])[0])
            except ValueError as e:
                c.fail(field + "['comm']", str(e))
    if len(layers) > 1:
        c.fail("'history'", f"has communication records for different layer counts {sorted(layers)}")
