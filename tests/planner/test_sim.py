"""The simulator: its rows equal the plans', its bytes follow ``block_bytes``, its model behaves."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

import numpy as np
import pytest

from tessera.cli.simulate import add_parser, run
from tessera.comm.wire import GROUP_ROWS, block_bytes
from tessera.datasets import load
from tessera.errors import ConfigError
from tessera.graph.partition import partition
from tessera.graph.partition.halo import build_plans, pair_rows
from tessera.nn import build_model
from tessera.planner.model import CommModel, eq7_ratios, exchange_time, project
from tessera.planner.volume.common import exchange_layers
from tessera.planner.volume.partition import pair_detail, runtime_bytes, simulate_volumes

MODES = ("pre", "post", "prepost")


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def small():
    return load("synthetic:small")


def _csr(g):
    return g.indptr.numpy(), g.indices.numpy()


def _specs(g, model: str, hidden: int, layers: int):
    return build_model(model, g.num_features, hidden, g.num_classes, layers).describe()


def _plan_rows(indptr, indices, part, mode: str, world: int) -> np.ndarray:
    """What the runtime sends: each rank's ``send_counts`` from its built plan (one cover per pair)."""
    return np.stack([p.send_counts for p in build_plans(indptr, indices, None, part, mode, world)])


@pytest.mark.parametrize("parts", [2, 3, 4])
def test_rows_equal_plans(small, parts):
    part = partition(small, parts, "metis", 0)
    rows = pair_rows(*_csr(small), part, parts)
    for mode in MODES:
        np.testing.assert_array_equal(_plan_rows(*_csr(small), part, mode, parts), rows[mode])
    assert np.all(np.diag(rows["prepost"]) == 0)
    assert np.all(rows["prepost"] <= np.minimum(rows["pre"], rows["post"]))
    assert rows["prepost"].sum() < min(rows["pre"].sum(), rows["post"].sum())


def test_rows_random_graph_and_partition():
    rng = np.random.default_rng(3)
    n, e, parts = 300, 2500, 5
    dst = np.sort(rng.integers(0, n, e))
    indptr = np.concatenate([[0], np.cumsum(np.bincount(dst, minlength=n))])
    indices = rng.integers(0, n, e)  # duplicates and self loops included
    part = rng.integers(0, parts, n)
    rows = pair_rows(indptr, indices, part, parts)
    for mode in MODES:
        np.testing.assert_array_equal(_plan_rows(indptr, indices, part, mode, parts), rows[mode])


def test_no_cut_gives_zero_rows():
    rows = pair_rows(np.array([0, 1, 2]), np.array([0, 1]), np.array([0, 1]), 2)
    assert all(int(r.sum()) == 0 for r in rows.values())


def test_bytes_are_blocks_of_rows(small):
    vol = simulate_volumes(small, 3, _specs(small, "gcn", 256, 3), MODES, (32, 8, 4, 2), model="gcn")
    assert vol.widths == (64, 256, 8) and vol.backward == (False, True, True)
    for mode in MODES:
        r = vol.rows[mode]
        for bits, summary in vol.modes[mode].bits.items():
            epoch_bytes = 0
            for la in summary.layers:
                fwd = pair_detail(vol, mode, bits, la.layer, "forward")
                blocks = {(p, q): block_bytes(int(r[p, q]), la.width, bits) for p, q in zip(*np.nonzero(r))}
                assert fwd == {pq: (int(r[pq]), *b) for pq, b in blocks.items()}
                data = sum(b[0] for b in blocks.values())
                params = sum(b[1] for b in blocks.values())
                if bits < 32:  # one scale and zero per group of rows, groups cut at each pair's block
                    assert params == 8 * sum(-(-int(n) // GROUP_ROWS) for n in r.ravel())
                    assert params < 8 * int(r.sum()) / (GROUP_ROWS - 1)
                bwd = pair_detail(vol, mode, bits, la.layer, "backward")
                f = la.forward
                assert f is not None
                if la.backward is None:
                    assert bwd == {}
                else:  # backward pair (q, p) carries what p sent q forward
                    assert bwd == {(q, p): v for (p, q), v in fwd.items()}
                    assert la.backward.bytes == f.bytes
                assert f.data_bytes == data and f.param_bytes == params
                assert f.bytes == f.data_bytes + f.param_bytes
                per_sender = [sum(sum(b) for (p, _), b in blocks.items() if p == i) for i in range(3)]
                assert f.max_rank_bytes == max(per_sender)
                epoch_bytes += f.bytes + (la.backward.bytes if la.backward else 0)
            assert summary.epoch.bytes == epoch_bytes
            rb = runtime_bytes(vol, mode, bits)
            total = np.array(rb["bytes_data"]).sum() + np.array(rb["bytes_params"]).sum()
            assert total == epoch_bytes


def test_int2_ratio(small):
    vol = simulate_volumes(small, 4, _specs(small, "gcn", 256, 3), ("prepost",), (32, 2), model="gcn")
    b = {bits: [la.forward for la in v.layers] for bits, v in vol.modes["prepost"].bits.items()}
    rows = vol.rows["prepost"]
    groups = int((-(-rows // GROUP_ROWS)).sum())
    assert b[2][1].param_bytes == 8 * groups
    hidden = b[32][1].bytes / b[2][1].bytes
    assert hidden == pytest.approx(1024 * rows.sum() / (64 * rows.sum() + 8 * groups))
    assert hidden > 15  # params included: 8 bytes per 4 rows of 64 data bytes
    narrow = b[32][2].bytes / b[2][2].bytes
    assert narrow == pytest.approx(32 * rows.sum() / (2 * rows.sum() + 8 * groups))
    assert 7.5 < narrow < 8  # 8 classes: the parameters still weigh (per-row ones would give 3.2x)


def test_first_layer_backward_rule():
    gcn = build_model("gcn", 128, 256, 40, 2).describe()
    assert exchange_layers(gcn) == [(128, False), (40, True)]
    assert exchange_layers(build_model("gcn", 128, 64, 40, 2).describe()) == [(64, True), (40, True)]
    assert exchange_layers(gcn, norm="layer")[0] == (128, True)
    assert exchange_layers(gcn, label_prop=0.5)[0] == (128, True)
    assert exchange_layers(build_model("gin", 16, 8, 4, 2).describe()) == [(16, False), (8, True)]
    # an attention layer's rows carry its features and one term per head (4 heads of 2, then 1 of 4)
    assert exchange_layers(build_model("gat", 16, 8, 4, 2, heads=4).describe()) == [(12, True), (5, True)]


def test_gat_partition_volume_is_post_rows_of_features_and_terms():
    # what tests/test_gat_dist.py measures: every mode gathers post-mode rows of the features and
    # one term per head, both ways, float32 (4 heads of 2, then the 4 classes in one head)
    g = load("synthetic:tiny")
    vol = simulate_volumes(g, 3, build_model("gat", 16, 8, 4, 2, heads=4).describe(), MODES, (32,))
    post = int(pair_rows(*_csr(g), partition(g, 3, "metis", 0), 3, ("post",))["post"].sum())
    for mode in MODES:
        assert vol.modes[mode].bits[32].epoch.bytes == 2 * 4 * post * ((8 + 4) + (4 + 1)), mode


def test_gat_tensor_projection_adds_the_terms_exchanges():
    from tessera.parallel.tensor_attention import term_blocks
    from tessera.planner.model import blocks_time, project_tensor
    from tessera.planner.volume.tensor import tensor_volumes

    g, m = load("synthetic:tiny"), CommModel()
    tv = tensor_volumes(g, 3, build_model("gat", 16, 8, 4, 2, heads=4).describe(), bits=(32, 2))
    assert tv.terms == (8, 2)  # a source and a destination term per head
    terms = sum(blocks_time(term_blocks(tv.counts, k), 32, m) for k in tv.terms)
    without = project_tensor(replace(tv, terms=(0, 0)), m)
    for bits, t in project_tensor(tv, m).items():
        assert t == pytest.approx(without[bits] + terms) and terms > 0


# ---------------------------------------------------------------------------------------- model
def _rows() -> np.ndarray:
    return np.array([[0, 100_000, 0, 5_000], [40_000, 0, 40_000, 0], [0, 0, 0, 0], [1, 1, 1, 0]])


def test_more_bandwidth_less_time():
    times = [exchange_time(_rows(), 64, b, CommModel(bw, 5.0)).time_s for b in (32, 2) for bw in (1, 10, 100)]
    assert times[0] > times[1] > times[2] and times[3] > times[4] > times[5]


def test_latency_adds_per_active_pair():
    rows = _rows()
    for bits in (32, 2):
        base = exchange_time(rows, 64, bits, CommModel(latency_us=0.0))
        lat = exchange_time(rows, 64, bits, CommModel(latency_us=7.0))
        assert lat.rank == base.rank == 0
        assert lat.time_s - base.time_s == pytest.approx(2 * 7e-6)  # rank 0 talks to 2 peers
        assert lat.comm_s > base.comm_s
    assert exchange_time(np.zeros((3, 3), dtype=np.int64), 64, 32, CommModel()).time_s == 0


def test_quantization_time_and_eq8():
    rows = np.array([[0, 1000], [0, 0]])  # one pair: Eq. 6 reduces to Eq. 8
    m = CommModel(12.5, 5.0, 1000.0)
    fp32 = exchange_time(rows, 256, 32, m)
    q = exchange_time(rows, 256, 2, m)
    assert fp32.quant_s == 0 and q.quant_s == pytest.approx(2 * 1000 * (4 * 256 + 64) / 1e12)
    assert q.comm_s == pytest.approx((1000 * 64 + 250 * 8) / 12.5e9 + 5e-6)  # 250 groups of 4 rows
    assert eq7_ratios(1000, 256, 2, m).alpha == 4 * 256 / 2
    assert fp32.time_s / q.time_s == pytest.approx(eq7_ratios(1000, 256, 2, m).speedup)
    # slow quantization relative to the link makes Int2 lose (beta ~ 2 here)
    slow = CommModel(12.5, 5.0, 25.0)
    assert exchange_time(rows, 256, 2, slow).time_s > exchange_time(rows, 256, 32, slow).time_s


def test_project_speedup_and_norm(small):
    vol = simulate_volumes(small, 4, _specs(small, "gcn", 256, 2), MODES, (32, 2), norm="layer", model="gcn")
    assert vol.backward == (True, True)
    proj = project(vol, CommModel(quant_gbps=1000.0))
    assert proj["post"][32].speedup_vs_fp32_post == pytest.approx(1.0)
    assert proj["prepost"][32].speedup_vs_fp32_post > 1
    assert proj["prepost"][2].speedup_vs_fp32_post > proj["prepost"][32].speedup_vs_fp32_post
    assert proj["prepost"][32].epoch.pre_quant_s > 0
    with pytest.raises(ConfigError):
        CommModel(bandwidth_gbps=0)


# ---------------------------------------------------------------------------------------- command
def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["simulate", *argv])


def test_command_json_and_plot(tmp_path, capsys):
    png = tmp_path / "sim.png"
    assert run(_args("--dataset", "synthetic:small", "--parts", "2,4", "--plot", str(png), "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    assert [r["parts"] for r in doc["runs"]] == [2, 4]
    t5 = doc["runs"][0]["table5"]
    assert t5["pre_over_prepost"] > 1 and t5["prepost_fp32_over_quant"] > 10
    assert doc["runs"][0]["modes"]["prepost"]["bits"]["2"]["epoch"]["model"]["time_s"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and doc["plot"] == str(png)
    assert not list(tmp_path.glob(".sim.png.*"))  # no temporary left behind


def test_command_text(capsys):
    assert (
        run(_args("--dataset", "synthetic:small", "--parts", "3", "--remote-agg", "prepost", "--comm-bits", "32,4"))
        == 0
    )
    out = capsys.readouterr().out
    assert "Table-5-style" in out and "prepost + Int4 params" in out
    assert "pre/prepost" not in out and "0.00x" not in out  # no ratio against a mode not simulated


@pytest.mark.parametrize(
    "argv",
    [
        ("--parts", "2", "--comm-bits", "16"),
        ("--parts", "x"),
        ("--parts", "2", "--remote-agg", "mid"),
        ("--parts", "0"),
    ],
)
def test_command_user_errors(argv):
    with pytest.raises(ConfigError):
        run(_args("--dataset", "synthetic:small", *argv))


def test_tensor_volume_is_the_all_to_all_formula_and_flat_in_p(capsys):
    # Every ordered pair (i, j) moves 4 (n_i w_j + n_j w_i) bytes per aggregation pass; the total is
    # 8 N d (1 - sum_i n_i w_i / (N d)): close to 8 N d at any P, where the halo volume grows.
    from tessera.cli.main import main
    from tessera.planner.volume.tensor import tensor_volumes

    g = load("synthetic:small")
    specs = build_model("gcn", g.num_features, 32, g.num_classes, 2).describe()
    totals = {}
    for parts in (2, 4, 16, 64):
        counts = np.bincount(partition(g, parts, "metis", 0), minlength=parts)
        want = 0
        for i, s in enumerate(specs):
            w = np.diff([s.aggregate_width * k // parts for k in range(parts + 1)])
            one = sum(4 * (counts[a] * w[b] + counts[b] * w[a]) for a in range(parts) for b in range(parts) if a != b)
            want += one * (2 if i > 0 or s.aggregates_input_grad(False) else 1)
        totals[parts] = tensor_volumes(g, parts, specs).bytes
        assert totals[parts] == want, parts
        upper = sum(8 * g.num_nodes * s.aggregate_width * 2 for s in specs)
        assert totals[parts] <= upper
    assert totals[64] / totals[16] < 1.1 and totals[64] >= totals[16]
    assert main(["simulate", "--dataset", "synthetic:small", "--parts", "2,64", "--strategy", "partition,tensor"]) == 0
    out = capsys.readouterr().out
    assert "tensor parallelism (MixGCN)" in out and "prepost" in out
    assert main(["simulate", "--dataset", "synthetic:small", "--parts", "2", "--strategy", "nope"]) == 2


def test_blocks_time_of_one_width_is_eq6():
    from tessera.planner.model import blocks_time

    rng = np.random.default_rng(3)
    rows = rng.integers(0, 500, (4, 4))
    np.fill_diagonal(rows, 0)
    rows[1, 2] = 0  # a silent pair adds no latency
    m = CommModel()
    for bits in (32, 8, 2):
        want = exchange_time(rows, 24, bits, m).time_s
        assert blocks_time([(rows, np.full((4, 4), 24))], bits, m) == pytest.approx(want, rel=1e-12)


def test_tensor_and_partition_memory_balance_and_plot(small, tmp_path, capsys):
    # MixGCN Figs. 9-11 analogues: per-rank feature memory and aggregation balance of both strategies
    specs = _specs(small, "gcn", 32, 2)
    part = partition(small, 4, "metis", 0)
    vol = simulate_volumes(small, 4, specs, ("prepost",), (32,))
    owned = np.bincount(part, minlength=4)
    received = vol.rows["prepost"].sum(axis=0)
    want = max(int((4 * w * (owned + received)).max()) for w in vol.widths)
    assert vol.feature_bytes_max["prepost"] == want
    edges = np.bincount(part[np.repeat(np.arange(small.num_nodes), np.diff(small.indptr.numpy()))], minlength=4)
    assert vol.flops_max_over_mean == pytest.approx(edges.max() / edges.mean())
    png = tmp_path / "sim.png"
    argv = ("--dataset", "synthetic:small", "--parts", "2,4", "--strategy", "partition,tensor", "--comm-bits", "32,8")
    assert run(_args(*argv, "--remote-agg", "prepost", "--plot", str(png), "--json")) == 0
    doc = json.loads(capsys.readouterr().out)
    t = doc["runs"][1]["tensor"]
    assert t["time_s"]["32"] > 0 and t["time_s"]["8"] > 0 and "_counts" not in t
    assert doc["runs"][1]["feature_bytes_max"]["prepost"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
