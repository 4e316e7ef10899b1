"""The single-process operand: a whole graph (or one CSR matrix) multiplied on this process's
backends, chosen per product by :mod:`tessera.backends.select` when the backend is ``auto``."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tessera.backends import select
from tessera.backends.base import Backend, available_backends, check_backend, get_backend
from tessera.backends.relational import choose_variant
from tessera.dense.liveness import live_rows
from tessera.digest import digest
from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.graph.csr import CSRMatrix, CSRStructure, select_rows
from tessera.graph.relations import require_types
from tessera.memo import PlanCache, TensorMemo
from tessera.relational.operand import RelationalOperand
from tessera.relational.plan import Relations

_derived = PlanCache()  # per graph: the normalised / self-looped graphs its variants multiply with
_row_keys: TensorMemo[tuple[str, str]] = TensorMemo()  # a tensor of row ids' digest


class LocalOperand(RelationalOperand):
    """``matrix`` with ``values`` (``None``: all ones), computed on ``backend``; ``row_vertices``
    when its rows are a selection of a graph's (:meth:`rows_of`)."""

    edge_values = True

    def __init__(
        self,
        matrix: CSRStructure,
        backend: str = "auto",
        values: torch.Tensor | None = None,
        row_vertices: torch.Tensor | None = None,
    ) -> None:
        self.matrix, self.backend, self.values = matrix, check_backend(backend), values
        self._row_vertices = row_vertices

    @property
    def row_vertices(self) -> torch.Tensor | None:
        return self._row_vertices

    def rows_of(self, ids: torch.Tensor) -> LocalOperand | None:
        if self._row_vertices is not None:
            return None
        m = self.matrix
        # The same ids every step (a training split): their digest is taken once per tensor, and the
        # rows' CSR cut once per graph and ids, on the host (ids on a device are read back then).
        key = _row_keys.get(ids, lambda: ("rows", digest("rows", [ids.cpu()])))
        sub, positions = _derived.get(m, key, lambda: _select(m, ids.cpu()))
        values = None if self.values is None else self.values[positions.to(self.values.device)]
        return LocalOperand(sub, self.backend, values, ids)

    @property
    def num_rows(self) -> int:
        return self.matrix.num_rows

    @property
    def num_cols(self) -> int:
        return self.matrix.num_cols

    def _backend(self, x: torch.Tensor, weight: torch.Tensor | None, direction: str) -> Backend:
        if self.backend != "auto":
            chosen = get_backend(self.backend)
            if not chosen.supports(x):
                raise ConfigError(
                    f"backend {self.backend!r} does not multiply {x.dtype} {x.device.type} tensors: "
                    f"use backend auto, or one of {', '.join(select.candidates(x)) or 'none'}"
                )
            return chosen
        # A backward gradient that is zero in most rows (loss on the training vertices only) goes
        # to a backend whose transposed product gathers only the live rows; the measured choice
        # was made on dense inputs.
        if direction == "backward" and live_rows(x) is not None:
            for name in available_backends():
                if get_backend(name).row_sparse_t:
                    return get_backend(name)
        return get_backend(select.choose(self.matrix, x, weight, direction))

    def spmm(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        w = self.values if weight is None else weight
        return self._backend(x, w, "forward").spmm(self.matrix, x, w)

    def spmm_t(self, g: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        w = self.values if weight is None else weight
        return self._backend(g, w, "backward").spmm_t(self.matrix, g, w)

    def sddmm_dot(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self._backend(g, None, "backward").sddmm_dot(self.matrix, g, x)

    def in_degree(self) -> torch.Tensor:
        return self.matrix.in_degree()

    def edge_structure(self) -> CSRStructure:
        return self.matrix

    def relations(self) -> Relations:
        backend = self.backend
        require_types(self.matrix)  # a GraphError on an untyped graph, before any structure is built
        return Relations(
            self.matrix, lambda m, values: LocalOperand(m, backend, values), ("local", backend), choose_variant
        )

    def masked_spmm(self, x, mask, weight=None, row_scale=None, transposed=False):
        backend = self._masked_backend()
        w = self.values if weight is None else weight
        if backend is not None and x.dim() == 2:
            return backend.masked_spmm(self.matrix, x, mask, w, row_scale, transposed)
        if backend is not None and x.dim() == 3 and (w is None or w.dim() == 1):
            n, h, f = x.shape
            flat = backend.masked_spmm(
                self.matrix, x.reshape(n, h * f), mask.reshape(mask.shape[0], h * f), w, row_scale, transposed
            )
            return flat.view(-1, h, f)
        return super().masked_spmm(x, mask, weight, row_scale, transposed)

    def _masked_backend(self) -> Backend | None:
        names = [self.backend] if self.backend != "auto" else available_backends()
        return next((get_backend(n) for n in names if get_backend(n).masked), None)

    # ------------------------------------------------------------------ variants
    def _derived_graph(self, key: tuple, what: str, make: Callable[[Graph], Graph]) -> Graph:
        """``make(matrix)``, kept per matrix under ``key``."""
        m = self.matrix
        if not isinstance(m, Graph):
            raise ConfigError(f"{what} needs a Graph, not a {type(m).__name__}")
        return _derived.get(m, key, lambda: make(m))

    def pattern(self) -> LocalOperand:
        return self if self.values is None else LocalOperand(self.matrix, self.backend)

    def weighted(self) -> LocalOperand:
        return LocalOperand(self.matrix, self.backend, self.matrix.edge_weight)

    def gcn_normalized(self, add_self_loops: bool = True, improved: bool = False) -> LocalOperand:
        g = self._derived_graph(
            ("gcn_norm", add_self_loops, improved), "GCN normalisation", lambda m: m.gcn_norm(add_self_loops, improved)
        )
        return LocalOperand(g, self.backend, g.edge_weight)

    def with_self_loops(self) -> LocalOperand:
        g = self._derived_graph(
            ("self_loops",),
            "self loops",
            lambda m: m.replace(edge_weight=None, edge_type=None, num_relations=None).add_self_loops(),
        )
        return LocalOperand(g, self.backend)


def _select(m: CSRStructure, ids: torch.Tensor) -> tuple[CSRMatrix, torch.Tensor]:
    indptr, positions = select_rows(m.indptr, ids)
    fp = m.fingerprint()
    key = None if fp is None else digest(f"rows of {fp}", [ids])
    return CSRMatrix(indptr, m.indices[positions], None, int(ids.numel()), m.num_cols, key=key), positions


def local_operand(matrix: CSRStructure, backend: str = "auto") -> LocalOperand:
    """The unweighted single-process operand of ``matrix`` on ``backend``."""
    return LocalOperand(matrix, backend)
