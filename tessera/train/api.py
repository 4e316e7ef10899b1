"""The Python API for a whole training job: :func:`fit` trains a model on a graph in this process
and returns a :class:`Run`; :func:`load_run` reads a ``tessera train`` run directory's best model
back as one. A :class:`Run` evaluates and predicts on its own graph or another one, preparing the
features as its run did."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch

from tessera.errors import ConfigError, TesseraError
from tessera.graph import Graph
from tessera.train.checkpoint import best_weights, check_layout, load_checkpoint
from tessera.train.config import FIELDS, TrainConfig, make_config
from tessera.train.loop import CHECKPOINT, RESULT, Trainer
from tessera.train.setup import check_out_dir

# settings that describe where and how a run wrote, not the model: an evaluation leaves them out
_EVAL_OFF: dict[str, Any] = {
    "out": None,
    "resume": False,
    "overwrite": False,
    "plot": False,
    "tensorboard": None,
    "progress": False,
    "patience": 0,  # an evaluation trains nothing: a graph without validation vertices is no error then
}


class Run:
    """A trained model with its settings, history and accuracies (``result``, as ``result.json``;
    a multi-label run's ROC-AUC instead, see :attr:`metric`); ``model`` holds the best-validation
    weights the run reported them with."""

    def __init__(
        self,
        config: TrainConfig,
        result: dict[str, Any],
        history: list[dict[str, Any]],
        weights: dict[str, torch.Tensor] | None = None,
        trainer: Trainer | None = None,
        path: Path | None = None,
    ) -> None:
        self.config, self.result, self.history, self.path = config, result, history, path
        self._weights = weights
        self._own = trainer  # the trainer on the run's own graph: built on first use by load_run
        self._last: tuple[Graph, Trainer] | None = None  # the trainer of the last other graph

    @property
    def model(self) -> torch.nn.Module:
        """The trained model (best-validation weights), built on the run's dataset."""
        return self._trainer(None).model

    @property
    def metric(self) -> str:
        """What the run measured: ``acc`` (accuracy of one class per vertex) or ``rocauc`` (multi-label
        targets: the ROC-AUC averaged over the tasks, as OGB's ogbn-proteins)."""
        return str(self.result.get("metric", "acc"))

    def _reported(self, key: str) -> float | None:
        if key not in self.result and key.endswith("_acc") and self.metric == "rocauc":
            raise ConfigError(
                f"this run has multi-label targets and reports ROC-AUC, not accuracy: use {key[:-4]}_rocauc"
            )
        if key not in self.result and key.endswith("_rocauc"):
            raise ConfigError(
                f"this run reports accuracy, not ROC-AUC (its targets are one class per vertex): use {key[:-7]}_acc"
            )
        value = self.result[key]
        return None if value is None else float(value)  # None: the run had no vertices in that split

    @property
    def test_acc(self) -> float | None:
        """The test accuracy the run reported (None: the graph had no test vertices)."""
        return self._reported("test_acc")

    @property
    def val_acc(self) -> float | None:
        """The validation accuracy the run reported."""
        return self._reported("val_acc")

    @property
    def train_acc(self) -> float | None:
        """The training accuracy the run reported."""
        return self._reported("train_acc")

    @property
    def test_rocauc(self) -> float | None:
        """The test ROC-AUC (mean over the tasks) a multi-label run reported."""
        return self._reported("test_rocauc")

    @property
    def val_rocauc(self) -> float | None:
        """The validation ROC-AUC (mean over the tasks) a multi-label run reported."""
        return self._reported("val_rocauc")

    @property
    def train_rocauc(self) -> float | None:
        """The training ROC-AUC (mean over the tasks) a multi-label run reported."""
        return self._reported("train_rocauc")

    def evaluate(self, graph: Graph | None = None) -> dict[str, float | None]:
        """Accuracy on each split (``train_acc``, ``val_acc``, ``test_acc``) and ``val_loss`` on
        ``graph`` (default: the run's own), features prepared as the run prepared them; of
        multi-label targets the ROC-AUC instead (``train_rocauc``, ``val_rocauc``, ``test_rocauc``)."""
        return self._trainer(graph).evaluate()

    def predict(self, graph: Graph | None = None) -> torch.Tensor:
        """Logits (float32, on the CPU) of every vertex of ``graph`` (default: the run's own), in its vertex order."""
        return self._trainer(graph).predict().cpu()

    def classes(self, graph: Graph | None = None) -> torch.Tensor:
        """The predicted class of every vertex of ``graph`` (default: the run's own), in its vertex
        order; of multi-label targets a 0/1 int64 matrix (vertices x tasks: logit > 0)."""
        trainer = self._trainer(graph)
        logits = trainer.predict().cpu()
        return (logits > 0).to(torch.int64) if trainer.multilabel else logits.argmax(1)

    def __repr__(self) -> str:
        where = f", path={str(self.path)!r}" if self.path else ""
        key = f"test_{self.metric}"
        return f"Run(model={self.config.model!r}, dataset={self.result.get('dataset')!r}, {key}={self.result.get(key)}{where})"

    def _eval_config(self) -> TrainConfig:
        """The run's settings for evaluating in this process: one process, nothing written, and
        the feature normalisation the run applied (not re-decided on another graph)."""
        applied = self.result.get("feature_norm")
        norm = applied if applied in ("row", "none") else self.config.feature_norm
        return dataclasses.replace(self.config, **_EVAL_OFF, nprocs=1, parts_dir=None, feature_norm=norm)

    def _trainer(self, graph: Graph | None) -> Trainer:
        if graph is None:
            if self._own is None:
                from tessera.datasets import load

                cfg = self.config
                self._own = self._build(load(cfg.dataset, name=cfg.name, split=cfg.split))
            return self._own
        if self._last is None or self._last[0] is not graph:
            self._last = (graph, self._build(graph))
        return self._last[1]

    def _build(self, graph: Graph) -> Trainer:
        """A trainer on ``graph`` holding this run's weights; the caller's torch generator untouched."""
        with torch.random.fork_rng(devices=[]):
            trainer = Trainer(self._eval_config(), graph, files=False)
        weights = self._weights if self._weights is not None else self._trainer(None).model.state_dict()
        own = trainer.model.state_dict()
        for k, t in own.items():
            w = weights.get(k)
            if w is None or w.shape != t.shape:
                got = "missing" if w is None else f"shaped {tuple(w.shape)}"
                raise ConfigError(
                    f"the run's {self.config.model} model does not fit {graph.name}: weight {k} is {got}, "
                    f"a model for this graph needs {tuple(t.shape)} (other feature or class counts?)"
                )
        if set(weights) != set(own):
            raise ConfigError(f"the run's weights do not fit the {self.config.model} model built for {graph.name}")
        trainer.model.load_state_dict(weights)
        return trainer


def fit(graph: Graph | str, model: str = "gcn", **settings: Any) -> Run:
    """Train ``model`` on ``graph`` (a Graph or a dataset name) in this process and return the :class:`Run`.

    ``settings`` are named like :class:`TrainConfig`'s fields (the ``tessera train`` flags with
    ``_`` for ``-``); nothing is written unless ``out`` names a run directory."""
    settings = {"model": model, **settings}
    for k in ("nprocs", "parts_dir"):
        if settings.get(k) not in (None, 1):
            raise ConfigError(f"fit trains in this process: {k} is for `tessera train` (distributed runs)")
    if isinstance(graph, str):
        from tessera.datasets import load

        settings["dataset"] = graph
        graph = load(graph, name=settings.get("name"), split=settings.get("split"))
    elif not isinstance(graph, Graph):
        raise ConfigError(f"fit takes a Graph or a dataset name, got {type(graph).__name__}")
    else:
        settings.setdefault("dataset", graph.name)
    cfg = make_config({}, settings)
    if cfg.out is not None:
        check_out_dir(cfg.out)
    trainer = Trainer(cfg, graph, files=cfg.out is not None)
    result = trainer.fit()
    # the trainer holds the best weights now; its evaluate and predict write nothing
    return Run(cfg, result, trainer.history, trainer=trainer, path=trainer.out if trainer.files else None)


def load_run(path: str | Path) -> Run:
    """The best model of the ``tessera train`` run in directory ``path``, with its settings and result."""
    d = Path(path)
    if not d.is_dir():
        raise ConfigError(f"--run {path} is not a directory; name a run directory that `tessera train --out` wrote")
    ckpt_path = d / CHECKPOINT
    if not ckpt_path.is_file():
        raise ConfigError(f"--run {path} holds no {CHECKPOINT}; name a run directory that `tessera train` wrote")
    ckpt = load_checkpoint(ckpt_path)
    check_layout(ckpt, ckpt_path, ())
    saved = ckpt["config"]
    cfg = TrainConfig(**{k: v for k, v in saved.items() if k in FIELDS})
    cfg.validate()
    result: dict[str, Any] = {}
    if (d / RESULT).is_file():
        try:
            result = json.loads((d / RESULT).read_text())
        except (OSError, ValueError) as e:
            raise TesseraError(f"--run {path}: {RESULT} is unreadable ({e}); train the run again") from None
        if not isinstance(result, dict):
            raise TesseraError(f"--run {path}: {RESULT} holds no result; train the run again")
    weights = best_weights(ckpt)
    if not isinstance(weights, dict) or not all(isinstance(t, torch.Tensor) for t in weights.values()):
        raise TesseraError(f"--run {path}: {CHECKPOINT} holds no model weights; train the run again")
    return Run(cfg, result, list(ckpt["history"]), weights=weights, path=d)
