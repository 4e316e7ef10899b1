"""What every strategy's volumes share: each layer's exchange width and backward exchange, and the
bytes of a block of rows on the wire.

Per layer and direction a sender sends each receiver one block of rows of the layer's exchange
width, costing ``tessera.comm.wire.block_bytes(rows, width, bits)`` data and parameter bytes (below
32 bits one scale and zero point per group of ``GROUP_ROWS`` rows, a block's last group possibly
short). A training epoch is the forward and backward exchange of every layer, except that layer 0
has no backward exchange when its aggregated input needs no gradient (autograd skips it: raw
features aggregated before the linear map, no LayerNorm, no label embedding), and a layer 0 that
aggregates constant raw features at dropout 0 exchanges nothing in a steady epoch.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from tessera.comm.wire import COMM_BITS, block_bytes
from tessera.errors import ConfigError
from tessera.sparse import LayerSpec

DIRECTIONS = ("forward", "backward")
PLACEMENTS = ("gather", "transform-first")  # a relational layer's exchange


class LayerExchange(NamedTuple):
    """One layer's exchange at one bit width: its row width (0: none in a steady epoch), whether
    it has a backward exchange, the rows each rank sends each rank forward (sender x receiver;
    backward sends the transpose), and a relational layer's placement (None for other layers)."""

    width: int
    backward: bool
    rows: np.ndarray
    placement: str | None = None


def exchange_layers(
    specs: list[LayerSpec], norm: str = "none", label_prop: float = 0.0, dropout: float = 0.5
) -> list[tuple[int, bool]]:
    """``(width, has_backward)`` per layer of partition parallelism, from the layers' own
    descriptions: every layer exchanges rows of its aggregated width; layer 0 exchanges gradients
    only when its aggregated input needs one (LayerNorm or label embedding before it, or the layer
    transforming first). An attention layer's rows also carry its sources' terms (``edge_terms``).
    Width 0: no exchange in a steady training epoch (:func:`first_input_constant`)."""
    return [
        (row_width(s) if w else 0, b) for (w, b), s in zip(aggregated_layers(specs, norm, label_prop, dropout), specs)
    ]


def row_width(spec: LayerSpec) -> int:
    """Values per row partition parallelism exchanges for a layer: its aggregated width, plus its
    sources' ``edge_terms`` attention terms where it has per-edge values."""
    return spec.aggregate_width + spec.edge_terms if spec.edge_values else spec.aggregate_width


def first_input_constant(specs: list[LayerSpec], norm: str = "none", label_prop: float = 0.0) -> bool:
    """Whether layer 0 aggregates the raw features themselves, with no LayerNorm or label embedding
    before it: its aggregation is then computed once and reused (``LayerHints.constant_input``) by
    evaluation forwards, and by training ones too when dropout is 0. Attention is never constant."""
    s = specs[0]
    return norm == "none" and label_prop == 0 and s.aggregates_first and not s.edge_values


def aggregated_layers(
    specs: list[LayerSpec], norm: str, label_prop: float, dropout: float = 0.5
) -> list[tuple[int, bool]]:
    """``(aggregated width, has_backward)`` per layer (see :func:`exchange_layers`)."""
    if norm not in ("none", "layer"):
        raise ConfigError(f"--norm must be none or layer, got {norm!r}")
    first_grad = norm == "layer" or label_prop > 0
    out = [(s.aggregate_width, i > 0 or s.aggregates_input_grad(first_grad)) for i, s in enumerate(specs)]
    if dropout == 0 and first_input_constant(specs, norm, label_prop):
        out[0] = (0, False)
    return out


def check_bits(bits) -> tuple[int, ...]:
    """``bits`` as a tuple, each among the wire's widths."""
    for b in bits:
        if b not in COMM_BITS:
            raise ConfigError(f"comm bits must be among {', '.join(map(str, COMM_BITS))}, got {b}")
    return tuple(bits)


def pair_bytes(rows: np.ndarray, width: int, bits: int) -> tuple[np.ndarray, np.ndarray]:
    """(data, parameter) bytes per ordered pair of one exchange whose sender x receiver row matrix
    is ``rows``: each pair's rows are one block on the wire (``tessera.comm.wire.block_bytes``)."""
    return block_bytes(np.asarray(rows), width, bits)


def blocks_bytes(rows: np.ndarray, widths: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(data bytes, parameter bytes, values) per ordered pair ``[src, dst]`` of one exchange whose
    pair ``[i, j]`` sends a block of ``rows[i, j]`` rows ``widths[i, j]`` wide. The diagonal stays
    on the rank."""
    n = rows.shape[0]
    data, params = np.zeros((n, n), dtype=np.int64), np.zeros((n, n), dtype=np.int64)
    for w in np.unique(widths):
        d, p = block_bytes(np.where(widths == w, rows, 0), int(w), bits)
        data += d
        params += p
    values = rows * widths
    for m in (data, params, values):
        np.fill_diagonal(m, 0)
    return data, params, values
