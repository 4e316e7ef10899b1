"""Row sparsity of gradients: a full-graph loss on the training vertices only leaves the last
layer's output gradient zero in every other row, and the products that take it (``A^T g``,
``g^T x``) can skip those rows and give the same values."""

from __future__ import annotations

import numba
import numpy as np
import torch

from tessera.bfloat16 import as_numpy
from tessera.kernels.placement import host_kernels
from tessera.memo import TensorMemo
from tessera.threads import sync_numba_threads

MIN_ROWS = 1 << 15  # smaller inputs are not worth the check
MAX_SHARE = 0.5  # rows count as sparse when at most this share of them is live
_SAMPLE = 1024  # rows looked at first: a mostly live tensor costs one small torch op
_last: TensorMemo[np.ndarray | None] = TensorMemo(last_only=True)


@numba.njit(parallel=True, cache=True, nogil=True)
def _live_rows(x, live):
    # live[i] = 1 where row i of x has a non-zero (nan counts: it must propagate); returns the
    # count. A row is read 16 values at a time (a vector compare) and left at its first non-zero.
    count = 0
    width = x.shape[1]
    for i in numba.prange(x.shape[0]):
        nz = False
        f = 0
        while f + 16 <= width and not nz:
            c = False
            for k in range(16):
                c |= x[i, f + k] != 0
            nz = c
            f += 16
        if not nz:
            for k in range(f, width):
                nz |= x[i, k] != 0
        live[i] = nz
        count += np.int64(nz)
    return count


def live_rows(x: torch.Tensor) -> np.ndarray | None:
    """For a 2-D float CPU tensor of at least :data:`MIN_ROWS` rows of which at most
    :data:`MAX_SHARE` hold a non-zero (or nan): a uint8 array marking those rows; else None.
    The answer for the last tensor asked about is kept while it is alive and unmodified (the
    backend chooser and the kernel ask about the same gradient)."""
    if x.dim() != 2 or x.shape[0] < MIN_ROWS or not host_kernels(x) or not x.dtype.is_floating_point:
        return None
    hit = _last.find(x)
    if hit is not None:
        return hit[0]
    answer = None
    sample = x.detach()[torch.linspace(0, x.shape[0] - 1, min(_SAMPLE, x.shape[0])).long()]
    # The full pass (a numba kernel) runs only when the sample looks sparse: between torch ops,
    # switching to numba's thread pool for a dense gradient measured slower than the pass itself.
    if (sample != 0).any(1).float().mean() <= MAX_SHARE:
        sync_numba_threads()
        live = np.empty(x.shape[0], np.uint8)
        if _live_rows(as_numpy(x.detach().contiguous()), live) <= MAX_SHARE * x.shape[0]:
            answer = live
    return _last.put(x, answer)
