"""Rectangular CSR matrices that the aggregation backends accept alongside ``Graph``."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from tessera.graph.graph import Memo, TransposedCSR, index_dtype


@dataclass(eq=False)
class CSRMatrix(Memo):
    """``num_rows x num_cols`` CSR: row ``i`` holds entries ``(indices[e], weight[e])`` for
    ``e in [indptr[i], indptr[i+1])``. Quacks like :class:`Graph` for the backends: the product
    ``out = M @ x`` is an aggregation into rows from columns."""

    indptr: torch.Tensor
    indices: torch.Tensor
    weight: torch.Tensor | None
    num_rows: int
    num_cols: int
    _cache: dict = field(default_factory=dict, repr=False)

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

    @property
    def num_edges(self) -> int:
        """Number of stored entries."""
        return int(self.indices.numel())

    @property
    def edge_weight(self) -> torch.Tensor | None:
        """The entry values (``None`` means all ones)."""
        return self.weight

    def dst_index(self) -> torch.Tensor:
        """Row of every entry (int64)."""
        return self.cached(
            "dst",
            lambda: torch.repeat_interleave(torch.arange(self.num_rows), (self.indptr[1:] - self.indptr[:-1]).long()),
        )

    def src_index(self) -> torch.Tensor:
        """Column of every entry (int64)."""
        return self.cached("src", lambda: self.indices.long())

    def in_degree(self) -> torch.Tensor:
        """Entries per row."""
        return (self.indptr[1:] - self.indptr[:-1]).long()

    def transpose(self) -> TransposedCSR:
        """Column-major view (cached): the CSR of the transpose plus the entry permutation."""

        def make() -> TransposedCSR:
            cols = self.src_index()
            perm = torch.argsort(cols * max(self.num_rows, 1) + self.dst_index(), stable=True)
            indptr = torch.zeros(self.num_cols + 1, dtype=torch.int64)
            indptr[1:] = torch.cumsum(torch.bincount(cols, minlength=self.num_cols), 0)
            idt = self.indptr.dtype
            return TransposedCSR(indptr.to(idt), self.dst_index()[perm].to(idt), perm.to(idt))

        return self.cached("transpose", make)
