"""Typed records of the planner's results and their JSON form.

Every result the planner and the simulator hand on is a frozen dataclass deriving from
:class:`Record`; :meth:`Record.to_dict` turns it into plain JSON values at the edge where it is
written or printed. Fields made with :func:`private` (row matrices, row splits) stay out of the
JSON; fields made with :func:`optional` are left out while None (keys a record has only in some
uses, such as a plan's cache key). JSON keys follow the fields' order.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import field, fields, is_dataclass
from typing import Any

_PRIVATE = "private"
_OMIT_NONE = "omit_none"


def private() -> Any:
    """A field kept out of the record's JSON (and out of its equality and repr): arrays."""
    return field(repr=False, compare=False, metadata={_PRIVATE: True})


def optional(default: Any = None) -> Any:
    """A field left out of the record's JSON while it is None."""
    return field(default=default, metadata={_OMIT_NONE: True})


def field_sums(records: Sequence[object], *names: str) -> dict[str, Any]:
    """The sum of each field ``names`` over ``records``, by name."""
    return {name: sum(getattr(r, name) for r in records) for name in names}


def as_json(value: Any) -> Any:
    """``value`` with every record turned into a dict and every tuple into a list, recursively."""
    if isinstance(value, Record):
        return value.to_dict()
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [as_json(v) for v in value]
    return value


class Record:
    """Base of the planner's frozen dataclasses: their JSON form."""

    def to_dict(self) -> dict[str, Any]:
        """The record as JSON values, in field order, without its private fields and its optional
        fields that are None."""
        assert is_dataclass(self)
        out = {}
        for f in fields(self):
            if f.metadata.get(_PRIVATE):
                continue
            v = getattr(self, f.name)
            if v is None and f.metadata.get(_OMIT_NONE):
                continue
            out[f.name] = as_json(v)
        return out
