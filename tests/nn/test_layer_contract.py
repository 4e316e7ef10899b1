"""A new layer written only against :class:`~tessera.nn.conv.base.GraphConv`'s contract trains in a
tessera model with the same values as the plain composition, whatever it declares it fuses; the
model's execution plan is built once per mode and placement and records who does what."""

from __future__ import annotations

import pytest
import torch

from helpers import awkward_graph
from tessera import dense, sparse
from tessera.nn.conv.base import Fusion, GraphConv, LayerHints
from tessera.nn.models import GNN, build_model
from tessera.nn.plan import InputDropout
from tessera.sparse import GraphOperand, LayerSpec, as_operand


class MeanConv(GraphConv):
    """``x'_i = W mean_{j in N(i)} x_j + b``, written from the base class's docstring alone."""

    def __init__(self, in_width: int, out_width: int, fuses: Fusion) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(in_width, out_width)
        self.fuses = fuses

    def forward(self, x: torch.Tensor, graph: GraphOperand, hints: LayerHints | None = None) -> torch.Tensor:
        hints = hints or LayerHints()
        a = as_operand(graph).pattern()
        h = sparse.aggregate(a, dense.dropout(x, hints.input_dropout, True, hints.rows), "mean")
        if hints.targets is not None:
            h = h[hints.targets]
        return dense.linear_act([h], [self.lin.weight], self.lin.bias, hints.epilogue, hints.output_rows())

    def describe(self) -> LayerSpec:
        return LayerSpec(self.lin.in_features, self.lin.out_features, self.lin.in_features, True)

    def fusion(self) -> Fusion:
        return self.fuses


def _model(fuses: Fusion, seed: int = 0) -> GNN:
    torch.manual_seed(seed)
    return GNN([MeanConv(12, 16, fuses), MeanConv(16, 16, fuses), MeanConv(16, 5, fuses)], dropout=0.5)


def _plain(model: GNN, x: torch.Tensor, g) -> torch.Tensor:
    """dropout -> layer -> ReLU per layer, each as its own node, with no hints."""
    for i, conv in enumerate(model.convs):
        x = conv(dense.dropout(x, 0.5, True), g)
        if i < len(model.convs) - 1:
            x = torch.relu(x)
    return x


@pytest.mark.parametrize(
    "fuses", [Fusion(), Fusion(input_dropout=True), Fusion(epilogue=True), Fusion(True, True, True)], ids=str
)
def test_a_contract_only_layer_equals_the_plain_composition(fuses):
    g = awkward_graph()
    x = torch.randn(g.num_nodes, 12)
    runs = []
    for run in ("model", "plain"):
        m = _model(fuses)
        m.train()
        torch.manual_seed(7)
        out = m(x, g) if run == "model" else _plain(m, x, g)
        out.square().sum().backward()
        runs.append((out.detach(), [p.grad for p in m.parameters()]))
    (a, ga), (b, gb) = runs
    torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    for u, v in zip(ga, gb, strict=True):
        torch.testing.assert_close(u, v, rtol=1e-5, atol=1e-6)
    # asking for some rows: the layer computes only those where it declared targets
    targets = torch.tensor([3, 0, 17, 42])
    m = _model(fuses)
    torch.manual_seed(7)
    some = m(x, g, targets=targets)
    torch.testing.assert_close(some, a[targets], rtol=1e-6, atol=1e-6)
    assert m.plan().last_takes_targets == fuses.targets


def test_the_plan_records_who_applies_each_dropout_and_is_kept():
    m = _model(Fusion(input_dropout=True, epilogue=True))
    m.train()
    plan = m.plan()
    assert [s.input_dropout for s in plan.steps] == [InputDropout.LAYER, InputDropout.DONE, InputDropout.DONE]
    assert [s.layer_dropout for s in plan.steps] == [0.5, 0.0, 0.0]
    # the activation and the next dropout ride in the layer's last product, none after the last layer
    assert [s.epilogue is not None for s in plan.steps] == [True, True, False]
    assert [s.activation_dropout for s in plan.steps] == [None, None, None]
    assert m.plan() is plan  # decided once
    m.eval()
    evaluation = m.plan()
    assert evaluation is not plan and evaluation.steps[0].input_dropout is InputDropout.MODEL
    assert evaluation.steps[0].epilogue.p == 0.0 and evaluation.steps[0].constant_input
    # LayerNorm before each layer: each dropout follows a norm, so no activation node carries it
    normed = GNN([MeanConv(12, 16, Fusion(True, True)), MeanConv(16, 5, Fusion(True, True))], 0.5, norms=[
        torch.nn.LayerNorm(12), torch.nn.LayerNorm(16)
    ])  # fmt: skip
    normed.train()
    steps = normed.plan().steps
    assert [s.input_dropout for s in steps] == [InputDropout.LAYER, InputDropout.LAYER]
    assert steps[0].epilogue.p == 0.0 and steps[0].activation_dropout is None


def test_placing_a_layer_gives_a_new_plan():
    m = build_model("gcn", 8, 32, 4, dropout=0.5)
    m.train()
    first = m.plan()
    m.convs[1].place(not m.convs[1].describe().aggregates_first)
    second = m.plan()
    assert second is not first
    assert second.steps[0].epilogue.mask_only != first.steps[0].epilogue.mask_only
    m.s_spmm = True  # S-SpMM draws the masks ahead instead of fusing the epilogue
    steps = m.plan().steps
    assert steps[0].epilogue is None and any(s.draws_output_mask or s.input_grad_mask for s in steps)
