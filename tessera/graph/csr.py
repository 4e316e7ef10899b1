"""Compressed sparse rows: the structure shared by :class:`~tessera.graph.Graph` and the
rectangular matrices a partitioned rank multiplies with, and the helpers every CSR user needs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import torch

from tessera.graph.sorting import mirror_transpose, transpose_csr

_INT32_MAX = 2**31 - 1


def index_dtype(num_nodes: int, num_edges: int) -> torch.dtype:
    """int32 when every vertex id and edge offset fits, else int64."""
    return torch.int32 if max(num_nodes, num_edges) <= _INT32_MAX else torch.int64


def rows_of(indptr: np.ndarray) -> np.ndarray:
    """The row of every entry of a CSR with row pointers ``indptr`` (int64, in entry order)."""
    indptr = np.asarray(indptr)
    return np.repeat(np.arange(indptr.size - 1, dtype=np.int64), np.diff(indptr))


def select_rows(indptr: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row pointers of the CSR made of rows ``ids`` (in that order) and, per entry of it, the
    position of that entry in the original CSR (int64)."""
    starts = indptr[ids].to(torch.int64)
    counts = indptr[ids + 1].to(torch.int64) - starts
    new_indptr = torch.zeros(ids.numel() + 1, dtype=torch.int64)
    torch.cumsum(counts, 0, out=new_indptr[1:])
    # entry k of selected row r sits at starts[r] + (k - new_indptr[r]) in the original
    offsets = torch.repeat_interleave(starts - new_indptr[:-1], counts, output_size=int(new_indptr[-1]))
    positions = offsets.add_(torch.arange(offsets.numel(), dtype=torch.int64))
    return new_indptr.to(indptr.dtype), positions


class TransposedCSR:
    """Column-major CSR of a matrix: ``indices[indptr[j]:indptr[j+1]]`` are the rows with an entry
    in column ``j`` and ``perm`` maps each transposed position to its entry id in the row-major CSR.
    ``perm`` may be given as a function that makes it on first use: a symmetric matrix's transpose
    is the matrix itself, and only products with per-edge values that differ from their mirrors'
    (attention) read it."""

    def __init__(
        self,
        indptr: torch.Tensor,
        indices: torch.Tensor,
        perm: torch.Tensor | Callable[[], torch.Tensor],
    ) -> None:
        self.indptr, self.indices = indptr, indices
        self._perm = perm

    @property
    def perm(self) -> torch.Tensor:
        """Each transposed position's entry id in the row-major CSR."""
        if callable(self._perm):
            self._perm = self._perm()
        return self._perm


class CSRStructure:
    """Derived structure of a ``num_rows x num_cols`` CSR (``indptr``, ``indices``), computed once
    per object. Only the structure's own facts are kept here; kernels keep their plans themselves."""

    indptr: torch.Tensor
    indices: torch.Tensor
    num_rows: int  # rows of the matrix (destinations)
    num_cols: int  # columns of the matrix (sources)
    edge_weight: torch.Tensor | None  # one value per entry (None: all ones)
    edge_type: torch.Tensor | None  # one relation id per entry of a typed matrix
    num_relations: int | None  # relations of a typed matrix (None: untyped)
    _structure: dict

    @property
    def num_edges(self) -> int:
        """Number of stored entries (edges)."""
        return int(self.indices.numel())

    def fingerprint(self) -> str | None:
        """A stable digest for on-disk caches; ``None`` (the default) means "do not cache on disk"."""
        return None

    def _derived(self, key: str, make):
        if key not in self._structure:
            self._structure[key] = make()
        return self._structure[key]

    def dst_index(self) -> torch.Tensor:
        """The row (destination vertex) of every entry, int64, in CSR order."""
        return self._derived("dst", lambda: torch.from_numpy(rows_of(self.indptr.numpy())))

    def src_index(self) -> torch.Tensor:
        """The column (source vertex) of every entry, int64, in CSR order."""
        return self._derived("src", lambda: self.indices.to(torch.int64))

    def in_degree(self) -> torch.Tensor:
        """Entries per row (int64): each vertex's in-edges."""
        return self._derived("indeg", lambda: (self.indptr[1:] - self.indptr[:-1]).to(torch.int64))

    def out_degree(self) -> torch.Tensor:
        """Entries per column (int64): each vertex's out-edges."""
        return self._derived("outdeg", lambda: torch.bincount(self.src_index(), minlength=self.num_cols))

    def transpose(self, with_perm: bool = False) -> TransposedCSR:
        """Column-major CSR (computed once), used by backward passes to scatter without atomics.
        A structurally symmetric matrix's shares its row pointers and sources, and its ``perm``
        is written on first use; a caller about to read ``perm`` says so (``with_perm``), so that
        the walk that finds the matrix symmetric writes it too."""

        def make() -> TransposedCSR:
            indptr, indices = self.indptr.numpy(), self.indices.numpy()
            # a symmetric matrix is its own transpose: one copy of the structure serves both
            perm = np.empty(indices.size, indptr.dtype) if with_perm else None
            if self.num_rows == self.num_cols and mirror_transpose(indptr, indices, perm):
                later = partial(_mirror_perm, self.indptr, self.indices)
                return TransposedCSR(self.indptr, self.indices, later if perm is None else torch.from_numpy(perm))
            parts = transpose_csr(indptr, indices, self.num_cols, indptr.dtype, perm)
            return TransposedCSR(*(torch.from_numpy(a) for a in parts))

        return self._derived("transpose", make)

    def on(self, device: torch.device) -> CSRStructure | DeviceCSR:
        """This structure with its arrays on ``device``: itself on the CPU, where it is built;
        elsewhere a :class:`DeviceCSR` kept with it, whose arrays are copied there once each."""
        if device.type == "cpu":
            return self
        return self._derived(f"on {device}", lambda: DeviceCSR(self, device))

    def set_transpose(self, t: TransposedCSR) -> None:
        """Use ``t`` as :meth:`transpose` (one computed elsewhere, such as a copy shared between
        processes); it must be this matrix's column-major CSR."""
        sizes = (t.indptr.numel(), t.indices.numel(), t.perm.numel())
        if sizes != (self.num_cols + 1, self.num_edges, self.num_edges):
            raise ValueError(
                f"not the transpose of this {self.num_rows} x {self.num_cols} CSR with {self.num_edges} entries"
            )
        self._structure["transpose"] = t


class DeviceCSR:
    """A host :class:`CSRStructure`'s arrays on another device (a GPU), each copied on first use
    and kept: the host computes the structure (transposes, permutations), products on the device
    read these copies, and no training step copies structure again."""

    def __init__(self, host: CSRStructure, device: torch.device) -> None:
        self.host, self.device = host, device
        self.num_rows, self.num_cols = host.num_rows, host.num_cols
        self._copies: dict[str, object] = {}

    def _copy(self, key: str, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        if key not in self._copies:
            self._copies[key] = make().to(self.device)
        return self._copies[key]  # type: ignore[return-value]

    @property
    def num_edges(self) -> int:
        """Number of stored entries (edges)."""
        return self.host.num_edges

    @property
    def indptr(self) -> torch.Tensor:
        """Row pointers on the device."""
        return self._copy("indptr", lambda: self.host.indptr)

    @property
    def indices(self) -> torch.Tensor:
        """Column of every entry on the device, in CSR order."""
        return self._copy("indices", lambda: self.host.indices)

    def dst_index(self) -> torch.Tensor:
        """The row of every entry (int64) on the device."""
        return self._copy("dst", self.host.dst_index)

    def src_index(self) -> torch.Tensor:
        """The column of every entry (int64) on the device."""
        return self._copy("src", self.host.src_index)

    def in_degree(self) -> torch.Tensor:
        """Entries per row (int64) on the device."""
        return self._copy("indeg", self.host.in_degree)

    def transpose(self, with_perm: bool = False) -> TransposedCSR:
        """The host's column-major CSR (:meth:`CSRStructure.transpose`) on the device; its ``perm``
        is copied when first read."""
        if "transpose" not in self._copies:
            t = self.host.transpose(with_perm)
            mirror = t.indptr is self.host.indptr and t.indices is self.host.indices  # a symmetric matrix's own
            self._copies["transpose"] = TransposedCSR(
                self.indptr if mirror else t.indptr.to(self.device),
                self.indices if mirror else t.indices.to(self.device),
                lambda: self.host.transpose(with_perm=True).perm.to(self.device),
            )
        return self._copies["transpose"]  # type: ignore[return-value]


def _mirror_perm(indptr: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """A symmetric CSR's transpose permutation (each entry's mirror entry), as :func:`transpose_csr`'s."""
    perm = np.empty(indices.numel(), indptr.numpy().dtype)
    mirror_transpose(indptr.numpy(), indices.numpy(), perm)
    return torch.from_numpy(perm)


@dataclass(eq=False)
class CSRMatrix(CSRStructure):
    """``num_rows x num_cols`` CSR: row ``i`` holds entries ``(indices[e], edge_weight[e])`` for
    ``e in [indptr[i], indptr[i+1])`` (``edge_weight`` None: all ones). The product ``out = M @ x``
    is an aggregation into rows from columns, so every backend runs it as it runs a graph's. A
    typed matrix (a partitioned rank's in-edges for RGCN) has ``edge_type``, one relation id per
    entry in ``[0, num_relations)``, as a typed :class:`~tessera.graph.Graph` has. A typed matrix
    holding only some of its rows' in-edges (a rank's in-edges from its own sources) gives
    ``relation_degree``: per entry, its row's in-degree within its relation over the whole graph,
    which a per-relation mean divides by (None: counted in this matrix)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    edge_weight: torch.Tensor | None
    num_rows: int
    num_cols: int
    _structure: dict = field(default_factory=dict, repr=False)
    edge_type: torch.Tensor | None = None
    num_relations: int | None = None
    relation_degree: torch.Tensor | None = None
    #: what :meth:`fingerprint` returns: set for a matrix derived from a fingerprinted graph (the
    #: rows of a training split), so its measured kernel choices are kept on disk as the graph's are
    key: str | None = None

    def fingerprint(self) -> str | None:
        return self.key

    @classmethod
    def from_numpy(
        cls, indptr: np.ndarray, indices: np.ndarray, weight: np.ndarray | None, num_rows: int, num_cols: int
    ) -> CSRMatrix:
        """Wrap numpy CSR arrays (copied into int32/int64 and float32 tensors)."""
        idt = index_dtype(max(num_rows, num_cols), int(indices.size))
        return cls(
            torch.from_numpy(np.ascontiguousarray(indptr)).to(idt),
            torch.from_numpy(np.ascontiguousarray(indices)).to(idt),
            None if weight is None else torch.from_numpy(np.ascontiguousarray(weight, dtype=np.float32)),
            int(num_rows),
            int(num_cols),
        )
