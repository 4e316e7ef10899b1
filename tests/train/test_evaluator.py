"""The multi-label metric and loss: ROC-AUC as OGB's ogbn-proteins evaluator computes it (sklearn's
roc_auc_score per task, ties half, tasks without both classes skipped), binary cross-entropy over
rows as torch's, and tessera.Evaluator with OGB's interface."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import tessera
from tessera.nn.loss import bce_rows
from tessera.train.evaluate import Evaluator, accuracy, mean_rocauc, roc_auc


def pairwise_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """The definition: over every (positive, negative) pair, 1 if the positive scores higher, 1/2 on a tie."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    wins = sum(1.0 if p > n else 0.5 if p == n else 0.0 for p, n in itertools.product(pos, neg))
    return wins / (pos.size * neg.size)


@pytest.mark.parametrize("seed", range(6))
def test_roc_auc_matches_the_pairwise_definition_with_ties(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(2, 60))
    labels = rng.integers(0, 2, n)
    labels[:2] = (0, 1)
    scores = rng.integers(0, 5, n).astype(np.float32)  # few distinct values: many ties
    assert roc_auc(labels, scores) == pytest.approx(pairwise_auc(labels, scores), abs=1e-12)
    cont = rng.standard_normal(n)
    assert roc_auc(labels, cont) == pytest.approx(pairwise_auc(labels, cont), abs=1e-12)


def test_roc_auc_extremes():
    assert roc_auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.2, 0.3, 0.4])) == 1.0
    assert roc_auc(np.array([1, 1, 0, 0]), np.array([0.1, 0.2, 0.3, 0.4])) == 0.0
    assert roc_auc(np.array([0, 1, 0, 1]), np.zeros(4)) == 0.5  # all tied: half
    with pytest.raises(ValueError, match="one positive and one negative"):
        roc_auc(np.array([1, 1]), np.array([0.1, 0.2]))


def test_mean_rocauc_skips_tasks_without_both_classes_and_unlabelled_rows():
    y = np.array([[1, 0, 1, 0], [0, 0, 1, 1], [1, 0, 1, 0], [0, 0, 1, 1]], dtype=np.float64)
    s = np.array([[0.9, 0.1, 0.5, 0.2], [0.1, 0.3, 0.5, 0.8], [0.4, 0.2, 0.5, 0.6], [0.6, 0.1, 0.5, 0.7]])
    # task 1 all negative and task 2 all positive: skipped; tasks 0 and 3 averaged
    expect = (pairwise_auc(y[:, 0], s[:, 0]) + pairwise_auc(y[:, 3], s[:, 3])) / 2
    assert mean_rocauc(y, s) == pytest.approx(expect)
    # an unlabelled entry (NaN, or -1 in integer targets) leaves that row out of its task only
    y_nan = y.copy()
    y_nan[3, 0] = np.nan
    keep = np.array([0, 1, 2])
    expect = (pairwise_auc(y[keep, 0], s[keep, 0]) + pairwise_auc(y[:, 3], s[:, 3])) / 2
    assert mean_rocauc(y_nan, s) == pytest.approx(expect)
    y_int = np.where(np.isnan(y_nan), -1, y_nan).astype(np.int64)
    assert mean_rocauc(torch.from_numpy(y_int), torch.from_numpy(s)) == pytest.approx(expect)
    with pytest.raises(ValueError, match="no task has both"):
        mean_rocauc(y[:, 1:3], s[:, 1:3])


def test_mean_rocauc_matches_sklearn_when_installed():
    metrics = pytest.importorskip("sklearn.metrics")  # not a dependency: the one comparison it enables
    rng = np.random.default_rng(0)
    y = rng.integers(0, 2, (300, 7))
    s = np.round(rng.standard_normal((300, 7)) + y, 1)  # rounded: ties
    expect = np.mean([metrics.roc_auc_score(y[:, j], s[:, j]) for j in range(7)])
    assert mean_rocauc(y, s) == pytest.approx(expect, abs=1e-12)


def test_bce_rows_matches_torch_value_and_gradient():
    torch.manual_seed(0)
    logits = torch.randn(30, 5, requires_grad=True)
    target = (torch.rand(30, 5) < 0.3).to(torch.int64)
    rows = torch.tensor([3, 0, 17, 29, 8])
    ref_logits = logits.detach().clone().requires_grad_(True)
    loss = bce_rows(logits, rows, target[rows])
    ref = F.binary_cross_entropy_with_logits(ref_logits[rows], target[rows].float(), reduction="sum")
    loss.backward()
    ref.backward()
    assert torch.equal(loss, ref) and torch.equal(logits.grad, ref_logits.grad)
    # every row (rows None), and an unlabelled target (-1) left out of the value and the gradient
    partial = target.clone()
    partial[4, 2] = -1
    logits.grad = None
    bce_rows(logits, None, partial).backward()
    keep = partial >= 0
    expect = F.binary_cross_entropy_with_logits(logits.detach()[keep], partial[keep].float(), reduction="sum")
    assert float(bce_rows(logits.detach(), None, partial)) == pytest.approx(float(expect), rel=1e-6)
    assert float(logits.grad[4, 2]) == 0.0


def test_evaluator_is_ogbs_interface():
    assert tessera.Evaluator is Evaluator
    ev = Evaluator(name="ogbn-proteins")
    assert ev.eval_metric == "rocauc" and ev.num_tasks == 112
    rng = np.random.default_rng(1)
    y = rng.integers(0, 2, (50, 112))
    s = rng.standard_normal((50, 112)) + y
    out = ev.eval({"y_true": y, "y_pred": s})
    assert list(out) == ["rocauc"] and out["rocauc"] == pytest.approx(mean_rocauc(y, s))
    assert ev.eval({"y_true": torch.from_numpy(y), "y_pred": torch.from_numpy(s)}) == out
    arxiv = Evaluator(name="ogbn-arxiv")
    yt = torch.tensor([[0], [2], [1], [1]])
    assert arxiv.eval({"y_true": yt, "y_pred": torch.tensor([[0], [2], [0], [1]])}) == {"acc": 0.75}
    assert Evaluator(name="ogbn-products").eval_metric == "acc"
    assert Evaluator(metric="rocauc").eval({"y_true": y[:, :3], "y_pred": s[:, :3]})["rocauc"] == pytest.approx(
        mean_rocauc(y[:, :3], s[:, :3])
    )
    assert accuracy(np.array([[1], [2]]), np.array([[1], [1]])) == 0.5


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda y, s: {"y_true": y}, "keys 'y_true' and 'y_pred'"),
        (lambda y, s: {"y_true": y.tolist(), "y_pred": s}, "numpy ndarray or a torch tensor"),
        (lambda y, s: {"y_true": y, "y_pred": s[:, :2]}, "must be equal"),
        (lambda y, s: {"y_true": y[:, 0], "y_pred": s[:, 0]}, "2-D"),
        (lambda y, s: {"y_true": y * 2, "y_pred": s}, "0 and 1 only"),
    ],
)
def test_evaluator_input_errors_name_the_expected_format(make, message):
    y = np.array([[0, 1, 1], [1, 0, 1]])
    s = np.zeros((2, 3))
    with pytest.raises(ValueError, match=message) as e:
        Evaluator(metric="rocauc").eval(make(y, s))
    assert "Expected input format" in str(e.value)


def test_evaluator_refuses_a_wrong_task_count_and_unknown_names():
    with pytest.raises(ValueError, match="112 tasks"):
        Evaluator(name="ogbn-proteins").eval({"y_true": np.zeros((2, 3)), "y_pred": np.zeros((2, 3))})
    with pytest.raises(ValueError, match="no evaluator for 'ogbn-nosuch'"):
        Evaluator(name="ogbn-nosuch")
    with pytest.raises(ValueError, match="unknown metric"):
        Evaluator(metric="f1")
    with pytest.raises(ValueError, match="give an OGB dataset name"):
        Evaluator()
