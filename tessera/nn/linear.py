"""``Linear``: ``torch.nn.Linear`` computing through :func:`tessera.sparse.linear`."""

from __future__ import annotations

import torch
from torch import nn

from tessera import sparse


class Linear(nn.Linear):
    """``torch.nn.Linear`` (same parameters, init and state dict) computing with :func:`tessera.sparse.linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sparse.linear(x, self.weight, self.bias)
