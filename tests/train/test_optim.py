"""tessera's Adam is torch.optim.Adam, bit for bit, with its state-dict layout."""

import pytest
import torch

from tessera.train.optim import Adam


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))


def _train(model, opt, steps=6):
    torch.manual_seed(1)
    x, y = torch.randn(50, 12), torch.randint(0, 3, (50,))
    for i in range(steps):
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        loss.backward()
        if i == 2:
            model[2].bias.grad = None  # a parameter without a gradient is skipped, as torch skips it
        opt.step()


@pytest.mark.parametrize("weight_decay", [0.0, 5e-4])
def test_adam_steps_bit_for_bit_as_torch(weight_decay):
    a, b = _model(), _model()
    _train(a, Adam(a.parameters(), lr=0.01, weight_decay=weight_decay))
    _train(b, torch.optim.Adam(b.parameters(), lr=0.01, weight_decay=weight_decay))
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)


def test_state_dicts_cross_over_both_ways():
    a, b = _model(), _model()
    ours, theirs = (
        Adam(a.parameters(), lr=0.01, weight_decay=5e-4),
        torch.optim.Adam(b.parameters(), lr=0.01, weight_decay=5e-4),
    )
    _train(a, ours, 3)
    _train(b, theirs, 3)
    sd, tsd = ours.state_dict(), theirs.state_dict()
    assert sd["param_groups"] == tsd["param_groups"]
    assert sd["state"].keys() == tsd["state"].keys()
    for i in sd["state"]:
        for k in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd["state"][i][k], tsd["state"][i][k])
    # resumed from the other's state, each continues as the other would have
    c, d = _model(), _model()
    c.load_state_dict(b.state_dict())
    d.load_state_dict(a.state_dict())
    resumed_ours, resumed_theirs = Adam(c.parameters(), lr=0.01), torch.optim.Adam(d.parameters(), lr=0.01)
    resumed_ours.load_state_dict(tsd)
    resumed_theirs.load_state_dict(sd)
    _train(c, resumed_ours, 2)
    _train(d, resumed_theirs, 2)
    for p, q in zip(c.parameters(), d.parameters(), strict=True):
        assert torch.equal(p, q)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="lr"):
        Adam(_model().parameters(), lr=-1.0)
    with pytest.raises(ValueError, match="beta2"):
        Adam(_model().parameters(), betas=(0.9, 1.0))
