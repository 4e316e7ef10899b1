"""Registry of aggregation backends: each implements the same weighted sum over in-edges."""

from __future__ import annotations

from typing import Protocol

import torch

from tessera.errors import ConfigError
from tessera.graph import Graph


class AggregationBackend(Protocol):
    """What a backend provides. ``x`` is ``(N, F)`` or ``(N, H, F)``; ``weight`` is ``None``,
    ``(E,)`` or ``(E, H)`` in the graph's CSR edge order. All reductions are sums; the
    ``aggregate`` primitive applies mean scaling and autograd around them."""

    name: str

    def spmm(self, graph: Graph, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """``out[i] = sum_{e=(j->i)} w_e * x[j]`` over the destination-major CSR."""

    def spmm_t(self, graph: Graph, g: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """Transposed product ``out[j] = sum_{e=(j->i)} w_e * g[i]`` through the source-major CSR."""

    def sddmm_dot(self, graph: Graph, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Per-edge dot products ``<g[i], x[j]>`` for every edge ``j -> i`` (per head for 3-D)."""


_BACKENDS: dict[str, AggregationBackend] = {}


def register_backend(backend: AggregationBackend) -> AggregationBackend:
    """Add a backend under its ``name`` (replacing one of the same name)."""
    _BACKENDS[backend.name] = backend
    return backend


def get_backend(name: str) -> AggregationBackend:
    """Look a backend up by name; unknown names raise :class:`ConfigError` listing the choices."""
    if name == "auto":  # per-call choice lives in tessera.ops.select; without a graph fingerprint
        # (a rank's local and remote matrices) the reference backend: on Cora's per-rank matrices
        # (4 ranks) the csr kernel's per-call overhead made a 200-epoch run 90 s instead of 70 s.
        name = "reference"
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ConfigError(
            f"unknown aggregation backend {name!r}; choose from {', '.join(available_backends())}"
        ) from None


def available_backends() -> list[str]:
    """Names of the registered backends."""
    return sorted(_BACKENDS)
