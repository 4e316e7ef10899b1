"""Buffers that a training step takes again every step: large CPU tensors without page faults.

Full-graph training allocates the same large shapes every step (activations, aggregation outputs,
gradients). glibc serves each block above its mmap threshold with a fresh ``mmap`` and unmaps it
on free, so every step page-faults all of them in again, a large share of a step's CPU time
(``docs/design/workspace-memory.md``). A
:class:`Workspace` keeps those blocks instead and hands one out again once nothing refers to it,
so after the first step the pages stay mapped, without changing the process's allocator (the
speed holds on any libc and inside any host process that imports tessera).

A block is free when no tensor uses it: each block is a NumPy array, each tensor handed out is
``torch.from_numpy`` of a view of it, and the tensor's storage holds a reference to that view until
the storage dies, so the block's reference count says whether any tensor still uses it. Handed-out
tensors are plain tensors (not views, storage used once): autograd may accumulate into them in
place as into any fresh tensor. Other devices have caching allocators of their own and get
``torch.empty``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager

import numpy as np
import torch

# Smaller tensors come from glibc's heap, which keeps them warm; and a small graph's step should
# not pay a lookup per tensor.
MIN_BYTES = 1 << 20
_ALIGN = 64  # a cache line, oneDNN's and MKL's preferred alignment
_HUGE = 1 << 21
_MADV_HUGEPAGE = 14
_NUMPY = {
    torch.float32: np.float32,
    torch.float64: np.float64,
    torch.float16: np.float16,
    torch.bfloat16: np.uint16,  # NumPy has no bfloat16: its bits, viewed as bfloat16 (_tensor)
    torch.int64: np.int64,
    torch.int32: np.int32,
    torch.int16: np.int16,
    torch.uint8: np.uint8,
    torch.int8: np.int8,
    torch.bool: np.bool_,
}
_libc: list = []


def chunk_rows(width: int, element_size: int, n: int, chunk_bytes: int) -> int:
    """Rows per chunk when walking ``n`` rows of ``width`` elements of ``element_size`` bytes in
    chunks of about ``chunk_bytes`` (at least 64 rows, at most ``n``, and 1 when ``n`` is 0)."""
    return max(1, min(n, max(64, chunk_bytes // (element_size * max(width, 1)))))


def advise_huge(ptr: int, nbytes: int) -> None:
    """Ask Linux for transparent huge pages behind the 2 MiB-aligned interior of ``[ptr, ptr + nbytes)``.

    Huge pages keep the TLB from missing on every gathered row, and memory the process wrote
    before is several times cheaper to write into again in them than in 4 KiB pages. Memory new
    to the process is the host's to give: on some hosts huge pages are faster there too, on others
    slower (``benchmarks/bench_startup.py --first-touch 2`` measures it); that is paid once, in the
    first step, and steady steps are faster with them (``docs/design/workspace-memory.md``). Best
    effort: any failure leaves the memory as it was."""
    if not sys.platform.startswith("linux") or _libc[:1] == [None]:
        return
    try:
        if not _libc:
            _libc.append(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True))
        a = (ptr + _HUGE - 1) & ~(_HUGE - 1)
        b = (ptr + nbytes) & ~(_HUGE - 1)
        if b > a:
            _libc[0].madvise(ctypes.c_void_p(a), ctypes.c_size_t(b - a), _MADV_HUGEPAGE)
    except (OSError, AttributeError, TypeError):
        _libc[:] = [None]


class Workspace:
    """Reusable blocks for large CPU tensors, keyed by byte size and dtype."""

    def __init__(self, min_bytes: int = MIN_BYTES) -> None:
        self.min_bytes = min_bytes
        self._blocks: dict[tuple[int, torch.dtype], list[np.ndarray]] = {}
        self._starts: set[int] = set()  # each block's address

    def empty(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of ``shape``: a free block when one fits, else a new one."""
        numel = 1
        for s in shape:
            numel *= int(s)
        if dtype not in _NUMPY or numel * _ITEMSIZE[dtype] < self.min_bytes:
            return torch.empty(tuple(shape), dtype=dtype)
        nbytes = numel * _ITEMSIZE[dtype]
        blocks = self._blocks.setdefault((nbytes, dtype), [])
        for block in blocks:
            if _free(block):
                return _tensor(block, shape, dtype)
        spare = self._spare(nbytes, dtype)
        if spare is not None:
            return _tensor(spare[:numel], shape, dtype)
        block = _new_block(numel, _NUMPY[dtype])
        blocks.append(block)
        self._starts.add(block.ctypes.data)
        return _tensor(block, shape, dtype)

    def _spare(self, nbytes: int, dtype: torch.dtype) -> np.ndarray | None:
        """The smallest free block of ``dtype`` larger than ``nbytes`` but at most twice it, or None:
        a step that asks for some rows of a full-graph tensor (a training split's) takes blocks
        whose pages are mapped already instead of holding blocks of one more size."""
        best = None
        for (size, dt), blocks in self._blocks.items():
            if dt != dtype or not nbytes < size <= 2 * nbytes or (best is not None and size >= best[0]):
                continue
            free = next((b for b in blocks if _free(b)), None)
            if free is not None:
                best = (size, free)
        return None if best is None else best[1]

    def empty_like(self, t: torch.Tensor) -> torch.Tensor:
        """:meth:`empty` with ``t``'s shape and dtype on CPU; ``torch.empty_like`` elsewhere."""
        if t.device.type != "cpu":
            return torch.empty_like(t, memory_format=torch.contiguous_format)
        return self.empty(t.shape, t.dtype)

    def zeros(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """:meth:`empty`, zero-filled."""
        return self.empty(shape, dtype).zero_()

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t``'s memory is one of this workspace's blocks: a value of one step, which
        nothing may keep anything derived from across steps."""
        return t.device.type == "cpu" and t.untyped_storage().data_ptr() in self._starts

    def held_bytes(self) -> int:
        """Bytes of every block held, in use or free."""
        return sum(n * len(b) for (n, _), b in self._blocks.items())

    def release(self) -> int:
        """Drop every free block (tensors in use keep theirs); returns the bytes dropped."""
        return self._drop(lambda block: True)

    @contextmanager
    def transient(self) -> Iterator[None]:
        """Within this block of code, the blocks it makes are dropped at its end once free: a
        measured trial's outputs, made while the step's own blocks are in use, would otherwise be
        held for the rest of the run (a products-sized GAT's first step kept a 747 MiB one)."""
        before = set(self._starts)
        try:
            yield
        finally:
            self._drop(lambda block: block.ctypes.data not in before)

    def _drop(self, which: Callable[[np.ndarray], bool]) -> int:
        """Drop the free blocks ``which`` picks; returns the bytes dropped."""
        dropped = 0
        for key, blocks in self._blocks.items():
            gone = [b for b in blocks if which(b) and _free(b)]
            dropped += key[0] * len(gone)
            self._starts.difference_update(b.ctypes.data for b in gone)
            blocks[:] = [b for b in blocks if not any(b is g for g in gone)]
        return dropped


_ITEMSIZE = {dt: np.dtype(npd).itemsize for dt, npd in _NUMPY.items()}


def _tensor(block: np.ndarray, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The tensor of ``shape`` and ``dtype`` over ``block``: not a view (autograd refuses to
    modify in place a view a custom function returned), its storage referring to ``block``."""
    t = torch.from_numpy(block.reshape(tuple(shape)))
    if t.dtype == dtype:
        return t
    return torch.empty(0, dtype=dtype).set_(t.untyped_storage(), 0, tuple(shape))  # type: ignore[call-overload]


def _free(block: np.ndarray) -> bool:
    """Whether no tensor uses ``block``. NumPy points every view's ``base`` at the array that owns
    the memory, so a tensor's view of ``block`` refers to the allocation behind it, not to
    ``block``: the allocation's references are ``block.base`` and getrefcount's argument."""
    return sys.getrefcount(block.base) == 2


def _new_block(numel: int, np_dtype: type) -> np.ndarray:
    """A ``numel``-element view, aligned to a cache line and advised onto huge pages, of a new
    allocation that only the view refers to."""
    itemsize = np.dtype(np_dtype).itemsize
    raw = np.empty(numel * itemsize + _ALIGN, np.uint8)
    offset = (-raw.ctypes.data) % _ALIGN
    block: np.ndarray = raw[offset : offset + numel * itemsize].view(np_dtype)
    advise_huge(block.ctypes.data, block.nbytes)
    return block


DEFAULT = Workspace()


def empty(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:meth:`Workspace.empty` on the process's workspace."""
    return DEFAULT.empty(shape, dtype)


def empty_like(t: torch.Tensor) -> torch.Tensor:
    """:meth:`Workspace.empty_like` on the process's workspace."""
    return DEFAULT.empty_like(t)


def contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when contiguous, else a contiguous copy of it in a workspace block: a strided
    view that a kernel copies every step (one output of a stacked product) then maps no new pages."""
    return t if t.is_contiguous() else DEFAULT.empty_like(t).copy_(t)


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """:meth:`Workspace.zeros` on the process's workspace."""
    return DEFAULT.zeros(shape, dtype)


def holds(t: torch.Tensor) -> bool:
    """:meth:`Workspace.holds` on the process's workspace."""
    return DEFAULT.holds(t)


def release() -> int:
    """:meth:`Workspace.release` on the process's workspace."""
    return DEFAULT.release()


def transient() -> AbstractContextManager[None]:
    """:meth:`Workspace.transient` on the process's workspace."""
    return DEFAULT.transient()
