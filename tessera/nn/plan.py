"""A model's execution plan: what runs fused with what around each layer, decided once per
training mode and placement and kept as frozen records that the model's forward iterates over.

Every choice keeps the values of the plain composition ``norm -> dropout -> layer -> activation``
per layer: a fused node draws the same dropout seed at the same point of the same generator
stream, so fusion never changes a result, only what is computed and kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

from tessera.dense import Epilogue
from tessera.nn.conv.base import Fusion


class InputDropout(Enum):
    """Who applies the dropout before a layer."""

    MODEL = "model"  # the model, with a fresh draw (dense.dropout)
    MASK = "mask"  # the model, with the keep mask drawn before the layer ahead (S-SpMM output side)
    LAYER = "layer"  # the layer, inside its first product (Fusion.input_dropout)
    DONE = "done"  # the layer before, in its activation's node


@dataclass(frozen=True)
class LayerStep:
    """What the model runs around layer ``index``.

    ``norm``: LayerNorm first. ``input_dropout``: who applies the dropout before the layer, and
    ``layer_dropout`` the probability handed to the layer when it does (``LayerHints.input_dropout``).
    ``input_grad_mask``: hand the layer the S-SpMM input-gradient mask (``x != 0`` after a ReLU).
    ``draws_output_mask``: draw the next dropout's keep mask before the layer and hand it over
    (S-SpMM output side). ``epilogue``: the activation and dropout after the layer, fused into it;
    ``activation_dropout``: otherwise the probability of the dropout the model fuses with the
    activation it applies after the layer (None: no activation, the last layer). ``targets``: the
    layer computes only the loss's target rows. ``constant_input``: the layer may be told its
    input is constant (layer 0 with nothing before it that changes the raw features).
    ``recompute``: the model keeps only the step's input and runs the step again in backward
    (``--memory lean``)."""

    index: int
    norm: bool
    input_dropout: InputDropout
    layer_dropout: float
    input_grad_mask: bool
    draws_output_mask: bool
    out_width: int
    epilogue: Epilogue | None
    activation_dropout: float | None
    targets: bool
    constant_input: bool
    recompute: bool = False


@dataclass(frozen=True)
class ExecutionPlan:
    """A model's steps for one training mode and placement, and whether the last layer computes
    only the target rows itself (else the model selects them from its output)."""

    steps: tuple[LayerStep, ...]
    training: bool

    @property
    def last_takes_targets(self) -> bool:
        """Whether the last layer returns only the target rows itself."""
        return self.steps[-1].targets


def build_plan(
    fusions: Sequence[Fusion],
    out_widths: Sequence[int],
    *,
    training: bool,
    dropout: float,
    activation: str,
    norms: bool,
    s_spmm: bool,
    recompute: bool = False,
) -> ExecutionPlan:
    """The execution plan of layers declaring ``fusions`` (in order, with output widths
    ``out_widths``) under a model with this dropout, activation, LayerNorm before each layer
    (``norms``) and S-SpMM setting, in training or evaluation.

    The rules: S-SpMM (MixGCN §3.2.1) runs only in training with ``0 < dropout < 1`` and no
    LayerNorm: a layer that aggregates last gets the next dropout's keep mask drawn ahead, one that
    aggregates first its input's ReLU mask. Without S-SpMM or LayerNorm the activation and the next
    dropout run as one node, inside the layer's last product where it takes the epilogue. A layer
    that takes its input dropout applies it inside its first product when nothing before it did.

    With ``recompute`` (training only) every layer but the last keeps only its input for backward
    and runs again there (activation checkpointing): the same draws from the same generator
    state, so the same values. Owed input-gradient products (:mod:`tessera.dense.deferred`) still
    pass between steps: backward walks the first run's graph, whose records they are kept in.
    The last layer is not run again: its internals would be rebuilt at once, at the same peak."""
    last = len(fusions) - 1
    fuse = s_spmm and training and 0.0 < dropout < 1.0 and not norms
    fused_next = not norms and not fuse
    p = dropout if training else 0.0
    recompute = recompute and training
    steps = []
    for i, f in enumerate(fusions):
        dropped_before = fused_next and i > 0
        mask_before = fuse and i > 0 and fusions[i - 1].output_mask and i - 1 < last
        if dropped_before:
            how = InputDropout.DONE
        elif mask_before:
            how = InputDropout.MASK
        elif f.input_dropout and training and not fuse:
            how = InputDropout.LAYER
        else:
            how = InputDropout.MODEL
        p_after = p if fused_next and i < last else 0.0
        epilogue = None
        if i < last and f.epilogue and not fuse:
            # nothing but the next layer reads the output, and nothing asks for its gradient: the
            # next layer's linear map may leave its input-gradient product to the epilogue's node
            epilogue = Epilogue(activation, p_after, mask_only=not fusions[i + 1].reads_input, takes_owed=True)
        steps.append(
            LayerStep(
                index=i,
                norm=norms,
                input_dropout=how,
                layer_dropout=dropout if how is InputDropout.LAYER else 0.0,
                input_grad_mask=fuse and f.input_grad_mask and i > 0 and activation == "relu",
                draws_output_mask=fuse and f.output_mask and i < last,
                out_width=out_widths[i],
                epilogue=epilogue,
                activation_dropout=p_after if i < last and epilogue is None else None,
                targets=i == last and f.targets,
                constant_input=i == 0 and not norms and p == 0.0,
                recompute=recompute and i < last,
            )
        )
    return ExecutionPlan(tuple(steps), training)
