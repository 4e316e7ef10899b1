"""Per-object caches and the one owner of the tuning state: answers kept while their object lives
unmodified, and ``tuning.reset()`` forgetting every decision, forced answer, plan and memo."""

from __future__ import annotations

import copy
import gc
import pickle
import weakref

import torch

from tessera.dense import gemm_path
from tessera.memo import PlanCache, TensorMemo


class _Identified:
    """An object whose ``==`` is identity, as a graph's is."""


def test_a_tensor_memo_keeps_an_answer_per_tensor_version_and_key():
    memo: TensorMemo[object] = TensorMemo()
    x, y = torch.zeros(3), torch.zeros(3)
    calls = []

    def make(tag: str) -> object:
        calls.append(tag)
        return None if tag == "none" else [tag]

    first = memo.get(x, lambda: make("x"))
    assert memo.get(x, lambda: make("again")) is first and calls == ["x"]
    assert memo.get(y, lambda: make("none")) is None and memo.find(y) == (None,)  # None is an answer
    assert memo.get(y, lambda: make("again")) is None and calls == ["x", "none"]
    x.add_(1)  # in place: a new version, a new answer
    assert memo.find(x) is None and memo.get(x, lambda: make("x1")) == ["x1"]
    graph, other = _Identified(), _Identified()
    assert memo.get(x, lambda: make("keyed"), key=(weakref.ref(graph), 2)) == ["keyed"]
    assert memo.get(x, lambda: make("again"), key=(weakref.ref(graph), 2)) == ["keyed"]
    assert memo.find(x, key=(weakref.ref(other), 2)) is None and memo.find(x, key=(weakref.ref(graph), 3)) is None
    assert len(memo) == 2
    del y
    gc.collect()
    assert len(memo) == 1  # the entry went with its tensor


def test_a_last_only_memo_keeps_one_answer_and_copies_start_empty():
    memo: TensorMemo[int] = TensorMemo(last_only=True)
    x, y = torch.zeros(2), torch.zeros(2)
    memo.put(x, 1)
    memo.put(y, 2)
    assert memo.find(x) is None and memo.find(y) == (2,) and len(memo) == 1
    for other in (copy.deepcopy(memo), pickle.loads(pickle.dumps(memo))):
        assert len(other) == 0 and other.find(y) is None
        other.put(x, 3)
        assert other.find(x) == (3,) and memo.find(x) is None


def test_reset_forgets_decisions_forced_answers_plans_and_memos(fresh_tuning):
    plans, memo = PlanCache(), TensorMemo[int]()
    x = torch.zeros(2)
    plans.entries(x)["plan"] = 1
    memo.put(x, 1)
    fresh_tuning.gemm_paths["some cpu"] = "mkl"
    with gemm_path.forced("mkl"), gemm_path.forced("onednn"), gemm_path.forced_chunks("onednn"):
        assert (gemm_path.gemm_path(), gemm_path.chunk_library()) == ("onednn", "onednn")
        fresh_tuning.reset()
        assert fresh_tuning.forced_gemm_path is None and fresh_tuning.forced_chunk_library is None
    with gemm_path.forced("mkl"):
        with gemm_path.forced("onednn"):
            fresh_tuning.reset()
        assert gemm_path.gemm_path() == "mkl"  # a block restores the answer outside it
    assert fresh_tuning.forced_gemm_path is None
    assert plans.find(x, "plan") is None and memo.find(x) is None and not fresh_tuning.gemm_paths
