"""Which kernels a tensor takes: tessera's CPU kernels (numba, the tuned MKL/oneDNN paths) for
CPU tensors, and the portable torch ops, which run on any device, for the rest. A run asks for
the portable ops on the CPU too with ``--backend torch`` (:data:`tessera.memo.tuning`'s
``portable``): the suite then runs on CPU tensors exactly the code a GPU runs."""

from __future__ import annotations

import torch

from tessera.memo import tuning


def host_kernels(*tensors: torch.Tensor) -> bool:
    """Whether every one of ``tensors`` is on the CPU and the CPU kernels are in use."""
    return not tuning.portable and all(t.device.type == "cpu" for t in tensors)
