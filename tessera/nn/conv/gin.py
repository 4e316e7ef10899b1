"""Graph isomorphism convolution with PyG ``GINConv`` semantics."""

from __future__ import annotations

import torch

from tessera import dense, sparse
from tessera.memo import TensorMemo
from tessera.nn.conv._util import InputAggregate, finish, target_aggregate
from tessera.nn.conv.base import Fusion, GraphConv, LayerHints
from tessera.nn.mlp import MLP
from tessera.sparse import GraphOperand, LayerSpec, Operand, as_operand
from tessera.sparse.rows import take_rows

_eps_values: TensorMemo[float] = TensorMemo()  # a fixed eps buffer's value, per tensor and version


class GINConv(GraphConv):
    """``x'_i = nn((1 + eps) x_i + sum_{j in N(i)} x_j)`` (PyG ``GINConv``)."""

    def __init__(self, nn: torch.nn.Module, eps: float = 0.0, train_eps: bool = False, backend: str = "auto") -> None:
        super().__init__()
        self.nn, self.initial_eps, self.backend = nn, eps, backend
        self._input_aggregate = InputAggregate()
        if train_eps:
            self.eps = torch.nn.Parameter(torch.tensor([float(eps)]))
        else:
            self.register_buffer("eps", torch.tensor([float(eps)]))

    def reset_parameters(self) -> None:
        """Reset the MLP and eps."""
        for m in self.nn.modules():
            if m is not self.nn and hasattr(m, "reset_parameters"):
                m.reset_parameters()  # type: ignore[operator]  # a module of the user's MLP
        self.eps.data.fill_(self.initial_eps)

    def fixed_eps(self) -> float:
        """A fixed eps as a Python float, read from its buffer once per value (on a GPU each read
        would wait for the device)."""
        return _eps_values.get(self.eps, lambda: float(self.eps))

    def forward(self, x: torch.Tensor, graph: GraphOperand, hints: LayerHints | None = None) -> torch.Tensor:
        """Apply the convolution to node features ``x`` (of the hints, ``input_grad_mask``)."""
        hints = hints or LayerHints()
        a = as_operand(graph, self.backend).pattern()
        if hints.targets is not None:
            # only the target rows are aggregated and go through the MLP
            h = self._target_rows(a, x, hints.targets)
        elif hints.constant_input and isinstance(self.eps, torch.nn.Parameter):
            out = self._input_aggregate(graph, x, lambda: sparse.aggregate(a, x, "sum"))
            h = out + dense.cast_like(x, 1 + self.eps) * x  # not in place: the aggregate is kept
        elif hints.constant_input:  # a fixed eps: the root term is constant too, and kept with the sum
            w = 1.0 + self.fixed_eps()
            h = self._input_aggregate(graph, x, lambda: sparse.aggregate(a, x, "sum", self_weight=w), w)
        elif isinstance(self.eps, torch.nn.Parameter):
            # eps (float32) in x's dtype: a bfloat16 x would otherwise be promoted to float32
            h = sparse.aggregate(a, x, "sum", grad_mask=hints.input_grad_mask) + dense.cast_like(x, 1 + self.eps) * x
        else:  # the root term inside the aggregation, in place both ways: no N x F temporaries
            h = sparse.aggregate(a, x, "sum", grad_mask=hints.input_grad_mask, self_weight=1.0 + self.fixed_eps())
        if isinstance(self.nn, MLP):
            return self.nn.run(h, hints.epilogue, hints.output_rows())
        return finish(self.nn(h), hints)

    def _target_rows(self, a: Operand, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """``((1 + eps) x + A x)[targets]``, over the targets' in-edges only where the operand can."""
        if isinstance(self.eps, torch.nn.Parameter):
            return target_aggregate(a, x, "sum", targets) + dense.cast_like(x, 1 + self.eps) * take_rows(x, targets)
        return target_aggregate(a, x, "sum", targets, self_weight=1.0 + self.fixed_eps())

    def describe(self) -> LayerSpec:
        linears = [m for m in self.nn.modules() if isinstance(m, torch.nn.Linear)]
        return LayerSpec(linears[0].in_features, linears[-1].out_features, linears[0].in_features, True)

    def fusion(self) -> Fusion:
        # the input goes into the sum and its root term; only a trainable eps's product keeps it
        return Fusion(
            epilogue=True, targets=True, input_grad_mask=True, reads_input=isinstance(self.eps, torch.nn.Parameter)
        )

    def extra_repr(self) -> str:
        return f"eps={self.initial_eps}"
