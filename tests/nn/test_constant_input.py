"""Layer 0 aggregates the raw features once (MixGCN Algorithm 2, line 1) when nothing before it
changes them: the same values as aggregating every call, and no exchange after the first epoch."""

import os

import pytest
import torch
import torch.nn.functional as F

from helpers import spawn_groups
from tessera import sparse
from tessera.datasets import load
from tessera.nn import build_model
from tessera.train.config import TrainConfig
from tessera.train.loop import Trainer

pytestmark = pytest.mark.distributed  # starts worker processes

MODELS = ("gcn", "sage", "gin")
EPOCHS = 3


def _steps(model, g, steps: int) -> list[float]:
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    losses = []
    for _ in range(steps):
        model.train()
        opt.zero_grad()
        loss = F.cross_entropy(model(g.x, g)[g.train_mask], g.y[g.train_mask])
        loss.backward()
        opt.step()
        losses.append(loss.item())
        model.eval()
        with torch.no_grad():
            model(g.x, g)
    return losses


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("dropout", [0.0, 0.5])
def test_raw_features_are_aggregated_once(model, dropout, monkeypatch):
    g = load("synthetic:tiny")
    torch.manual_seed(0)
    cached = build_model(model, g.num_features, 32, g.num_classes, 2, dropout=dropout)
    fresh = build_model(model, g.num_features, 32, g.num_classes, 2, dropout=dropout)
    fresh.load_state_dict(cached.state_dict())
    assert cached.describe()[0].aggregates_first  # 16 features -> 32 hidden: the input is aggregated

    calls = []
    aggregate = sparse.aggregate

    def counting(a, x, *args, **kwargs):
        calls.append(x.shape[-1] == g.num_features)  # layer 0 (layer 1 aggregates its narrower output)
        return aggregate(a, x, *args, **kwargs)

    monkeypatch.setattr(sparse, "aggregate", counting)
    torch.manual_seed(1)
    got = _steps(cached, g, 4)
    raw = sum(calls)
    # training with dropout redraws layer 0's input every step; evaluation's input never changes
    assert raw == (1 if dropout == 0 else 4 + 1)

    monkeypatch.setattr(sparse, "aggregate", aggregate)
    for conv in fresh.convs:  # the reference: every call aggregates
        conv._input_aggregate = _NoMemo()
    torch.manual_seed(1)
    assert got == _steps(fresh, g, 4)  # bit for bit


class _NoMemo:
    def __call__(self, graph, x, compute, extra=None):
        return compute()


def test_a_modified_input_is_aggregated_again():
    g = load("synthetic:tiny")
    model = build_model("gcn", g.num_features, 32, g.num_classes, 2, dropout=0.0).eval()
    x = g.x.clone()
    with torch.no_grad():
        first = model(x, g)
        x[0] += 1.0  # in place: the version counter moves
        second = model(x, g)
        want = build_model("gcn", g.num_features, 32, g.num_classes, 2, dropout=0.0).eval()
        want.load_state_dict(model.state_dict())
        assert torch.equal(second, want(x, g))
    assert not torch.equal(first, second)


def test_a_fixed_gin_eps_is_kept_with_the_sum_and_a_new_eps_recomputes_it():
    # a fixed eps makes (1 + eps) x + A x constant: kept whole, keyed by the eps it was made with
    g = load("synthetic:tiny")
    model = build_model("gin", g.num_features, 32, g.num_classes, 2, dropout=0.0).eval()
    want = build_model("gin", g.num_features, 32, g.num_classes, 2, dropout=0.0).eval()
    with torch.no_grad():
        first = model(g.x, g)
        for conv in (*model.convs, *want.convs):
            conv.eps.fill_(0.5)
        want.load_state_dict(model.state_dict())
        second = model(g.x, g)
        torch.testing.assert_close(second, want(g.x, g), rtol=0, atol=0)
    assert not torch.equal(first, second)


def _config(strategy: str, model: str, out) -> TrainConfig:
    return TrainConfig(
        strategy=strategy,
        groups=2 if strategy == "hybrid" else 1,
        dataset="synthetic:tiny",
        model=model,
        hidden=32,
        dropout=0.0,
        epochs=EPOCHS,
        patience=0,
        remote_agg="prepost",
        out=str(out),
        progress=False,
        checkpoint_every=1000,
    )


WORLDS = (2, 3, 4)


def _strategies(world: int) -> tuple[str, ...]:
    return ("partition", "tensor", "hybrid") if world == 4 else ("partition", "tensor")  # hybrid: M = 2


def _worker(rank, world, port, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from tessera.comm.group import init_from_env, shutdown
    from tessera.threads import set_num_threads

    set_num_threads(1)
    comm = init_from_env(120)
    try:
        g = load("synthetic:tiny")
        for strategy in _strategies(world):
            for model in MODELS:
                t = Trainer(_config(strategy, model, os.path.join(out_dir, f"{world}-{strategy}-{model}")), g, comm)
                t.fit()
                if rank == 0:
                    per_epoch = [[sum(map(sum, d)) for d in h["comm"]["bytes_data"][0]] for h in t.history]
                    losses = [h["train_loss"] for h in t.history]
                    res = {"losses": losses, "layer0": per_epoch, "totals": t.comm_totals}
                    torch.save(res, f"{out_dir}/{world}-{strategy}-{model}.pt")
    finally:
        shutdown()


def test_distributed_layer_zero_exchanges_in_the_first_epoch_only(tmp_path):
    # Dropout 0 at N = 2, 3, 4: the same losses as one process, and layer 0's aggregation (of the
    # constant raw features) exchanges in the first epoch only, as tessera simulate --dropout 0 says
    from tessera.planner.volume import hybrid_volumes, simulate_volumes, tensor_volumes

    g = load("synthetic:tiny")
    single = {}
    for model in MODELS:
        t = Trainer(_config("partition", model, tmp_path / f"single-{model}"), g)  # one process
        t.fit()
        single[model] = [h["train_loss"] for h in t.history]
    spawn_groups(_worker, list(WORLDS), (str(tmp_path),))
    for world in WORLDS:
        for strategy in _strategies(world):
            for model in MODELS:
                key = f"{world}-{strategy}-{model}"
                r = torch.load(tmp_path / f"{key}.pt")
                assert r["losses"] == pytest.approx(single[model], abs=1e-5), key
                first, *later = r["layer0"]  # layer 0's [forward, backward] data bytes per epoch
                assert first[0] > 0 and all(e == [0, 0] for e in later), (key, r["layer0"])
                specs = build_model(model, g.num_features, 32, g.num_classes, 2, dropout=0.0).describe()
                if strategy == "hybrid":
                    steady = hybrid_volumes(g, world, 2, specs, dropout=0.0).bits[32].bytes
                    full = hybrid_volumes(g, world, 2, specs).runtime[32]["bytes_data"]
                    once = int(full[0, 0].sum())
                elif strategy == "tensor":
                    steady = tensor_volumes(g, world, specs, dropout=0.0).bytes
                    once = tensor_volumes(g, world, specs).bits[32].layers[0].forward.data_bytes
                else:
                    vol = simulate_volumes(g, world, specs, ("prepost",), (32,), dropout=0.0)
                    steady = vol.modes["prepost"].bits[32].epoch.data_bytes
                    full = simulate_volumes(g, world, specs, ("prepost",), (32,)).modes["prepost"].bits[32]
                    once = full.layers[0].forward.data_bytes
                assert sum(map(sum, r["totals"]["bytes_data"])) == EPOCHS * steady + once, key
