"""Activation checkpointing: run a function keeping none of the tensors its backward reads, and
run it again, from the same inputs and generator state, when backward first asks for one.

``torch.utils.checkpoint`` does the same, but its first call imports ``torch._dynamo`` (146 MiB
resident on torch 2.13): more than a lean step saves on a mid-sized graph. This is its
non-reentrant form, on ``torch.autograd.graph.saved_tensors_hooks``: the first run's graph is the
one backward walks; each tensor it would save is replaced by its position in the save order, and
the second run's saves, made in the same order, are handed out by position, each once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

from tessera.sparse.saving import recomputed_step

T = TypeVar("T")


class _Saved:
    """The tensors one call's second run saved, in save order, each handed out once."""

    def __init__(self, fn: Callable[..., Any], args: tuple[Any, ...], rng: torch.Tensor) -> None:
        self.fn, self.args, self.rng = fn, args, rng
        self.count = 0
        self.tensors: list[torch.Tensor | None] | None = None

    def pack(self, _: torch.Tensor) -> int:
        self.count += 1
        return self.count - 1

    def unpack(self, i: int) -> torch.Tensor:
        if self.tensors is None:
            self.tensors = self._run_again()
        t = self.tensors[i]
        if t is None:
            raise RuntimeError("a recomputed step's saved tensor was read twice (backward through it ran twice)")
        self.tensors[i] = None
        return t

    def _run_again(self) -> list[torch.Tensor | None]:
        saved: list[torch.Tensor | None] = []
        args = tuple(
            a.detach().requires_grad_(a.requires_grad) if isinstance(a, torch.Tensor) else a for a in self.args
        )
        state = torch.get_rng_state()
        torch.set_rng_state(self.rng)  # dropout seeds come from torch's CPU generator: the same draws
        try:
            with (
                torch.enable_grad(),
                torch.autograd.graph.saved_tensors_hooks(_keep(saved), _never),
            ):
                self.fn(*args)
        finally:
            torch.set_rng_state(state)
        if len(saved) != self.count:
            raise RuntimeError(f"a recomputed step saved {len(saved)} tensors, its first run {self.count}")
        self.args = ()
        return saved


def _keep(saved: list[torch.Tensor | None]) -> Callable[[torch.Tensor], None]:
    def pack(t: torch.Tensor) -> None:
        saved.append(t)

    return pack


def _never(_: None) -> torch.Tensor:
    raise RuntimeError("the second run of a recomputed step is never differentiated")


def recompute(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``, keeping for backward only ``args`` (and what ``fn`` holds itself), running
    ``fn`` again when backward needs what it saved; ``fn`` must be deterministic given torch's
    CPU generator state."""
    if not torch.is_grad_enabled():
        return fn(*args)
    saved = _Saved(fn, args, torch.get_rng_state())
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack), recomputed_step():
        return fn(*args)
