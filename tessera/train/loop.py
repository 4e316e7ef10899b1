"""The full-graph training loop: every vertex in every epoch, Adam, early stopping, exact resume."""

from __future__ import annotations

import contextlib
import copy
import csv
import hashlib
import io
import json
import logging
import math
import os
import re
import resource
import statistics
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F

from tessera import workspace
from tessera.comm.accounting import add_epoch
from tessera.comm.group import Comm, env_world_size, single_process
from tessera.datasets import announce_when_loaded
from tessera.dense import gemm_path
from tessera.devices import training_device
from tessera.errors import ConfigError, DistributedError, TesseraError
from tessera.files import atomic_write, remove_stale_temps, write_json
from tessera.graph import Graph
from tessera.memo import tuning
from tessera.nn.loss import bce_rows, cross_entropy_rows
from tessera.nn.mixture import MixtureGNN
from tessera.nn.models import GNN
from tessera.phases import phase
from tessera.threads import set_num_threads
from tessera.train.checkpoint import (
    check_contents,
    check_layout,
    checkpoint_metric,
    load_checkpoint,
    save_checkpoint,
)
from tessera.train.config import FIELDS, NUMBER_SETTINGS, TrainConfig, read_toml
from tessera.train.evaluate import mean_rocauc
from tessera.train.mixture import placed_model
from tessera.train.optim import Adam
from tessera.train.progress import progress
from tessera.train.rundir import (
    LOCK,
    Appender,
    RunLock,
    acquire,
    busy_error,
    check_run_path,
    expand_out,
    owner_of,
    writing,
)
from tessera.train.setup import prepare

log = logging.getLogger(__name__)

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
METRICS_CSV = "metrics.csv"
RESULT = "result.json"
PLOT = "curves.png"
CONFIG = "config.toml"
#: what a run writes in its directory
RUN_FILES = (CONFIG, CHECKPOINT, METRICS, METRICS_CSV, RESULT, PLOT)
#: the files that show a directory holds a run
_RUN_MARKERS = (CONFIG, RESULT, CHECKPOINT, METRICS)
#: settings that do not change what a run trains: two runs differing only in them are the same run
_NOT_RUN_SETTINGS = (
    "out",
    "resume",
    "overwrite",
    "progress",
    "plot",
    "threads",
    "timeout",
    "checkpoint_every",
    "tensorboard",
)
#: the columns of metrics.csv: the per-epoch numbers (communication records stay in metrics.jsonl)
CSV_COLUMNS = ("epoch", "train_loss", "train_acc", "val_acc", "test_acc", "val_loss", "epoch_time_s")
#: what each metric is called where a run reports it (``acc``: accuracy of one class per vertex;
#: ``rocauc``: multi-label targets, the ROC-AUC averaged over the tasks as OGB's ogbn-proteins)
METRIC_NAMES = {"acc": "accuracy", "rocauc": "ROC-AUC"}


def csv_columns(metric: str = "acc") -> tuple[str, ...]:
    """The columns of metrics.csv of a run reporting ``metric`` (``acc`` or ``rocauc``)."""
    return tuple(k.replace("_acc", f"_{metric}") for k in CSV_COLUMNS)


# Settings that must agree between a checkpoint and the run resuming from it.
_RESUME_KEYS = (
    "model",
    "hidden",
    "layers",
    "dropout",
    "heads",
    "lr",
    "weight_decay",
    "seed",
    "feature_norm",
    "patience",
)


def resume_changes(recorded: dict[str, Any], cfg: TrainConfig) -> tuple[str, ...]:
    """The settings that change a run's numbers in which ``cfg`` differs from a checkpoint's
    ``recorded`` config, each as ``name=recorded (this run value)``. A setting the checkpoint lacks
    (written before it existed) had its default, except ``split``, which old checkpoints never
    recorded whatever it was."""
    defaults, mine = TrainConfig().to_dict(), cfg.to_dict()
    return tuple(
        f"{k.replace('_', '-')}={recorded.get(k, defaults[k])!r} (this run {mine[k]!r})"
        for k in NUMBER_SETTINGS
        if (k in recorded or k != "split") and recorded.get(k, defaults[k]) != mine[k]
    )


def peak_rss_mb() -> float:
    """Peak resident set size of this process in MiB."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _json_line(rec: dict[str, Any]) -> str:
    # JSON has no NaN or infinity; the loop stops before a non-finite value could reach a record.
    return json.dumps(rec, allow_nan=False) + "\n"


#: how a setting that changes a run's numbers is written in a default run directory's name
_NAME_LABELS = {
    "split": "split-",
    "hidden": "h",
    "layers": "l",
    "dropout": "do",
    "heads": "heads",
    "lr": "lr",
    "weight_decay": "wd",
    "patience": "pat",
    "feature_norm": "fn-",
    "comm_bits": "bits",
    "norm": "norm-",
    "label_prop": "lp",
    "num_bases": "bases",
    "num_blocks": "blocks",
    "precision": "",
}
#: a default name's settings part longer than this becomes a digest of the settings
_NAME_SETTINGS_MAX = 48


def _safe(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text)


def _shown_value(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def default_out_dir(cfg: TrainConfig) -> Path:
    """``runs/<model>-<dataset>-s<seed>`` when ``--out`` is not given, followed by every other
    setting that changes the run's numbers and is not at its default (``-h16-lr0.005``; a digest
    of them, ``-x<10 hex digits>``, where they would make a long name), so runs that would train
    different numbers never share a default directory. ``epochs`` is left out: ``--resume
    --epochs`` extends the run in its own directory."""
    ds = _safe(cfg.dataset.split("/")[-1] or "data")
    defaults, mine = TrainConfig().to_dict(), cfg.to_dict()
    parts = [f"{_safe(cfg.name)}" if cfg.name else ""]
    for k in NUMBER_SETTINGS:
        if k in ("model", "seed") or mine[k] == defaults[k]:
            continue
        parts.append(_safe(f"{_NAME_LABELS.get(k, k.replace('_', '-') + '-')}{_shown_value(mine[k])}"))
    settings = "-".join(p for p in parts if p)
    if len(settings) > _NAME_SETTINGS_MAX:
        numbers = json.dumps({k: mine[k] for k in ("name", *NUMBER_SETTINGS)}, sort_keys=True)
        settings = "x" + hashlib.sha256(numbers.encode()).hexdigest()[:10]
    name = f"{cfg.model}-{ds[:150]}-s{cfg.seed}" + (f"-{settings}" if settings else "")
    return Path("runs") / name


class RunDir(NamedTuple):
    """Where a run writes: ``path``; ``instead_of``, the default directory it did not take because
    that holds a run with other settings; ``replaces``, the other settings of the run
    ``--overwrite`` replaces in ``path`` (empty when it replaces none)."""

    path: Path
    instead_of: Path | None = None
    replaces: tuple[str, ...] = ()


def recorded_settings(path: str | Path) -> dict[str, Any] | None:
    """The settings of the run in directory ``path``, from its ``config.toml`` or (runs written
    before it existed) its ``result.json``; None when it holds no run. Settings that cannot be
    read come back as ``{"?": ...}``, which no run's settings equal."""
    d = Path(path)
    if not any((d / name).exists() for name in _RUN_MARKERS):
        return None
    defaults = TrainConfig().to_dict()
    try:
        if (d / CONFIG).is_file():
            return {**defaults, **read_toml(d / CONFIG)}
        if (d / RESULT).is_file():
            old = json.loads((d / RESULT).read_text())["config"]
            return {**defaults, **{k: v for k, v in old.items() if k in FIELDS}}
    except (TesseraError, OSError, ValueError, KeyError, TypeError):
        pass
    return {"?": "not recorded"}


def settings_differ(cfg: TrainConfig, recorded: dict[str, Any]) -> tuple[str, ...]:
    """The settings in which a recorded run differs from ``cfg``, each as ``name=recorded (this
    run value)``, leaving out those that do not change what is trained (output, display, threads)."""
    if "?" in recorded:
        return ("settings not recorded (no readable config.toml or result.json)",)
    mine = cfg.to_dict()
    return tuple(
        f"{k.replace('_', '-')}={recorded.get(k)!r} (this run {mine[k]!r})"
        for k in FIELDS
        if k not in _NOT_RUN_SETTINGS and recorded.get(k) != mine[k]
    )


def _listed(diff: tuple[str, ...]) -> str:
    return ", ".join(diff[:3]) + (f" and {len(diff) - 3} more" if len(diff) > 3 else "")


def run_dir(cfg: TrainConfig, owner_check: bool = True) -> RunDir:
    """The run directory of ``cfg``, never one holding a run with other settings unless asked:
    ``--out`` (``~`` expanded; or, with ``--resume`` or ``--overwrite``, the default directory)
    as given, a :class:`ConfigError` if it holds a run with other settings and neither flag is
    given; without ``--out``, the first of :func:`default_out_dir`, ``...-2``, ``...-3``, ...
    that is empty or holds a run with the same settings. Refused in one line before anything is
    read or written: a path no directory can have (:func:`~tessera.train.rundir.expand_out`,
    :func:`~tessera.train.rundir.check_run_path`) and, with ``owner_check`` (on rank 0), a
    directory another live run holds."""
    where = _chosen_run_dir(cfg)
    check_run_path(where.path, (*RUN_FILES, LOCK), "--out" if cfg.out else "run directory")
    if owner_check and int(os.environ.get("RANK", "0")) == 0 and (owner := owner_of(where.path)) is not None:
        raise busy_error(where.path, owner)
    return where


def _chosen_run_dir(cfg: TrainConfig) -> RunDir:
    base = expand_out(cfg.out) if cfg.out else default_out_dir(cfg)
    # before its files are read: a FIFO is never opened, a directory never taken for a file
    given = cfg.out or cfg.resume or cfg.overwrite
    check_run_path(base, (*RUN_FILES, LOCK) if given else (), "--out" if cfg.out else "run directory")
    if cfg.resume:  # the checkpoint's own settings are checked when it is read
        return RunDir(base)
    if cfg.out or cfg.overwrite:
        recorded = recorded_settings(base)
        diff = () if recorded is None else settings_differ(cfg, recorded)
        if diff and not cfg.overwrite:
            where = f"--out {base}" if cfg.out else str(base)
            raise ConfigError(
                f"{where} holds a run with other settings ({_listed(diff)}); add --resume to continue it, "
                "--overwrite to replace it, or choose another --out"
            )
        return RunDir(base, replaces=diff)
    path, n = base, 1
    while (recorded := recorded_settings(path)) is not None and settings_differ(cfg, recorded):
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return RunDir(path, instead_of=None if n == 1 else base)


def _shown(value: float | None) -> str:
    """A split's score for the progress bar: three decimals, or ``-`` for an empty split."""
    return "-" if value is None else f"{value:.3f}"


def announce_run_dir(where: RunDir) -> None:
    """Say (through the ``tessera`` logger) that a run took a suffixed directory."""
    if where.instead_of is not None:
        log.warning("%s holds a run with other settings; this run writes %s", where.instead_of, where.path)


def tensorboard_writer_class() -> Any:
    """``torch.utils.tensorboard.SummaryWriter``, or a :class:`ConfigError` saying to install tensorboard."""
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install tensorboard") from None
    return SummaryWriter


def kernels_compiled() -> bool:
    """Whether numba's cache holds tessera's CSR aggregation kernel (one of the kernels every CPU
    run compiles): False on a first run, True when it is there or the cache cannot be read."""
    try:
        from tessera.backends import cpu_csr

        return bool(cpu_csr._spmm._cache._cache_file._load_index())
    except Exception:  # numba's cache internals differ between versions: say nothing rather than fail
        return True


class _MetricsFiles:
    """The per-epoch records: ``metrics.jsonl`` (every field), ``metrics.csv`` (the numbers of
    :data:`CSV_COLUMNS`) and, with ``--tensorboard``, TensorBoard scalars; all three rewritten
    from the checkpoint's history on resume, so nothing past the checkpoint survives."""

    def __init__(self, out: Path, history: list[dict[str, Any]], tensorboard: str | None, metric: str = "acc") -> None:
        self.columns = csv_columns(metric)
        with writing(out / METRICS, "metrics file"):
            atomic_write(out / METRICS, lambda tmp: tmp.write_text("".join(map(_json_line, history))))
        with writing(out / METRICS_CSV, "metrics file"):
            atomic_write(out / METRICS_CSV, lambda tmp: self._write_csv(tmp, history))
        # each epoch's record is appended whole or not at all (a full disk leaves no half line)
        self.jsonl = Appender(out / METRICS, "metrics file")
        self.csv_file = Appender(out / METRICS_CSV, "metrics file")
        self.tb: Any = None
        if tensorboard:
            writer = tensorboard_writer_class()
            start = history[-1]["epoch"] if history else 0
            try:
                # purge_step drops the events a killed run wrote past the checkpoint
                self.tb = writer(log_dir=tensorboard, purge_step=start + 1 if start else None)
            except OSError as e:
                self.close()
                raise ConfigError(f"--tensorboard {tensorboard} cannot be written ({e.strerror or e})") from None

    def _write_csv(self, tmp: Path, history: list[dict[str, Any]]) -> None:
        with open(tmp, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(self.columns)
            w.writerows([rec[k] for k in self.columns] for rec in history)

    def write(self, rec: dict[str, Any]) -> None:
        """Append one epoch's record to every file and flush it."""
        self.jsonl.write(_json_line(rec))
        row = io.StringIO()
        csv.writer(row).writerow([rec[k] for k in self.columns])
        self.csv_file.write(row.getvalue())
        if self.tb is not None:
            for key in self.columns[1:]:
                split, _, what = key.rpartition("_")  # train_loss -> loss/train
                tag = "time/epoch_s" if key == "epoch_time_s" else f"{what}/{split}"
                if rec[key] is not None:  # an empty split has no value
                    self.tb.add_scalar(tag, rec[key], rec["epoch"])
            self.tb.flush()

    def close(self) -> None:
        """Close the files (and the TensorBoard writer)."""
        self.jsonl.close()
        self.csv_file.close()
        if self.tb is not None:
            self.tb.close()


class _NoMetrics:
    """What a non-zero rank writes: nothing."""

    def write(self, rec: dict[str, Any]) -> None:
        """Nothing."""

    def close(self) -> None:
        """Nothing."""


def _agree_gemm_path(comm: Comm) -> None:
    """Every rank runs its dense products on rank 0's decided GEMM path and chunk library (measured
    there if not yet known); a path forced for a block is not adopted beyond it."""
    mine = [-1, -1]
    if comm.rank == 0:
        mine = [gemm_path.PATHS.index(gemm_path.decided()), gemm_path.CHUNK_LIBRARIES.index(gemm_path.decided_chunks())]
    choice = comm.broadcast(torch.tensor(mine, dtype=torch.int64, device=comm.device))
    if comm.rank != 0:
        path, chunks = choice.tolist()
        gemm_path.adopt(gemm_path.PATHS[path], gemm_path.CHUNK_LIBRARIES[chunks])


class Trainer:
    """Trains one model on one graph (or, in a distributed job, on this rank's part of it);
    ``fit()`` returns the result dict also written to ``result.json``. With ``files=False`` it
    writes nothing (no run directory, checkpoint, metrics or result: the Python API's runs)."""

    def __init__(
        self, cfg: TrainConfig, graph: Graph | dict[str, Any], comm: Comm | None = None, *, files: bool = True
    ) -> None:
        cfg.validate()
        if not files and (cfg.resume or cfg.plot or cfg.tensorboard):
            raise ConfigError("resume, plot and tensorboard need a run directory: give out")
        self.cfg = cfg
        self.files = files
        distributed = comm is not None and comm.world > 1 or not isinstance(graph, Graph)
        # a rank of a group computes where its group's collectives run
        self.device = comm.device if comm is not None and comm.world > 1 else training_device(cfg.device, distributed)
        self.comm = comm or single_process(self.device)
        self.is_main = self.comm.rank == 0
        if cfg.threads:
            set_num_threads(cfg.threads)
        if self.comm.world > 1 and self.comm.device.type == "cpu":  # the path is the CPU products'
            _agree_gemm_path(self.comm)
        torch.manual_seed(cfg.seed)
        self.where = run_dir(cfg, owner_check=False) if files else RunDir(Path(cfg.out or "."))
        self.out = self.where.path
        self.writes = files and self.is_main  # only rank 0 writes
        self._lock: RunLock | None = None
        # a directory another live run holds is refused here, before the set-up's work, on every rank
        owner = owner_of(self.out) if self.writes else None
        self._on_every_rank(None if owner is None else busy_error(self.out, owner))
        if self.writes:
            announce_run_dir(self.where)
        if cfg.tensorboard:
            tensorboard_writer_class()  # refused before the set-up's work, not after it
        self._resume = self._read_checkpoint()
        if self.is_main and sys.stderr.isatty() and not kernels_compiled():
            # only where someone watches: a log gets no line that depends on the cache's state
            log.info("compiling kernels for this machine (first run only: numba caches them for later runs)")
        with self.kernels(), phase("setting the run up (vertex order, model, operands)"):
            run = prepare(
                cfg, graph, self.comm, None if self._resume is None else (self.out / CHECKPOINT, self._resume)
            )
        self.operands, self.order, self.counts = run.operands, run.order, run.counts
        shard = run.shard
        # set-up ran on the CPU; the model and the step's tensors now move to the run's device once
        # (an operand's structure is copied there by its backend on the first product)
        run.model.to(self.device)
        self.gnn = run.model  # the layers and weights, however the run executes them
        # the model as it runs: on the device, or aggregating on the host beside it (--aggregate-on)
        self.model: GNN | MixtureGNN = placed_model(cfg, run.model, self.operands[0], self.device)
        x_device = self.model.input_device or self.device  # a mixture reads its input on the host
        self.x, self.y, self.global_ids = run.x.to(x_device), shard.y.to(self.device), shard.ids
        # Random draws are keyed by global vertex id; rows in their own order need no ids.
        identity = shard.ids.numel() == shard.num_nodes and torch.equal(shard.ids, torch.arange(shard.num_nodes))
        self.row_ids = None if identity else shard.ids.to(self.device)
        self._train_cpu = shard.masks["train"].nonzero().view(-1)  # the label-propagation draw is taken on the CPU
        self.idx = {k: m.nonzero().view(-1).to(self.device) for k, m in shard.masks.items()}
        self.info = (shard.name, shard.num_nodes, shard.num_edges)
        self._fingerprint = shard.fingerprint
        self.strategy, self.log, self.plan = run.strategy, run.strategy.log, run.plan
        self.feature_norm = run.feature_norm  # what --feature-norm did to this graph: row or none
        self.comm_bits = run.comm_bits
        # multi-label targets (y of shape N x C): binary cross-entropy, measured by ROC-AUC
        self.multilabel = self.y.dim() == 2
        self.metric = "rocauc" if self.multilabel else "acc"
        self._targets: dict[str, int] = {}  # multi-label: labelled targets per split, over all ranks
        if self.multilabel:
            local = torch.stack([(self.y[i] >= 0).sum() for i in self.idx.values()]).to(torch.int64)
            self._targets = dict(zip(self.idx, self.comm.all_reduce_sum(local).tolist(), strict=True))
        self.comm_totals: dict[str, Any] = {}
        self.opt = Adam(self.model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
        self.epoch = 0
        self.best: dict[str, Any] = {f"val_{self.metric}": -1.0, "val_loss": float("inf"), "epoch": 0, "state": None}
        self.bad_epochs = 0
        self.history: list[dict[str, Any]] = []
        self._require_validation()  # at set-up: before anything is written or announced

    def _on_every_rank(self, problem: TesseraError | None) -> None:
        """Raise ``problem``, found by rank 0 (which alone writes the run directory), on every rank
        of a run that writes files, so that no rank goes on to wait for a peer that stopped."""
        if self.files and self.comm.world > 1:
            flag = torch.tensor([int(problem is not None)], dtype=torch.int64)  # on the host: the group copies it
            if int(self.comm.broadcast(flag)[0]) and problem is None:
                problem = ConfigError(f"rank 0 refused the run directory {self.out}; its error line says why")
        if problem is not None:
            raise problem

    def _take_run_dir(self) -> None:
        """Rank 0 creates the run directory and takes its lock, held until :meth:`fit` ends; a
        run that took it first is named, and every rank stops before training."""
        problem = None
        if self.writes:
            try:
                self._lock = acquire(self.out)
            except TesseraError as e:
                problem = e
        self._on_every_rank(problem)

    def _give_back_run_dir(self, failed: bool) -> None:
        """Release the lock (a failed run also removes the directories it created, if still empty)."""
        lock, self._lock = self._lock, None
        if lock is not None:
            lock.release(remove_created=failed)

    def kernels(self) -> AbstractContextManager[None]:
        """The run's kernels for the block: with ``--backend torch`` every kernel of the step is the
        portable torch op a GPU runs, on the CPU too (:mod:`tessera.kernels.placement`)."""
        return tuning.forcing("portable", self.cfg.backend == "torch")

    def fingerprint(self) -> str:
        """Fingerprint of the graph as the caller numbered it (what checkpoints are tied to)."""
        return self._fingerprint

    def train_step(self) -> float:
        """Forward, loss on the train split, backward, Adam step; returns the loss."""
        with self.kernels():
            return self._train_step()

    def _train_step(self) -> float:
        self.model.train()
        self.opt.zero_grad(set_to_none=True)
        tr, rows, n_loss = self.idx["train"], None, self.counts["train"]
        if self.cfg.label_prop > 0:
            # Masked label propagation: a random share of training labels become input features
            # and only the other training vertices enter the loss. The draw is over global vertex
            # ids, so it does not depend on how the graph is partitioned.
            gen = torch.Generator().manual_seed(self.cfg.seed * 1_000_003 + self.epoch)
            chosen = torch.rand(self.info[1], generator=gen)[self.global_ids[self._train_cpu]] < self.cfg.label_prop
            chosen = chosen.to(self.device)
            rows, tr = tr[chosen], tr[~chosen]
            n_loss = int(self.comm.all_reduce_sum(torch.tensor([tr.numel()]))[0])
        if self.log is not None:
            self.log.start_forward("train")
        # only the logits of the vertices in the loss: the last layer computes no others
        logits = self.model(self.x, self.operands, rows, None if rows is None else self.y[rows], self.row_ids, tr)
        # The sum over this rank's training vertices divided by the global count: summed over ranks
        # it is exactly the single-process mean loss, and so are the all-reduced gradients.
        if self.multilabel:  # summed over the rows and tasks, divided by every rank's labelled targets
            loss = bce_rows(logits, None, self.y[tr]) / max(self._targets["train"], 1)
        else:
            loss = cross_entropy_rows(logits, None, self.y[tr]) / max(n_loss, 1)
        loss.backward()
        if self.comm.world > 1:
            self._all_reduce_grads()
        self.opt.step()
        return float(self.comm.all_reduce_sum(loss.detach().clone()))

    def _all_reduce_grads(self) -> None:
        """Sum every parameter's gradient over the ranks. A rank whose rows leave a parameter
        unused (an LSTM without in-edges here) has no gradient for it and adds zeros, so every
        rank reduces the same tensor; a parameter no rank used keeps no gradient, as in one process."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        used = [p.grad is not None for p in params]
        parts = [p.grad.reshape(-1) if p.grad is not None else p.new_zeros(p.numel()) for p in params]
        parts.append(torch.tensor(used, dtype=parts[0].dtype).to(self.device))
        flat = self.comm.all_reduce_sum(torch.cat(parts))
        # read back only where this rank lacks a gradient: a device run's steady step reads nothing
        anywhere = flat[-len(params) :].tolist() if not all(used) else used
        offset = 0
        for p, count in zip(params, anywhere, strict=True):
            if count > 0:
                g = flat[offset : offset + p.numel()].view_as(p)
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.copy_(g)
            offset += p.numel()

    def evaluate(self) -> dict[str, float | None]:
        """Accuracy on each split (``train_acc``, ...; of multi-label targets the ROC-AUC averaged
        over the tasks, ``train_rocauc``, ...) and the validation loss, in eval mode (no dropout),
        over all ranks; None for an empty split (and ``val_loss`` None without validation vertices)."""
        with self.kernels(), torch.no_grad():
            return self._evaluate()

    def _evaluate(self) -> dict[str, float | None]:
        self.model.eval()
        if self.log is not None:
            self.log.start_forward("eval")
        rows = self.idx["train"] if self.cfg.label_prop > 0 else None  # evaluation sees every training label
        logits = self.model(self.x, self.operands, rows, None if rows is None else self.y[rows], self.row_ids)
        if self.multilabel:
            return self._evaluate_multilabel(logits)
        pred = logits.argmax(1)
        sums = [(pred[i] == self.y[i]).sum().to(torch.float64) for i in self.idx.values()]
        vi = self.idx["val"]
        sums.append(F.cross_entropy(logits[vi].float(), self.y[vi], reduction="sum").to(torch.float64))
        tot = self.comm.all_reduce_sum(torch.stack(sums))
        # an empty split has no accuracy (None: null in result.json), never a 0.0 that reads as a measurement
        res: dict[str, float | None] = {
            f"{k}_acc": float(tot[n] / self.counts[k]) if self.counts[k] else None for n, k in enumerate(self.idx)
        }
        res["val_loss"] = float(tot[3] / self.counts["val"]) if self.counts["val"] else None
        return res

    def _evaluate_multilabel(self, logits: torch.Tensor) -> dict[str, float | None]:
        """Each split's ROC-AUC (OGB's, :func:`~tessera.train.evaluate.mean_rocauc`) of the logits,
        over the split's rows of every rank (gathered: an AUC is no sum), and the validation
        binary cross-entropy per labelled target."""
        res: dict[str, float | None] = {}
        for k, i in self.idx.items():
            if not self.counts[k]:
                res[f"{k}_rocauc"] = None  # an empty split has no ROC-AUC
                continue
            scores = self.comm.all_gather_rows(logits[i].float()).cpu()
            labels = self.comm.all_gather_rows(self.y[i]).cpu()
            try:
                res[f"{k}_rocauc"] = mean_rocauc(labels, scores)
            except ValueError:
                raise TesseraError(
                    f"no task of the {k} split has both a positive and a negative target: its ROC-AUC is "
                    "undefined; give the split vertices of both kinds"
                ) from None
        vi = self.idx["val"]
        val = bce_rows(logits, vi, self.y[vi]).to(torch.float64).reshape(1)
        total = float(self.comm.all_reduce_sum(val)[0])
        res["val_loss"] = total / self._targets["val"] if self._targets["val"] else None
        return res

    def predict(self) -> torch.Tensor:
        """Logits of every vertex with the current weights (eval mode), rows in the caller's vertex
        order (on a rank of a distributed run: its owned vertices, ``global_ids``); float32 under
        ``--precision bf16`` too."""
        with self.kernels(), torch.no_grad():
            return self._predict()

    def _predict(self) -> torch.Tensor:
        self.model.eval()
        rows = self.idx["train"] if self.cfg.label_prop > 0 else None
        logits = self.model(self.x, self.operands, rows, None if rows is None else self.y[rows], self.row_ids).float()
        return logits if self.order is None else self.order.to_original(logits)

    # ------------------------------------------------------------------ state
    def state(self) -> dict[str, Any]:
        """Everything needed to continue this run bit-for-bit."""
        return {
            "format": 1,
            "config": self.cfg.to_dict(),
            "graph": self.fingerprint(),
            "epoch": self.epoch,
            "model": self.model.state_dict(),
            "optimizer": self.opt.state_dict(),
            "rng": torch.get_rng_state(),
            "best": self.best,
            "bad_epochs": self.bad_epochs,
            "history": self.history,
            "plan": None if self.plan is None else {"world": self.plan.world, "choices": list(self.plan.choices)},
        }

    def _read_checkpoint(self) -> dict[str, Any] | None:
        """The checkpoint ``--resume`` continues from (None without one), its layout and settings
        checked: its plan decides the layers' strategies before the rest is restored."""
        path = self.out / CHECKPOINT
        if not self.cfg.resume or not path.exists():
            return None
        ckpt = load_checkpoint(path)
        check_layout(ckpt, path, _RESUME_KEYS)
        self._check_settings(ckpt)
        return ckpt

    def _check_settings(self, ckpt: dict[str, Any]) -> None:
        """Raise :class:`ConfigError` unless ``ckpt`` was written with this run's settings: every
        one that changes the numbers trained (:data:`~tessera.train.config.NUMBER_SETTINGS`; those
        :data:`~tessera.train.config.RESUME_EXEMPT` lists may change), all that differ named."""
        changed = resume_changes(ckpt["config"], self.cfg)
        if changed:
            raise ConfigError(
                f"checkpoint in {self.out} was trained with other settings: {', '.join(changed)}; "
                "resume with the checkpoint's settings, or train them afresh with another --out"
            )

    def load_state(self, ckpt: dict[str, Any]) -> None:
        """Restore a checkpoint written by :meth:`state`, after checking every field and that it
        belongs to this run; a bad field raises :class:`TesseraError` before anything changes."""
        path = self.out / CHECKPOINT
        check_layout(ckpt, path, _RESUME_KEYS)
        if ckpt["graph"] != self.fingerprint():
            raise ConfigError(
                f"checkpoint in {self.out} was written for a different graph; use another --out or drop --resume"
            )
        self._check_settings(ckpt)
        if checkpoint_metric(ckpt) != self.metric:
            raise ConfigError(
                f"checkpoint in {self.out} was written by a run measured by {METRIC_NAMES[checkpoint_metric(ckpt)]}, "
                f"but this graph's targets are measured by {METRIC_NAMES[self.metric]}; use another --out or drop --resume"
            )
        check_contents(ckpt, path, self.gnn, self.opt)
        self.model.load_state_dict(ckpt["model"])
        self.opt.load_state_dict(ckpt["optimizer"])
        torch.set_rng_state(ckpt["rng"])
        self.epoch, self.best, self.bad_epochs = ckpt["epoch"], ckpt["best"], ckpt["bad_epochs"]
        self.history = list(ckpt["history"])
        if self.log is not None:
            self._restore_comm_totals(path)

    def _restore_comm_totals(self, path: Path) -> None:
        """Communication totals of the checkpointed epochs, from the per-epoch records in the history
        (every rank's counters, all-reduced when they were gathered, so the same on every rank)."""
        self.comm_totals = {}
        for rec in self.history:
            if "comm" in rec:
                add_epoch(self.comm_totals, rec["comm"])
        missing = len(self.history) - self.comm_totals.get("epochs", 0)
        if missing and self.is_main:
            log.warning(
                "checkpoint %s has no communication records for %d of its %d epochs; "
                "the communication totals leave those epochs out",
                path,
                missing,
                len(self.history),
            )

    def _checkpoint(self) -> None:
        if self.writes:
            save_checkpoint(self.out / CHECKPOINT, self.state())

    def _start_metrics(self) -> _MetricsFiles | _NoMetrics:
        return _MetricsFiles(self.out, self.history, self.cfg.tensorboard, self.metric) if self.writes else _NoMetrics()

    def _start_files(self) -> None:
        """On rank 0: the stale temporaries a killed write left removed, the files of a run with
        other settings that ``--overwrite`` replaces deleted, and this run's ``config.toml`` written."""
        if not self.writes:  # only rank 0 writes: what a killed write left behind is nobody's now
            return
        for name in RUN_FILES:
            remove_stale_temps(self.out / name)
        if self.where.replaces:
            log.info("--overwrite: replacing the run in %s (%s)", self.out, _listed(self.where.replaces))
            for name in RUN_FILES:
                (self.out / name).unlink(missing_ok=True)
        with writing(self.out / CONFIG, "settings file"):
            atomic_write(self.out / CONFIG, lambda tmp: tmp.write_text(self.cfg.to_toml()))

    # ------------------------------------------------------------------ the loop
    def fit(self) -> dict[str, Any]:
        """Train until ``epochs`` or early stopping, restore the best-validation weights, test."""
        self._take_run_dir()
        try:
            result = self._fit()
        except BaseException:
            self._give_back_run_dir(failed=True)
            raise
        self._give_back_run_dir(failed=False)
        return result

    def _fit(self) -> dict[str, Any]:
        cfg = self.cfg
        if self._resume is not None:
            ckpt, self._resume = self._resume, None
            self.load_state(ckpt)
        elif cfg.resume and self.is_main:
            log.warning("no checkpoint in %s; starting from epoch 1", self.out)
        self._start_files()
        metrics = self._start_metrics()
        stopped = self.bad_epochs >= cfg.patience > 0
        bar = progress(cfg.epochs, self.epoch, cfg.progress)
        try:
            while self.epoch < cfg.epochs and not stopped:
                t0 = time.perf_counter()
                loss = self.train_step()
                step = time.perf_counter() - t0
                self.epoch += 1
                ev = self.evaluate()
                rec: dict[str, Any] = {"epoch": self.epoch, "train_loss": loss, **ev, "epoch_time_s": step}
                self._stop_if_diverged(rec)
                if self.log is not None:
                    rec["comm"] = self.log.gather(self.comm)
                    add_epoch(self.comm_totals, rec["comm"])
                self.history.append(rec)
                metrics.write(rec)
                key = f"val_{self.metric}"
                score, val_loss = ev[key], ev["val_loss"]
                if score is None or val_loss is None:  # no validation split (--patience 0): the last epoch's weights
                    better, score, val_loss = True, -1.0, 0.0
                else:
                    better = score > self.best[key] or (score == self.best[key] and val_loss < self.best["val_loss"])
                if better:
                    state = copy.deepcopy(self.model.state_dict())
                    self.best = {
                        key: score,
                        "val_loss": val_loss,
                        "epoch": self.epoch,
                        "state": state,
                    }
                    self.bad_epochs = 0
                else:
                    self.bad_epochs += 1
                stopped = cfg.patience > 0 and self.bad_epochs >= cfg.patience
                if self.epoch % cfg.checkpoint_every == 0 or stopped or self.epoch == cfg.epochs:
                    self._checkpoint()
                if self.multilabel:  # named: a ROC-AUC is no accuracy
                    shown = {"train_rocauc": _shown(ev["train_rocauc"]), "val_rocauc": _shown(ev["val_rocauc"])}
                else:
                    shown = {"train": _shown(ev["train_acc"]), "val": _shown(ev["val_acc"])}
                bar.set_postfix(loss=f"{loss:.4f}", **shown, t=f"{step * 1e3:.1f}ms")
                bar.update(1)
        finally:
            bar.close()
            metrics.close()
        if stopped and self.is_main:  # after the bar, which a terminal has on its last line
            log.info(
                "early stopping at epoch %d: no better validation %s in the last %s (--patience %d); best epoch %d",
                self.epoch,
                METRIC_NAMES[self.metric],
                f"{self.bad_epochs} epochs" if self.bad_epochs != 1 else "epoch",
                cfg.patience,
                self.best["epoch"],
            )
        return self._finish(stopped)

    def _require_validation(self) -> None:
        """Refuse, before anything is written, a run without validation vertices that early
        stopping or best-epoch selection would need: with ``--patience 0`` it trains every epoch
        and keeps the last epoch's weights, as a plain training loop does."""
        if self.counts["val"] or self.cfg.patience == 0:
            return
        raise ConfigError(
            f"the validation split of {self.info[0]} is empty, so early stopping and best-epoch selection "
            f"have nothing to measure (--patience {self.cfg.patience}); give the graph validation vertices, "
            "or pass --patience 0 to train every epoch and keep the last epoch's weights"
        )

    def _stop_if_diverged(self, rec: dict[str, Any]) -> None:
        """Stop the run, before the epoch is recorded or checkpointed, on a NaN or infinite loss
        (the same on every rank: both losses are all-reduced)."""
        for key, what in (("train_loss", "training loss"), ("val_loss", "validation loss")):
            if rec[key] is not None and not math.isfinite(rec[key]):
                raise TesseraError(
                    f"training diverged at epoch {self.epoch}: the {what} is {rec[key]}; "
                    f"lower --lr (now {self.cfg.lr:g}) and train again without --resume"
                )

    def _finish(self, stopped: bool) -> dict[str, Any]:
        if self.best["state"] is not None:
            self.model.load_state_dict(self.best["state"])
        final = self.evaluate()
        # the step buffers go back once training is over: a host process (a notebook, a
        # pipeline) keeps running with its memory, and a later call maps them again once
        workspace.release()
        rss = torch.zeros(self.comm.world, dtype=torch.float64, device=self.comm.device)
        rss[self.comm.rank] = peak_rss_mb()
        rss_per_rank = self.comm.all_reduce_sum(rss).tolist()  # every rank's, in rank order
        times = [h["epoch_time_s"] for h in self.history]
        result = {
            "dataset": self.info[0],
            "num_nodes": self.info[1],
            "num_edges": self.info[2],
            "best_epoch": self.best["epoch"],
            "epochs_run": self.epoch,
            "stopped_early": stopped,
            "metric": self.metric,
            **{f"{k}_{self.metric}": final[f"{k}_{self.metric}"] for k in ("train", "val", "test")},
            "epoch_time_median_s": statistics.median(times) if times else 0.0,
            "peak_rss_mb": rss_per_rank[self.comm.rank],
            "peak_rss_mb_per_rank": rss_per_rank,
            "num_params": sum(p.numel() for p in self.model.parameters()),
            "vertex_order": "none" if self.order is None else self.order.method,
            "feature_norm": self.feature_norm,
            "config": self.cfg.to_dict(),
        }
        if not self.is_main:
            return {}
        result["world_size"] = self.comm.world
        if self.comm_totals:
            result["comm"] = self.comm_totals
        if self.comm_bits is not None:
            result["comm_bits"] = [list(b) for b in self.comm_bits]
        if self.plan is not None:
            result["plan"] = self.plan.to_dict()
        if not self.writes:
            return result
        with writing(self.out / RESULT, "result file"):
            write_json(self.out / RESULT, result)
        if self.cfg.plot:
            from tessera.train.plot import plot_curves

            with writing(self.out / PLOT, "plot"):
                plot_curves(self.history, self.out / PLOT, title=f"{self.cfg.model} on {self.info[0]}")
        return result


@contextlib.contextmanager
def _peers_may_fail(rank: int) -> Iterator[None]:
    """A distributed rank's block: a failed collective (gloo/NCCL: a peer died, hung past
    ``--timeout``, or broke the exchange) becomes one :class:`DistributedError`, and any error
    leaves the process group first."""
    from tessera.comm.group import lost_peers, shutdown

    try:
        yield
    except RuntimeError as e:
        lost = lost_peers(rank)  # before leaving: this rank's beacon tells its peers it still lives
        shutdown(clean=False)
        if os.environ.get("TESSERA_DEBUG"):
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        first = re.sub(r"^\[[^\]]*\.(?:cc|cpp|h):\d+\] ", "", first)  # gloo's source location
        said = f"; {lost}" if lost else ""
        raise DistributedError(
            f"rank {rank}: a collective failed ({first[:200]}); a peer died or timed out{said}"
        ) from None
    except BaseException:
        shutdown(clean=False)
        raise


def train(cfg: TrainConfig, graph: Graph | None = None) -> dict[str, Any]:
    """Load ``cfg.dataset`` (unless a graph is given), train, and return the result dict.

    Inside a distributed job (``WORLD_SIZE`` > 1, from ``tessera train --nprocs`` or torchrun)
    every rank runs this; each trains its partition and rank 0 writes the outputs."""
    from tessera.comm.group import init_from_env, shutdown

    single = env_world_size() <= 1 and not cfg.parts_dir
    world, rank = env_world_size(), int(os.environ.get("RANK", "0"))
    # what loading announces (a generated split) is said once the run's set-up has passed its checks
    with announce_when_loaded():
        if graph is None and not cfg.parts_dir:
            from tessera.datasets import load

            with phase(f"loading {cfg.dataset}"):
                graph = load(cfg.dataset, name=cfg.name, split=cfg.split)
        if single:
            assert graph is not None  # loaded above
            trainer = Trainer(cfg, graph)
        else:
            if int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
                cfg.resume = True  # a restarted torchrun worker continues from the last checkpoint
            part = None
            if cfg.parts_dir:  # each rank reads only its own part file, before joining: a bad file fails alone
                from tessera.graph.partition import load_part

                part = load_part(cfg.parts_dir, rank, expect_parts=world)
            comm = single_process()
            with _peers_may_fail(rank):
                if world > 1:  # each rank on its own GPU (cuda:LOCAL_RANK) or on the CPU, as --device says
                    comm = init_from_env(cfg.timeout, training_device(cfg.device, True))
                source = graph if part is None else part
                assert source is not None  # the graph loaded above, unless part files were given
                trainer = Trainer(cfg, source, comm)
    if single:
        del graph  # a renumbered run trains on its own copy: the loaded graph's memory can go
        return trainer.fit()
    with _peers_may_fail(rank):
        result = trainer.fit()
    shutdown(clean=True)
    return result
