"""``Linear``: ``torch.nn.Linear`` computing through :func:`tessera.ops.linear`."""

from __future__ import annotations

import torch
from torch import nn

from tessera import ops


class Linear(nn.Linear):
    """``torch.nn.Linear`` (same parameters, init and state dict) computing with :func:`tessera.ops.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)
