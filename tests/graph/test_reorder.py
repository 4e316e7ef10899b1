"""Locality orderings: valid permutations, exact relabelling, caching, the measured choice, and a
Trainer whose renumbering is invisible (same accuracy, outputs and checkpoints in caller order)."""

import json

import numpy as np
import pytest
import torch

from tessera import sparse
from tessera.backends import ordering
from tessera.cli.main import main
from tessera.datasets import load
from tessera.errors import ConfigError
from tessera.files import save_npy
from tessera.graph import Graph
from tessera.graph import order as ro
from tessera.train.checkpoint import load_checkpoint
from tessera.train.config import TrainConfig
from tessera.train.loop import Trainer

ORDERS = ("none", "rcm", "metis", "degree")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "cache"))


def _messy_graph(n=300, seed=0) -> Graph:
    """Power-law-ish directed graph with duplicate edges, self loops, isolated vertices, a hub,
    edge weights and types, features, labels and split masks."""
    rng = np.random.default_rng(seed)
    e = 3000
    src = (rng.pareto(1.5, e) * 10).astype(np.int64) % (n - 20)
    dst = rng.integers(0, n - 20, e)
    src[:400] = 7  # a hub
    src[400:420], dst[400:420] = np.arange(20), np.arange(20)  # self loops
    src[420:440], dst[420:440] = 3, 5  # duplicates
    y = rng.integers(0, 4, n)
    perm = rng.permutation(n)
    masks = [torch.zeros(n, dtype=torch.bool) for _ in range(3)]
    for k, m in enumerate(masks):
        m[torch.from_numpy(perm[k * 60 : (k + 1) * 60])] = True
    return Graph.from_edge_index(
        torch.from_numpy(np.stack([src, dst])),
        n,
        edge_weight=torch.from_numpy(rng.random(e)).float(),
        edge_type=torch.from_numpy(rng.integers(0, 3, e)),
        x=torch.randn(n, 5, generator=torch.Generator().manual_seed(seed)),
        y=torch.from_numpy(y),
        train_mask=masks[0],
        val_mask=masks[1],
        test_mask=masks[2],
    )


@pytest.mark.parametrize("method", ORDERS)
def test_every_order_is_a_permutation(method):
    g = load("synthetic:small")
    perm = ro.vertex_order(g, method, parts=16)
    assert perm.dtype == np.int64 and ro.is_permutation(perm, g.num_nodes)
    if method == "none":
        assert np.array_equal(perm, np.arange(g.num_nodes))
    if method == "degree":
        deg = g.in_degree().numpy()[perm]
        assert (np.diff(deg) <= 0).all()
    assert ro.is_permutation(ro.vertex_order(_messy_graph(), method, parts=8), 300)


def test_metis_order_groups_parts_and_improves_locality():
    g = load("synthetic:small")
    perm = ro.vertex_order(g, "metis", parts=16)
    part = ro.metis_parts(g, 16)
    assert (np.diff(part[perm]) >= 0).all() and np.unique(part).size == 16
    # the new numbering keeps most edges between nearby ids; the synthetic ids are shuffled
    inv = ro.inverse_permutation(perm)
    src, dst = g.src_index().numpy(), g.dst_index().numpy()
    assert np.median(np.abs(inv[src] - inv[dst])) < 0.25 * np.median(np.abs(src - dst))


@pytest.mark.parametrize("method", ORDERS)
def test_permute_aggregate_unpermute_is_exact(method):
    g = _messy_graph().gcn_norm()
    order = ro.VertexOrder.of(g, method, width=4)  # small width: several METIS parts
    pg = order.permute(g)
    x = torch.randn(g.num_nodes, 6, dtype=torch.float64)
    w = g.edge_weight.double()
    for backend in ("reference", "csr"):
        want = sparse.aggregate(g, x, weight=w, backend=backend)
        got = sparse.aggregate(pg, order.to_new(x), weight=pg.edge_weight.double(), backend=backend)
        torch.testing.assert_close(order.to_original(got), want, rtol=1e-12, atol=1e-12)
        want_m = sparse.aggregate(g, x, reduce="mean", backend=backend)
        got_m = sparse.aggregate(pg, order.to_new(x), reduce="mean", backend=backend)
        torch.testing.assert_close(order.to_original(got_m), want_m, rtol=1e-12, atol=1e-12)


def test_permute_graph_moves_every_field_and_inverts_exactly():
    g = _messy_graph()
    perm = np.random.default_rng(1).permutation(g.num_nodes)
    pg = ro.permute_graph(g, perm)
    p = torch.from_numpy(perm)
    assert torch.equal(pg.x, g.x[p]) and torch.equal(pg.y, g.y[p])
    for m in ("train_mask", "val_mask", "test_mask"):
        assert torch.equal(getattr(pg, m), getattr(g, m)[p])
    assert pg.num_classes == g.num_classes and pg.num_edges == g.num_edges
    # CSR stays sorted within rows; edges (with weight and type) are the same multiset
    ip, ind = pg.indptr.long(), pg.indices.long()
    for i in range(pg.num_nodes):
        row = ind[ip[i] : ip[i + 1]]
        assert bool((row[1:] >= row[:-1]).all())
    old = {(int(perm[s]), int(perm[d]), float(w), int(t)) for s, d, w, t in zip(
        pg.src_index(), pg.dst_index(), pg.edge_weight, pg.edge_type)}  # fmt: skip
    new = {(int(s), int(d), float(w), int(t)) for s, d, w, t in zip(
        g.src_index(), g.dst_index(), g.edge_weight, g.edge_type)}  # fmt: skip
    assert old == new
    back = ro.permute_graph(pg, ro.inverse_permutation(perm))
    for f in ("indptr", "indices", "edge_weight", "edge_type", "x", "y", "train_mask"):
        assert torch.equal(getattr(back, f), getattr(g, f)), f
    assert ro.permute_graph(g, perm, features=False).x is None
    with pytest.raises(ValueError, match="not a permutation"):
        ro.permute_graph(g, np.zeros(g.num_nodes, dtype=np.int64))


def test_vertex_order_helpers():
    order = ro.VertexOrder.from_perm([2, 0, 1])
    assert order.inv.tolist() == [1, 2, 0]
    t = torch.tensor([[10.0], [11.0], [12.0]])
    assert order.to_new(t).view(-1).tolist() == [12.0, 10.0, 11.0]
    assert torch.equal(order.to_original(order.to_new(t)), t)
    assert order.ids_to_new(torch.tensor([2])).tolist() == [0]
    assert order.ids_to_original(torch.tensor([0])).tolist() == [2]
    with pytest.raises(ValueError):
        ro.VertexOrder.from_perm([0, 0, 1])
    with pytest.raises(ConfigError, match="unknown vertex order"):
        ro.vertex_order(_messy_graph(), "hilbert")


def test_orders_are_cached_on_disk_by_fingerprint(tmp_path, monkeypatch):
    g = load("synthetic:small")
    a = ro.vertex_order(g, "rcm")
    assert list((tmp_path / "cache" / "orders").glob("*.npy"))
    fresh = load("synthetic:small")  # a new object: nothing cached in memory

    def boom(*args):
        raise AssertionError("recomputed instead of read from the cache")

    monkeypatch.setattr(ro, "_compute", boom)
    assert np.array_equal(ro.vertex_order(fresh, "rcm"), a)


def _mapped_from(t: torch.Tensor, path) -> bool:
    """Whether ``t``'s memory lies in a mapping of the file ``path`` (Linux's /proc/self/maps)."""
    where = t.data_ptr()
    for line in open("/proc/self/maps"):
        fields = line.split()
        lo, hi = (int(v, 16) for v in fields[0].split("-"))
        if len(fields) >= 6 and fields[5] == str(path) and lo <= where < hi:
            return True
    return False


@pytest.mark.parametrize("edge_data", [False, True])
def test_a_kept_renumbering_is_read_back_exactly_and_a_bad_file_is_recomputed(tmp_path, monkeypatch, edge_data):
    g = _messy_graph() if edge_data else load("synthetic:small")
    order = ro.VertexOrder.of(g, "rcm")
    want = ro.permute_graph(g, order.perm.numpy())  # not kept: below the size, and keep off
    assert not list((tmp_path / "cache" / "orders").glob("*.csr.*"))
    monkeypatch.setattr(ro, "KEEP_EDGES", 0)
    first = order.permute(g)
    (kept,) = (tmp_path / "cache" / "orders").glob("*.csr.indices.npy")
    assert len(list((tmp_path / "cache" / "orders").glob("*.csr.*.npy"))) == (3 if edge_data else 2)
    renumber = ro.renumbered_csr

    def boom(*args, **kwargs):
        raise AssertionError("renumbered again instead of read from the cache")

    monkeypatch.setattr(ro, "renumbered_csr", boom)
    again = order.permute(g)
    for got in (first, again):
        for name in ("indptr", "indices", "edge_weight", "edge_type", "x", "y", "train_mask"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None and b is None) or torch.equal(a, b), name
    assert _mapped_from(again.indices, kept)  # mapped from the file, not read into new memory
    # a file of another graph's size is not trusted: the structure is computed and kept again
    del first, again  # the mapped file is replaced below
    save_npy(kept, np.load(kept)[:-1])
    calls = []
    monkeypatch.setattr(ro, "renumbered_csr", lambda *a, **k: calls.append(1) or renumber(*a, **k))
    assert torch.equal(order.permute(g).indices, want.indices) and calls == [1]
    assert np.load(kept).shape == want.indices.shape


def test_choose_order_margin_and_decision_cache(tmp_path, monkeypatch):
    g = load("synthetic:small")
    assert ordering.choose_order(g, 16, candidates=("rcm", "degree"), margin=0.99, reps=1) == "none"
    pick = ordering.choose_order(g, 32, candidates=("rcm", "degree"), margin=-100.0, reps=1)
    assert pick in ("rcm", "degree")
    files = list((tmp_path / "cache" / "orders").glob("choice-*.json"))
    assert len(files) == 2
    rec = json.loads(next(f for f in files if json.loads(f.read_text())["widths"] == [32]).read_text())
    assert rec["choice"] == pick and set(rec["times"]) == {"none", "rcm", "degree"}
    monkeypatch.setattr(ordering, "time_orders", lambda *a, **k: pytest.fail("measured again"))
    assert ordering.choose_order(load("synthetic:small"), 32, candidates=("rcm", "degree"), margin=-100.0) == pick


def test_choose_order_sums_the_widths_a_run_aggregates_at(monkeypatch):
    # One numbering serves every layer: the choice goes by the total over the widths (a width
    # listed twice counts twice), not by any one width.
    g = load("synthetic:small")
    per_width = {"none": {16: 1.0, 64: 4.0}, "rcm": {16: 0.2, 64: 4.2}, "degree": {16: 1.0, 64: 3.9}}
    seen = []

    def fake(graph, widths, methods, *a, **k):
        seen.append(widths)
        return {
            m: {"order_s": 0.0, "agg_by_width": per_width[m], "agg_s": sum(per_width[m][w] for w in widths)}
            for m in methods
        }

    monkeypatch.setattr(ordering, "time_orders", fake)
    cands = ("rcm", "degree")
    assert ordering.choose_order(g, 64, candidates=cands, margin=0.0) == "degree"  # 3.9 < 4.0 < 4.2
    assert ordering.choose_order(g, [64, 16], candidates=cands, margin=0.0) == "rcm"  # 4.4 < 4.9 < 5.0
    assert ordering.choose_order(g, [64, 64, 16], candidates=cands, margin=0.05) == "none"  # 8.6 > 0.95 * 9
    assert seen == [(64,), (16, 64), (16, 64, 64)]
    with pytest.raises(ConfigError):
        ordering.choose_order(g, [64, 0])


def test_time_orders_reports_every_width_and_their_sum():
    g = load("synthetic:small")
    res = ordering.time_orders(g, (8, 16, 16), ("none", "degree"), backend="csr", reps=1)
    for m in ("none", "degree"):
        by = res[m]["agg_by_width"]
        assert set(by) == {8, 16} and min(by.values()) > 0
        assert res[m]["agg_s"] == pytest.approx(by[8] + 2 * by[16])


@pytest.mark.parametrize(("budget", "rounds"), [(1e9, 5), (0.0, 2)])
def test_time_orders_stops_after_a_pair_of_rounds_past_its_budget(monkeypatch, budget, rounds):
    """Every order gets the same number of timed rounds: all of them within the budget, else the
    first forward-and-reverse pair past it."""
    g = load("synthetic:small")
    timed = []
    real = ordering._time_aggregate
    monkeypatch.setattr(ordering, "_time_aggregate", lambda graph, *a: timed.append(graph) or real(graph, *a))
    monkeypatch.setattr(ordering, "ORDER_TRIAL_BUDGET_S", budget)
    ordering.time_orders(g, 8, ("none", "degree"), backend="csr", reps=5)
    assert len(timed) == 2 * (1 + rounds)  # a warm-up call and the rounds, for each of two orders


def test_trainer_measures_orders_at_the_models_aggregation_widths(tmp_path, monkeypatch):
    g = load("synthetic:tiny")
    monkeypatch.setattr(ordering, "AUTO_MIN_NODES", 1)
    asked = []
    monkeypatch.setattr(ordering, "choose_order", lambda graph, widths, backend: asked.append(list(widths)) or "none")
    for model in ("gcn", "gin", "gat"):
        Trainer(_cfg(tmp_path, model, model=model, epochs=1, hidden=24, heads=4, reorder="auto"), g)
    f, c = g.x.shape[1], g.num_classes
    assert asked == [[min(f, 24), min(24, c)], [f, 24], [24, c]]


def test_auto_keeps_small_graphs_without_measuring(monkeypatch):
    monkeypatch.setattr(ordering, "choose_order", lambda *a, **k: pytest.fail("measured a small graph"))
    g = load("synthetic:small")
    assert ordering.resolve(g, "auto", 64) == "none"
    assert ordering.resolve(g, "rcm", 64) == "rcm"
    with pytest.raises(ConfigError):
        ordering.resolve(g, "spectral", 64)
    monkeypatch.setattr(ordering, "AUTO_MIN_NODES", 100)
    monkeypatch.setattr(ordering, "choose_order", lambda *a, **k: "degree")
    assert ordering.resolve(g, "auto", 64) == "degree"


# ---------------------------------------------------------------------------------------- trainer
def _cfg(tmp_path, name, **kw):
    base = dict(dataset="synthetic:tiny", epochs=30, hidden=16, out=str(tmp_path / name), progress=False)
    return TrainConfig(**{**base, **kw})


def test_trainer_reorder_is_invisible_with_dropout_and_label_propagation(tmp_path):
    # Dropout masks and the label-propagation draw are keyed by the caller's vertex ids, so a
    # renumbered run draws the same random numbers for the same vertices.
    g = load("synthetic:tiny")
    kw = dict(dropout=0.5, label_prop=0.5, norm="layer")
    ta = Trainer(_cfg(tmp_path, "a", reorder="none", **kw), g)
    ra = ta.fit()
    tb = Trainer(_cfg(tmp_path, "b", reorder="metis", **kw), g)
    rb = tb.fit()
    assert ra["vertex_order"] == "none" and rb["vertex_order"] == "metis"
    assert tb.order is not None and not torch.equal(tb.order.perm, torch.arange(g.num_nodes))
    for k in ("train_acc", "val_acc", "test_acc", "best_epoch"):
        assert ra[k] == pytest.approx(rb[k], abs=1e-9), k
    # predictions come back in the caller's vertex order
    torch.testing.assert_close(tb.predict(), ta.predict(), rtol=1e-4, atol=1e-4)
    pred = tb.predict().argmax(1)
    assert float((pred[g.test_mask] == g.y[g.test_mask]).float().mean()) == pytest.approx(rb["test_acc"])
    # the checkpoint belongs to the caller's graph and holds the same (order-free) weights
    ca, cb = (load_checkpoint(tmp_path / k / "checkpoint.pt") for k in "ab")
    assert ca["graph"] == cb["graph"] == g.fingerprint()
    for k in ca["model"]:
        torch.testing.assert_close(ca["model"][k], cb["model"][k], rtol=1e-4, atol=1e-5)
    hist_a = [json.loads(s) for s in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    hist_b = [json.loads(s) for s in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert [h["val_acc"] for h in hist_a] == [h["val_acc"] for h in hist_b]
    assert [h["train_loss"] for h in hist_a] == pytest.approx([h["train_loss"] for h in hist_b], rel=1e-4)


def test_trainer_reorder_same_accuracy_on_cora(planetoid_root, monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_DATA", str(planetoid_root.parent))
    g = load("cora")
    res = {}
    for m in ("none", "metis"):
        cfg = TrainConfig(dataset="cora", hidden=16, epochs=100, out=str(tmp_path / m), progress=False, reorder=m)
        res[m] = Trainer(cfg, g).fit()["test_acc"]
    # the same random draws per vertex: the runs differ by rounding only (one test vertex = 0.001)
    assert abs(res["metis"] - res["none"]) <= 0.002, res
    assert min(res.values()) > 0.79, res  # GCN on Cora: about 81 %


def test_resume_across_reorder(tmp_path):
    g = load("synthetic:tiny")
    full = Trainer(_cfg(tmp_path, "full", dropout=0.0, epochs=20, reorder="none", patience=0), g).fit()
    Trainer(_cfg(tmp_path, "x", dropout=0.0, epochs=10, reorder="rcm", patience=0), g).fit()
    # a checkpoint written in the renumbered run resumes in the original numbering, and back
    res = Trainer(_cfg(tmp_path, "x", dropout=0.0, epochs=15, reorder="none", patience=0, resume=True), g).fit()
    assert res["epochs_run"] == 15
    res = Trainer(_cfg(tmp_path, "x", dropout=0.0, epochs=20, reorder="degree", patience=0, resume=True), g).fit()
    assert res["epochs_run"] == 20 and res["vertex_order"] == "degree"
    assert res["test_acc"] == pytest.approx(full["test_acc"], abs=1e-9)
    a = load_checkpoint(tmp_path / "full" / "checkpoint.pt")["model"]
    b = load_checkpoint(tmp_path / "x" / "checkpoint.pt")["model"]
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-4, atol=1e-5)


def test_label_propagation_draw_follows_original_ids(tmp_path):
    g = load("synthetic:tiny")
    kw = dict(dropout=0.0, label_prop=0.5, epochs=10)
    a = Trainer(_cfg(tmp_path, "a", reorder="none", **kw), g).fit()
    b = Trainer(_cfg(tmp_path, "b", reorder="metis", **kw), g).fit()
    assert a["test_acc"] == pytest.approx(b["test_acc"], abs=1e-9)


def test_cli_reorder_flag(tmp_path):
    out = tmp_path / "run"
    args = ["train", "--dataset", "synthetic:tiny", "--epochs", "3", "--no-progress", "--out", str(out)]
    assert main([*args, "--reorder", "degree"]) == 0
    res = json.loads((out / "result.json").read_text())
    assert res["vertex_order"] == "degree" and res["config"]["reorder"] == "degree"
    assert main([*args, "--reorder", "spectral"]) == 2
    with pytest.raises(ConfigError, match="--reorder"):
        TrainConfig(reorder="spectral").validate()
