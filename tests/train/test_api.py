"""The Python API (``tessera.fit``, ``tessera.load_run``) and ``tessera predict``: a run's model
evaluates to the accuracies it reported, writes nothing unasked, and reads back from a CLI run."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import tessera
from tessera.cli.main import main
from tessera.datasets import load
from tessera.errors import ConfigError
from tessera.train.setup import prepare_features


@pytest.fixture
def cora_env(planetoid_root, monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_DATA", str(planetoid_root.parent))
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_fit_on_cora_evaluates_to_its_reported_accuracy_and_writes_nothing(cora_env):
    g = load("cora")
    x_before = g.x.clone()
    run = tessera.fit(g, "gcn", hidden=16, epochs=30, patience=0, progress=False, seed=1)
    assert list(cora_env.iterdir()) == []  # no run directory, checkpoint or metrics
    assert run.path is None and len(run.history) == 30
    assert run.test_acc > 0.6 and run.result["feature_norm"] == "row"  # Cora's bag-of-words features
    assert run.evaluate()["test_acc"] == run.test_acc
    assert run.evaluate(g)["test_acc"] == run.test_acc  # the caller's graph, prepared the same way
    assert torch.equal(g.x, x_before)  # the caller's features are not normalised in place
    logits = run.predict(g)
    assert logits.shape == (g.num_nodes, g.num_classes)
    test = g.test_mask
    assert float((run.classes(g)[test] == g.y[test]).double().mean()) == pytest.approx(run.test_acc)
    # the model, fed the row-normalised features, gives the same logits
    run.model.eval()
    with torch.no_grad():
        direct = run.model(prepare_features(g.x, "row"), [g] * 2).float()
    assert torch.allclose(direct, logits, atol=1e-5)


def test_fit_refuses_unknown_settings_and_distributed_ones():
    with pytest.raises(ConfigError, match="unknown setting 'hiden'"):
        tessera.fit("synthetic:tiny", hiden=8)
    with pytest.raises(ConfigError, match="nprocs"):
        tessera.fit("synthetic:tiny", nprocs=2)
    with pytest.raises(ConfigError, match="run directory"):
        tessera.fit("synthetic:tiny", epochs=1, plot=True, progress=False)


def test_fit_with_out_writes_a_run_that_load_run_reads_back(tmp_path):
    run = tessera.fit("synthetic:tiny", epochs=4, progress=False, out=str(tmp_path / "r"))
    assert json.loads((tmp_path / "r" / "result.json").read_text())["test_acc"] == run.test_acc
    assert tessera.load_run(tmp_path / "r").evaluate()["test_acc"] == run.test_acc


def _cli_run(tmp_path, capsys) -> tuple:
    out = tmp_path / "run"
    args = ["train", "--dataset", "synthetic:tiny", "--epochs", "6", "--hidden", "8", "--seed", "3"]
    assert main([*args, "--no-progress", "--out", str(out)]) == 0
    capsys.readouterr()
    return out, json.loads((out / "result.json").read_text())


def test_load_run_reproduces_the_cli_runs_test_accuracy(tmp_path, capsys):
    out, result = _cli_run(tmp_path, capsys)
    run = tessera.load_run(out)
    g = load("synthetic:tiny")
    assert run.evaluate(g)["test_acc"] == result["test_acc"]
    assert run.evaluate()["test_acc"] == result["test_acc"]  # the run's own dataset, loaded by name
    assert run.config.hidden == 8 and run.config.seed == 3 and len(run.history) == 6
    assert run.test_acc == result["test_acc"]


def test_load_run_refuses_a_graph_its_model_does_not_fit(tmp_path, capsys):
    out, _ = _cli_run(tmp_path, capsys)
    with pytest.raises(ConfigError, match="does not fit"):
        tessera.load_run(out).evaluate(load("synthetic:small"))


def test_an_old_checkpoint_loads_with_its_best_weights(tmp_path):
    import shutil
    from pathlib import Path

    old = Path(__file__).resolve().parents[1] / "data" / "checkpoint-gcn-tiny-s3-epoch4.pt"
    shutil.copy(old, tmp_path / "checkpoint.pt")
    run = tessera.load_run(tmp_path)
    assert run.config.model == "gcn" and run.result == {}  # no result.json beside it
    acc = run.evaluate(load(run.config.dataset))["test_acc"]
    assert 0.0 <= acc <= 1.0


@pytest.mark.parametrize("suffix", [".npy", ".csv"])
def test_predict_writes_the_classes_load_run_predicts(tmp_path, capsys, suffix):
    out, result = _cli_run(tmp_path, capsys)
    dest = tmp_path / f"pred{suffix}"
    assert main(["predict", "--run", str(out), "--out", str(dest)]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith(f"wrote {dest}") and f"test acc {result['test_acc']:.4f}" in line
    if suffix == ".npy":
        classes = np.load(dest)
    else:
        rows = dest.read_text().splitlines()
        assert rows[0] == "vertex,class"
        classes = np.array([int(r.split(",")[1]) for r in rows[1:]])
    assert np.array_equal(classes, tessera.load_run(out).classes().numpy())


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--run", "nowhere"], "--run nowhere is not a directory"),
        (["--run", "."], "holds no checkpoint.pt"),
        (["--run", ".", "--out", "p.txt"], "must end in .npy or .csv"),
    ],
)
def test_predict_errors_are_one_line_and_write_nothing(tmp_path, monkeypatch, capsys, extra, message):
    monkeypatch.chdir(tmp_path)
    assert main(["predict", *extra]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("tessera: error: ") and message in err[0]
    assert list(tmp_path.iterdir()) == []
