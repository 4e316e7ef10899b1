"""Vertex partitioning: methods, balance, the on-disk cache, statistics and per-part files."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from helpers import awkward_graph
from tessera import Graph, datasets
from tessera.errors import ConfigError, DatasetError
from tessera.graph.partition import assign as pt
from tessera.graph.partition import format_partition_report, load_part, metis, partition, partition_stats, write_parts


@pytest.fixture(scope="module")
def small() -> Graph:
    return datasets.load("synthetic:small")


@pytest.fixture(scope="module")
def metis4(small, tmp_path_factory) -> np.ndarray:
    return partition(small, 4, "metis", cache_dir=tmp_path_factory.mktemp("cache"))


def _weighted_awkward() -> Graph:
    g = awkward_graph()
    gen = torch.Generator().manual_seed(3)
    n = g.num_nodes
    train = torch.zeros(n, dtype=torch.bool)
    train[::4] = True
    return g.replace(
        edge_weight=torch.rand(g.num_edges, generator=gen) + 0.1,
        x=torch.randn(n, 5, generator=gen),
        y=torch.randint(0, 3, (n,), generator=gen),
        train_mask=train,
    )


@pytest.mark.parametrize("method", ["metis", "range", "random"])
@pytest.mark.parametrize("parts", [2, 3, 8])
def test_methods_give_valid_assignments(small, tmp_path, method, parts):
    p = partition(small, parts, method, cache_dir=tmp_path)
    assert p.shape == (small.num_nodes,) and p.dtype.kind == "i"
    assert p.min() == 0 and p.max() == parts - 1
    assert (np.bincount(p, minlength=parts) > 0).all()


def test_range_and_random_shapes(small, tmp_path):
    r = partition(small, 3, "range", cache_dir=tmp_path)
    assert (np.diff(r) >= 0).all()
    assert np.ptp(np.bincount(r)) <= 1
    a = partition(small, 5, "random", seed=1, cache_dir=tmp_path)
    b = partition(small, 5, "random", seed=1, cache_dir=tmp_path / "other")
    c = partition(small, 5, "random", seed=2, cache_dir=tmp_path)
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    assert np.ptp(np.bincount(a)) <= 1


def test_metis_balances_and_cuts_less_than_random(small, metis4, tmp_path):
    s = partition_stats(small, metis4)
    assert s["vertex_balance"] < 1.1
    assert s["train_balance"] < 1.1
    assert s["edge_balance"] < 1.1
    rnd = partition_stats(small, partition(small, 4, "random", cache_dir=tmp_path))
    assert s["edge_cut"] < 0.5 * rnd["edge_cut"]
    assert s["halo_total"] < rnd["halo_total"]


def test_metis_is_deterministic(small, metis4, tmp_path):
    again = partition(small, 4, "metis", cache_dir=tmp_path)  # fresh cache: recomputed
    assert np.array_equal(again, metis4)


def test_metis_small_awkward_graph(tmp_path):
    g = _weighted_awkward()
    for parts in (2, 5, g.num_nodes):
        p = partition(g, parts, cache_dir=tmp_path)
        assert p.shape == (g.num_nodes,) and 0 <= p.min() and p.max() < parts


def test_single_constraint_fallback(small, metis4, monkeypatch):
    monkeypatch.setattr(metis, "_metis_lib", lambda: None)  # no ctypes path: one combined weight
    with pytest.warns(RuntimeWarning, match="falling back to single-constraint pymetis"):
        p = pt._metis(small, 4, 0)
    assert not np.array_equal(p, metis4)
    s = partition_stats(small, p, 4)
    assert s["edge_balance"] < 1.5 and s["edge_cut_fraction"] < 0.5


def test_one_part_and_errors(small, tmp_path):
    assert not partition(small, 1, cache_dir=tmp_path).any()
    for parts in (0, -2, small.num_nodes + 1, 2.5, True):
        with pytest.raises(ConfigError):
            partition(small, parts, cache_dir=tmp_path)
    with pytest.raises(ConfigError, match="unknown partition method"):
        partition(small, 2, "spectral", cache_dir=tmp_path)


def test_cache_hit_and_corrupt_file(small, tmp_path, monkeypatch):
    first = partition(small, 4, "metis", seed=0, cache_dir=tmp_path)
    files = list((tmp_path / "partitions").glob("*.npy"))
    assert len(files) == 1 and files[0].stem == pt.cache_key(small, 4, "metis", 0)

    def boom(*a, **k):
        raise AssertionError("recomputed despite a valid cache entry")

    monkeypatch.setattr(pt, "_compute", boom)
    assert np.array_equal(partition(small, 4, "metis", seed=0, cache_dir=tmp_path), first)
    monkeypatch.undo()

    files[0].write_bytes(b"\x93NUMPY garbage")
    assert np.array_equal(partition(small, 4, "metis", seed=0, cache_dir=tmp_path), first)
    assert np.array_equal(np.load(files[0], allow_pickle=False), first)  # rewritten
    np.save(files[0], first[:-1])  # wrong length
    assert np.array_equal(partition(small, 4, "metis", seed=0, cache_dir=tmp_path), first)
    np.save(files[0], first + 10)  # ids out of range
    assert np.array_equal(partition(small, 4, "metis", seed=0, cache_dir=tmp_path), first)


def test_cache_key_and_default_dir(small, tmp_path, monkeypatch):
    other_train = small.replace(train_mask=small.val_mask, val_mask=small.train_mask)
    assert pt.cache_key(small, 4, "metis", 0) != pt.cache_key(other_train, 4, "metis", 0)
    assert pt.cache_key(small, 4, "metis", 0) != pt.cache_key(small, 4, "metis", 1)
    assert pt.cache_key(small, 4, "metis", 0) != pt.cache_key(small, 4, "random", 0)
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "env"))
    partition(small, 2, "range")
    assert len(list((tmp_path / "env" / "partitions").glob("*.npy"))) == 1


def test_stats_by_hand():
    # edges j->i: 0->1, 1->0, 2->1, 3->1, 3->2, 2->2 (self loop); parts {0,1} and {2,3}
    g = Graph.from_edge_index(
        torch.tensor([[0, 1, 2, 3, 3, 2], [1, 0, 1, 1, 2, 2]]), 4, train_mask=torch.tensor([True, True, True, False])
    )
    s = partition_stats(g, np.array([0, 0, 1, 1]))
    assert s["edge_cut"] == 2 and s["edge_cut_fraction"] == pytest.approx(2 / 6)
    assert s["vertices"] == [2, 2] and s["edges"] == [4, 2] and s["train"] == [2, 1]
    assert s["halo"] == [2, 0] and s["cut_in_edges"] == [2, 0]
    assert s["edge_balance"] == pytest.approx(4 / 3) and s["train_balance"] == pytest.approx(2 / 1.5)
    report = format_partition_report(s)
    assert "edge cut: 2 (33.33% of edges)" in report and len(report.splitlines()) == 6


def test_write_and_load_parts_round_trip(tmp_path):
    g = _weighted_awkward()
    part = partition(g, 3, "random", cache_dir=tmp_path)
    out = write_parts(g, part, tmp_path / "parts", method="random")
    meta = json.loads((out / "meta.json").read_text())
    assert meta["parts"] == 3 and meta["fingerprint"] == g.fingerprint() and meta["method"] == "random"
    assert np.array_equal(np.load(out / "parts.npy"), part)
    src, dst = g.src_index().numpy(), g.dst_index().numpy()
    w = g.edge_weight.numpy()
    for k in range(3):
        d = load_part(out, k, expect_fingerprint=g.fingerprint(), expect_parts=3)
        owned = np.flatnonzero(part == k)
        assert np.array_equal(d["owned"], owned)
        assert np.array_equal(d["x"], g.x.numpy()[owned]) and np.array_equal(d["y"], g.y.numpy()[owned])
        assert np.array_equal(d["train_mask"], g.train_mask.numpy()[owned])
        ip = g.indptr.numpy()
        for li, v in enumerate(owned):
            lo, hi = d["indptr"][li], d["indptr"][li + 1]
            assert np.array_equal(d["src"][lo:hi], g.indices.numpy()[ip[v] : ip[v + 1]])
            assert np.array_equal(d["weight"][lo:hi], w[ip[v] : ip[v + 1]])
        cut_out = (part[src] == k) & (part[dst] != k)
        got = sorted(zip(d["owned"][d["out_src"]], d["out_dst"], d["out_weight"]))
        assert got == sorted(zip(src[cut_out], dst[cut_out], w[cut_out]))
        assert np.array_equal(d["ref_part"], part[d["ref_ids"]])
        assert set(d["src"]) | set(d["out_dst"]) <= set(d["ref_ids"])


def test_load_part_errors(tmp_path):
    g = _weighted_awkward()
    part = partition(g, 2, "range", cache_dir=tmp_path)
    out = write_parts(g, part, tmp_path / "p")
    with pytest.raises(DatasetError, match="different graph"):
        load_part(out, 0, expect_fingerprint="0" * 32)
    with pytest.raises(DatasetError, match="has 2 parts, expected 4"):
        load_part(out, 0, expect_parts=4)
    with pytest.raises(DatasetError, match="out of range"):
        load_part(out, 2)
    with pytest.raises(DatasetError, match="not a partition directory"):
        load_part(tmp_path / "nowhere", 0)
    (out / "part-1.npz").write_bytes(b"PK\x03\x04 truncated")
    with pytest.raises(DatasetError, match="corrupt"):
        load_part(out, 1)
    (out / "part-1.npz").unlink()
    with pytest.raises(DatasetError, match="missing"):
        load_part(out, 1)
    # a part file from another partition of the same directory name
    other = write_parts(g, 1 - part, tmp_path / "q")
    write_parts(g.replace(edge_weight=None), part, tmp_path / "r")
    (tmp_path / "r" / "part-0.npz").write_bytes((other / "part-0.npz").read_bytes())
    with pytest.raises(DatasetError, match="does not belong"):
        load_part(tmp_path / "r", 0)
    # a part whose features or weights hold a NaN or an infinity is refused, as a whole graph's are
    for name, bad in (("x", float("nan")), ("weight", float("inf"))):
        fresh = write_parts(g, part, tmp_path / f"bad-{name}")
        with np.load(fresh / "part-0.npz") as z:
            arrays = {k: z[k] for k in z.files}
        arrays[name] = arrays[name].copy()
        arrays[name].flat[0] = bad
        np.savez(fresh / "part-0.npz", **arrays)
        with pytest.raises(DatasetError, match=f"NaN or infinite {name}"):
            load_part(fresh, 0)
        assert load_part(fresh, 1)["rank"] == 1
    (out / "meta.json").write_text("{not json")
    with pytest.raises(DatasetError, match="corrupt"):
        load_part(out, 0)
