"""MixGCN's mixture of accelerators with both sides on the CPU: the same values and gradients as
the model run whole (to 1e-4 with dropout 0.5), the same bits for every stage count, stages in
pipeline order, the planner's model on hand-computed cases, and its settings' refusals."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import awkward_graph
from tessera.cli.main import main
from tessera.graph.synthetic import generate
from tessera.nn.mixture import MixtureGNN
from tessera.nn.models import build_model
from tessera.planner.accelerators import LayerShape, Rates, choose, device_only_time, mixture_time
from tessera.sparse import mixture as mixture_module
from tessera.sparse.mixture import mixture_plan

MODELS = ("gcn", "sage", "gin")


@pytest.fixture(scope="module")
def graph():
    """Hubs, self loops, duplicate edges, rows without in-edges and isolated vertices."""
    g = awkward_graph(n=90, e=500, seed=3)
    gen = torch.Generator().manual_seed(0)
    return g.replace(x=torch.randn(g.num_nodes, 12, generator=gen))


def _model(name: str, g, backend: str = "csr"):
    torch.manual_seed(7)
    return build_model(name, g.num_features, 16, 5, 3 if name == "gcn" else 2, 0.5, backend=backend)


def _step(model, g, seed: int = 11):
    """Output and parameter gradients of one training forward/backward with dropout drawn from ``seed``."""
    model.train()
    torch.manual_seed(seed)
    out = model(g.x, g)
    weights = torch.linspace(-1, 1, out.numel()).view_as(out)
    (out * weights).sum().backward()
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad.clone() for p in params]
    for p in params:
        p.grad = None
    return out.detach(), grads


@pytest.mark.parametrize("name", MODELS)
def test_mixture_equals_the_whole_model_with_dropout(graph, name):
    gnn = _model(name, graph)
    want_out, want_grads = _step(gnn, graph)
    got_out, got_grads = _step(MixtureGNN(gnn, mixture_plan(graph.num_nodes, 3, "cpu")), graph)
    torch.testing.assert_close(got_out, want_out, rtol=1e-4, atol=1e-5)
    for got, want in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_every_stage_count_gives_the_same_bits(graph, name):
    gnn = _model(name, graph)
    runs = [_step(MixtureGNN(gnn, mixture_plan(graph.num_nodes, s, "cpu")), graph) for s in (1, 2, 3, 4)]
    first_out, first_grads = runs[0]
    for out, grads in runs[1:]:
        assert torch.equal(out, first_out)
        assert all(torch.equal(a, b) for a, b in zip(grads, first_grads, strict=True))


def test_evaluation_needs_no_graph_and_equals_the_whole_model(graph):
    gnn = _model("sage", graph)
    mix = MixtureGNN(gnn, mixture_plan(graph.num_nodes, 2, "cpu"))
    gnn.eval()
    mix.eval()
    with torch.no_grad():
        torch.testing.assert_close(mix(graph.x, graph), gnn(graph.x, graph), rtol=1e-4, atol=1e-5)
    assert mix.state_dict().keys() == gnn.state_dict().keys()


def test_plan_tiles_and_stages():
    plan = mixture_plan(10, 3, "cpu", tiles=6)
    assert plan.tiles == ((0, 2), (2, 3), (3, 5), (5, 7), (7, 8), (8, 10))
    assert plan.stages == ((0, 2), (2, 4), (4, 6))
    assert [plan.stage_rows(s) for s in range(3)] == [(0, 3), (3, 7), (7, 10)]
    assert mixture_plan(3, 4, "cpu").tiles == ((0, 1), (1, 2), (2, 3))  # never an empty tile
    assert len(mixture_plan(3, 4, "cpu").stages) == 3
    with pytest.raises(ValueError, match="at least one stage"):
        mixture_plan(10, 0, "cpu")


@pytest.mark.parametrize("stages", [1, 2, 3, 4])
def test_the_cpu_aggregates_a_stage_before_the_device_updates_it_and_after_the_previous_launch(
    graph, stages, monkeypatch
):
    """Per stage: the host aggregates every tile of the stage, one copy takes it to the device, the
    device updates its tiles; only then does the host aggregate the next stage (on a GPU the update
    launches return at once, so that aggregation overlaps the device's work)."""
    events: list[tuple[str, int]] = []
    real = mixture_module._to_device

    def to_device(plan, host):
        events.append(("copy", host.shape[0]))
        return real(plan, host)

    monkeypatch.setattr(mixture_module, "_to_device", to_device)
    gnn = _model("gcn", graph)
    plan = mixture_plan(graph.num_nodes, stages, "cpu", tiles=4)
    agg = mixture_module.host_aggregation(mixture_module_operand(graph), plan)
    for t, op in enumerate(agg.tiles):
        spmm = op.spmm
        op.spmm = lambda x, w=None, t=t, spmm=spmm: (events.append(("aggregate", t)), spmm(x, w))[1]  # type: ignore[method-assign]

    def update(z, r, w):
        events.append(("update", z.shape[0]))
        return z @ w

    w = torch.randn(graph.num_features, 4)
    mixture_module.aggregate_update(graph.x, agg, update, [w], plan, out_on_device=True)
    want: list[tuple[str, int]] = []
    for s, (a, b) in enumerate(plan.stages):
        want += [("aggregate", t) for t in range(a, b)]
        lo, hi = plan.stage_rows(s)
        want.append(("copy", hi - lo))
        want += [("update", plan.tiles[t][1] - plan.tiles[t][0]) for t in range(a, b)]
    assert events == want
    del gnn


def mixture_module_operand(g):
    from tessera.sparse import as_operand

    return as_operand(g, "csr").gcn_normalized()


def test_the_model_prefers_the_side_the_rates_favour():
    layers = [LayerShape(edges=1000, rows=100, aggregated=10, width_in=10, width_out=5)]
    rates = Rates(host_aggregation=1e4, device_aggregation=1e5, device_gemm=1e5, link=4e5)
    # device: 2 * 1000*10/1e5 + 3 * 2*100*10*5/1e5 = 0.2 + 0.3
    assert device_only_time(layers, rates) == pytest.approx(0.5)
    # mixture: agg 1.0, gemm 0.1, copies 4*100*(10+5)/4e5 = 0.015;
    # forward max 1.0 + 0.115/2, backward max(0.2, 0.015) + 0.015/2 + 1.0
    assert mixture_time(layers, rates, 2) == pytest.approx(1.0575 + 1.2075)
    assert choose(layers, rates, 2).aggregate_on == "device"
    slow_device = Rates(host_aggregation=1e6, device_aggregation=1e3, device_gemm=1e7, link=1e8)
    assert choose(layers, slow_device, 4).aggregate_on == "cpu"


def _losses(out) -> list[float]:
    return [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("name", MODELS)
def test_a_run_aggregating_on_the_cpu_trains_as_the_device_alone(tmp_path, capsys, name):
    argv = ["train", "--dataset", "synthetic:tiny", "--model", name, "--epochs", "4", "--no-progress"]
    assert main([*argv, "--out", str(tmp_path / "device")]) == 0
    assert main([*argv, "--aggregate-on", "cpu", "--mixture-stages", "3", "--out", str(tmp_path / "cpu")]) == 0
    capsys.readouterr()
    want, got = _losses(tmp_path / "device"), _losses(tmp_path / "cpu")
    assert len(got) == 4 and got == pytest.approx(want, abs=1e-4)
    result = json.loads((tmp_path / "cpu" / "result.json").read_text())
    assert result["config"]["aggregate_on"] == "cpu" and result["config"]["mixture_stages"] == 3


def test_auto_aggregates_on_the_device_when_the_device_is_the_cpu(tmp_path, capsys):
    argv = ["train", "--dataset", "synthetic:tiny", "--epochs", "2", "--no-progress", "--aggregate-on", "auto"]
    assert main([*argv, "--out", str(tmp_path / "auto")]) == 0
    assert (
        main(["train", "--dataset", "synthetic:tiny", "--epochs", "2", "--no-progress", "--out", str(tmp_path / "d")])
        == 0
    )
    capsys.readouterr()
    assert _losses(tmp_path / "auto") == _losses(tmp_path / "d")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--aggregate-on", "gpu"], "--aggregate-on must be device, cpu or auto, got 'gpu'"),
        (["--aggregate-on", "cpu", "--model", "gat"], "--aggregate-on cpu is not available with --model gat"),
        (["--aggregate-on", "cpu", "--nprocs", "2"], "--aggregate-on cpu is not available with --nprocs 2"),
        (["--aggregate-on", "cpu", "--norm", "layer"], "--aggregate-on cpu is not available with --norm layer"),
        (["--mixture-stages", "2"], "--mixture-stages pipelines the CPU's aggregation"),
        (["--aggregate-on", "cpu", "--mixture-stages", "0"], "--mixture-stages must be in [1, 64]"),
    ],
)
def test_settings_the_mixture_cannot_run_are_one_line_exit_2_and_no_files(tmp_path, capsys, argv, message):
    out = tmp_path / "run"
    assert main(["train", "--dataset", "synthetic:tiny", "--epochs", "1", "--out", str(out), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tessera: error: ") and message in err[0], err
    assert list(tmp_path.iterdir()) == []


def test_a_synthetic_graph_runs_as_the_whole_model():
    g = generate("tiny", seed=2)
    gnn = _model("gcn", g)
    torch.testing.assert_close(
        _step(MixtureGNN(gnn, mixture_plan(g.num_nodes, 4, "cpu")), g)[0], _step(gnn, g)[0], rtol=1e-4, atol=1e-5
    )


def test_a_mixture_run_resumes_exactly(tmp_path, capsys):
    argv = ["train", "--dataset", "synthetic:tiny", "--no-progress", "--aggregate-on", "cpu", "--checkpoint-every", "2"]
    assert main([*argv, "--epochs", "6", "--out", str(tmp_path / "whole")]) == 0
    assert main([*argv, "--epochs", "4", "--out", str(tmp_path / "cut")]) == 0
    assert main([*argv, "--epochs", "6", "--out", str(tmp_path / "cut"), "--resume"]) == 0
    capsys.readouterr()
    assert _losses(tmp_path / "cut") == _losses(tmp_path / "whole")
