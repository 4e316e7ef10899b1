"""What an operand offers relational layers: an :class:`~tessera.sparse.Operand` that also holds
its rows' in-edges per relation. Operands that hold every in-edge of their rows (one process, a
partition rank's source gather, a transform-first pair exchange) implement it."""

from __future__ import annotations

from abc import abstractmethod

import torch

from tessera.errors import ConfigError
from tessera.relational.plan import Relations
from tessera.sparse.operand import Operand


class RelationalOperand(Operand):
    """An operand with per-relation structures, which relational layers (RGCN) aggregate with."""

    @abstractmethod
    def relations(self) -> Relations:
        """The per-relation structures of this operand's typed matrix."""

    def relational_sources(
        self, x: torch.Tensor, weight: torch.Tensor, reduce: str
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What :func:`~tessera.relational.variants.relational_sum` multiplies for this operand's
        rows, given ``x`` (its rows' inputs) and ``weight`` (``(R, fi, fo)``): the rows of the
        columns of :meth:`relations` (:meth:`gather_sources`' rows), and a term to add to their
        relational sum, or None. An operand over part of a graph whose remote sources are
        transformed by their owners returns ``x`` (its relations then span its own sources) and
        the received ``W_r x_j`` rows, already reduced into its rows."""
        return self.gather_sources(x)[0], None


def relational(operand: Operand) -> RelationalOperand:
    """``operand`` as a relational operand; a ConfigError in one line where it has no per-relation structure."""
    if not isinstance(operand, RelationalOperand):
        raise ConfigError(
            f"{type(operand).__name__} has no per-relation structure: RGCN runs with --strategy partition or in "
            "one process, on a typed graph"
        )
    return operand
