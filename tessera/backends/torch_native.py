"""Torch-native backend: every product through torch ops only (a sparse CSR matrix product, gathers
and sums), on the device of its input, so one code path runs on CPU and CUDA tensors alike and the
suite's CPU runs test the code a GPU runs. Nothing here reads a tensor through NumPy or numba."""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Hashable
from typing import ClassVar, NamedTuple

import torch

from tessera.backends.base import Backend, changes_every_step
from tessera.graph.csr import CSRStructure
from tessera.graph.normalize import known_mirrored
from tessera.memo import PlanCache

_SDDMM_CHUNK_FLOATS = 1 << 24  # 64 MiB of float32 per gathered temporary


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype sums run in: float32 for bfloat16 storage, else ``dtype``."""
    return torch.float32 if dtype == torch.bfloat16 else dtype


def _forget_when_dead(
    plans: PlanCache, graph: CSRStructure, key: Hashable, dtype: torch.dtype
) -> Callable[[weakref.ref], None]:
    """A weakref callback that drops what ``plans`` keep for a weight under ``key`` once the
    weight dies (kept, a copy would hold E entries as long as the graph lives)."""
    graph_ref = weakref.ref(graph)

    def forget(ref: weakref.ref) -> None:
        g = graph_ref()
        memo = None if g is None else plans.find(g, key)
        if memo is not None and memo.get(dtype, (None,))[0] is ref:
            del memo[dtype]

    return forget


class Transposed(NamedTuple):
    """Column-major CSR of a matrix on one device; ``perm`` maps each transposed position to its
    entry id in the row-major CSR, ``symmetric`` says the structure is its own transpose (then
    ``indptr`` and ``indices`` are the matrix's own)."""

    indptr: torch.Tensor
    indices: torch.Tensor
    perm: torch.Tensor
    symmetric: bool


def _csr_tensor(indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, shape: tuple[int, int]):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "sparse CSR support is in beta"
        return torch.sparse_csr_tensor(indptr, indices, values, shape, check_invariants=False)


def _matmul(indptr: torch.Tensor, indices: torch.Tensor, values: torch.Tensor, x: torch.Tensor, rows: int):
    """``A x`` for ``A`` of CSR ``(indptr, indices)``, ``rows x len(x)``: ``values`` ``(E,)`` for
    every head, or ``(H, E)`` one row per head of a 3-D ``x``."""
    shape = (rows, x.shape[0])
    # written into a fresh tensor, never returned as a view: autograd refuses in-place changes to
    # a view made inside a custom Function (aggregate adds the bias in place)
    out = x.new_empty((rows, *x.shape[1:]))
    if values.dim() == 1:  # one weight for every head: a 3-D input is one wide row
        torch.mm(_csr_tensor(indptr, indices, values, shape), x.reshape(x.shape[0], -1), out=out.view(rows, -1))
        return out
    for h in range(x.shape[1]):
        out[:, h] = _csr_tensor(indptr, indices, values[h], shape) @ x[:, h]
    return out


class TorchBackend(Backend):
    """torch's sparse CSR product (MKL on CPU, cuSPARSE on CUDA) with bfloat16 summed in float32;
    the transposed CSR and the rows of the entries built with torch ops on the input's device."""

    name = "torch"
    # Measured on the CPU, one thread (best of 40 calls): on synthetic:small at width 128 it moved
    # 0.55x the csr kernel's bytes per second (it is MKL's product, as the reference backend's), and
    # on synthetic:tiny at width 8 a call took about 7 us more than the reference backend's. No GPU
    # figure yet: on CUDA tensors it is the only backend so far, and the model only ranks it there.
    efficiency = 0.55
    call_overhead_s = 20e-6
    # the transposed CSR and its permutation, the entries' rows, the all-ones values, and a device
    # copy of the structure and fixed weights of a matrix kept elsewhere: O(E) each, per matrix
    keeps_entry_plan = True
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float64, torch.bfloat16)
    # on the CPU the numba backends are faster, and auto's choices there stay as they were: it
    # runs on CPU tensors when named (--backend torch)
    auto_devices: ClassVar[tuple[str, ...] | None] = ("cuda",)

    def supports(self, x: torch.Tensor) -> bool:
        """Whether ``x`` is a CPU or CUDA tensor of a supported dtype."""
        return x.device.type in ("cpu", "cuda") and x.dtype in self.dtypes

    # ------------------------------------------------------------------ structure on a device
    def _structure(self, graph: CSRStructure, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The matrix's ``(indptr, indices)`` on ``device`` (its own when it lives there)."""
        if graph.indptr.device == device and graph.indices.device == device:
            return graph.indptr, graph.indices
        m = graph.on(device)  # a host structure's copy on the device, kept with the structure
        return m.indptr, m.indices

    def _rows(self, graph: CSRStructure, device: torch.device) -> torch.Tensor:
        """The row of every entry (int64, CSR order) on ``device``."""

        def make() -> torch.Tensor:
            indptr = self._structure(graph, device)[0]
            counts = (indptr[1:] - indptr[:-1]).to(torch.int64)
            rows = torch.arange(graph.num_rows, device=device)
            return torch.repeat_interleave(rows, counts, output_size=graph.num_edges)

        return self.plans.get(graph, ("rows", device), make)

    def _transpose(self, graph: CSRStructure, device: torch.device) -> Transposed:
        """The column-major CSR on ``device``, built by a stable sort of the entries' columns."""

        def make() -> Transposed:
            indptr, indices = self._structure(graph, device)
            cols = indices.to(torch.int64)
            perm = torch.argsort(cols, stable=True)
            t_indptr = torch.zeros(graph.num_cols + 1, dtype=torch.int64, device=device)
            torch.cumsum(torch.bincount(cols, minlength=graph.num_cols), 0, out=t_indptr[1:])
            t_indices = self._rows(graph, device).index_select(0, perm).to(indices.dtype)
            t_indptr = t_indptr.to(indptr.dtype)
            symmetric = (
                graph.num_rows == graph.num_cols and torch.equal(t_indptr, indptr) and torch.equal(t_indices, indices)
            )
            if symmetric:  # one copy of the structure serves both directions
                t_indptr, t_indices = indptr, indices
            # kept in the index dtype (int32 where it fits): index_select takes either
            return Transposed(t_indptr, t_indices, perm.to(indices.dtype), symmetric)

        return self.plans.get(graph, ("transpose", device), make)

    def _ones(self, graph: CSRStructure, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
        return self.plans.get(
            graph, ("ones", device, dtype), lambda: torch.ones(graph.num_edges, dtype=dtype, device=device)
        )

    def _permuted_weight(self, graph: CSRStructure, weight: torch.Tensor, t: Transposed) -> torch.Tensor:
        """``weight`` in transposed-CSR order on the permutation's device. A fixed weight's copy is
        kept while it lives unchanged (:meth:`keep_transposed_weight`), and a weight known to equal
        its mirror entries on a symmetric structure is its own transpose; a weight of one step is
        permuted every call."""
        if changes_every_step(weight):
            return weight.detach().to(t.perm.device).index_select(0, t.perm)
        memo = self.plans.get(graph, "transposed_weight", dict)
        hit = memo.get(weight.dtype)
        if hit is not None and hit[0]() is weight and hit[1] == weight._version:
            return weight if hit[2] is None else hit[2]
        mirrored = t.symmetric and weight.dim() == 1 and known_mirrored(weight)
        wt = None if mirrored else weight.detach().to(t.perm.device).index_select(0, t.perm)
        self.keep_transposed_weight(graph, weight, wt)
        return weight if wt is None else wt

    def _on_device(self, graph: CSRStructure, weight: torch.Tensor, device: torch.device) -> torch.Tensor:
        """``weight`` on ``device``. A fixed weight kept elsewhere (a host graph's edge weights under
        a GPU step) is copied once while it lives unchanged, not every product."""
        if weight.device == device or changes_every_step(weight):
            return weight.detach().to(device)
        key = ("weight_on", device)
        memo = self.plans.get(graph, key, dict)
        hit = memo.get(weight.dtype)
        if hit is not None and hit[0]() is weight and hit[1] == weight._version:
            return hit[2]
        copy = weight.detach().to(device)
        ref = weakref.ref(weight, _forget_when_dead(self.plans, graph, key, weight.dtype))
        memo[weight.dtype] = (ref, weight._version, copy)
        return copy

    # ------------------------------------------------------------------ products
    def _run(self, graph: CSRStructure, x: torch.Tensor, weight: torch.Tensor | None, transposed: bool) -> torch.Tensor:
        rows = graph.num_cols if transposed else graph.num_rows
        if weight is not None and weight.dim() == 2 and (x.dim() != 3 or weight.shape[1] != x.shape[1]):
            raise ValueError(
                f"per-head weights {tuple(weight.shape)} need x (N, H, F) with H heads, got {tuple(x.shape)}"
            )
        if rows == 0 or x.numel() == 0 or graph.num_edges == 0:
            return x.new_zeros((rows, *x.shape[1:]))
        device, dt = x.device, compute_dtype(x.dtype)
        if transposed:
            t = self._transpose(graph, device)
            indptr, indices = t.indptr, t.indices
            w = None if weight is None else self._permuted_weight(graph, weight, t)
        else:
            indptr, indices = self._structure(graph, device)
            w = weight
        if w is None:
            values = self._ones(graph, device, dt)
        else:
            values = self._on_device(graph, w, device).to(dt)
            values = values.t().contiguous() if values.dim() == 2 else values
        out = _matmul(indptr, indices, values, x.detach().to(dt).contiguous(), rows)
        return out.to(x.dtype)

    def spmm(self, matrix: CSRStructure, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """``out[i] = sum_{e=(j->i)} w_e * x[j]`` over the row-major CSR."""
        return self._run(matrix, x, weight, transposed=False)

    def spmm_t(self, matrix: CSRStructure, g: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """``out[j] = sum_{e=(j->i)} w_e * g[i]`` over the column-major CSR built on ``g``'s device."""
        return self._run(matrix, g, weight, transposed=True)

    def sddmm_dot(self, matrix: CSRStructure, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per-entry ``<g[i], x[j]>`` (per head for 3-D), summed in float32 for bfloat16 rows."""
        device, dt = g.device, compute_dtype(g.dtype)
        out = g.new_empty((matrix.num_edges, *g.shape[1:-1]), dtype=dt)
        if matrix.num_edges == 0:
            return out
        indices = self._structure(matrix, device)[1]
        rows = self._rows(matrix, device)
        g, x = g.detach(), x.detach()
        # in edge chunks: gathering both endpoints of every edge at once would hold two E x heads
        # x F temporaries (gigabytes for GAT on an arxiv-sized graph)
        step = max(1, _SDDMM_CHUNK_FLOATS // max(1, g[0].numel() if g.shape[0] else 1))
        for e0 in range(0, matrix.num_edges, step):
            e1 = min(matrix.num_edges, e0 + step)
            a = g.index_select(0, rows[e0:e1]).to(dt)
            b = x.index_select(0, indices[e0:e1]).to(dt)
            torch.sum(a.mul_(b), -1, out=out[e0:e1])
        return out
