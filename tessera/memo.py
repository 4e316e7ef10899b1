"""Per-object caches kept beside the object instead of on it, and the one owner of this process's
tuning state.

A kernel's plans for a matrix live in the kernel's own :class:`PlanCache` and vanish with the
matrix; an answer about a tensor lives in a :class:`TensorMemo` while the tensor lives unmodified.
Every cache and memo registers with :data:`tuning` when it is made, and :data:`tuning` also holds
the measured library decisions and the choices tests and benchmarks force: ``tuning.reset()``
forgets them all."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import TYPE_CHECKING, Any, Generic, TypeVar

if TYPE_CHECKING:
    import torch

V = TypeVar("V")


class PlanCache:
    """``cache.get(obj, key, make)`` computes ``make()`` once per live ``obj`` and ``key``.

    Objects are told apart by identity (tensors compare element-wise, so they cannot be dict
    keys by value) and forgotten when they are collected. A value must not refer to ``obj``: it
    would keep ``obj`` alive for good."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, dict]] = {}
        tuning.register(self)

    def entries(self, obj: object) -> dict:
        """The mutable dict of everything stored for ``obj``."""
        hit = self._by_id.get(id(obj))
        if hit is not None and hit[0]() is obj:
            return hit[1]
        oid = id(obj)
        self._by_id[oid] = (weakref.ref(obj, partial(_forget, self._by_id, oid)), {})
        return self._by_id[oid][1]

    def find(self, obj: object, key: Hashable) -> Any:
        """The value stored for ``(obj, key)``, or None (nothing is stored for ``obj`` by asking)."""
        hit = self._by_id.get(id(obj))
        return hit[1].get(key) if hit is not None and hit[0]() is obj else None

    def drop(self, obj: object) -> None:
        """Forget everything stored for ``obj``."""
        hit = self._by_id.get(id(obj))
        if hit is not None and hit[0]() is obj:
            del self._by_id[id(obj)]

    def get(self, obj: object, key: Hashable, make: Callable[[], Any]) -> Any:
        """The value stored for ``(obj, key)``, made the first time it is asked for."""
        entries = self.entries(obj)
        if key not in entries:
            entries[key] = make()
        return entries[key]

    def clear(self) -> None:
        """Forget everything stored for every object."""
        self._by_id.clear()


class TensorMemo(Generic[V]):
    """``memo.get(t, make)`` computes ``make()`` once per live tensor ``t``, version and ``key``.

    Tensors are told apart by identity (an entry goes with its tensor) and in-place changes by the
    tensor's version counter (``t._version``, which every in-place operation bumps). ``key``
    (compared with ``==``) tells apart answers that depend on more than ``t``; an object whose
    ``==`` is identity (a graph, an operand) goes in as a weak reference to it, which does not keep
    it alive. With ``last_only``, only the answer stored last is kept. An answer must not refer to
    ``t``: it would keep ``t`` alive for good. Copies and pickles of a memo start empty."""

    def __init__(self, last_only: bool = False) -> None:
        self._last_only = last_only
        self._by_id: dict[int, tuple[weakref.ref, int, Hashable, tuple[V]]] = {}
        tuning.register(self)

    def find(self, t: torch.Tensor, key: Hashable = None) -> tuple[V] | None:
        """``(answer,)`` stored for ``t`` at its current version and ``key``, or None when there is
        none (an answer may itself be None)."""
        hit = self._by_id.get(id(t))
        if hit is not None and hit[0]() is t and hit[1] == t._version and hit[2] == key:
            return hit[3]
        return None

    def put(self, t: torch.Tensor, answer: V, key: Hashable = None) -> V:
        """Store ``answer`` for ``t`` at its current version and ``key``, and return it."""
        if self._last_only:
            self._by_id.clear()
        oid = id(t)
        self._by_id[oid] = (weakref.ref(t, partial(_forget, self._by_id, oid)), t._version, key, (answer,))
        return answer

    def get(self, t: torch.Tensor, make: Callable[[], V], key: Hashable = None) -> V:
        """The answer stored for ``t`` at its current version and ``key``, else ``make()``'s, stored."""
        hit = self.find(t, key)
        return hit[0] if hit is not None else self.put(t, make(), key)

    def clear(self) -> None:
        """Forget every answer."""
        self._by_id.clear()

    def __len__(self) -> int:
        return len(self._by_id)

    def __reduce__(self) -> tuple[type, tuple[bool]]:
        return type(self), (self._last_only,)


def _forget(by_id: dict, oid: int, ref: weakref.ref) -> None:
    hit = by_id.get(oid)
    if hit is not None and hit[0] is ref:
        del by_id[oid]


class TuningState:
    """What this process measured, was told, or cached about how to compute; ``reset()`` forgets it.

    - ``gemm_paths``, ``chunk_libraries``: the library for dense products and for the fused nodes'
      row chunks, per CPU, torch version, thread count and allocator
      (:mod:`tessera.dense.gemm_path`, which also keeps them on disk).
    - ``forced_gemm_path``, ``forced_chunk_library``, ``forced_native_bf16``, ``forced_backend``:
      the answer that ``gemm_path.forced``, ``gemm_path.forced_chunks``, ``widened.forced_native``
      and ``select.forced`` set for their blocks (tests and benchmarks), else None.
    - ``portable``: every step kernel runs the portable torch ops a GPU runs, on CPU tensors too
      (``--backend torch``; :func:`tessera.kernels.placement.host_kernels`).
    - every :class:`PlanCache` and :class:`TensorMemo`, registered when made: plans per matrix, the
      aggregation backend decided per matrix (:mod:`tessera.backends.select`), the last answer
      about a gradient's live rows and the non-zeros found per feature tensor.
    """

    def __init__(self) -> None:
        self.gemm_paths: dict[str, str] = {}
        self.chunk_libraries: dict[str, str] = {}
        self.forced_gemm_path: str | None = None
        self.forced_chunk_library: str | None = None
        self.forced_native_bf16: bool | None = None
        self.forced_backend: str | None = None
        self.portable = False
        self._memos: weakref.WeakSet[PlanCache | TensorMemo] = weakref.WeakSet()

    @contextmanager
    def forcing(self, name: str, value: object) -> Iterator[None]:
        """Within this block, the forced answer ``name`` (``portable`` or a ``forced_*`` field) is ``value``;
        the answer before it comes back after, whatever the block did."""
        before = getattr(self, name)
        setattr(self, name, value)
        try:
            yield
        finally:
            setattr(self, name, before)

    def register(self, memo: PlanCache | TensorMemo) -> None:
        """Clear ``memo`` on :meth:`reset` while it lives."""
        self._memos.add(memo)

    def reset(self) -> None:
        """Forget every decision, forced answer, plan and memo, as in a new process (decisions kept
        on disk under ``$TESSERA_CACHE`` stay: the next product reads them back). For tests and
        benchmarks, between runs: the next products rebuild what they use."""
        self.gemm_paths.clear()
        self.chunk_libraries.clear()
        self.forced_gemm_path = self.forced_chunk_library = self.forced_backend = None
        self.forced_native_bf16 = None
        self.portable = False
        for memo in list(self._memos):
            memo.clear()


#: this process's tuning state
tuning = TuningState()
