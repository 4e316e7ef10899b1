"""Node-classification metrics as OGB computes them: accuracy of class ids, and the ROC-AUC of
multi-label scores averaged over the tasks (ogbn-proteins); :class:`Evaluator` is OGB's
``ogb.nodeproppred.Evaluator`` interface over them. The trainer reports the same numbers."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

#: the metric of each OGB node-property dataset, and its number of tasks
OGB_DATASETS: dict[str, tuple[str, int]] = {
    "ogbn-proteins": ("rocauc", 112),
    "ogbn-arxiv": ("acc", 1),
    "ogbn-products": ("acc", 1),
    "ogbn-mag": ("acc", 1),
    "ogbn-papers100M": ("acc", 1),
}
METRICS = ("acc", "rocauc")


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The ROC-AUC of ``scores`` for binary ``labels`` (1 positive, 0 negative): the probability that
    a random positive scores above a random negative, ties counting half (sklearn's
    ``roc_auc_score``), from the Mann-Whitney rank sum with tied scores given their average rank.
    Both classes must occur."""
    labels = np.asarray(labels).reshape(-1)
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    pos = labels == 1
    n_pos = int(pos.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        raise ValueError("ROC-AUC needs at least one positive and one negative label")
    _, inverse, counts = np.unique(scores, return_inverse=True, return_counts=True)
    ends = np.cumsum(counts, dtype=np.float64)  # 1-based rank of each distinct score's last copy
    ranks = (ends - (counts - 1) / 2.0)[inverse.reshape(-1)]  # average rank of tied scores
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def _labelled(column: np.ndarray) -> np.ndarray:
    """Which entries of a target column are labelled: not NaN (OGB's mark) and not -1 (tessera's)."""
    if column.dtype.kind == "f":
        return ~np.isnan(column) & (column != -1)
    return column != -1


def mean_rocauc(y_true: Any, y_score: Any) -> float:
    """OGB's ogbn-proteins metric: the ROC-AUC (:func:`roc_auc`) of every task (column of the
    ``(n, C)`` arrays) that has at least one positive and one negative among its labelled rows
    (NaN or -1: unlabelled), averaged over those tasks; ValueError if no task has both."""
    y_true, y_score = _numpy(y_true), _numpy(y_score)
    aucs = []
    for j in range(y_true.shape[1]):
        keep = _labelled(y_true[:, j])
        col = y_true[keep, j]
        if (col == 1).any() and (col == 0).any():
            aucs.append(roc_auc(col, y_score[keep, j]))
    if not aucs:
        raise ValueError("no task has both a positive and a negative labelled row: ROC-AUC is undefined")
    return float(sum(aucs) / len(aucs))


def accuracy(y_true: Any, y_pred: Any) -> float:
    """OGB's accuracy: per column of the ``(n, T)`` class ids, the share of labelled rows (not NaN)
    predicted right, averaged over the columns."""
    y_true, y_pred = _numpy(y_true), _numpy(y_pred)
    accs = []
    for j in range(y_true.shape[1]):
        keep = y_true[:, j] == y_true[:, j]
        accs.append(float(np.sum(y_true[keep, j] == y_pred[keep, j])) / max(int(keep.sum()), 1))
    return float(sum(accs) / len(accs))


def _numpy(a: Any) -> np.ndarray:
    return a.detach().cpu().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)


class Evaluator:
    """OGB's node-property ``Evaluator``: ``Evaluator(name="ogbn-proteins")`` (ROC-AUC) or
    ``"ogbn-arxiv"`` / ``"ogbn-products"`` / ``"ogbn-mag"`` / ``"ogbn-papers100M"`` (accuracy), or
    ``Evaluator(metric="acc" | "rocauc")`` for any number of tasks. ``eval({"y_true": ...,
    "y_pred": ...})`` takes numpy arrays or torch tensors and returns ``{"rocauc": float}`` or
    ``{"acc": float}``; inputs of the wrong kind or shape raise a ValueError naming
    :attr:`expected_input_format`."""

    def __init__(self, name: str | None = None, metric: str | None = None) -> None:
        if (name is None) == (metric is None):
            raise ValueError(
                "give an OGB dataset name (Evaluator(name='ogbn-proteins')) or a metric ('acc' or 'rocauc')"
            )
        self.name = name
        self.num_tasks: int | None = None
        if name is not None:
            if name not in OGB_DATASETS:
                raise ValueError(
                    f"no evaluator for {name!r}; known: {', '.join(OGB_DATASETS)} (or metric='acc'|'rocauc')"
                )
            metric, self.num_tasks = OGB_DATASETS[name]
        if metric not in METRICS:
            raise ValueError(f"unknown metric {metric!r}; use 'acc' or 'rocauc'")
        self.eval_metric: str = metric

    @property
    def expected_input_format(self) -> str:
        """What :meth:`eval` takes, in OGB's words."""
        tasks = self.num_tasks if self.num_tasks is not None else "num_tasks"
        head = f"==== Expected input format of Evaluator for {self.name or self.eval_metric}\n"
        if self.eval_metric == "rocauc":
            return head + (
                "{'y_true': y_true, 'y_pred': y_pred}\n"
                f"- y_true: numpy ndarray or torch tensor of shape (num_nodes, {tasks}), 0/1 (NaN: unlabelled)\n"
                f"- y_pred: numpy ndarray or torch tensor of shape (num_nodes, {tasks}), scores (logits or probabilities)\n"
                "the ROC-AUC is averaged over the tasks that have both a positive and a negative label"
            )
        return head + (
            "{'y_true': y_true, 'y_pred': y_pred}\n"
            f"- y_true: numpy ndarray or torch tensor of shape (num_nodes, {tasks}), class ids\n"
            f"- y_pred: numpy ndarray or torch tensor of shape (num_nodes, {tasks}), predicted class ids\n"
            "(y_pred = logits.argmax(dim=-1, keepdim=True))"
        )

    @property
    def expected_output_format(self) -> str:
        """What :meth:`eval` returns, in OGB's words."""
        return f"==== Expected output format of Evaluator for {self.name or self.eval_metric}\n{{'{self.eval_metric}': float}}"

    def _parse(self, input_dict: Any) -> tuple[np.ndarray, np.ndarray]:
        def fail(problem: str) -> ValueError:
            return ValueError(f"{problem}\n{self.expected_input_format}")

        if not isinstance(input_dict, dict) or "y_true" not in input_dict or "y_pred" not in input_dict:
            raise fail("eval takes a dict with the keys 'y_true' and 'y_pred'")
        arrays = []
        for key in ("y_true", "y_pred"):
            v = input_dict[key]
            if not isinstance(v, (np.ndarray, torch.Tensor)):
                raise fail(f"{key} must be a numpy ndarray or a torch tensor, got {type(v).__name__}")
            arrays.append(_numpy(v))
        y_true, y_pred = arrays
        if y_true.shape != y_pred.shape:
            raise fail(f"y_true has shape {y_true.shape} but y_pred has shape {y_pred.shape}; they must be equal")
        if y_true.ndim != 2:
            raise fail(f"y_true and y_pred must be 2-D arrays (num_nodes, num_tasks), got {y_true.ndim}-D")
        if self.num_tasks is not None and y_true.shape[1] != self.num_tasks:
            raise fail(f"{self.name} has {self.num_tasks} tasks, but the arrays have {y_true.shape[1]} columns")
        if self.eval_metric == "rocauc":
            values = y_true[_labelled(y_true)]
            if values.size and not bool(np.all((values == 0) | (values == 1))):
                raise fail("y_true of a ROC-AUC must hold 0 and 1 only (NaN: unlabelled)")
        return y_true, y_pred

    def eval(self, input_dict: dict[str, Any]) -> dict[str, float]:
        """``{"rocauc": mean ROC-AUC over the tasks}`` or ``{"acc": accuracy}`` of ``input_dict``'s
        ``y_true`` and ``y_pred``."""
        y_true, y_pred = self._parse(input_dict)
        if self.eval_metric == "rocauc":
            return {"rocauc": mean_rocauc(y_true, y_pred)}
        return {"acc": accuracy(y_true, y_pred)}

    def __repr__(self) -> str:
        return f"Evaluator({'name=' + repr(self.name) if self.name else 'metric=' + repr(self.eval_metric)})"
