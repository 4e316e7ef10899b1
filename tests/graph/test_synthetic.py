"""Tests for the synthetic DC-SBM graph generator."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tessera.errors import DatasetError
from tessera.graph import Graph
from tessera.graph.synthetic import PRESETS, SyntheticSpec, generate


@pytest.fixture(scope="module")
def tiny() -> Graph:
    return generate("tiny")


@pytest.fixture(scope="module")
def small() -> Graph:
    return generate("small")


def _check_structure(g: Graph) -> None:
    src, dst = g.src_index(), g.dst_index()
    assert not bool((src == dst).any()), "self loop"
    key = dst * g.num_nodes + src
    assert bool((key[1:] > key[:-1]).all()), "rows must be sorted and duplicate-free"
    assert g.is_undirected()


def _accuracy_nearest_centroid(feat: torch.Tensor, g: Graph) -> float:
    y, tr, te = g.y, g.train_mask, g.test_mask
    cent = torch.stack([feat[tr & (y == c)].mean(0) for c in range(g.num_classes)])
    return float((torch.cdist(feat[te], cent).argmin(1) == y[te]).float().mean())


def _neighbour_mean(g: Graph) -> torch.Tensor:
    agg = torch.zeros_like(g.x).index_add_(0, g.dst_index(), g.x[g.src_index()])
    return agg / g.in_degree().clamp(min=1).unsqueeze(1)


def test_unknown_preset_lists_presets() -> None:
    with pytest.raises(DatasetError) as e:
        generate("nope")
    for name in PRESETS:
        assert name in str(e.value)


def test_invalid_spec_raises() -> None:
    with pytest.raises(DatasetError):
        generate(SyntheticSpec(100, 10_000, 8, 2))
    with pytest.raises(DatasetError):
        generate(dataclasses.replace(PRESETS["tiny"], homophily=1.5))


def test_preset_specs_match_benchmarks() -> None:
    arxiv, products, reddit = PRESETS["arxiv"], PRESETS["products"], PRESETS["reddit"]
    assert (arxiv.num_nodes, arxiv.num_features, arxiv.num_classes) == (169_343, 128, 40)
    assert abs(2 * arxiv.num_undirected_edges - 2_300_000) <= 0.03 * 2_300_000
    assert abs(products.num_nodes - 500_000) <= 15_000
    assert (products.num_features, products.num_classes) == (100, 47)
    assert abs(2 * products.num_undirected_edges - 24_000_000) <= 0.03 * 24_000_000
    assert abs(reddit.num_nodes - 100_000) <= 3_000
    assert (reddit.num_features, reddit.num_classes) == (602, 41)
    assert abs(2 * reddit.num_undirected_edges / reddit.num_nodes - 200) <= 6
    for name, spec in PRESETS.items():
        assert spec.name == name


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_sizes_and_metadata(name: str, tiny: Graph, small: Graph) -> None:
    g, spec = {"tiny": tiny, "small": small}[name], PRESETS[name]
    assert g.num_nodes == spec.num_nodes
    assert g.num_edges == 2 * spec.num_undirected_edges
    assert g.x.shape == (spec.num_nodes, spec.num_features) and g.x.dtype == torch.float32
    assert g.num_classes == spec.num_classes
    assert set(g.y.unique().tolist()) == set(range(spec.num_classes))
    assert g.name == f"synthetic:{name}"
    _check_structure(g)


def test_preset_sizes_small_preset_scale() -> None:
    spec = PRESETS["small"]
    assert spec.num_nodes == 10_000 and spec.num_features == 64 and spec.num_classes == 8
    assert abs(spec.num_undirected_edges - 50_000) <= 1_500
    tiny = PRESETS["tiny"]
    assert abs(tiny.num_nodes - 200) <= 10 and abs(tiny.num_undirected_edges - 800) <= 40
    assert (tiny.num_features, tiny.num_classes) == (16, 4)


def test_arxiv_preset() -> None:
    g = generate("arxiv")
    assert g.num_nodes == 169_343
    assert abs(g.num_edges - 2_300_000) <= 0.03 * 2_300_000
    assert g.num_features == 128 and g.num_classes == 40
    src, dst = g.src_index(), g.dst_index()
    assert not bool((src == dst).any())
    assert bool((dst * g.num_nodes + src).diff().gt(0).all())
    stats = g.degree_stats()
    assert 1_000 <= stats["max"] <= 10_000 and stats["max"] > 50 * stats["mean"]


@pytest.mark.parametrize("name", ["products", "reddit"])
def test_scaled_down_large_presets(name: str) -> None:
    spec = PRESETS[name]
    s = 20  # same mean degree, exponent, homophily and edge density inside communities; fewer vertices
    scaled = dataclasses.replace(
        spec,
        num_nodes=spec.num_nodes // s,
        num_undirected_edges=spec.num_undirected_edges // s,
        num_classes=max(2, spec.num_classes // s),
        max_degree=spec.max_degree // s,
    )
    g = generate(scaled, seed=3)
    assert g.num_nodes == scaled.num_nodes
    assert g.num_edges == 2 * scaled.num_undirected_edges
    assert g.num_features == spec.num_features
    assert g.name == f"synthetic:{name}"
    _check_structure(g)
    hom = float((g.y[g.src_index()] == g.y[g.dst_index()]).float().mean())
    assert abs(hom - spec.homophily) < 0.01


def test_too_dense_spec_raises() -> None:
    spec = SyntheticSpec(1_000, 100_000, 8, 40, max_degree=250)
    with pytest.raises(DatasetError, match="dense"):
        generate(spec)


def test_determinism_and_seed_sensitivity(small: Graph) -> None:
    again = generate("small", seed=0)
    assert again.fingerprint() == small.fingerprint()
    assert torch.equal(again.x, small.x) and torch.equal(again.y, small.y)
    for m in ("train_mask", "val_mask", "test_mask"):
        assert torch.equal(getattr(again, m), getattr(small, m))
    other = generate("small", seed=1)
    assert other.fingerprint() != small.fingerprint()
    assert not torch.equal(other.x, small.x)


def test_power_law_degree_spread(small: Graph) -> None:
    deg = small.in_degree().numpy()
    assert deg.max() >= 10 * deg.mean()
    assert np.percentile(deg, 99) >= 4 * np.median(deg)
    assert deg.max() <= PRESETS["small"].max_degree * 1.5


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_homophily(name: str, tiny: Graph, small: Graph) -> None:
    g = {"tiny": tiny, "small": small}[name]
    hom = float((g.y[g.src_index()] == g.y[g.dst_index()]).float().mean())
    assert abs(hom - PRESETS[name].homophily) < 0.01


@pytest.mark.parametrize("name", ["tiny", "small"])
def test_masks(name: str, tiny: Graph, small: Graph) -> None:
    g, spec = {"tiny": tiny, "small": small}[name], PRESETS[name]
    tr, va, te = g.train_mask, g.val_mask, g.test_mask
    assert tr.any() and va.any() and te.any()
    assert not bool((tr & va).any() or (tr & te).any() or (va & te).any())
    assert bool((tr | va | te).all())
    assert spec.per_class is not None
    counts = torch.bincount(g.y[tr], minlength=spec.num_classes)
    assert bool((counts == spec.per_class[0]).all())


def test_fraction_split() -> None:
    spec = dataclasses.replace(PRESETS["arxiv"], num_nodes=5_000, num_undirected_edges=30_000, max_degree=300)
    g = generate(spec)
    n = spec.num_nodes
    for mask, frac in zip((g.train_mask, g.val_mask, g.test_mask), spec.split, strict=True):
        assert abs(int(mask.sum()) - frac * n) <= 2
    assert not bool((g.train_mask & g.val_mask).any() or (g.val_mask & g.test_mask).any())


def test_features_correlate_with_classes_and_neighbours_help(tiny: Graph, small: Graph) -> None:
    for g in (tiny, small):
        chance = 1.0 / g.num_classes
        raw = _accuracy_nearest_centroid(g.x, g)
        agg = _accuracy_nearest_centroid(_neighbour_mean(g), g)
        assert chance + 0.15 < raw < 0.9, raw
        assert agg > raw + 0.1, (raw, agg)


def test_custom_spec_name() -> None:
    g = generate(SyntheticSpec(300, 1_000, 8, 3, max_degree=50, per_class=(5, 5)), seed=2)
    assert g.name == "synthetic:custom" and g.num_nodes == 300 and g.num_edges == 2_000
    _check_structure(g)


def test_a_generated_graph_is_cached_on_disk_and_read_back_equal(tmp_path, monkeypatch):
    import tessera.datasets as datasets

    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    monkeypatch.setattr(datasets, "_CACHED_MIN_EDGES", 0)
    fresh = datasets.load("synthetic:tiny", seed=3)
    (path,) = (tmp_path / "synthetic").glob("tiny-s3-*.npz")
    cached = datasets.load("synthetic:tiny", seed=3)
    assert cached.fingerprint() == fresh.fingerprint()
    for k in ("indptr", "indices", "x", "y", "train_mask", "val_mask", "test_mask"):
        assert torch.equal(getattr(cached, k), getattr(fresh, k)), k
    assert (cached.num_classes, cached.name) == (fresh.num_classes, fresh.name)
    typed = datasets.load("synthetic:tiny-rel3")
    assert torch.equal(datasets.load("synthetic:tiny-rel3").edge_type, typed.edge_type)
    path.write_bytes(path.read_bytes()[:100])  # a torn file is generated again, not an error
    again = datasets.load("synthetic:tiny", seed=3)
    assert again.fingerprint() == fresh.fingerprint()
    assert datasets.load("synthetic:tiny", seed=3).fingerprint() == fresh.fingerprint()  # rewritten whole
