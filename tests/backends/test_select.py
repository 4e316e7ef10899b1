"""``backend="auto"``: measured choice, on-disk decision cache, and the ``tessera kernels`` command."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import awkward_graph
from tessera import sparse
from tessera.backends import available_backends, get_backend, select
from tessera.cli.main import main
from tessera.graph.synthetic import generate


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    return tmp_path / "kernels.json"


def test_auto_matches_reference_forward_and_backward(cache):
    g = awkward_graph()
    w = torch.rand(g.num_edges)
    for weight in (None, w):
        for reduce in ("sum", "mean"):
            x1 = torch.randn(g.num_nodes, 7, requires_grad=True)
            x2 = x1.detach().clone().requires_grad_()
            a = sparse.aggregate(g, x1, reduce, weight, "auto")
            b = sparse.aggregate(g, x2, reduce, weight, "reference")
            # Relative to the output's scale: float32 sums in another order differ by rounding.
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5 * float(b.abs().max()))
            a.square().sum().backward()
            b.square().sum().backward()
            torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5 * float(x2.grad.abs().max()))


def test_small_problems_use_the_cost_model_without_measuring(cache, monkeypatch):
    g = awkward_graph()
    monkeypatch.setattr(select, "measure", lambda *a, **k: pytest.fail("measured a tiny problem"))
    name = select.choose(g, torch.randn(g.num_nodes, 4), None, "forward")
    assert name in available_backends()
    assert not cache.exists()


def test_measured_choice_is_the_fastest_and_is_reused_from_disk(cache, monkeypatch):
    g = generate("tiny", seed=0)
    monkeypatch.setattr(select, "_TRIAL_MIN_WORK", 0)
    seen = []
    real = select.measure

    def spy(*args, **kw):
        got = real(*args, **kw)
        seen.append(got)
        return got

    monkeypatch.setattr(select, "measure", spy)
    x = torch.randn(g.num_nodes, 32)
    name = select.choose(g, x, None, "forward")
    assert len(seen) == 1 and name == select.pick(seen[0])
    assert select.choose(g, x, None, "forward") == name and len(seen) == 1  # memo
    stored = json.loads(cache.read_text())
    key = select.decision_key(g, 32, False, 1, "forward")
    assert stored[key]["choice"] == name and set(stored[key]["seconds"]) == set(seen[0])
    # A fresh graph object with the same fingerprint reads the decision instead of measuring.
    again = generate("tiny", seed=0)
    monkeypatch.setattr(select, "measure", lambda *a, **k: pytest.fail("measured a cached decision"))
    assert select.choose(again, x, None, "forward") == name
    # The backward direction, another width or another thread count is a different decision.
    assert select.decision_key(g, 32, False, 1, "backward") != key
    assert select.decision_key(g, 64, False, 1, "forward") != key


def test_modelled_only_runs_the_model_favourite_unmeasured_and_unrecorded(cache, monkeypatch):
    g = generate("tiny", seed=0)
    monkeypatch.setattr(select, "_TRIAL_MIN_WORK", 0)
    x = torch.randn(g.num_nodes, 32)
    favourite = select.trial_candidates(g, 32, False, False, select.candidates(x))[0]
    real = select.measure
    monkeypatch.setattr(select, "measure", lambda *a, **k: pytest.fail("measured inside modelled_only"))
    with select.modelled_only():
        assert select.choose(g, x, None, "forward") == favourite
    assert not cache.exists()
    seen = []
    monkeypatch.setattr(select, "measure", lambda *a, **k: seen.append(1) or real(*a, **k))
    select.choose(g, x, None, "forward")  # outside the block the product decides as usual
    assert seen == [1] and cache.exists()


def test_unreadable_cache_file_is_ignored(cache, monkeypatch):
    cache.write_text("{not json")
    g = generate("tiny", seed=0)
    monkeypatch.setattr(select, "_TRIAL_MIN_WORK", 0)
    name = select.choose(g, torch.randn(g.num_nodes, 8), None, "backward")
    assert json.loads(cache.read_text())[select.decision_key(g, 8, False, 1, "backward")]["choice"] == name


def test_kernels_command_reports_every_backend_and_the_choice(cache, capsys):
    assert main(["kernels", "--dataset", "synthetic:tiny", "--width", "8,16", "--reps", "1", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [(r["width"], r["direction"]) for r in out["rows"]] == [
        (8, "forward"),
        (8, "backward"),
        (16, "forward"),
        (16, "backward"),
    ]
    for r in out["rows"]:
        assert set(r["seconds"]) == set(available_backends())
        assert r["choice"] in r["seconds"] and all(v > 0 for v in r["gbps"].values())
    assert main(["kernels", "--dataset", "synthetic:tiny", "--width", "8", "--reps", "1"]) == 0
    text = capsys.readouterr().out
    assert "choice" in text and str(cache) in text


def test_a_backend_that_keeps_an_entry_plan_must_win_by_the_margin():
    keeps = {name: get_backend(name).keeps_entry_plan for name in ("csr", "dense_block", "reference")}
    assert keeps == {"csr": False, "dense_block": True, "reference": True}
    near = 1 + select._PLAN_MARGIN * 0.9
    far = 1 + select._PLAN_MARGIN * 1.1
    assert select.pick({"csr": 0.1 * near, "dense_block": 0.1, "reference": 0.5}) == "csr"
    assert select.pick({"csr": 0.1 * far, "dense_block": 0.1, "reference": 0.5}) == "dense_block"
    assert select.pick({"csr": 0.1 * near, "dense_block": 0.3, "reference": 0.1}) == "csr"
    assert select.pick({"dense_block": 0.1 * near, "reference": 0.1}) == "reference"  # no plan-free one
    assert select.pick({"csr": 0.1, "dense_block": 0.2}) == "csr"
    assert select.pick({"dense_block": 0.2}) == "dense_block"


def test_a_stored_decision_is_taken_again_by_the_margin_rule(cache, monkeypatch):
    # a cache written when the fastest always won: its times decide again, not its stored choice
    g = generate("tiny", seed=0)
    key = select.decision_key(g, 32, False, 1, "forward")
    seconds = {"csr": 0.1003, "dense_block": 0.1, "reference": 0.4}
    cache.write_text(json.dumps({key: {"choice": "dense_block", "seconds": seconds}}))
    monkeypatch.setattr(select, "measure", lambda *a, **k: pytest.fail("measured a cached decision"))
    assert select.choose(g, torch.randn(g.num_nodes, 32), None, "forward") == "csr"


@pytest.mark.parametrize("winner", ["csr", "dense_block"])
def test_a_trial_drops_the_plans_of_a_losing_backend_that_keeps_entry_plans(cache, monkeypatch, winner):
    g = generate("tiny", seed=0)
    monkeypatch.setattr(select, "_TRIAL_MIN_WORK", 0)
    monkeypatch.setattr(select, "trial_candidates", lambda *a: ["csr", "dense_block"])
    monkeypatch.setattr(select, "pick", lambda seconds: winner)
    dense = get_backend("dense_block")
    assert select.choose(g, torch.randn(g.num_nodes, 32), None, "forward") == winner
    assert bool(dense.plans.entries(g)) == (winner == "dense_block")
    # a later trial that dense_block loses keeps the plans an earlier decision still uses
    monkeypatch.setattr(select, "pick", lambda seconds: "csr")
    select.choose(g, torch.randn(g.num_nodes, 32), None, "backward")
    assert bool(dense.plans.entries(g)) == (winner == "dense_block")


def test_kernels_command_choice_is_the_fastest_it_measured_and_is_stored(cache, capsys, monkeypatch):
    monkeypatch.setattr(select, "_TRIAL_MIN_WORK", 0)  # big enough for auto to measure
    assert main(["kernels", "--dataset", "synthetic:tiny", "--width", "8,32", "--reps", "2", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    stored = json.loads(cache.read_text())
    g = generate("tiny", seed=0)
    auto = select.auto_candidates(torch.empty(0, 8))  # every backend is measured; auto picks among these
    for r in rows:
        trial = {k: v for k, v in r["seconds"].items() if k in auto}
        assert set(r["seconds"]) > set(trial) == set(auto)
        assert r["choice"] == select.pick(trial), r
        key = select.decision_key(g, r["width"], False, 1, r["direction"])
        assert stored[key]["choice"] == r["choice"] and stored[key]["seconds"] == trial


@pytest.mark.parametrize("argv", [["--width", "0"], ["--width", "a,b"], ["--reduce", "max"], ["--reps", "0"]])
def test_kernels_command_bad_flags_are_one_line_errors(cache, capsys, argv):
    assert main(["kernels", "--dataset", "synthetic:tiny", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "error" in err[0], err


def test_cora_accuracy_does_not_depend_on_the_backend(planetoid_root, cache, monkeypatch, tmp_path):
    from tessera.train.config import TrainConfig
    from tessera.train.loop import train

    monkeypatch.setenv("TESSERA_DATA", str(planetoid_root.parent))
    monkeypatch.setattr(select, "_TRIAL_MIN_WORK", 0)  # auto measures even on Cora
    acc = {}
    # The CPU's backends; the portable ones (auto_devices without the CPU: torch, and triton in its
    # interpreter) train to the default path's losses in test_torch_native.py and test_triton.py.
    cpu = [n for n in available_backends() if get_backend(n).auto_devices in (None, ("cpu",))]
    assert {"reference", "csr", "dense_block"} <= set(cpu)
    for backend in ["auto", *cpu]:
        cfg = TrainConfig(
            dataset="cora", epochs=200, seed=0, backend=backend, out=str(tmp_path / backend), progress=False
        )
        acc[backend] = train(cfg)["test_acc"]
    assert acc["reference"] > 0.78, acc
    for a in acc.values():
        assert abs(a - acc["reference"]) <= 0.005, acc


def test_auto_sends_row_sparse_backward_gradients_to_the_live_row_csr_path(cache, monkeypatch):
    # The measured choice comes from dense inputs; a gradient that is zero off a few rows takes
    # the csr backend, which gathers only live rows, whatever was chosen; dense ones keep the choice.
    from tessera.backends.base import get_backend
    from tessera.dense import liveness

    monkeypatch.setattr(liveness, "MIN_ROWS", 0)
    csr = get_backend("csr")
    calls = []
    real = csr.spmm_t
    monkeypatch.setattr(csr, "spmm_t", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = awkward_graph()
    for share, expect in ((0.1, [1]), (1.0, [])):
        calls.clear()
        x1 = torch.randn(g.num_nodes, 5, requires_grad=True)
        x2 = x1.detach().clone().requires_grad_()
        grad = torch.randn(g.num_nodes, 5)
        grad[torch.rand(g.num_nodes) >= share] = 0
        with select.forced("reference"):
            sparse.aggregate(g, x1, "sum", None, "auto").backward(grad)
        sparse.aggregate(g, x2, "sum", None, "reference").backward(grad)
        assert calls == expect
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("seconds", "timed_calls"),
    [
        ({"fast": 0.1, "close": 0.12, "slow": 0.5}, {"fast": 3, "close": 3, "slow": 1}),
        ({"fast": 0.1, "slow": 0.5}, {"fast": 1, "slow": 1}),  # one left: settled
        ({"fast": 1.5, "slow": 1.6}, {"fast": 1, "slow": 1}),  # over the budget
    ],
)
def test_a_measured_trial_drops_clear_losers_and_stops_at_its_budget(monkeypatch, seconds, timed_calls):
    """A backend over twice the fastest's time in a round runs no more rounds, and no round starts
    once one backend is left or the timed rounds have used the budget (clock and backends faked:
    what is counted is calls)."""
    clock = [0.0]
    calls = dict.fromkeys(seconds, 0)

    class Fake:
        def __init__(self, name):
            self.name = name

        def spmm(self, matrix, x, w):
            calls[self.name] += 1
            clock[0] += seconds[self.name]

    class Clock:
        @staticmethod
        def perf_counter():
            return clock[0]

    monkeypatch.setattr(select, "get_backend", Fake)
    monkeypatch.setattr(select, "time", Clock)
    got = select.measure(awkward_graph(), torch.ones(60, 2), None, list(seconds), False, reps=3)
    assert {n: c - 1 for n, c in calls.items()} == timed_calls  # one warm-up call each
    assert got == pytest.approx(seconds)
