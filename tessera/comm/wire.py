"""The wire format of exchanged row blocks: the single definition the runtime's buffers, its byte
counts and the simulator's projections all use, so the three agree exactly.

A *block* is the rows one rank sends one peer in one exchange. At 32 bits it is the float32 rows.
Below 32 bits (:mod:`tessera.comm.quantize`) the block's rows are cut into groups of
``GROUP_ROWS`` consecutive rows (the last group of a block may be shorter; a group never spans two
blocks, so every peer can decode its block alone), and each group carries one float32 scale and
one float32 zero point (``PARAM_BYTES``) after its rows' packed values. A block of ``n`` rows of
width ``w`` at ``b`` bits therefore takes ``n * ceil(w * b / 8)`` data bytes plus
``ceil(n / GROUP_ROWS) * 8`` parameter bytes (:func:`block_bytes`).

Why 4 rows: the parameters of a group are amortised over its rows, which matters for narrow
exchanges (the 40-wide class gradient of an arxiv GCN carries 10 bytes of int2 data per row, so a
per-row scale and zero would nearly double it), while a larger group widens the quantization step
of rows whose range is smaller than their neighbours'. Measured on ``synthetic:arxiv`` at P = 8
(int2 bytes per fp32 bytes, 2-layer GCN epoch) and Cora int2 training (accuracy, quantization
error): ``benchmarks/quant_groups.py``, ``docs/design/quantize-kernels.md``. SuperGCN's fused kernel also
takes 4 rows at a time (§7.3 (2)).
"""

from __future__ import annotations

import numpy as np

COMM_BITS = (32, 8, 4, 2)
PARAM_BYTES = 8  # per group of rows: float32 scale and float32 zero point
GROUP_ROWS = 4  # rows sharing one scale and zero point (read at call time, so tools can vary it)


def check_bits(bits: int) -> int:
    """``bits`` if it is a supported width (32, 8, 4, 2), else ValueError."""
    if bits not in COMM_BITS:
        raise ValueError(f"comm bits must be one of {COMM_BITS}, got {bits}")
    return bits


def group_rows(group: int | None = None) -> int:
    """The group size in effect: ``group``, or the module's ``GROUP_ROWS``."""
    g = GROUP_ROWS if group is None else group
    if int(g) != g or g < 1:
        raise ValueError(f"the parameter group must be a positive number of rows, got {g}")
    return int(g)


def data_bytes(width: int, bits: int) -> int:
    """Data bytes of one ``width``-wide row at ``bits``: 4 per value at 32 bits, else ``8 // bits``
    values packed per byte (the last byte of a row padded with zero bits)."""
    check_bits(bits)
    return 4 * width if bits == 32 else -(-width * bits // 8)


def block_bytes(rows, width: int, bits: int, group: int | None = None):
    """(data bytes, quantization-parameter bytes) of a block of ``rows`` rows sent to one peer:
    ``rows * data_bytes(width, bits)`` and, below 32 bits, ``PARAM_BYTES`` per group of at most
    ``group`` (default ``GROUP_ROWS``) rows. ``rows`` may be an int or an integer numpy array (one
    block per element; the results have its shape)."""
    data = data_bytes(width, bits)
    if isinstance(rows, np.ndarray):
        rows = rows.astype(np.int64, copy=False)
        params = np.zeros_like(rows) if bits == 32 else -(-rows // group_rows(group)) * PARAM_BYTES
        return rows * data, params
    rows = int(rows)
    return rows * data, 0 if bits == 32 else -(-rows // group_rows(group)) * PARAM_BYTES


def wire_bytes(rows, width: int, bits: int, group: int | None = None):
    """Total bytes of a block (or of each block of an array): data plus parameters."""
    data, params = block_bytes(rows, width, bits, group)
    return data + params


def layout(splits, width: int, bits: int, group: int | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Where the blocks of ``splits`` rows lie in an encoded buffer: int64 arrays of length
    ``len(splits) + 1`` with each block's first row, first group and first byte (the last entry
    of each is the total), from :func:`tessera.comm.wire.block_bytes`."""
    check_bits(bits)
    if bits == 32:
        raise ValueError("32-bit rows are sent as float32 directly, not encoded")
    n = np.asarray(splits, dtype=np.int64).reshape(-1)
    if n.size and n.min() < 0:
        raise ValueError(f"block row counts must be non-negative, got {n.tolist()}")
    g = group_rows(group)
    starts = [np.zeros(n.size + 1, dtype=np.int64) for _ in range(3)]
    for a, v in zip(starts, (n, -(-n // g), wire_bytes(n, width, bits, g))):
        np.cumsum(v, out=a[1:])
    return starts[0], starts[1], starts[2]


def block_splits(splits, rows: int | None) -> list[int]:
    """The row count of each block: ``splits`` as a list (one int: one block; None: one block of
    ``rows``, which is then required)."""
    if splits is None:
        if rows is None:
            raise TypeError("splits is required: the row count of each block")
        return [rows]
    if isinstance(splits, (int, np.integer)):
        return [int(splits)]
    return [int(n) for n in splits]
