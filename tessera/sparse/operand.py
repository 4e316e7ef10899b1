"""The operand: the sparse matrix a layer aggregates with, as the primitives see it.

A layer never learns whether its operand is one process's whole graph or one rank's share of a
partitioned one; it asks the operand for the variant it needs (unweighted pattern, the graph's
own weights, GCN's normalisation, self loops for attention) and hands it to the primitives in
:mod:`tessera.sparse`. The strategies in :mod:`tessera.parallel` make operands; a plain
:class:`~tessera.graph.Graph` becomes the single-process operand through :func:`as_operand`, whose
factory the backends layer registers (it owns the kernels that operand runs on).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable

import torch

from tessera.errors import ConfigError
from tessera.graph.csr import CSRStructure


class Operand(ABC):
    """A ``num_rows x num_cols`` sparse matrix with values (``None``: all ones) and the products the
    autograd primitives are built from. Products are sums; mean scaling and autograd live in
    :mod:`tessera.sparse.aggregate`. ``x`` is ``(num_cols, F)`` or ``(num_cols, H, F)``."""

    #: whether :meth:`edge_structure` exists, i.e. per-edge values (attention) can be computed
    edge_values: bool = False

    @property
    @abstractmethod
    def num_rows(self) -> int:
        """Output rows (destination vertices this operand produces)."""

    @property
    @abstractmethod
    def num_cols(self) -> int:
        """Input rows (source vertices this operand reads)."""

    @abstractmethod
    def spmm(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """``out[i] = sum_{e=(j->i)} v_e x[j]`` with ``v`` = ``weight`` if given, else the operand's values."""

    @abstractmethod
    def spmm_t(self, g: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """The transposed product ``out[j] = sum_{e=(j->i)} v_e g[i]``."""

    @abstractmethod
    def sddmm_dot(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per-edge ``<g[i], x[j]>`` for every edge ``j -> i`` in CSR order (per head for 3-D). An
        operand whose edge values every rank holds whole but whose columns are split over the ranks
        returns this rank's share of the sum; :meth:`gather_edge_terms`'s backward adds the shares."""

    @abstractmethod
    def in_degree(self) -> torch.Tensor:
        """In-edge count of every output row over the whole graph (what ``mean`` divides by)."""

    @abstractmethod
    def pattern(self) -> Operand:
        """This operand with every value 1 (SAGE, GIN)."""

    @abstractmethod
    def weighted(self) -> Operand:
        """This operand with the graph's edge weights as values (ones where it has none)."""

    @abstractmethod
    def gcn_normalized(self, add_self_loops: bool = True, improved: bool = False) -> Operand:
        """PyG's ``gcn_norm``: remaining self loops (fill 1, or 2 when ``improved``) and values
        ``w_ji / sqrt(deg_i deg_j)`` with ``deg`` the weighted in-degree."""

    @abstractmethod
    def with_self_loops(self) -> Operand:
        """The pattern with exactly one self loop per vertex (GAT), values all ones."""

    def edge_structure(self) -> CSRStructure:
        """The CSR whose edge order per-edge values (``weight=``) follow; only where :attr:`edge_values`."""
        raise ConfigError(
            f"{type(self).__name__} cannot take per-edge values (attention): run GAT with --strategy partition "
            "or in one process"
        )

    def gather_sources(self, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Per-vertex tensors of this operand's rows extended to its columns (the rows
        :meth:`spmm` reads). Where every column is a row of this process they are the tensors
        themselves; an operand over part of a graph appends the rows of its remote sources
        (received, with their gradients sent back in backward)."""
        return xs

    def gather_edge_terms(self, src: torch.Tensor, dst: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The per-vertex terms per-edge values are computed from, extended to :meth:`edge_structure`:
        ``src`` (rows as :meth:`gather_sources` returns them) to its columns and ``dst`` (this
        operand's rows) to its rows. Where those are the same vertices they are returned as given;
        an operand whose edge structure spans vertices of other ranks gathers them."""
        return src, dst

    def edge_ids(self, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The global vertex ids of :meth:`edge_structure`'s rows and columns, given those of this
        operand's rows (what per-edge random draws are keyed by)."""
        return rows, rows

    @property
    def row_vertices(self) -> torch.Tensor | None:
        """The input row (column) each output row is the vertex of, where the rows are a selection
        (:meth:`rows_of`); None where output row ``i`` is input row ``i``'s vertex."""
        return None

    def rows_of(self, ids: torch.Tensor) -> Operand | None:
        """This operand with only the output rows ``ids`` (distinct, int64, in that order), whose
        products cost only those rows' edges: a model whose loss reads some vertices' outputs asks
        its last layer for only those. None where this operand cannot (the caller then selects the
        rows of the whole product)."""
        return None

    def masked_spmm(
        self,
        x: torch.Tensor,
        mask: torch.Tensor,
        weight: torch.Tensor | None = None,
        row_scale: torch.Tensor | None = None,
        transposed: bool = False,
    ) -> torch.Tensor:
        """``(diag(row_scale) A x) ⊙ mask`` (``A^T`` when ``transposed``): S-SpMM. This default
        computes the whole product; operands whose kernels skip masked outputs override it."""
        out = self.spmm_t(x, weight) if transposed else self.spmm(x, weight)
        if row_scale is not None:
            out = out * row_scale.view(-1, *([1] * (out.dim() - 1)))
        return out * (mask if mask.dtype == torch.bool else mask != 0)


_local_factory: list[Callable[[CSRStructure, str], Operand]] = []


def register_local(factory: Callable[[CSRStructure, str], Operand]) -> None:
    """Set how :func:`as_operand` wraps a graph or CSR matrix (the backends layer registers it)."""
    _local_factory[:] = [factory]


def as_operand(obj: Operand | CSRStructure, backend: str = "auto") -> Operand:
    """``obj`` itself when it is an operand; a graph or CSR matrix becomes the single-process
    operand over it, unweighted, computing on ``backend``."""
    if isinstance(obj, Operand):
        return obj
    if not isinstance(obj, CSRStructure):
        raise TypeError(f"expected a Graph, CSRMatrix or Operand, got {type(obj).__name__}")
    if not _local_factory:
        raise RuntimeError("no local operand registered: import tessera (which loads tessera.backends)")
    return _local_factory[0](obj, backend)


#: what layers and primitives accept as their graph operand
GraphOperand = Operand | CSRStructure
