"""Typed block products (the segment GEMM and the gTask micro-kernels): outputs and gradients
against a per-row loop, uncovered rows, and the fusion of adjacent one-relation batches."""

import numpy as np
import torch

from tessera.relational.block_matmul import Block, block_matmul, chunk_blocks, fuse, gather_block_matmul, segment_blocks
from tessera.relational.gtask import build_plan
from tessera.relational.gtask_kernels import CATEGORIES, OutlierPolicy, build_execution

# rows 0-5: two batches of relation 1 (3 rows, then 1 unit of 3); rows 6-7 uncovered; rows 8-13:
# a bmm of 3 units of 2 rows with relations 0, 2, 0; rows 14-17: relation 2, then relation 2 again
# in another category (not fused)
BLOCKS = [
    Block(0, 1, 3, torch.tensor([1]), 1, "regular"),
    Block(3, 1, 3, torch.tensor([1]), 1, "regular"),
    Block(8, 3, 2, torch.tensor([0, 2, 0]), None, "regular"),
    Block(14, 2, 1, torch.tensor([2, 2]), 2, "regular"),
    Block(16, 1, 2, torch.tensor([2]), 2, "underfill"),
]


def reference(x, w, blocks):
    """Row by row: ``out[i] = x[i] @ W[type of i]``, zero for rows no block covers."""
    rows = []
    for i in range(x.shape[0]):
        b = next((b for b in blocks if b.offset <= i < b.offset + b.rows), None)
        rows.append(x.new_zeros(w.shape[2]) if b is None else x[i] @ w[int(b.types[(i - b.offset) // b.size])])
    return torch.stack(rows)


def test_block_matmul_and_its_gradients_equal_the_row_loop():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(19, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(19, 5, generator=gen, dtype=torch.float64)
    for blocks in (BLOCKS, fuse(BLOCKS)):
        out = block_matmul(x, w, blocks)
        want = reference(x, w, BLOCKS)
        torch.testing.assert_close(out, want)
        assert out[6:8].abs().max() == 0 and out[18].abs().max() == 0  # uncovered rows
        got = torch.autograd.grad((out * probe).sum(), (x, w))
        for a, b in zip(got, torch.autograd.grad((want * probe).sum(), (x, w)), strict=True):
            torch.testing.assert_close(a, b)


def test_fuse_merges_adjacent_batches_of_one_relation_and_category_only():
    fused = fuse(BLOCKS)
    assert [(b.offset, b.units, b.rows, b.single_type, b.category) for b in fused] == [
        (0, 1, 6, 1, "regular"),
        (8, 3, 6, None, "regular"),
        (14, 2, 2, 2, "regular"),
        (16, 1, 2, 2, "underfill"),
    ]
    # a gap between two blocks of one relation keeps them apart
    apart = [Block(0, 1, 2, torch.tensor([0]), 0), Block(3, 1, 2, torch.tensor([0]), 0)]
    assert len(fuse(apart)) == 2
    assert [(b.offset, b.rows, b.single_type) for b in segment_blocks([0, 4, 4, 11])] == [(0, 4, 0), (4, 7, 2)]


def test_gtask_execution_runs_one_product_per_relation_and_category():
    """uniq(Src.ID)=4 & uniq(Edge.Type)=1 makes gTasks of one relation; its batches of a relation
    are adjacent in the layout, so the products are one GEMM per (category, relation) present."""
    rng = np.random.default_rng(3)
    n, e, types = 200, 1500, 4
    src, dst, etype = rng.integers(0, n, e), rng.integers(0, n, e), rng.integers(0, types, e)
    plan = build_plan((src, dst, etype, n), "uniq(Src.ID)=4 & uniq(Edge.Type)=1")
    ex = build_execution(plan, OutlierPolicy(batch_rows=16))  # batches of 4 units
    runs = {(b.category, b.single_type) for b in ex.blocks}
    assert all(b.single_type is not None for b in ex.blocks)
    assert len(ex.blocks) > len(runs)  # several batches per relation ...
    assert sorted((b.category, b.single_type) for b in ex.products) == sorted(runs)  # ... one product each
    assert ex.stats["products"] == len(ex.products)
    assert {b.category for b in ex.products} <= set(CATEGORIES)


def test_gather_block_matmul_equals_gather_then_block_matmul_for_every_chunk_size():
    """Chunked gathered products against ``block_matmul`` of the gathered rows (padding rows zero):
    outputs and gradients, with repeated sources (a hub gathered 8 times), padding rows, uncovered
    rows, and ``x`` with and without a gradient."""
    gen = torch.Generator().manual_seed(1)
    index = torch.randint(0, 9, (19,), generator=gen)
    index[[0, 4, 8, 9, 12, 15, 16, 17]] = 5  # the hub
    pads = torch.tensor([2, 11, 17])
    w = torch.randn(3, 4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(19, 5, generator=gen, dtype=torch.float64)
    for x_grad in (True, False):
        x = torch.randn(9, 4, generator=gen, dtype=torch.float64, requires_grad=x_grad)
        for blocks in (BLOCKS, fuse(BLOCKS)):
            want = block_matmul(x.index_select(0, index).index_fill(0, pads, 0), w, blocks)
            wanted = torch.autograd.grad((want * probe).sum(), (x, w) if x_grad else (w,))
            for rows in (1, 2, 3, 5, 100):
                out = gather_block_matmul(x, index, w, blocks, pads, chunk_bytes=rows * 4 * 8)
                torch.testing.assert_close(out, want)
                assert out[6:8].abs().max() == 0 and out[18].abs().max() == 0
                got = torch.autograd.grad((out * probe).sum(), (x, w) if x_grad else (w,))
                for a, b in zip(got, wanted, strict=True):
                    torch.testing.assert_close(a, b)


def test_chunk_blocks_cover_the_same_rows_with_the_same_weights():
    for rows in (1, 2, 4, 100):
        pieces = chunk_blocks(fuse(BLOCKS), rows)
        assert all(p.rows <= max(rows, p.size) for p in pieces)
        cover = {(p.offset + i, int(p.types[i // p.size])) for p in pieces for i in range(p.rows)}
        assert cover == {(b.offset + i, int(b.types[i // b.size])) for b in BLOCKS for i in range(b.rows)}
