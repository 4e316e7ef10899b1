"""Triton backend: CSR SpMM (forward and transposed) and the per-entry dot products as Triton
kernels, for CUDA tensors; on CPU tensors they run in Triton's interpreter (``TRITON_INTERPRET=1``),
which is how the suite tests them on a machine without a GPU.

Work split (:func:`row_items`). The unit of work is an *item*: a whole row when it has at most
:attr:`TritonBackend.chunk` entries, else one piece of ``chunk`` consecutive entries of a hub row
(a hub of ``d`` entries is ``ceil(d / chunk)`` items, so it never serialises the product on one
program). Items are ordered by entry count, largest first, and a program takes ``ROWS`` consecutive
items and one block of ``BLOCK_F`` features of one head: items of about equal length share a
program, so its ``ROWS x BLOCK_E x BLOCK_F`` tile is seldom idle, and it steps through their
entries ``BLOCK_E`` at a time. A whole row's item writes its output row (an empty row writes
zeros); a piece writes its float32 (float64) partial sum into a scratch row, and a second kernel
adds each hub's pieces in piece order. No atomics: every output is summed in an order fixed by the
tile, so results do not depend on scheduling, and bfloat16 rows are rounded once, after the sum.

bfloat16 rows are read and written as their bits (int16) and widened / rounded to nearest even in
integer arithmetic: Triton's interpreter truncates on ``.to(tl.bfloat16)`` where the GPU rounds, so
the explicit rounding makes both, and the numba kernels, agree bit for bit. Sums run in float32
(float64 for float64 rows). Weights are cast to that dtype.

``sddmm_dot`` is a Triton kernel too: one program per block of entries and one head, looping over
the features (entry-parallel, so hubs need no split).

Tile sizes (:class:`Tile`) are a first guess on the GPU, unmeasured; in the interpreter, where each
operation costs the same whatever its size, programs take far larger tiles (the same code).

The backend takes no part in ``auto`` on the CPU: it supports CPU tensors only under the
interpreter, it names CUDA as its only ``auto`` device (:attr:`TritonBackend.auto_devices`), and
under the interpreter its modelled cost is infinite (so a measured trial, such as ``tessera
kernels``'s, never ranks it either).
"""

from __future__ import annotations

import math
import os
from typing import ClassVar, NamedTuple

import torch

from tessera.backends.base import Backend
from tessera.bfloat16 import compute_dtype
from tessera.graph.csr import CSRStructure

#: entries per hub piece: rows with more entries are split into pieces of this many
DEFAULT_CHUNK = 512


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernels():
    """The Triton kernels, imported on first use."""
    from tessera.kernels import triton_csr_kernels

    return triton_csr_kernels


def interpreted() -> bool:
    """Whether Triton kernels run in Triton's interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


class Tile(NamedTuple):
    """A program's tile: about ``values`` elements, ``block_e`` entries per item per step, at most
    ``max_block_f`` features and ``max_rows`` items."""

    values: int
    block_e: int
    max_block_f: int
    max_rows: int

    def block_f(self, width: int) -> int:
        """Features per program: ``width`` rounded up to a power of two, at least 16, at most :attr:`max_block_f`."""
        return min(self.max_block_f, max(16, _next_power_of_2(max(1, width))))

    def rows(self, width: int, items: int) -> int:
        """Items per program at this width (a power of two, no more than ``items`` needs)."""
        fit = max(1, self.values // (self.block_e * self.block_f(width)))
        return min(self.max_rows, 1 << (fit.bit_length() - 1), _next_power_of_2(max(1, items)))

    def entries(self, width: int, total: int) -> int:
        """Entries per program of the entry-parallel kernels (a power of two, at least 16, no
        more than ``total`` entries need)."""
        fit = max(16, self.values // self.block_f(width))
        return min(1 << (fit.bit_length() - 1), max(16, _next_power_of_2(total)))


GPU_TILE = Tile(values=4096, block_e=8, max_block_f=128, max_rows=32)
INTERPRETER_TILE = Tile(values=1 << 19, block_e=32, max_block_f=1024, max_rows=64)


# ---------------------------------------------------------------------------------- kernels
# ---------------------------------------------------------------------------------- work split
class Items(NamedTuple):
    """The items of one CSR, largest first: per item its row, entry range ``lo:hi`` and scratch
    slot (-1: a whole row, written directly; else a hub's piece); the hub rows and, per hub,
    its pieces' slots ``hub_ptr[r]:hub_ptr[r + 1]`` (in piece order)."""

    row: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    slot: torch.Tensor
    hub_rows: torch.Tensor
    hub_ptr: torch.Tensor

    @property
    def slots(self) -> int:
        """Scratch rows the hubs' pieces write."""
        return int(self.hub_ptr[-1])


def row_items(indptr: torch.Tensor, chunk: int) -> Items:
    """The items of a CSR with row pointers ``indptr``: rows of at most ``chunk`` entries whole,
    longer rows cut into pieces of ``chunk`` entries (the last one shorter), ordered by entry
    count, largest first (a stable order: ties keep row order)."""
    ip = indptr.to(torch.int64)
    deg = ip[1:] - ip[:-1]
    hub = deg > chunk
    pieces = torch.where(hub, (deg + chunk - 1) // chunk, torch.ones_like(deg))
    total = int(pieces.sum())
    row = torch.repeat_interleave(torch.arange(deg.numel(), device=ip.device), pieces, output_size=total)
    k = torch.arange(total, device=ip.device) - (torch.cumsum(pieces, 0) - pieces)[row]
    lo = ip[row] + k * chunk
    hi = torch.minimum(lo + chunk, ip[row + 1])
    in_hub = hub[row]
    slot = torch.where(in_hub, torch.cumsum(in_hub, 0) - 1, torch.full_like(row, -1))
    order = torch.sort(hi - lo, descending=True, stable=True).indices
    hub_rows = torch.nonzero(hub).flatten()
    hub_ptr = torch.zeros(hub_rows.numel() + 1, dtype=torch.int64, device=ip.device)
    torch.cumsum(pieces[hub_rows], 0, out=hub_ptr[1:])
    dt = indptr.dtype  # int32 when every entry offset fits
    row, lo, hi, slot = (t[order].to(dt) for t in (row, lo, hi, slot))
    return Items(row, lo, hi, slot, hub_rows.to(dt), hub_ptr)


def bits(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernels read it: bfloat16 as its int16 bits."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t


def on_device(matrix: CSRStructure, device: torch.device) -> CSRStructure:
    """``matrix`` with its arrays on ``device`` (itself when they are there already)."""
    return matrix if matrix.indptr.device == device else matrix.on(device)  # type: ignore[return-value]


class TritonBackend(Backend):
    """Triton CSR kernels, hub rows split into fixed-size pieces; deterministic, no atomics."""

    name = "triton"
    efficiency = 1.0  # unmeasured on a GPU
    call_overhead_s = 10e-6
    dtypes = (torch.float32, torch.float64, torch.bfloat16)
    #: ``auto`` chooses it on CUDA tensors only: on CPU ones it runs in Triton's interpreter
    auto_devices: ClassVar[tuple[str, ...]] = ("cuda",)

    def __init__(self, chunk: int = DEFAULT_CHUNK, tile: Tile | None = None) -> None:
        super().__init__()
        self.chunk = chunk
        self.tile = tile  # None: GPU_TILE, or INTERPRETER_TILE under the interpreter

    def tile_for(self) -> Tile:
        """The tile the kernels run with now."""
        return self.tile if self.tile is not None else INTERPRETER_TILE if interpreted() else GPU_TILE

    def supports(self, x: torch.Tensor) -> bool:
        """CUDA tensors of :attr:`dtypes`; CPU ones only under Triton's interpreter."""
        here = x.device.type == "cuda" or (x.device.type == "cpu" and interpreted())
        return here and x.dtype in self.dtypes

    def cost(self, matrix: CSRStructure, width: int, transposed: bool, weighted: bool = False) -> float:
        """The base model on the GPU; infinite under the interpreter, so ``auto`` never picks it there."""
        return math.inf if interpreted() else super().cost(matrix, width, transposed, weighted)

    def items(self, matrix: CSRStructure, indptr: torch.Tensor, transposed: bool) -> Items:
        """:func:`row_items` of ``matrix`` (its transpose), kept in this backend's plans."""
        key = ("triton_items", transposed, self.chunk, str(indptr.device))
        return self.plans.get(matrix, key, lambda: row_items(indptr, self.chunk))

    def _run(self, matrix: CSRStructure, transposed: bool, x: torch.Tensor, weight: torch.Tensor | None):
        x = x.detach().contiguous()
        m = on_device(matrix, x.device)
        perm = None
        if transposed:
            t = m.transpose(with_perm=weight is not None)
            indptr, indices = t.indptr, t.indices
            perm = None if weight is None else t.perm
            rows = matrix.num_cols
        else:
            indptr, indices = m.indptr, m.indices
            rows = matrix.num_rows
        heads, width = (x.shape[1], x.shape[2]) if x.dim() == 3 else (1, x.shape[1])
        per_head = weight is not None and weight.dim() == 2
        if weight is not None and per_head and (x.dim() != 3 or weight.shape[1] != heads):
            raise ValueError(
                f"per-head weights {tuple(weight.shape)} need x of (N, {weight.shape[1]}, F), got {tuple(x.shape)}"
            )
        if x.dim() == 3 and not per_head:  # one weight for every head: one wide row
            heads, width = 1, heads * width
        out = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        if rows == 0 or width == 0 or heads == 0:
            return out
        if matrix.num_edges == 0:
            return out.zero_()
        acc = compute_dtype(x.dtype)
        w = x if weight is None else weight.detach().to(acc).contiguous()
        items = self.items(matrix, indptr, transposed)
        part = torch.empty((max(1, items.slots), heads * width), dtype=acc, device=x.device)
        tile = self.tile_for()
        bf, nr = tile.block_f(width), tile.rows(width, items.row.numel())
        nfb = _cdiv(width, bf)
        bf16 = x.dtype == torch.bfloat16
        k = _kernels()
        k.spmm_kernel[(_cdiv(items.row.numel(), nr), heads * nfb)](
            indices, w, indices if perm is None else perm, bits(x), bits(out), part,
            items.row, items.lo, items.hi, items.slot, items.row.numel(), width, heads, nfb,
            HAS_W=weight is not None, HAS_PERM=perm is not None, W_PER_HEAD=per_head,
            HAS_PIECES=items.hub_rows.numel() > 0, BF16=bf16,
            ACC=k.TL_DTYPE[acc], ROWS=nr, BLOCK_E=tile.block_e, BLOCK_F=bf,
        )  # fmt: skip
        if items.hub_rows.numel():
            k.combine_kernel[(items.hub_rows.numel(), heads * nfb)](
                part, bits(out), items.hub_rows, items.hub_ptr, width, heads, nfb, BF16=bf16, BLOCK_F=bf
            )
        return out

    def spmm(self, matrix: CSRStructure, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """``out[i] = sum_{e=(j->i)} w_e * x[j]`` over the row-major CSR."""
        return self._run(matrix, False, x, weight)

    def spmm_t(self, matrix: CSRStructure, g: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """``out[j] = sum_{e=(j->i)} w_e * g[i]`` over the column-major CSR, weights read through its ``perm``."""
        return self._run(matrix, True, g, weight)

    def sddmm_dot(self, matrix: CSRStructure, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``<g[i], x[j]>`` per entry ``j -> i`` (per head for 3-D), float32 for bfloat16 rows."""
        squeeze = g.dim() == 2
        g3 = (g.unsqueeze(1) if squeeze else g).detach().contiguous()
        x3 = (x.unsqueeze(1) if squeeze else x).detach().to(g.dtype).contiguous()
        heads, width = g3.shape[1], g3.shape[2]
        out = torch.zeros((matrix.num_edges, heads), dtype=compute_dtype(g.dtype), device=g.device)
        if matrix.num_edges and heads and width:
            m = on_device(matrix, g.device)
            tile = self.tile_for()
            bf, be = tile.block_f(width), tile.entries(width, matrix.num_edges)
            k = _kernels()
            k.sddmm_kernel[(_cdiv(matrix.num_edges, be), heads)](
                m.indices, m.dst_index(), bits(g3), bits(x3), out, matrix.num_edges, width, heads,
                BF16=g.dtype == torch.bfloat16, ACC=k.TL_DTYPE[compute_dtype(g.dtype)], BLOCK_E=be, BLOCK_F=bf,
            )  # fmt: skip
        return out.squeeze(1) if squeeze else out
