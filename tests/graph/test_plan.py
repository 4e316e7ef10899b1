"""Minimum vertex cover and per-rank aggregation plans, checked by simulating every rank."""

from __future__ import annotations

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from helpers import awkward_graph
from tessera import Graph, datasets
from tessera.errors import ConfigError
from tessera.graph.partition import load_part, partition, write_parts
from tessera.graph.partition.cover import min_vertex_cover
from tessera.graph.partition.halo import (
    MODES,
    build_plans,
    build_rank_plan,
    compare_modes,
    pair_rows,
    plan_from_part,
)


# ---------------------------------------------------------------------------------------- helpers
def brute_cover_size(src: np.ndarray, dst: np.ndarray) -> int:
    """Smallest vertex cover by enumerating every subset of U | V."""
    u, ui = np.unique(src, return_inverse=True)
    v, vi = np.unique(dst, return_inverse=True)
    k = u.size + v.size
    masks = np.arange(1 << k, dtype=np.int64)
    ok = np.ones(masks.size, dtype=bool)
    for a, b in zip(ui, vi + u.size):
        ok &= ((masks >> a) & 1 | (masks >> b) & 1).astype(bool)
    popcount = np.array([bin(m).count("1") for m in range(1 << k)])
    return int(popcount[ok].min())


def _sp(indptr, indices, weight, shape) -> sp.csr_matrix:
    w = np.ones(indices.size) if weight is None else weight.astype(np.float64)
    return sp.csr_matrix((w, indices, indptr), shape=shape)


def global_matrix(indptr, indices, weight) -> sp.csr_matrix:
    n = indptr.size - 1
    return _sp(indptr, indices, weight, (n, n))


def local_mats(pl):
    n = pl.n_owned
    return (
        _sp(*pl.A, (n, n)),
        _sp(*pl.S[:3], (pl.S.n_rows, n)),
        _sp(*pl.R[:3], (n, pl.R.n_cols)),
    )


def all_to_all(bufs: list[np.ndarray], counts: list[np.ndarray]) -> list[np.ndarray]:
    """``bufs[p]`` holds rank p's rows for each peer in rank order (``counts[p][q]`` of them);
    returns each receiver's buffer: the blocks from every peer, in rank order."""
    offs = [np.concatenate([[0], np.cumsum(c)]) for c in counts]
    world = len(bufs)
    return [np.concatenate([bufs[p][offs[p][q] : offs[p][q + 1]] for p in range(world)]) for q in range(world)]


def check_plans(indptr, indices, weight, part, mode, world):
    plans = build_plans(indptr, indices, weight, part, mode, world)
    n = indptr.size - 1
    a = global_matrix(indptr, indices, weight)
    rng = np.random.default_rng(7)
    h = rng.standard_normal((n, 4))
    g = rng.standard_normal((n, 4))
    mats = [local_mats(pl) for pl in plans]
    # forward
    sends = [s @ h[pl.owned] for pl, (_, s, _) in zip(plans, mats)]
    recvs = all_to_all(sends, [pl.send_counts for pl in plans])
    ref = a @ h
    for pl, (al, _, r), recv in zip(plans, mats, recvs):
        assert recv.shape == (pl.R.n_cols, 4)
        np.testing.assert_allclose(al @ h[pl.owned] + r @ recv, ref[pl.owned], rtol=0, atol=1e-10)
    # backward: grad_h = A^T g + S^T all_to_all_back(R^T g)
    back = [r.T @ g[pl.owned] for pl, (_, _, r) in zip(plans, mats)]
    got_back = all_to_all(back, [pl.recv_counts for pl in plans])
    ref_t = a.T @ g
    for pl, (al, s, _), gb in zip(plans, mats, got_back):
        assert gb.shape == (pl.S.n_rows, 4)
        np.testing.assert_allclose(al.T @ g[pl.owned] + s.T @ gb, ref_t[pl.owned], rtol=0, atol=1e-10)
    # bookkeeping
    deg = np.diff(indptr)
    for pl in plans:
        assert pl.world == world and pl.send_counts[pl.rank] == 0 and pl.recv_counts[pl.rank] == 0
        assert np.array_equal(pl.rows_post + pl.rows_pre, pl.send_counts)
        assert np.array_equal(pl.in_degree_global, deg[pl.owned])
        assert np.array_equal(pl.owned, np.flatnonzero(part == pl.rank))
        for arr in (pl.A.indptr, pl.A.indices, pl.S.indptr, pl.S.indices, pl.R.indptr, pl.R.indices):
            assert arr.dtype == np.int64
        for wt in (pl.A.weight, pl.S.weight, pl.R.weight):
            assert (wt is None) == (weight is None) and (wt is None or wt.dtype == np.float32)
        for q in range(world):
            assert pl.send_counts[q] == plans[q].recv_counts[pl.rank]
    return plans


def awkward_weighted(seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    g = awkward_graph(seed=seed)
    w = torch.rand(g.num_edges, generator=torch.Generator().manual_seed(seed)) + 0.25
    return g.indptr.numpy(), g.indices.numpy(), w.numpy()


@pytest.fixture(scope="module")
def small() -> Graph:
    return datasets.load("synthetic:small")


# ---------------------------------------------------------------------------------------- cover
def test_cover_matches_brute_force():
    rng = np.random.default_rng(0)
    for _ in range(300):
        e = int(rng.integers(1, 14))
        src = rng.integers(0, 6, e) * 7 - 3  # arbitrary ids, duplicates likely
        dst = rng.integers(0, 6, e) + 100
        cu, cv = min_vertex_cover(src, dst)
        assert np.all(np.isin(src, cu) | np.isin(dst, cv)), "not a cover"
        assert cu.size + cv.size == brute_cover_size(src, dst)
        assert np.array_equal(cu, np.unique(cu)) and np.array_equal(cv, np.unique(cv))
        perm = rng.permutation(e)
        cu2, cv2 = min_vertex_cover(src[perm], dst[perm])
        assert np.array_equal(cu, cu2) and np.array_equal(cv, cv2), "cover depends on edge order"


def test_cover_edge_cases():
    cu, cv = min_vertex_cover(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    assert cu.size == 0 and cv.size == 0
    # a star: one source to many destinations is covered by the source
    cu, cv = min_vertex_cover(np.zeros(5, dtype=np.int64), np.arange(5))
    assert cu.tolist() == [0] and cv.size == 0
    cu, cv = min_vertex_cover(np.arange(5), np.zeros(5, dtype=np.int64))
    assert cu.size == 0 and cv.tolist() == [0]
    with pytest.raises(ValueError):
        min_vertex_cover(np.arange(3), np.arange(2))


def test_cover_large_is_fast_and_valid():
    rng = np.random.default_rng(1)
    src = rng.integers(0, 20_000, 200_000)
    dst = rng.integers(0, 5_000, 200_000)
    cu, cv = min_vertex_cover(src, dst)
    assert np.all(np.isin(src, cu) | np.isin(dst, cv))
    m = sp.csr_matrix((np.ones(src.size), (src, dst)))
    from scipy.sparse.csgraph import maximum_bipartite_matching

    assert cu.size + cv.size == int((maximum_bipartite_matching(m, perm_type="column") >= 0).sum())


# ---------------------------------------------------------------------------------------- plans
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_plans_on_synthetic_small(small, tmp_path_factory, mode, world):
    part = partition(small, world, "metis", cache_dir=tmp_path_factory.getbasetemp() / "cache")
    ip, ix = small.indptr.numpy(), small.indices.numpy()
    plans = check_plans(ip, ix, None, part, mode, world)
    np.testing.assert_array_equal(np.stack([pl.send_counts for pl in plans]), pair_rows(ip, ix, part, world)[mode])


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_plans_on_awkward_weighted_graph(mode, world):
    ip, ix, w = awkward_weighted(world)
    n = ip.size - 1
    part = np.random.default_rng(world).integers(0, world, n)
    part[:world] = np.arange(world)
    check_plans(ip, ix, w, part, mode, world)


@pytest.mark.parametrize("mode", MODES)
def test_empty_rank_and_no_cut_edges(mode):
    ip, ix, w = awkward_weighted(5)
    n = ip.size - 1
    part = np.random.default_rng(0).integers(0, 3, n)
    part[part == 1] = 0  # rank 1 owns nothing; rank 3 (trailing) owns nothing too
    plans = check_plans(ip, ix, w, part, mode, 4)
    assert plans[1].n_owned == 0 and plans[3].n_owned == 0
    assert plans[1].send_counts.sum() == 0 and plans[1].R.n_cols == 0
    # a partition with no cut edges at all: two disconnected halves
    edges = torch.tensor([[0, 1, 2, 3, 4, 5], [1, 0, 2, 4, 5, 3]])
    g = Graph.from_edge_index(edges, 6)
    plans = check_plans(g.indptr.numpy(), g.indices.numpy(), None, np.array([0, 0, 0, 1, 1, 1]), mode, 2)
    assert all(pl.S.n_rows == 0 and pl.R.n_cols == 0 for pl in plans)
    plans = check_plans(g.indptr.numpy(), g.indices.numpy(), None, np.zeros(6, dtype=np.int64), mode, 1)
    assert plans[0].A.indices.size == 6


def test_prepost_rows_equal_brute_force_cover():
    rng = np.random.default_rng(3)
    for trial in range(20):
        n, e, world = 14, 30, 3
        src, dst = rng.integers(0, n, e), rng.integers(0, n, e)
        g = Graph.from_edge_index(torch.from_numpy(np.stack([src, dst])), n)
        ip, ix = g.indptr.numpy(), g.indices.numpy()
        part = rng.integers(0, world, n)
        plans = check_plans(ip, ix, None, part, "prepost", world)
        fast = pair_rows(ip, ix, part, world)
        gs, gd = g.src_index().numpy(), g.dst_index().numpy()
        for pl in plans:
            p = pl.rank
            for q in range(world):
                if q == p:
                    continue
                sel = (part[gs] == p) & (part[gd] == q)
                expect = brute_cover_size(gs[sel], gd[sel]) if sel.any() else 0
                assert pl.send_counts[q] == fast["prepost"][p, q] == expect, (trial, p, q)
                assert expect <= min(fast["pre"][p, q], fast["post"][p, q])


def test_prepost_never_worse_on_synthetic(small, tmp_path_factory):
    part = partition(small, 4, "metis", cache_dir=tmp_path_factory.getbasetemp() / "cache")
    ip, ix = small.indptr.numpy(), small.indices.numpy()
    rows = {m: np.stack([pl.send_counts for pl in build_plans(ip, ix, None, part, m)]) for m in MODES}
    assert np.all(rows["prepost"] <= np.minimum(rows["pre"], rows["post"]))
    cmp = compare_modes(ip, ix, part)
    assert cmp["prepost"]["total"] < min(cmp["pre"]["total"], cmp["post"]["total"])
    for m in MODES:
        assert cmp[m] == {"total": int(rows[m].sum()), "max_rank": int(rows[m].sum(axis=1).max())}


def _same_plan(a, b) -> None:
    assert (a.rank, a.world, a.mode) == (b.rank, b.world, b.mode)
    for name in ("owned", "send_counts", "recv_counts", "in_degree_global", "rows_post", "rows_pre"):
        assert np.array_equal(getattr(a, name), getattr(b, name)), name
    for m in ("A", "S", "R"):
        for x, y in zip(getattr(a, m), getattr(b, m)):
            assert (x is None and y is None) or np.array_equal(x, y), m


@pytest.mark.parametrize("mode", MODES)
def test_rank_plan_and_part_files_agree_with_build_plans(tmp_path, mode):
    ip, ix, w = awkward_weighted(1)
    n = ip.size - 1
    part = np.random.default_rng(1).integers(0, 3, n)
    g = Graph.from_csr(ip, ix, edge_weight=w)
    write_parts(g, part, tmp_path / "parts")
    for r, pl in enumerate(build_plans(ip, ix, w, part, mode)):
        _same_plan(pl, build_rank_plan(ip, ix, w, part, mode, r))
        _same_plan(pl, plan_from_part(load_part(tmp_path / "parts", r), mode))


def test_plan_errors():
    ip, ix, w = awkward_weighted(0)
    part = np.zeros(ip.size - 1, dtype=np.int64)
    with pytest.raises(ConfigError, match="unknown aggregation mode"):
        build_plans(ip, ix, w, part, "both")
    with pytest.raises(ValueError):
        build_rank_plan(ip, ix, w, part[:-1], "post", 0)
    with pytest.raises(ValueError):
        build_rank_plan(ip, ix, w, part, "post", 2, world=2)
