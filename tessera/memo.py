"""Per-object caches kept beside the object instead of on it: a kernel's plans for a matrix live
in the kernel's own cache and vanish with the matrix."""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable
from typing import Any


class PlanCache:
    """``cache.get(obj, key, make)`` computes ``make()`` once per live ``obj`` and ``key``.

    Objects are told apart by identity (tensors compare element-wise, so they cannot be dict
    keys by value) and forgotten when they are collected. A value must not refer to ``obj``: it
    would keep ``obj`` alive for good."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[weakref.ref, dict]] = {}

    def entries(self, obj: object) -> dict:
        """The mutable dict of everything stored for ``obj``."""
        hit = self._by_id.get(id(obj))
        if hit is not None and hit[0]() is obj:
            return hit[1]
        oid = id(obj)
        ref = weakref.ref(obj, lambda r, oid=oid, by_id=self._by_id: _forget(by_id, oid, r))
        self._by_id[oid] = (ref, {})
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


def _forget(by_id: dict, oid: int, ref: weakref.ref) -> None:
    hit = by_id.get(oid)
    if hit is not None and hit[0] is ref:
        del by_id[oid]
