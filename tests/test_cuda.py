"""On a CUDA GPU: training with ``device="cuda"`` to the CPU run's losses for every model, keyed
dropout masks bitwise the CPU's, the torch and Triton backends on CUDA tensors against the
reference backend on the CPU, and a bfloat16 step on the GPU. Every test is marked ``cuda`` and
skips where torch sees no GPU (``benchmarks/device_check.sh`` runs them on a GPU machine:
``pytest -m cuda tests/test_cuda.py``)."""

from __future__ import annotations

import pytest
import torch

from helpers import awkward_graph

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)"),
]

MODELS = ("gcn", "sage", "gin", "gat", "rgcn", "sage-lstm")
STEPS = 3


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-5) -> None:
    """``got`` (any device) against ``want`` (CPU), relative to ``want``'s largest magnitude."""
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = float(want.detach().abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got.detach().cpu(), want.detach(), rtol=rel, atol=rel * max(scale, 1e-30))


def _trainer(dataset: str, model: str, device: str, out, precision: str = "fp32"):
    from tessera.datasets import load
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    cfg = TrainConfig(
        dataset=dataset, model=model, hidden=16, heads=2, dropout=0.5, epochs=STEPS, seed=0, device=device,
        reorder="none", precision=precision, progress=False, out=str(out), checkpoint_every=1000,
    )  # fmt: skip
    return Trainer(cfg.validate(), load(dataset))


@pytest.mark.parametrize("model", MODELS)
def test_cuda_training_equals_the_cpu_run(model, tmp_path):
    """Three steps with dropout 0.5 on the GPU (its auto backend) give the CPU run's losses (the
    default path) to 1e-4: the keyed dropout draws the same masks on both devices."""
    dataset = "synthetic:small-rel" if model == "rgcn" else "synthetic:small"
    losses = {}
    for device in ("cpu", "cuda"):
        t = _trainer(dataset, model, device, tmp_path / device)
        assert t.device.type == device and t.x.device.type == device
        assert all(p.device.type == device for p in t.model.parameters())
        losses[device] = [t.train_step() for _ in range(STEPS)]
    want = torch.tensor(losses["cpu"], dtype=torch.float64)
    torch.testing.assert_close(torch.tensor(losses["cuda"], dtype=torch.float64), want, rtol=1e-4, atol=0)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
@pytest.mark.parametrize("keyed", [False, True])
def test_dropout_masks_on_cuda_are_the_cpus_bitwise(p, keyed):
    from tessera.kernels.dropout import dropout, dropout_mask

    shape = (3001, 37)  # more than one hash block of 2**14 elements, a width that is no power of 2
    rows = torch.randperm(10_000, generator=torch.Generator().manual_seed(1))[: shape[0]] if keyed else None
    torch.manual_seed(7)
    want = dropout_mask(shape, p, rows, device="cpu")
    torch.manual_seed(7)
    got = dropout_mask(shape, p, None if rows is None else rows.cuda(), device="cuda")
    assert got.device.type == "cuda" and got.dtype == torch.bool
    assert torch.equal(got.cpu(), want)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(2))
    torch.manual_seed(8)
    want_x = dropout(x, p, True, rows)
    torch.manual_seed(8)
    got_x = dropout(x.cuda(), p, True, None if rows is None else rows.cuda())
    assert got_x.device.type == "cuda" and torch.equal(got_x.cpu(), want_x)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_backends_on_cuda_equal_the_reference_on_the_cpu(backend):
    """spmm, spmm_t and sddmm_dot on CUDA tensors (the graph handed over on the CPU, as a layer
    does) against the reference backend on the CPU: hub rows, empty rows, isolated vertices."""
    from tessera.backends import available_backends, get_backend

    if backend not in available_backends():
        pytest.skip(f"no {backend} backend registered (is triton installed?)")
    dev, ref = get_backend(backend), get_backend("reference")
    g = awkward_graph(n=60, e=400, seed=3)
    gen = torch.Generator().manual_seed(0)
    for shape in ((37,), (3, 7)):
        x = torch.randn(g.num_nodes, *shape, generator=gen)
        gy = torch.randn(g.num_nodes, *shape, generator=gen)
        weights = [None, torch.rand(g.num_edges, generator=gen)]
        if len(shape) == 2:
            weights.append(torch.rand(g.num_edges, shape[0], generator=gen))  # one weight per head
        for w in weights:
            wc = None if w is None else w.cuda()
            for fn in ("spmm", "spmm_t"):
                got = getattr(dev, fn)(g, x.cuda(), wc)
                assert got.device.type == "cuda", (backend, fn)
                _close(got, getattr(ref, fn)(g, x, w))
        got = dev.sddmm_dot(g, gy.cuda(), x.cuda())
        assert got.device.type == "cuda"
        _close(got, ref.sddmm_dot(g, gy, x))


def test_bf16_trains_gcn_on_cuda_with_bfloat16_activations(tmp_path):
    t = _trainer("synthetic:small", "gcn", "cuda", tmp_path, precision="bf16")
    assert t.x.dtype == torch.bfloat16 and t.x.device.type == "cuda"
    seen: list[tuple[torch.dtype, torch.dtype, str]] = []

    def note(module, inputs, output):
        seen.append((inputs[0].dtype, output.dtype, output.device.type))

    hooks = [conv.register_forward_hook(note) for conv in t.model.convs]
    loss = t.train_step()
    for h in hooks:
        h.remove()
    assert seen and all(s == (torch.bfloat16, torch.bfloat16, "cuda") for s in seen), seen
    assert torch.isfinite(torch.tensor(loss))
    assert all(
        p.dtype == torch.float32 and p.grad is not None and p.grad.dtype == torch.float32 for p in t.model.parameters()
    )
