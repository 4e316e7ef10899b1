"""Parameter initialisation and the aggregate-the-narrower-side rule shared by the layers."""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Protocol

import torch

from tessera import dense, sparse
from tessera.memo import TensorMemo
from tessera.nn.conv.base import Fusion, LayerHints
from tessera.sparse import LayerSpec, Operand
from tessera.sparse.rows import take_rows


def glorot_(t: torch.Tensor) -> torch.Tensor:
    """Glorot/Xavier uniform init over the last two dimensions (PyG's ``glorot``)."""
    a = math.sqrt(6.0 / (t.size(-2) + t.size(-1)))
    with torch.no_grad():
        return t.uniform_(-a, a)


def add_bias_(out: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``out + bias``, in place: ``out`` is a layer's fresh output (an aggregation's or a linear
    map's, which neither saves), so the bias costs no N x F temporary. A float32 bias of a
    bfloat16 output is cast first: added as it is, the in-place add copies the whole output to
    float32 and back."""
    return out if bias is None else out.add_(dense.cast_like(out, bias))


class LinearMap(Protocol):
    """What the shared layer helpers read of a linear map: its weight, widths and product."""

    weight: torch.Tensor
    in_features: int
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class InputAggregate:
    """A layer's aggregation of its constant input (:attr:`LayerHints.constant_input`), computed
    once and reused while the call's graph operand and input are the same objects and the input
    is unmodified (its version counter). Holds weak references only to them, so a new graph or
    feature tensor recomputes. With the result cached, the layer aggregates, and exchanges, nothing
    for it: the strategies' logs count its bytes once, on the first call."""

    def __init__(self) -> None:
        self._memo: TensorMemo[torch.Tensor] = TensorMemo(last_only=True)

    def __call__(
        self, graph: object, x: torch.Tensor, compute: Callable[[], torch.Tensor], extra: object = None
    ) -> torch.Tensor:
        """``compute()``, or its result from the last call with this ``graph``, ``x`` and ``extra``
        (whatever else ``compute`` reads, compared by value)."""
        if x.requires_grad:
            return compute()
        return self._memo.get(x, compute, key=(weakref.ref(graph), extra))


def linear_then_aggregate(
    a: Operand,
    x: torch.Tensor,
    lin: LinearMap,
    reduce: str = "sum",
    hints: LayerHints | None = None,
    aggregate_first: bool | None = None,
    constant: tuple[InputAggregate, object] | None = None,
) -> torch.Tensor:
    """``A (x W^T)`` or ``(A x) W^T``, whichever aggregates the narrower matrix unless
    ``aggregate_first`` fixes the order (same result; WiseGraph's indexing swap and operation
    placement), of only the rows of ``hints.targets`` when given. ``lin`` must have no bias;
    callers add it after aggregation. Of the S-SpMM
    ``hints``, the side that aggregates uses its own (see :class:`LayerHints`). ``constant`` (the
    layer's memo and the graph operand it was called with): with ``hints.constant_input``, ``A x``
    is computed once. ``hints.input_dropout`` is applied to ``x`` first, inside the linear map
    (:func:`~tessera.dense.dropout_linear`: over ``x``'s non-zeros where it is mostly zeros)."""
    hints = hints or LayerHints()
    if aggregates_output(lin, aggregate_first):
        xw = dense.dropout_linear(x, lin.weight, None, hints.input_dropout, True, hints.rows)
        if hints.targets is not None:
            return target_aggregate(a, xw, reduce, hints.targets)
        if hints.output_mask is not None:
            return sparse.masked_aggregate(a, xw, hints.output_mask, reduce)
        return sparse.aggregate(a, xw, reduce)
    return lin(input_aggregate(a, dense.dropout(x, hints.input_dropout, True, hints.rows), reduce, hints, constant))


def input_aggregate(
    a: Operand,
    x: torch.Tensor,
    reduce: str,
    hints: LayerHints,
    constant: tuple[InputAggregate, object] | None = None,
) -> torch.Tensor:
    """``A x`` for a layer that aggregates its input first: once, with ``hints.constant_input``
    and the layer's ``constant`` memo; with the S-SpMM input-gradient mask of the ``hints``; only
    the rows of ``hints.targets`` when given."""
    if hints.constant_input and constant is not None:
        memo, graph = constant
        out = memo(graph, x, lambda: sparse.aggregate(a, x, reduce))
        return out if hints.targets is None else take_rows(out, hints.targets)
    if hints.targets is not None:
        return target_aggregate(a, x, reduce, hints.targets)
    return sparse.aggregate(a, x, reduce, grad_mask=hints.input_grad_mask)


def target_aggregate(a: Operand, x: torch.Tensor, reduce: str, targets: torch.Tensor, self_weight: float = 0.0):
    """``aggregate(a, x, reduce, self_weight=...)[targets]``, over only the targets' in-edges where
    the operand can give their rows (:meth:`~tessera.sparse.Operand.rows_of`)."""
    sub = a.rows_of(targets)
    if sub is None:
        return take_rows(sparse.aggregate(a, x, reduce, self_weight=self_weight), targets)
    return sparse.aggregate(sub, x, reduce, self_weight=self_weight)


def finish(out: torch.Tensor, hints: LayerHints) -> torch.Tensor:
    """A layer's output with the ``hints``' epilogue (activation, dropout) applied, if any."""
    ep = hints.epilogue
    return out if ep is None else dense.act_dropout(out, ep.act, ep.p, True, hints.output_rows())


def aggregates_output(lin: LinearMap, aggregate_first: bool | None = None) -> bool:
    """Whether :func:`linear_then_aggregate` aggregates after the linear map: when the output is
    narrower, unless ``aggregate_first`` fixes the order."""
    return lin.out_features <= lin.in_features if aggregate_first is None else not aggregate_first


def linear_fusion(
    lin: LinearMap, aggregate_first: bool | None = None, output_mask: bool = True, reads_input_first: bool = True
) -> Fusion:
    """What a layer built on :func:`linear_then_aggregate` takes over from the model: its input
    dropout, epilogue and target rows, and the S-SpMM side of the order it runs in (the output
    mask only where ``output_mask`` allows). Its backward reads its input when it aggregates last
    (the product by the weight saves it), and when it aggregates first if ``reads_input_first``."""
    last = aggregates_output(lin, aggregate_first)
    return Fusion(
        input_dropout=True,
        epilogue=True,
        targets=True,
        input_grad_mask=not last,
        output_mask=last and output_mask,
        reads_input=last or reads_input_first,
    )


def linear_spec(lin: LinearMap, aggregate_first: bool | None = None) -> LayerSpec:
    """The :class:`LayerSpec` of a layer built on :func:`linear_then_aggregate`."""
    last = aggregates_output(lin, aggregate_first)
    return LayerSpec(
        lin.in_features, lin.out_features, lin.out_features if last else lin.in_features, aggregates_first=not last
    )
