"""What an aggregation backend is: one class per file with declared capabilities, and the registry
``backend="name"`` is looked up in. Every backend computes the same weighted sums over the entries
of a CSR (a :class:`~tessera.graph.Graph` or a :class:`~tessera.graph.csr.CSRMatrix`); mean
scaling and autograd live in :mod:`tessera.sparse`."""

from __future__ import annotations

import weakref
from abc import ABC, abstractmethod
from typing import ClassVar

import torch

from tessera import workspace
from tessera.errors import ConfigError
from tessera.graph.csr import CSRStructure
from tessera.graph.normalize import known_mirrored
from tessera.graph.sorting import mirrored_values_equal
from tessera.memo import PlanCache


def traffic_bytes(matrix: CSRStructure, width: int, weighted: bool, transposed: bool = False) -> int:
    """Bytes a row-wise SpMM moves when every gathered row comes from memory: the CSR arrays,
    one ``width``-float row per non-zero, and each output row written once (float32)."""
    rows = matrix.num_cols if transposed else matrix.num_rows
    nnz = matrix.num_edges
    index = matrix.indices.element_size()
    return (rows + 1) * matrix.indptr.element_size() + nnz * (index + (4 if weighted else 0)) + 4 * width * (nnz + rows)


# Bytes per second of the csr kernel on gathered rows (efficiency 1.0), measured on one thread; the
# backends' per-call overheads (``call_overhead_s``) were measured on the same blocks at narrow
# widths. With them tiny per-rank products go to the reference backend and wide or large ones to
# csr, as those measurements do (docs/design/backend-selection.md).
REFERENCE_BANDWIDTH = 17e9


def changes_every_step(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a value of one step (trainable, or in a workspace block, as a
    layer's attention weights are) rather than fixed: nothing derived from it is worth keeping."""
    return weight.requires_grad or workspace.holds(weight)


class Backend(ABC):
    """An aggregation kernel set. ``x`` is ``(num_cols, F)`` or ``(num_cols, H, F)``; ``weight`` is
    ``None`` (all ones), ``(E,)`` or ``(E, H)`` in the CSR's entry order. A backend keeps whatever
    it derives from a matrix (work splits, block plans) in its own :attr:`plans`."""

    name: ClassVar[str]
    #: computes :meth:`masked_spmm` by skipping masked outputs (S-SpMM) rather than masking afterwards
    masked: ClassVar[bool] = False
    #: :meth:`spmm_t` gathers only the live rows of a gradient that is zero in most rows
    row_sparse_t: ClassVar[bool] = False
    #: effective bandwidth relative to the csr kernel, for :meth:`cost` (bench_kernels.py, arxiv, width 128)
    efficiency: ClassVar[float] = 0.5
    #: fixed seconds per call (launch, thread-pool hand-off, planning lookups), for :meth:`cost`
    call_overhead_s: ClassVar[float] = 0.0
    #: keeps a plan of a matrix's entries (O(E) memory, built on the matrix's first product, which a
    #: measured trial does not time): chosen only when it measures clearly faster (backends.select)
    keeps_entry_plan: ClassVar[bool] = False
    #: the dtypes of ``x`` this backend multiplies
    dtypes: ClassVar[tuple[torch.dtype, ...]] = (torch.float32, torch.float64)
    #: the device types on which ``auto`` considers this backend (None: every device it supports);
    #: one that also runs elsewhere does so only when named (backends.select)
    auto_devices: ClassVar[tuple[str, ...] | None] = None

    def __init__(self) -> None:
        self.plans = PlanCache()

    def transposed_weight(self, graph: CSRStructure, weight: torch.Tensor) -> torch.Tensor:
        """``weight`` in transposed-CSR order. For a weight that does not require grad (a fixed
        edge weight such as the GCN normalisation) the permuted copy is kept while ``weight`` is
        alive and its version counter unchanged, so it is permuted once, not every backward
        (docs/design/aggregation-kernels.md). Trainable weights are permuted every call: gradcheck and other
        callers change them through ``.data``, which the version counter does not see; so are
        weights in workspace blocks, each a value of one step (:func:`changes_every_step`)."""
        # perm as stored (int32 where it fits): no int64 copy of E entries kept; a fixed CPU weight
        # may be its own mirror image (below), which is checked without it
        every_step = changes_every_step(weight)
        may_mirror = not every_step and weight.dim() == 1 and weight.device.type == graph.indices.device.type == "cpu"
        t = graph.transpose(with_perm=not may_mirror)
        if every_step:
            out = workspace.empty((t.perm.numel(), *weight.shape[1:]), weight.dtype)
            return torch.index_select(weight.detach(), 0, t.perm, out=out)
        memo = self.plans.get(graph, "transposed_weight", dict)
        hit = memo.get(weight.dtype)
        if hit is not None and hit[0]() is weight and hit[1] == weight._version:
            return weight if hit[2] is None else hit[2]
        w = weight.detach()
        # a symmetric matrix's symmetric values (GCN's D^-1/2 A D^-1/2 of an undirected graph) are their own
        # transpose: no copy kept; GCN's values of an unweighted graph are known to be, with no walk to check
        mirrored = (
            may_mirror
            and t.indices is graph.indices
            and (
                known_mirrored(weight) or mirrored_values_equal(graph.indptr.numpy(), graph.indices.numpy(), w.numpy())
            )
        )
        wt = weight if mirrored else w.index_select(0, t.perm)
        self.keep_transposed_weight(graph, weight, None if mirrored else wt)
        return wt

    def keep_transposed_weight(self, graph: CSRStructure, weight: torch.Tensor, wt: torch.Tensor | None) -> None:
        """Use ``wt`` as :meth:`transposed_weight` of ``weight`` (fixed, not requiring grad) while
        ``weight`` is alive and unchanged (one permuted elsewhere, such as a shared copy; None:
        ``weight`` itself)."""
        memo = self.plans.get(graph, "transposed_weight", dict)
        memo[weight.dtype] = (weakref.ref(weight, self._forget_weight(graph, weight.dtype)), weight._version, wt)

    def _forget_weight(self, graph: CSRStructure, dtype: torch.dtype):
        """A weakref callback that drops the permuted copy kept for a weight once the weight dies:
        kept, it would hold E entries per head as long as the graph lives (a measured trial's
        attention weights on products: 784 MB per backend)."""
        graph_ref = weakref.ref(graph)

        def forget(ref: weakref.ref) -> None:
            g = graph_ref()
            memo = None if g is None else self.plans.entries(g).get("transposed_weight")
            if memo is not None and memo.get(dtype, (None,))[0] is ref:
                del memo[dtype]

        return forget

    @abstractmethod
    def spmm(self, matrix: CSRStructure, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """``out[i] = sum_{e=(j->i)} w_e * x[j]`` over the row-major CSR."""

    @abstractmethod
    def spmm_t(self, matrix: CSRStructure, g: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Transposed product ``out[j] = sum_{e=(j->i)} w_e * g[i]`` through the column-major CSR."""

    @abstractmethod
    def sddmm_dot(self, matrix: CSRStructure, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per-entry dot products ``<g[i], x[j]>`` for every entry ``j -> i`` (per head for 3-D)."""

    def masked_spmm(
        self,
        matrix: CSRStructure,
        x: torch.Tensor,
        mask: torch.Tensor,
        weight: torch.Tensor | None,
        row_scale: torch.Tensor | None,
        transposed: bool,
    ) -> torch.Tensor:
        """S-SpMM ``(diag(row_scale) A x) ⊙ mask``; only backends that declare :attr:`masked`."""
        raise NotImplementedError(f"backend {self.name!r} has no masked product")

    def supports(self, x: torch.Tensor) -> bool:
        """Whether this backend runs on ``x`` (its device and dtype)."""
        return x.device.type == "cpu" and x.dtype in self.dtypes

    def cost(self, matrix: CSRStructure, width: int, transposed: bool, weighted: bool = False) -> float:
        """Modelled seconds of one product: the bytes moved at :attr:`efficiency` times
        :data:`REFERENCE_BANDWIDTH`, plus :attr:`call_overhead_s`."""
        bandwidth = self.efficiency * REFERENCE_BANDWIDTH
        return traffic_bytes(matrix, width, weighted, transposed) / bandwidth + self.call_overhead_s


_BACKENDS: dict[str, Backend] = {}


def register_backend(backend: Backend) -> Backend:
    """Add a backend under its ``name`` (replacing one of the same name)."""
    if not isinstance(backend, Backend):
        raise TypeError(f"a backend must subclass tessera.backends.base.Backend, got {type(backend).__name__}")
    _BACKENDS[backend.name] = backend
    return backend


def get_backend(name: str) -> Backend:
    """Look a backend up by name; unknown names raise :class:`ConfigError` listing the choices."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ConfigError(
            f"unknown aggregation backend {name!r}; choose from auto, {', '.join(available_backends())}"
        ) from None


def available_backends() -> list[str]:
    """Names of the registered backends."""
    return sorted(_BACKENDS)


def check_backend(name: str) -> str:
    """``name`` when it is ``auto`` or registered, else the :func:`get_backend` error."""
    if name != "auto":
        get_backend(name)
    return name
