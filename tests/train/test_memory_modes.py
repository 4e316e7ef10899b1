"""``--memory lean``: every hidden layer keeps only its input for backward and runs again there
(activation checkpointing). It trains the same numbers as ``fast``, keeps fewer bytes where a
layer's internals outweigh its input, and ``auto`` picks it only when fast's modelled step would
not fit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tessera import workspace
from tessera.datasets import load
from tessera.nn.conv.base import Fusion
from tessera.nn.plan import build_plan
from tessera.train import setup
from tessera.train.config import TrainConfig
from tessera.train.loop import Trainer

REPO = Path(__file__).resolve().parents[2]


def _train(dataset: str, model: str, memory: str, layers: int, steps: int = 4, hidden: int = 16):
    torch.manual_seed(0)
    cfg = TrainConfig(
        model=model, dataset=dataset, hidden=hidden, layers=layers, heads=2, dropout=0.5, epochs=steps,
        memory=memory, progress=False, backend="csr", reorder="none",
    )  # fmt: skip
    tr = Trainer(cfg, load(dataset))
    assert tr.model.recompute == (memory == "lean")
    with tr.kernels():
        losses = [tr.train_step() for _ in range(steps)]
    return losses, {k: v.clone() for k, v in tr.model.state_dict().items()}, tr


def _same(dataset: str, model: str, layers: int) -> None:
    fast_loss, fast_params, _ = _train(dataset, model, "fast", layers)
    lean_loss, lean_params, _ = _train(dataset, model, "lean", layers)
    assert lean_loss == fast_loss  # bitwise: the same draws from the same generator state
    for name, value in fast_params.items():
        assert torch.equal(lean_params[name], value), name


@pytest.mark.parametrize("model", ["gcn", "sage", "gin", "gat", "sage-lstm"])
def test_lean_trains_the_same_numbers_as_fast(model):
    _same("synthetic:tiny", model, layers=3)


def test_lean_trains_the_same_numbers_as_fast_for_rgcn():
    _same("synthetic:tiny-rel", "rgcn", layers=3)


@pytest.mark.parametrize("model", ["gcn", "gat"])
def test_lean_trains_the_same_numbers_as_fast_on_cora(planetoid_root, monkeypatch, model):
    monkeypatch.setenv("TESSERA_DATA", str(planetoid_root.parent))
    _same("cora", model, layers=2)


def test_the_plan_runs_every_hidden_layer_again_in_training_only():
    fusions = [Fusion(input_dropout=True, epilogue=True)] * 3
    kw = dict(dropout=0.5, activation="relu", norms=False, s_spmm=False, recompute=True)
    train = build_plan(fusions, [8, 8, 4], training=True, **kw)
    assert [s.recompute for s in train.steps] == [True, True, False]
    assert not any(s.recompute for s in build_plan(fusions, [8, 8, 4], training=False, **kw).steps)


def _held_after_steps(model: str, memory: str) -> int:
    workspace.release()
    _, _, tr = _train("synthetic:small", model, memory, layers=4, steps=2, hidden=128)
    held = workspace.DEFAULT.held_bytes()
    del tr
    workspace.release()
    return held


def test_lean_keeps_two_activations_fewer_in_a_four_layer_gat():
    # GAT keeps per layer its projected features, its output and per-edge scores; lean keeps each
    # hidden layer's input only and rebuilds one layer's internals at a time in backward. The
    # workspace holds blocks of at least 1 MiB: here 10,000 vertices x 128 wide, 5,120,000 bytes.
    fast, lean = _held_after_steps("gat", "fast"), _held_after_steps("gat", "lean")
    assert fast - lean == 2 * 10_000 * 128 * 4, (fast, lean)


def test_auto_is_lean_exactly_when_a_deep_models_fast_step_would_not_fit(monkeypatch):
    cfg = TrainConfig(model="gat", hidden=256, heads=8, layers=3, memory="auto")
    need = setup.fast_step_bytes(cfg, rows=1000, edges=20_000, in_dim=64)
    assert need == 4 * (1000 * (64 + 4 * 256 * 2) + 20_000 * 3 * 8 * 2)
    monkeypatch.setattr(setup, "memory_limit", lambda: 3 * need // 2)
    assert not setup.recomputes(cfg, 1000, 20_000, 64)
    monkeypatch.setattr(setup, "memory_limit", lambda: 3 * need // 2 - 1)
    assert setup.recomputes(cfg, 1000, 20_000, 64)
    # two layers: lean would keep no fewer bytes, so auto stays fast however little memory there is
    assert not setup.recomputes(TrainConfig(model="gat", layers=2, memory="auto"), 1000, 20_000, 64)
    for memory, want in (("fast", False), ("lean", True)):
        assert setup.recomputes(TrainConfig(memory=memory), 1000, 20_000, 64) is want


@pytest.mark.distributed
def test_lean_under_two_ranks_trains_as_one_fast_process(tmp_path):
    def run(out: Path, *flags: str) -> list[float]:
        cmd = [sys.executable, "-m", "tessera", "train", "--dataset", "synthetic:small", "--model", "sage",
               "--hidden", "16", "--layers", "3", "--epochs", "3", "--patience", "0", "--no-progress",
               "--out", str(out), *flags]  # fmt: skip
        subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=300)
        return [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]

    one = run(tmp_path / "one")
    two = run(tmp_path / "two", "--memory", "lean", "--nprocs", "2", "--strategy", "partition")
    torch.testing.assert_close(torch.tensor(two), torch.tensor(one), rtol=1e-4, atol=0)


def test_a_lean_step_never_imports_torch_dynamo():
    # torch.utils.checkpoint's first call imports torch._dynamo, 146 MiB resident: more than lean saves
    code = (
        "import sys, torch\n"
        "from tessera.datasets import load\n"
        "from tessera.train.config import TrainConfig\n"
        "from tessera.train.loop import Trainer\n"
        "tr = Trainer(TrainConfig(model='gat', layers=3, memory='lean', progress=False), load('synthetic:tiny'))\n"
        "tr.train_step()\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
