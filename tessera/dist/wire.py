"""The wire format of one exchanged row: the single definition the runtime's byte counts and the
simulator's projections both use, so the two agree exactly."""

from __future__ import annotations

COMM_BITS = (32, 8, 4, 2)
PARAM_BYTES = 8  # per row: float32 scale and float32 zero point


def row_bytes(width: int, bits: int) -> tuple[int, int]:
    """(data bytes, quantization-parameter bytes) of one ``width``-wide row sent at ``bits``:
    fp32 rows carry no parameters; b-bit rows pack ``8 // b`` values per byte plus scale and zero."""
    if bits not in COMM_BITS:
        raise ValueError(f"comm bits must be one of {COMM_BITS}, got {bits}")
    if bits == 32:
        return 4 * width, 0
    return -(-width * bits // 8), PARAM_BYTES
