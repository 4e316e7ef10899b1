"""``Linear``: ``torch.nn.Linear`` computing through :func:`tessera.dense.linear`."""

from __future__ import annotations

import torch
from torch import nn

from tessera import dense


class Linear(nn.Linear):
    """``torch.nn.Linear`` (same parameters, init and state dict) computing with :func:`tessera.dense.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense.linear(x, self.weight, self.bias)
