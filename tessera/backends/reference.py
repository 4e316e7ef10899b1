"""Reference backend: torch's sparse CSR matrix product (MKL on CPU), per head for 3-D inputs."""

from __future__ import annotations

import warnings

import torch

from tessera import workspace
from tessera.backends.base import Backend
from tessera.graph.csr import CSRStructure

_SDDMM_CHUNK_FLOATS = 1 << 24  # 64 MiB of float32 per gathered temporary


def _csr(indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        return torch.sparse_csr_tensor(indptr, indices, values, shape, check_invariants=False)


def _matmul(indptr, indices, values, x, shape, perm=None):
    """``A x`` for ``A`` of CSR ``(indptr, indices)`` and ``values`` (per head when 2-D), taken
    in the order ``perm`` when given. Head by head, each written into its slice of the output:
    no E x heads copy of the values and no list of per-head outputs (on a products-sized GAT a
    measured trial of this backend held 1.7 GB above the step's own memory)."""
    if x.dim() == 2:
        a = _csr(indptr, indices, values if perm is None else values.index_select(0, perm), shape)
        if x.device.type != "cpu":
            return a @ x
        # into a kept block; MKL still maps one temporary of the output's size per call
        return torch.mm(a, x, out=workspace.empty((shape[0], x.shape[1]), x.dtype))
    out = (
        workspace.empty((shape[0], *x.shape[1:]), x.dtype)
        if x.device.type == "cpu"
        else x.new_empty(shape[0], *x.shape[1:])
    )
    for h in range(x.shape[1]):
        vh = values if values.dim() == 1 else values[:, h]
        vh = vh.contiguous() if perm is None else vh.index_select(0, perm)
        out[:, h] = _csr(indptr, indices, vh, shape) @ x[:, h]
    return out


class ReferenceBackend(Backend):
    """Plain torch: correct everywhere, used as the ground truth for the fast backends."""

    name = "reference"
    efficiency = 0.6
    call_overhead_s = 12e-6
    keeps_entry_plan = True  # the unweighted products' all-ones values

    def _ones(self, graph: CSRStructure, dtype: torch.dtype) -> torch.Tensor:
        return self.plans.get(graph, ("ones", dtype), lambda: torch.ones(graph.num_edges, dtype=dtype))

    def spmm(self, graph: CSRStructure, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        values = self._ones(graph, x.dtype) if weight is None else weight.to(x.dtype)
        return _matmul(graph.indptr, graph.indices, values, x.contiguous(), (graph.num_rows, graph.num_cols))

    def spmm_t(self, graph: CSRStructure, g: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        shape = (graph.num_cols, graph.num_rows)
        if weight is not None and weight.dim() == 2:  # per-head weights: permuted head by head
            t = graph.transpose(with_perm=True)
            return _matmul(t.indptr, t.indices, weight.to(g.dtype), g.contiguous(), shape, t.perm)
        t = graph.transpose()
        values = self._ones(graph, g.dtype) if weight is None else self.transposed_weight(graph, weight.to(g.dtype))
        return _matmul(t.indptr, t.indices, values, g.contiguous(), shape)

    def sddmm_dot(self, graph: CSRStructure, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        # In edge chunks: gathering both endpoints for all edges at once would hold two
        # E x heads x F temporaries (gigabytes for GAT on an arxiv-sized graph).
        dst, src = graph.dst_index(), graph.src_index()
        out = g.new_empty((graph.num_edges, *g.shape[1:-1]))
        step = max(1, _SDDMM_CHUNK_FLOATS // max(1, g[0].numel() if g.shape[0] else 1))
        for e0 in range(0, graph.num_edges, step):
            e1 = min(graph.num_edges, e0 + step)
            torch.sum(g.index_select(0, dst[e0:e1]) * x.index_select(0, src[e0:e1]), -1, out=out[e0:e1])
        return out
