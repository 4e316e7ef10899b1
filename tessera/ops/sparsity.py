"""Row sparsity of gradients: a full-graph loss on the training vertices only leaves the last
layer's output gradient zero in every other row, and the products that take it (``A^T g``,
``g^T x``, ``g W``) can skip those rows and give the same values."""

from __future__ import annotations

import numba
import numpy as np
import torch

from tessera.ops.threads import sync_numba_threads

MIN_ROWS = 1 << 15  # smaller inputs are not worth the check
MAX_SHARE = 0.5  # rows count as sparse when at most this share of them is live


@numba.njit(parallel=True, cache=True, nogil=True)
def _live_rows(x, live):
    # live[i] = 1 where row i of x has a non-zero (nan counts: it must propagate); returns the count
    count = 0
    for i in numba.prange(x.shape[0]):
        nz = False
        for f in range(x.shape[1]):
            nz |= x[i, f] != 0
        live[i] = nz
        count += np.int64(nz)
    return count


def sparse_rows(x: torch.Tensor) -> np.ndarray | None:
    """For a 2-D float CPU tensor of at least :data:`MIN_ROWS` rows of which at most
    :data:`MAX_SHARE` hold a non-zero (or nan): a uint8 array marking those rows; else None."""
    if x.dim() != 2 or x.shape[0] < MIN_ROWS or x.device.type != "cpu" or not x.dtype.is_floating_point:
        return None
    sync_numba_threads()
    live = np.empty(x.shape[0], np.uint8)
    if _live_rows(x.detach().contiguous().numpy(), live) > MAX_SHARE * x.shape[0]:
        return None
    return live
