"""Input gradients a dense product leaves for the node that made its input to form in row chunks.

A hidden layer's output ``y`` (from :func:`~tessera.dense.linear_act`) that feeds the next layer's
linear map ``y W^T`` gets from that map the gradient ``g W``, an ``N x F`` block that
``linear_act``'s backward then reads in row chunks. That block need never exist: the map hands
``(g, W)`` over and ``linear_act`` forms each chunk's rows of ``g W`` in cache (products: 512 MB
fewer to write, read and page in at hidden width 256).

Autograd still passes ``y`` a gradient of its shape: the map returns zeros with stride 0 (no
memory), which ``linear_act`` recognises and does not read. Whatever else ``y``'s gradient holds
(another consumer's term) arrives summed with those zeros, as a real tensor, and is added as usual,
so the result never depends on who else reads ``y``. What it does change is the gradient of ``y``
itself, were anyone to ask for it (``torch.autograd.grad`` with ``y`` among the inputs): so only an
epilogue that says so (``Epilogue.takes_owed``, set by the model between its layers) takes owed products.
"""

from __future__ import annotations

import torch

from tessera.dense import chunk_gemm
from tessera.memo import PlanCache


class Owed:
    """The products ``sum_k g_k @ w_k`` owed to one tensor's gradient, and the zeros standing in for them."""

    __slots__ = ("terms", "stand_in")

    def __init__(self) -> None:
        self.terms: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.stand_in: torch.Tensor | None = None

    def take(self, g: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor | None]:
        """The owed terms (cleared: each backward owes its own) and the part of ``g`` to add to
        them: None when ``g`` is only the stand-in zeros."""
        terms, self.terms = self.terms, []
        stand_in, self.stand_in = self.stand_in, None
        return terms, None if stand_in is not None and g is stand_in else g


_accepting = PlanCache()  # y -> its record


def accept(y: torch.Tensor, owed: Owed) -> torch.Tensor:
    """Mark ``y`` (a fresh output whose producer's backward reads ``owed``) as taking owed products."""
    _accepting.entries(y)["owed"] = owed
    return y


def owed_to(x: torch.Tensor) -> Owed | None:
    """The record of ``x`` when its producer takes owed products, else None."""
    return _accepting.find(x, "owed")


def owe(owed: Owed, x: torch.Tensor, g: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Record ``g @ w`` (``w`` shaped ``(g's width, x's width)``) as owed to ``x``'s gradient and
    return what stands in for it: zeros of ``x``'s shape and dtype with stride 0."""
    owed.terms.append((g, w))
    if owed.stand_in is None:
        owed.stand_in = torch.zeros((), dtype=x.dtype, device=x.device).expand(x.shape)
    return owed.stand_in


def prepared(
    terms: list[tuple[torch.Tensor, torch.Tensor]], dtype: torch.dtype
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The owed terms ``(g_k, w_k)`` as :func:`owed_rows` reads them: ``g_k`` contiguous, ``w_k``
    in ``dtype`` and transposed (contiguous), once per backward rather than once per chunk."""
    return [(go.contiguous(), wo.to(dtype).t().contiguous()) for go, wo in terms]


def owed_rows(
    out: torch.Tensor, terms: list[tuple[torch.Tensor, torch.Tensor]], r0: int, r1: int, g: torch.Tensor | None
) -> torch.Tensor:
    """Rows ``r0:r1`` of ``sum_k g_k @ w_k`` (plus ``g``, those rows of the rest of the gradient,
    when given) into ``out``, for ``terms`` as :func:`prepared` returns them."""
    for k, (go, wo_t) in enumerate(terms):
        if k == 0:
            chunk_gemm.product(out, go[r0:r1], wo_t)
        else:
            chunk_gemm.add_product_(out, go[r0:r1], wo_t)
    return out if g is None else out.add_(g)
