"""GIN's two-layer perceptron, whose dense transforms run fused with the activations after them."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from tessera import dense
from tessera.dense import Epilogue
from tessera.nn.linear import Linear


class ReLU(nn.Module):
    """``torch.nn.ReLU`` whose output and gradient are workspace blocks (:func:`tessera.sparse.act_dropout`
    without dropout): no page faults for a large activation, no in-place hazards."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense.act_dropout(x, "relu", 0.0)


class MLP(nn.Sequential):
    """``Linear(in, hidden)``, ``ReLU``, ``Linear(hidden, out)``: an ``nn.Sequential`` (same
    modules, parameters and state-dict keys) whose :meth:`run` fuses each linear map with the
    activation after it (:func:`tessera.dense.linear_act`), the last one with the caller's."""

    def __init__(self, in_features: int, hidden: int, out_features: int) -> None:
        super().__init__(Linear(in_features, hidden), ReLU(), Linear(hidden, out_features))

    def run(self, x: torch.Tensor, epilogue: Epilogue | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """``epilogue(self(x))`` with the ReLU and the epilogue each fused into the product before it."""
        first, last = cast(Linear, self[0]), cast(Linear, self[2])
        # only the second map reads h: its input-gradient product may be left to h's node
        # (tessera.dense.deferred), which forms it in row chunks, so no N x hidden block exists
        h = dense.linear_act([x], [first.weight], first.bias, Epilogue("relu", takes_owed=True), rows)
        return dense.linear_act([h], [last.weight], last.bias, epilogue, rows)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run(x)
