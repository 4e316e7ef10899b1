"""Dense-block backend: locality-aware chunks computed as small dense GEMMs (NeutronAscend §6).

The destination rows are chunked with the greedy locality-aware algorithm
(:func:`tessera.graph.chunking.locality_chunks`, Alg. 2; chunk size from the L2 cache-size rule),
each chunk is column-compressed to the sources that at least ``min_col_density`` of its rows read,
and a chunk whose compressed block holds enough edges is computed as ``A_k @ H[N_k]`` with torch's
(MKL) GEMM: ``A_k`` is ``|chunk| x |N_k|`` with edge multiplicities (or weights) summed. Every
other edge, sparse columns of dense chunks and all edges of sparse chunks, forms a remainder CSR
computed by the backend it is given as ``remainder`` (the ``csr`` backend in the registry).
Blocks of equal row count and similar width are padded to a common width and run as one batched GEMM (``torch.bmm``), so a product costs a few torch calls rather than
three per block. Blocks write disjoint output rows, so the result is deterministic.

The backward product ``A^T g`` is the forward product of the transposed graph with its own
chunking (for a structurally symmetric graph, such as every undirected graph, the forward
structure is reused and only the weights are permuted). The gather ``H[N]`` of the next batch
can run on a helper thread while the current GEMM runs (``pipeline``; off by default: it did not
measure faster, see ``benchmarks/bench_dense_block.py``). 3-D inputs (heads), ``(E, H)`` weights
and ``sddmm_dot`` are delegated to the ``remainder`` backend, and so is everything when no chunk
is dense enough (then ``dense_block`` is exactly its remainder backend).

Chunking and compression depend on the structure only: they are computed once per graph and
kept in this backend's plans; unweighted block values are cached per dtype, weighted ones are
scattered from the weights on every call.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import torch

from tessera import workspace
from tessera.backends.base import Backend
from tessera.graph.chunking import DenseBlocks, chunk_rows_for_cache, compress, locality_chunking
from tessera.graph.csr import CSRMatrix, CSRStructure, TransposedCSR

_SMALL_REMAINDER = 1024


@dataclass
class DenseBlockConfig:
    """Tuning knobs. ``min_col_density``: a column joins a chunk's dense block when at least this
    share of the chunk's rows reads it (this bounds the block's density from below);
    ``min_block_nnz``: fewer edges in a block than this and the chunk stays sparse (a GEMM call
    has a fixed cost); ``chunk_rows``: ``None`` applies the cache-size rule; ``batch_cols``:
    blocks of equal row count and similar column count (padded up to one of a few sizes) run as one
    batched GEMM gathering at most this many source rows (0: one GEMM per block, no padding);
    ``pipeline``: gather the next batch on a helper thread during the current GEMM."""

    min_col_density: float = 0.3
    min_block_nnz: int = 4096
    chunk_rows: int | None = None
    batch_cols: int = 32768
    pipeline: bool = False


@dataclass(eq=False)
class BlockPlan:
    """Everything one direction's product needs, as torch tensors. Batch ``i`` holds ``B`` blocks
    of ``r`` rows and ``c`` (padded) columns: output rows ``rows[i]`` (``B * r``), gathered source
    rows ``cols[i]`` (``B * c``; padding repeats a column whose value is zero) and values
    ``[off, off + B * r * c)`` of the flat buffer, laid out ``(B, r, c)``."""

    blocks: DenseBlocks
    rows: list
    cols: list
    shapes: list  # per batch: (B, r, c, value offset)
    num_values: int
    dense_eid: torch.Tensor
    dense_pos: torch.Tensor
    remainder: CSRMatrix | None  # None: no dense block, the whole product goes to the CSR kernel
    rem_eid: torch.Tensor
    _values: dict = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_batches(self) -> int:
        return len(self.shapes)

    def values(self, dtype: torch.dtype, weight: torch.Tensor | None) -> torch.Tensor:
        """The flat buffer of all blocks' values: edge multiplicities (cached per dtype) or
        ``weight`` summed into positions (rebuilt per call, ``O(E_dense + block values)``, so a
        weight changed in place, by an optimiser or by ``.data``, is always seen)."""
        if weight is None and dtype in self._values:
            return self._values[dtype]
        buf = torch.zeros(self.num_values, dtype=dtype)
        if weight is None:
            src = torch.ones(self.dense_pos.numel(), dtype=dtype)
        else:
            src = weight.detach().to(dtype).index_select(0, self.dense_eid)
        buf.index_add_(0, self.dense_pos, src)
        if weight is None:
            self._values[dtype] = buf
        return buf


def _pad_size(c: int) -> int:
    """Round a column count up to one of a few sizes (steps of about 1/8, multiples of 8)."""
    if c <= 64:
        return -(-c // 8) * 8
    step = 1 << max(3, (c - 1).bit_length() - 3)
    return -(-c // step) * step


def _batches(b: DenseBlocks, batch_cols: int) -> tuple[list, np.ndarray, np.ndarray]:
    """Group blocks into batches: ``[(block ids, r, c_pad)]``, plus each block's padded width and
    value offset in the batched layout."""
    nb = b.num_blocks
    r = np.diff(b.row_ptr)
    c = np.diff(b.col_ptr)
    cpad = c.copy() if batch_cols <= 0 else np.array([_pad_size(int(v)) for v in c], dtype=np.int64)
    out, off, pos = [], np.zeros(nb, np.int64), 0
    order = np.lexsort((np.arange(nb), cpad, r))  # deterministic: by r, then padded width, then id
    cur: list[int] = []
    for k in order.tolist():
        same = cur and r[cur[0]] == r[k] and cpad[cur[0]] == cpad[k]
        if cur and (not same or batch_cols <= 0 or (len(cur) + 1) * cpad[k] > batch_cols):
            out.append((cur, int(r[cur[0]]), int(cpad[cur[0]])))
            cur = []
        cur.append(k)
    if cur:
        out.append((cur, int(r[cur[0]]), int(cpad[cur[0]])))
    for ids, rr, cc in out:
        for k in ids:
            off[k] = pos
            pos += rr * cc
    return out, cpad, off


def _build_plan(indptr, indices, num_rows: int, num_cols: int, chunking, cfg: DenseBlockConfig) -> BlockPlan:
    b = compress(indptr.numpy(), indices.numpy(), num_cols, chunking, cfg.min_col_density, cfg.min_block_nnz)
    batches, cpad, new_off = _batches(b, cfg.batch_cols)
    rl, cl, shapes = [], [], []
    for ids, r, c in batches:
        rl.append(torch.from_numpy(np.concatenate([b.rows[b.row_ptr[k] : b.row_ptr[k + 1]] for k in ids])))
        cols = []
        for k in ids:
            ck = b.cols[b.col_ptr[k] : b.col_ptr[k + 1]]
            cols += [ck, np.full(c - ck.size, ck[0], np.int64)]
        cl.append(torch.from_numpy(np.concatenate(cols)))
        shapes.append((len(ids), r, c, int(new_off[ids[0]])))
    # Remap dense positions from compress's packed layout to the padded, batched one.
    pos = b.dense_pos
    k = np.searchsorted(b.val_ptr, pos, side="right") - 1
    local = pos - b.val_ptr[k]
    width = np.diff(b.col_ptr)[k]
    pos = new_off[k] + (local // width) * cpad[k] + local % width
    num_values = max((n * r * c + off for n, r, c, off in shapes), default=0)
    rem = None
    if b.num_blocks:
        rem = CSRMatrix.from_numpy(b.rem_indptr, indices.numpy()[b.rem_eid], None, num_rows, num_cols)
    return BlockPlan(
        b,
        rl,
        cl,
        shapes,
        num_values,
        torch.from_numpy(b.dense_eid),
        torch.from_numpy(pos),
        rem,
        torch.from_numpy(b.rem_eid),
    )


def _symmetric(graph, t: TransposedCSR) -> bool:
    return (
        graph.num_rows == graph.num_cols
        and torch.equal(graph.indptr, t.indptr)
        and torch.equal(graph.indices, t.indices)
    )


class DenseBlockBackend(Backend):
    """Locality-aware chunks as dense MKL GEMMs plus a sparse remainder computed by ``remainder``
    (``small`` takes remainders too small for a parallel kernel launch)."""

    name = "dense_block"
    call_overhead_s = 30e-6
    keeps_entry_plan = True

    def __init__(self, remainder: Backend, small: Backend, config: DenseBlockConfig | None = None):
        super().__init__()
        self.remainder, self.small = remainder, small
        self.config = config or DenseBlockConfig()
        self._pool: ThreadPoolExecutor | None = None

    # ------------------------------------------------------------------ plans
    def _cfg_key(self) -> tuple:
        c = self.config
        return (c.min_col_density, c.min_block_nnz, c.chunk_rows or chunk_rows_for_cache(), c.batch_cols)

    def plan(self, graph, transposed: bool = False) -> BlockPlan:
        """The cached :class:`BlockPlan` of ``graph`` (of its transpose when ``transposed``)."""
        key = ("dense_block_plan", transposed, self._cfg_key())
        if transposed:
            t = graph.transpose()
            if self.plans.get(graph, "symmetric", lambda: _symmetric(graph, t)):
                return self.plan(graph, False)

        def make() -> BlockPlan:
            rows = self._cfg_key()[2]
            ch = self.plans.get(graph, ("chunks", rows, transposed), lambda: locality_chunking(graph, rows, transposed))
            if transposed:
                t = graph.transpose()
                return _build_plan(t.indptr, t.indices, graph.num_cols, graph.num_rows, ch, self.config)
            return _build_plan(graph.indptr, graph.indices, graph.num_rows, graph.num_cols, ch, self.config)

        return self.plans.get(graph, key, make)

    def describe(self, graph, transposed: bool = False) -> dict:
        """Plan statistics for a cost model: blocks, share of edges in blocks, block density."""
        p = self.plan(graph, transposed)
        nd = int(p.dense_eid.numel())
        return {
            "dense_blocks": p.num_blocks,
            "dense_edge_share": nd / max(1, graph.num_edges),
            "block_density": nd / max(1, p.blocks.block_values),
            "block_values": p.blocks.block_values,
            "batches": p.num_batches,
            "padded_values": p.num_values,
        }

    # ------------------------------------------------------------------ products
    def _gather_pool(self) -> ThreadPoolExecutor:
        """The thread that gathers the next batch's columns while this one multiplies."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="tessera-gather")
        return self._pool

    def _product(self, plan: BlockPlan, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        assert plan.remainder is not None  # a plan without dense blocks goes to the remainder backend whole
        w_rem = None if weight is None else weight.index_select(0, plan.rem_eid)
        # A tiny remainder is not worth a parallel kernel launch (and the csr backend's work
        # splitter mishandles rows with fewer non-zeros than work items): torch handles it.
        rem_backend = self.remainder if plan.remainder.num_edges >= _SMALL_REMAINDER else self.small
        out = rem_backend.spmm(plan.remainder, x, w_rem)
        if x.shape[1] == 0:
            return out
        vals = plan.values(x.dtype, weight)
        width = x.shape[1]
        if self.config.pipeline and plan.num_batches > 1:
            nxt = self._gather_pool().submit(torch.index_select, x, 0, plan.cols[0])
        for i, (n, r, c, off) in enumerate(plan.shapes):
            if self.config.pipeline and plan.num_batches > 1:
                xs = nxt.result()
                if i + 1 < plan.num_batches:
                    nxt = self._gather_pool().submit(torch.index_select, x, 0, plan.cols[i + 1])
            else:
                xs = x.index_select(0, plan.cols[i])
            a = vals[off : off + n * r * c]
            y = torch.mm(a.view(r, c), xs) if n == 1 else torch.bmm(a.view(n, r, c), xs.view(n, c, width))
            out.index_add_(0, plan.rows[i], y.view(n * r, width))
        return out

    def _delegate(self, x: torch.Tensor, weight: torch.Tensor | None) -> bool:
        return x.dim() != 2 or (weight is not None and weight.dim() != 1)

    def spmm(self, graph: CSRStructure, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if self._delegate(x, weight) or (plan := self.plan(graph, False)).remainder is None:
            return self.remainder.spmm(graph, x, weight)
        return self._product(plan, workspace.contiguous(x), weight)

    def spmm_t(self, graph: CSRStructure, g: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        if self._delegate(g, weight) or (plan := self.plan(graph, True)).remainder is None:
            return self.remainder.spmm_t(graph, g, weight)
        w = None if weight is None else weight.index_select(0, graph.transpose(with_perm=True).perm.long())
        return self._product(plan, workspace.contiguous(g), w)

    def sddmm_dot(self, graph: CSRStructure, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        return self.remainder.sddmm_dot(graph, g, x)
