"""The GPU path's device placement, checked without a GPU: runs on the stand-in device of
:mod:`fake_device` (CPU values, a GPU's refusal of host tensors mixed into device ops, a count of
reads back to the host) give bitwise the losses, metrics and predictions of the same portable
code on CPU tensors, and a steady training step reads one value back to the host (its loss) and
runs no op whose output size depends on device values (each would wait for the device)."""

from __future__ import annotations

import pytest
import torch
from fake_device import FAKE, FakeDevice, OnDevice, fake_gpu

import tessera.train.loop as loop
from tessera.datasets import load
from tessera.train.config import TrainConfig

MODELS = ("gcn", "sage", "gin", "gat", "rgcn", "sage-lstm")


def test_the_stand_in_refuses_host_tensors_in_device_ops_and_counts_reads():
    with FakeDevice() as mode:
        a = torch.randn(4, 3).to(FAKE)
        assert isinstance(a, OnDevice) and a.device == FAKE
        b = torch.ones(3, 2, device=FAKE)
        assert isinstance(a @ b, OnDevice)
        with pytest.raises(RuntimeError, match="mixed with device tensors"):
            a @ torch.ones(3, 2)
        assert torch.equal((a * torch.tensor(2.0)).cpu(), a.cpu() * 2)  # a 0-dim host scalar is fine
        reads = mode.host_reads
        float(a.sum())
        a.cpu()
        assert mode.host_reads == reads + 2
        with pytest.raises(Exception):  # noqa: B017 - any failure: device memory is not the host's
            a.numpy()


def _config(model: str, tmp, **settings) -> tuple[TrainConfig, str]:
    dataset = "synthetic:tiny-rel" if model == "rgcn" else "synthetic:tiny"
    cfg = TrainConfig(
        dataset=dataset, model=model, hidden=16, epochs=3, out=str(tmp), progress=False, reorder="none", **settings
    )
    return cfg.validate(), dataset


def _run(cfg: TrainConfig, dataset: str) -> dict:
    t = loop.Trainer(cfg, load(dataset))
    losses = [t.train_step() for _ in range(3)]
    return {"losses": losses, "metrics": t.evaluate(), "predict": t.predict().cpu()}


def _both(tmp_path, model: str, **settings) -> tuple[dict, dict]:
    cfg, dataset = _config(model, tmp_path / "cpu", backend="torch", **settings)
    on_cpu = _run(cfg, dataset)
    with fake_gpu():
        cfg, dataset = _config(model, tmp_path / "device", **settings)
        on_device = _run(cfg, dataset)
    return on_cpu, on_device


def _assert_same(on_cpu: dict, on_device: dict) -> None:
    assert on_device["losses"] == on_cpu["losses"]
    assert on_device["metrics"] == on_cpu["metrics"]
    assert not isinstance(on_device["predict"], OnDevice)
    assert torch.equal(on_device["predict"], on_cpu["predict"])


@pytest.mark.parametrize("model", MODELS)
def test_every_model_trains_on_the_device_as_the_portable_code_on_the_cpu(tmp_path, model):
    _assert_same(*_both(tmp_path, model))


@pytest.mark.parametrize(
    ("model", "settings"),
    [
        ("gcn", {"label_prop": 0.5}),
        ("sage", {"norm": "layer"}),
        ("gcn", {"precision": "bf16"}),
        ("gin", {"s_spmm": True}),
        ("gat", {"heads": 2, "dropout": 0.3}),
    ],
)
def test_settings_that_add_work_to_the_step_keep_it_on_the_device(tmp_path, model, settings):
    _assert_same(*_both(tmp_path, model, **settings))


@pytest.mark.parametrize("model", ["gcn", "sage", "gin"])
def test_the_mixture_aggregates_on_the_host_and_updates_on_the_device(tmp_path, model):
    on_cpu, on_device = _both(tmp_path, model, aggregate_on="cpu", mixture_stages=3)
    _assert_same(on_cpu, on_device)


@pytest.mark.parametrize("model", MODELS)
def test_a_steady_step_reads_only_its_loss_back_and_never_waits_on_sizes(tmp_path, model):
    with fake_gpu() as mode:
        cfg, dataset = _config(model, tmp_path)
        t = loop.Trainer(cfg, load(dataset))
        t.train_step()
        t.train_step()
        reads, syncs = mode.host_reads, mode.syncs
        t.train_step()
        assert (mode.host_reads - reads, mode.syncs - syncs) == (1, 0)
