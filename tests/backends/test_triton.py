"""Triton kernels (CSR products, hashed dropout, fused GAT attention) against the reference: on CPU
tensors under Triton's interpreter where no GPU is present (tests/conftest.py sets
TRITON_INTERPRET=1), on CUDA tensors where one is."""

from __future__ import annotations

import importlib
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

from helpers import awkward_graph  # noqa: E402
from tessera import sparse  # noqa: E402
from tessera.backends import get_backend, select  # noqa: E402
from tessera.backends.triton_attention import triton_attend  # noqa: E402
from tessera.backends.triton_csr import Tile, TritonBackend, interpreted, row_items  # noqa: E402
from tessera.graph.csr import CSRMatrix  # noqa: E402
from tessera.kernels import dropout as drop  # noqa: E402
from tessera.kernels.triton_dropout import triton_hashed  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and not interpreted() else "cpu"
if DEVICE == "cpu" and not interpreted():
    pytest.skip("no GPU and TRITON_INTERPRET is not 1", allow_module_level=True)

# Small tiles and pieces, so that small graphs take every path: several feature blocks (widths
# over 16 that are not a multiple of it), several items per program, several steps per item, and
# hub rows split into pieces.
SMALL = Tile(values=128, block_e=4, max_block_f=16, max_rows=2)
SHAPES = [(5,), (37,), (3, 7)]


@pytest.fixture(scope="module")
def hub():
    """63 vertices: a hub holding a third of the edges, empty rows, isolated vertices 60..62,
    self loops and duplicate edges."""
    return awkward_graph(n=60, e=300, seed=4)


@pytest.fixture(scope="module")
def tiny():
    """15 vertices, the hub's 20 edges, isolated vertices 12..14: small enough for small tiles."""
    return awkward_graph(n=12, e=40, seed=4)


@pytest.fixture
def triton_chunk(monkeypatch):
    """The registered backend with hub pieces of ``chunk`` entries for one test."""

    def set_chunk(chunk: int) -> TritonBackend:
        backend = get_backend("triton")
        assert isinstance(backend, TritonBackend)
        monkeypatch.setattr(backend, "chunk", chunk)
        return backend

    return set_chunk


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    scale = float(want.abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got.cpu(), want.cpu(), rtol=rel, atol=rel * max(scale, 1e-30))


def _weights(kind: str, graph, shape, gen, dtype=torch.float32):
    if kind == "none":
        return None
    if kind == "edge":
        return torch.rand(graph.num_edges, generator=gen, dtype=dtype)
    return torch.rand(graph.num_edges, shape[0], generator=gen, dtype=dtype)


def _cases():
    for shape in SHAPES:
        for kind in ("none", "edge", "head"):
            if kind != "head" or len(shape) == 2:
                yield pytest.param(None, shape, kind, id=f"{'x'.join(map(str, shape))}-{kind}")
    # small tiles cost many programs in the interpreter: one case per shape
    for shape, kind in (((5,), "edge"), ((37,), "none"), ((3, 7), "head")):
        yield pytest.param(SMALL, shape, kind, id=f"{'x'.join(map(str, shape))}-{kind}-small-tile")


# ---------------------------------------------------------------------------------- work split
def test_items_cover_every_entry_once_in_pieces_of_at_most_chunk(hub):
    items = row_items(hub.indptr, 16)
    lo, hi, row, slot = (t.to(torch.int64) for t in (items.lo, items.hi, items.row, items.slot))
    count = hi - lo
    assert int(count.max()) <= 16 and bool((count[:-1] >= count[1:]).all()), "pieces of at most chunk, largest first"
    cover = torch.zeros(hub.num_edges, dtype=torch.int64)
    for a, b in zip(lo.tolist(), hi.tolist()):
        cover[a:b] += 1
    assert bool((cover == 1).all())
    ip = hub.indptr.to(torch.int64)
    assert bool(((lo >= ip[row]) & (hi <= ip[row + 1])).all()), "every item lies in its row"
    assert set(row.tolist()) == set(range(hub.num_nodes)), "every row, empty ones too, is an item"
    deg = ip[1:] - ip[:-1]
    hubs = torch.nonzero(deg > 16).flatten()
    assert items.hub_rows.tolist() == hubs.tolist() and hubs.numel() >= 1
    for r, (s0, s1) in zip(hubs.tolist(), zip(items.hub_ptr[:-1].tolist(), items.hub_ptr[1:].tolist())):
        mine = slot[row == r]
        assert sorted(mine.tolist()) == list(range(s0, s1)), "a hub's pieces own its slots"
        assert int(deg[r]) == int(count[row == r].sum())
    assert bool((slot[~torch.isin(row, hubs)] == -1).all()), "whole rows write their output directly"
    plain = row_items(hub.indptr, 10_000)
    assert plain.hub_rows.numel() == 0 and plain.slots == 0 and bool((plain.slot == -1).all())


# ---------------------------------------------------------------------------------- products
@pytest.mark.parametrize(("tile", "shape", "kind"), list(_cases()))
def test_products_match_reference(hub, tiny, tile, shape, kind):
    graph = hub if tile is None else tiny
    gen = torch.Generator().manual_seed(len(shape) * 10 + shape[-1])
    x = torch.randn(graph.num_nodes, *shape, generator=gen)
    w = _weights(kind, graph, shape, gen)
    ref = get_backend("reference")
    backends = [TritonBackend(chunk=6, tile=tile), TritonBackend(chunk=10_000, tile=tile)]  # hub split, and whole
    want = (ref.spmm(graph, x, w), ref.spmm_t(graph, x, w))
    xd, wd = x.to(DEVICE), None if w is None else w.to(DEVICE)
    for b in backends:
        got = (b.spmm(graph, xd, wd), b.spmm_t(graph, xd, wd))
        for a, r in zip(got, want):
            assert a.shape == r.shape and a.dtype == r.dtype
            _close(a, r)
        assert bool((got[0][-3:] == 0).all()) and bool((got[1][-3:] == 0).all()), "isolated vertices give zeros"
        assert torch.equal(b.spmm(graph, xd, wd), got[0]), "deterministic"


def test_float64_matches_reference_tightly_and_rectangular_matrix():
    gen = torch.Generator().manual_seed(1)
    rows, cols, nnz = 9, 14, 60
    r = torch.randint(0, rows - 2, (nnz,), generator=gen)  # the last two rows stay empty
    r[:25] = 3  # a hub row
    c = torch.randint(0, cols, (nnz,), generator=gen)
    order = torch.argsort(r * cols + c)
    r, c = r[order], c[order]
    indptr = torch.zeros(rows + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(torch.bincount(r, minlength=rows), 0)
    m = CSRMatrix.from_numpy(indptr.numpy(), c.numpy(), None, rows, cols)
    w = torch.rand(nnz, dtype=torch.float64, generator=gen)
    dense = torch.zeros(rows, cols, dtype=torch.float64).index_put_((r, c), w, accumulate=True)
    x = torch.randn(cols, 21, dtype=torch.float64, generator=gen)
    g = torch.randn(rows, 21, dtype=torch.float64, generator=gen)
    b = TritonBackend(chunk=4, tile=SMALL)
    torch.testing.assert_close(b.spmm(m, x.to(DEVICE), w.to(DEVICE)).cpu(), dense @ x, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(b.spmm_t(m, g.to(DEVICE), w.to(DEVICE)).cpu(), dense.T @ g, rtol=1e-12, atol=1e-12)
    got = b.spmm(m, x.to(DEVICE), None).cpu()
    assert bool((got[-2:] == 0).all())
    # no entries at all: zeros of the right shape
    empty = CSRMatrix.from_numpy(torch.zeros(rows + 1, dtype=torch.int64).numpy(), c[:0].numpy(), None, rows, cols)
    assert torch.equal(b.spmm(empty, x.to(DEVICE), None).cpu(), torch.zeros(rows, 21, dtype=torch.float64))
    assert b.sddmm_dot(empty, g.to(DEVICE), x.to(DEVICE)).shape == (0,)


@pytest.mark.parametrize("tile", [None, SMALL], ids=["tile-default", "tile-small"])
def test_bfloat16_rows_sum_in_float32_and_round_once(hub, tiny, tile):
    graph = hub if tile is None else tiny
    gen = torch.Generator().manual_seed(5)
    b = TritonBackend(chunk=6, tile=tile)
    for shape in ((37,), (3, 7)) if tile is None else ((37,),):
        x = torch.randn(graph.num_nodes, *shape, generator=gen).bfloat16().to(DEVICE)
        w = torch.rand(graph.num_edges, generator=gen).to(DEVICE)
        for fn in (b.spmm, b.spmm_t):
            got = fn(graph, x, w)
            # the float32 kernel on the widened rows, rounded to nearest even by torch
            assert got.dtype == torch.bfloat16 and torch.equal(got, fn(graph, x.float(), w).bfloat16())
        gx = torch.randn(graph.num_nodes, *shape, generator=gen).bfloat16().to(DEVICE)
        dots = b.sddmm_dot(graph, gx, x)
        assert dots.dtype == torch.float32 and torch.equal(dots, b.sddmm_dot(graph, gx.float(), x.float()))
    if DEVICE == "cpu" and tile is None:  # the numba kernel rounds the same sums the same way, up to their order
        x = torch.randn(hub.num_nodes, 37, generator=gen).bfloat16()
        mine, csr = b.spmm(hub, x, None).float(), get_backend("csr").spmm(hub, x, None).float()
        _close(mine, csr, rel=1e-2)


@pytest.mark.parametrize("shape", [(5,), (37,), (3, 7)])
def test_sddmm_dot_matches_reference(hub, tiny, shape):
    gen = torch.Generator().manual_seed(shape[-1])
    for graph, b in ((hub, get_backend("triton")), (tiny, TritonBackend(tile=SMALL))):
        g = torch.randn(graph.num_nodes, *shape, generator=gen)
        x = torch.randn(graph.num_nodes, *shape, generator=gen)
        want = get_backend("reference").sddmm_dot(graph, g, x)
        _close(b.sddmm_dot(graph, g.to(DEVICE), x.to(DEVICE)), want)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
@pytest.mark.parametrize("heads", [False, True])
def test_aggregate_values_and_gradients_match_reference(hub, triton_chunk, reduce, heads):
    triton_chunk(8)
    gen = torch.Generator().manual_seed(2 + heads)
    shape = (3, 7) if heads else (37,)
    x = torch.randn(hub.num_nodes, *shape, generator=gen)
    w = torch.rand(hub.num_edges, *shape[:-1], generator=gen)
    g = torch.randn(hub.num_nodes, *shape, generator=gen)
    res = {}
    for name, dev in (("reference", "cpu"), ("triton", DEVICE)):
        xr = x.clone().to(dev).requires_grad_(True)
        wr = w.clone().to(dev).requires_grad_(True)
        out = sparse.aggregate(hub, xr, reduce, wr, name)
        out.backward(g.to(dev))
        res[name] = (out.detach(), xr.grad, wr.grad)
    for a, b in zip(res["triton"], res["reference"]):
        _close(a, b)


@pytest.mark.skipif(DEVICE != "cpu", reason="gradcheck in float64 on the interpreter")
def test_aggregate_gradcheck_with_hub_pieces(triton_chunk):
    triton_chunk(4)
    g = awkward_graph(n=6, e=16, seed=3)  # the hub's 8 edges are two pieces
    assert int(g.in_degree().max()) > 4
    x = torch.randn(g.num_nodes, 2, 3, dtype=torch.float64, requires_grad=True)
    w = torch.rand(g.num_edges, 2, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, w: sparse.aggregate(g, x, "sum", w, "triton"), (x, w), fast_mode=True)


# ---------------------------------------------------------------------------------- selection
def test_supported_on_cpu_only_under_the_interpreter_and_never_chosen_there(hub, monkeypatch, fresh_tuning):
    b = get_backend("triton")
    x = torch.randn(hub.num_nodes, 8)
    assert b.supports(x.bfloat16()) and not b.supports(x.half())
    if DEVICE == "cpu":
        assert b.supports(x) and b.cost(hub, 8, False) == float("inf")
        monkeypatch.setattr(select, "_TRIAL_MIN_WORK", 0)  # auto measures even here
        for direction in ("forward", "backward"):
            assert select.choose(hub, x, None, direction) != "triton"
        assert "triton" not in select.trial_candidates(hub, 8, False, False, select.candidates(x))
        monkeypatch.delenv("TRITON_INTERPRET")
        assert not b.supports(x) and b.cost(hub, 8, False) < float("inf")


def test_without_triton_the_backends_register_without_a_triton_backend(monkeypatch):
    import tessera.backends
    from tessera.backends import base

    monkeypatch.setitem(sys.modules, "triton", None)  # "import triton" raises ModuleNotFoundError
    monkeypatch.setattr(base, "_BACKENDS", {})  # the registrations below end with the test
    importlib.reload(tessera.backends)
    assert "reference" in base.available_backends() and "triton" not in base.available_backends()


def test_a_cpu_training_step_never_loads_triton():
    # Triton's libraries hold about 70 MB resident: a process that runs no Triton kernel must not map them
    code = (
        "import sys, torch\n"
        "from tessera.datasets import load\n"
        "from tessera.nn.models import build_model\n"
        "g = load('synthetic:tiny')\n"
        "m = build_model('gat', g.x.shape[1], 8, int(g.num_classes), heads=2)\n"
        "m(g.x, g).sum().backward()\n"
        "assert 'triton' in __import__('tessera').backends.available_backends()\n"
        "print(sorted(k for k in sys.modules if k.split('.')[0] == 'triton'))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


# ---------------------------------------------------------------------------------- dropout
MODES = [drop.DROP, drop._MASK, drop._RELU_DROP, drop._ELU_DROP, drop._RELU_DROP_GRAD, drop._ELU_DROP_GRAD]
MODES += [drop.DROP_IN_PLACE]
_INT = {torch.float32: torch.int32, torch.float64: torch.int64, torch.bfloat16: torch.int16}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("rows", ["none", "ids"])
def test_triton_dropout_is_the_numba_kernels_bit_for_bit(dtype, rows):
    gen = torch.Generator().manual_seed(9)
    shape = (70, 3, 11)  # 33 elements a row: no block boundary lines up with a row
    x = torch.randn(*shape, generator=gen).to(dtype)
    y = torch.relu(torch.randn(*shape, generator=gen)).to(dtype)
    # global indices from about 2**33: the block key mixes the index's high bits in
    ids = None if rows == "none" else torch.randperm(70, generator=gen) + 2**28
    for seed, p in ((12345, 0.5), (2**63 - 2, 0.13)):
        for mode in MODES:
            masking = mode == drop._MASK
            want = torch.empty(shape, dtype=torch.bool if masking else dtype)
            got = torch.empty(shape, dtype=want.dtype, device=DEVICE)
            if mode == drop.DROP_IN_PLACE:
                want.copy_(x)
                got.copy_(x)
            aux = y if mode in (drop._RELU_DROP_GRAD, drop._ELU_DROP_GRAD) else None
            drop.run_hashed(want if masking else x, want, seed, p, ids, mode, aux)
            triton_hashed(
                got if masking else x.to(DEVICE),
                got,
                seed,
                p,
                None if ids is None else ids.to(DEVICE),
                mode,
                None if aux is None else aux.to(DEVICE),
            )
            got = got.cpu()
            if masking:
                assert torch.equal(got, want), (seed, p)
                kept = float(got.float().mean())
                assert abs(kept - (1 - p)) < 0.05
            elif mode == drop._ELU_DROP:  # expm1 in float64, rounded once: not promised bit for bit
                rel = {torch.float32: 2e-7, torch.bfloat16: 8e-3, torch.float64: 1e-15}[dtype]
                torch.testing.assert_close(got, want, rtol=rel, atol=1e-30)
            else:
                assert torch.equal(got.view(_INT[dtype]), want.view(_INT[dtype])), (mode, seed, p)


def test_triton_dropout_mask_is_the_one_dropout_draws_and_refuses_bad_input():
    ids = torch.randperm(50) + 1000
    torch.manual_seed(4)
    want = drop.dropout_mask((50, 19), 0.3, ids)
    torch.manual_seed(4)
    seed = drop.draw_seed()
    got = torch.empty(50, 19, dtype=torch.bool, device=DEVICE)
    triton_hashed(got, got, seed, 0.3, ids.to(DEVICE), drop._MASK)
    assert torch.equal(got.cpu(), want)
    x = torch.randn(4, 5, device=DEVICE)
    with pytest.raises(ValueError, match="drops every element"):
        triton_hashed(x, torch.empty_like(x), 1, 1.0, None, drop.DROP)
    with pytest.raises(ValueError, match="rows has 3 ids for 4 rows"):
        triton_hashed(x, torch.empty_like(x), 1, 0.5, torch.arange(3, device=DEVICE), drop.DROP)
    with pytest.raises(ValueError, match="unknown dropout mode"):
        triton_hashed(x, torch.empty_like(x), 1, 0.5, None, 17)
    empty = torch.empty(0, 5, device=DEVICE)
    triton_hashed(empty, torch.empty_like(empty), 1, 0.5, None, drop.DROP)  # nothing to do


# ---------------------------------------------------------------------------------- attention
def _attend_reference(graph, a_src, a_dst, x, slope):
    """Plain torch: scores, the row softmax with its maximum subtracted, the weighted sum."""
    dst, src = graph.dst_index(), graph.src_index()
    s = torch.nn.functional.leaky_relu(a_src[src] + a_dst[dst], slope)
    rowmax = torch.full((graph.num_rows, s.shape[1]), float("-inf"), dtype=s.dtype)
    rowmax = rowmax.scatter_reduce(0, dst[:, None].expand_as(s), s.detach(), "amax")
    ex = torch.exp(s - rowmax[dst])
    alpha = ex / torch.zeros_like(rowmax).index_add(0, dst, ex)[dst]
    out = torch.zeros(graph.num_rows, *x.shape[1:], dtype=x.dtype)
    return out.index_add(0, dst, alpha[:, :, None] * x[src])


@pytest.mark.parametrize(("heads", "width", "chunk"), [(1, 5, 10_000), (3, 37, 8)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_fused_attention_matches_plain_torch_with_gradients(hub, triton_chunk, heads, width, chunk, dtype):
    triton_chunk(chunk)  # 8: the hub row runs as pieces combined by the second kernel
    gen = torch.Generator().manual_seed(heads * width)
    a_src = torch.randn(hub.num_nodes, heads, dtype=dtype, generator=gen)
    a_dst = torch.randn(hub.num_nodes, heads, dtype=dtype, generator=gen)
    x = torch.randn(hub.num_nodes, heads, width, dtype=dtype, generator=gen)
    g = torch.randn(hub.num_nodes, heads, width, dtype=dtype, generator=gen)
    res = {}
    for name, dev in (("torch", "cpu"), ("triton", DEVICE)):
        ins = [t.clone().to(dev).requires_grad_(True) for t in (a_src, a_dst, x)]
        fn = _attend_reference if name == "torch" else triton_attend
        out = fn(hub, *ins, 0.2)
        out.backward(g.to(dev))
        res[name] = (out.detach(), *(t.grad for t in ins))
    rel = 1e-5 if dtype == torch.float32 else 1e-12
    for a, b in zip(res["triton"], res["torch"]):
        _close(a, b, rel)
    assert bool((res["triton"][0][-3:] == 0).all()), "rows without entries attend to nothing"


def test_fused_attention_bfloat16_features_and_small_tiles(hub, tiny, monkeypatch, triton_chunk):
    b = triton_chunk(6)
    gen = torch.Generator().manual_seed(8)
    for graph, tile in ((hub, None), (tiny, SMALL)):  # SMALL: several feature blocks, items and steps per program
        monkeypatch.setattr(b, "tile", tile)
        a_src, a_dst = torch.randn(graph.num_nodes, 2, generator=gen), torch.randn(graph.num_nodes, 2, generator=gen)
        x = torch.randn(graph.num_nodes, 2, 21, generator=gen)
        want = _attend_reference(graph, a_src, a_dst, x, 0.2)
        _close(triton_attend(graph, a_src.to(DEVICE), a_dst.to(DEVICE), x.to(DEVICE), 0.2), want)
        xb = x.bfloat16()
        got = triton_attend(graph, a_src.to(DEVICE), a_dst.to(DEVICE), xb.to(DEVICE), 0.2)
        assert got.dtype == torch.bfloat16
        _close(got.float(), _attend_reference(graph, a_src, a_dst, xb.float(), 0.2), rel=1e-2)
    with pytest.raises(ValueError, match="need a_src"):
        triton_attend(hub, a_src[:5].to(DEVICE), a_dst.to(DEVICE), x.to(DEVICE))


@pytest.mark.skipif(DEVICE != "cpu", reason="gradcheck in float64 on the interpreter")
def test_fused_attention_gradcheck(triton_chunk):
    triton_chunk(4)
    g = awkward_graph(n=6, e=16, seed=3)
    gen = torch.Generator().manual_seed(0)
    ins = [
        torch.randn(g.num_nodes, 2, dtype=torch.float64, generator=gen).requires_grad_(True),
        torch.randn(g.num_nodes, 2, dtype=torch.float64, generator=gen).requires_grad_(True),
        torch.randn(g.num_nodes, 2, 3, dtype=torch.float64, generator=gen).requires_grad_(True),
    ]
    assert torch.autograd.gradcheck(lambda s, d, x: triton_attend(g, s, d, x, 0.2), ins, fast_mode=True)
