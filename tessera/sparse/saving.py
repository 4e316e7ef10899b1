"""Whether the step now running rebuilds its saved tensors in backward (``--memory lean``): a
primitive that keeps a tensor beside its saved ones (an attribute of its autograd context, so
its backward can free it early) keeps none then, and makes it again in backward."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

_RECOMPUTED: ContextVar[bool] = ContextVar("tessera_recomputed", default=False)


def recomputed() -> bool:
    """True inside :func:`recomputed_step`: what the running step saves is made again in backward."""
    return _RECOMPUTED.get()


@contextlib.contextmanager
def recomputed_step() -> Iterator[None]:
    """Mark the block as the first run of a step whose saved tensors backward rebuilds."""
    token = _RECOMPUTED.set(True)
    try:
        yield
    finally:
        _RECOMPUTED.reset(token)
