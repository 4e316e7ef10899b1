"""Adam without torch.optim: the same arithmetic and state layout, minus torch._dynamo's import.

``torch.optim.Optimizer.__init__`` imports ``torch._dynamo`` on first use (its methods are
wrapped by ``torch._disable_dynamo``): seconds of set-up in every run and every distributed
worker (``benchmarks/bench_startup.py``'s set-up column). Full-graph training steps a few weight
matrices once per epoch, so nothing of torch.optim's machinery is needed.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

# torch.optim.Adam's param-group settings with its defaults, so state dicts pass either way
_GROUP_DEFAULTS = {
    "amsgrad": False,
    "maximize": False,
    "foreach": None,
    "capturable": False,
    "differentiable": False,
    "fused": None,
    "decoupled_weight_decay": False,
}


class Adam:
    """Adam (Kingma & Ba) with L2 weight decay: per parameter, the operations of
    ``torch.optim.Adam``'s single-tensor path (what it runs on CPU) in the same order, so the
    same parameters bit for bit, and its ``state_dict`` layout."""

    def __init__(
        self,
        params: Iterable[torch.nn.Parameter],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        for name, v in (
            ("lr", lr),
            ("eps", eps),
            ("weight_decay", weight_decay),
            ("beta1", betas[0]),
            ("beta2", betas[1]),
        ):
            if not 0.0 <= v < (1.0 if name.startswith("beta") else math.inf):
                raise ValueError(f"invalid Adam {name}: {v}")
        group = {"params": list(params), "lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay}
        self.param_groups: list[dict[str, Any]] = [{**group, **_GROUP_DEFAULTS}]
        self.state: dict[torch.Tensor, dict[str, torch.Tensor]] = {}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop (or zero) every parameter's gradient."""
        for p in self.param_groups[0]["params"]:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_().zero_()

    @torch.no_grad()
    def step(self) -> None:
        """One Adam update of every parameter that has a gradient."""
        g = self.param_groups[0]
        lr, (beta1, beta2), eps, wd = g["lr"], g["betas"], g["eps"], g["weight_decay"]
        for p in g["params"]:
            if p.grad is None:
                continue
            st = self.state.get(p)
            if st is None:
                st = self.state[p] = {
                    "step": torch.tensor(0.0),
                    "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                    "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
                }
            grad, exp_avg, exp_avg_sq = p.grad, st["exp_avg"], st["exp_avg_sq"]
            st["step"] += 1
            if wd != 0:
                grad = grad.add(p, alpha=wd)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = st["step"].item()
            step_size = lr / (1 - beta1**step)
            denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-step_size)

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: {...}}, "param_groups": [...]}`` as ``torch.optim.Adam`` writes it."""
        params = self.param_groups[0]["params"]
        index = {id(p): i for i, p in enumerate(params)}
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        group["params"] = list(range(len(params)))
        return {"state": {index[id(p)]: dict(s) for p, s in self.state.items()}, "param_groups": [group]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Take the settings and moments of a state dict from :meth:`state_dict` or torch's Adam."""
        params = self.param_groups[0]["params"]
        (group,) = state_dict["param_groups"]
        self.param_groups[0].update({k: v for k, v in group.items() if k != "params"})
        self.state = {}
        for i, s in state_dict["state"].items():
            p = params[int(i)]
            self.state[p] = {
                "step": s["step"].detach().to(torch.float32).clone(),
                "exp_avg": s["exp_avg"].detach().to(p.device, p.dtype).clone(),
                "exp_avg_sq": s["exp_avg_sq"].detach().to(p.device, p.dtype).clone(),
            }
