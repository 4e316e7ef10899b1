"""Where a run's tensors live: the ``--device`` setting, checked when the settings are read and
resolved once at set-up into a :class:`torch.device`.

``auto`` takes this process's GPU when there is one (under ``torchrun`` or ``--nprocs``, rank
``LOCAL_RANK``'s, when the node has one for each of its ranks) and the CPU otherwise; ``cuda``
means the same GPU without the fallback; ``cuda:N`` names one (one process only). Asking for a
GPU the node lacks is a one-line :class:`ConfigError`."""

from __future__ import annotations

import os
import re

import torch

from tessera.errors import ConfigError

#: the forms ``--device`` accepts, for messages
DEVICE_FORMS = "auto, cpu, cuda or cuda:N"
_SETTING = re.compile(r"(auto|cpu|cuda)(?::(\d{1,4}))?")


def check_device_setting(setting: str) -> str:
    """``setting`` if it is one of :data:`DEVICE_FORMS` (an index only after ``cuda``), else a ConfigError."""
    m = _SETTING.fullmatch(setting)
    if m is None or (m.group(2) is not None and m.group(1) != "cuda"):
        raise ConfigError(f"--device must be {DEVICE_FORMS}, got {setting!r}")
    return setting


def cuda_count() -> int:
    """How many CUDA devices this process sees (0 without a GPU or a CUDA build of torch)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def local_rank() -> int:
    """This process's index on its node: ``LOCAL_RANK`` (torchrun, ``--nprocs``), else 0."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def resolve_device(setting: str) -> torch.device:
    """The device ``setting`` (checked by :func:`check_device_setting`) means for this process."""
    check_device_setting(setting)
    if setting == "cpu" or (setting == "auto" and cuda_count() == 0):
        return torch.device("cpu")
    count = cuda_count()
    index = local_rank() if ":" not in setting else int(setting.split(":")[1])
    if count == 0:
        raise ConfigError(
            f"--device {setting}: this machine has no CUDA device that torch can use "
            f"(torch {torch.__version__}, CUDA build: {torch.version.cuda is not None}); use --device cpu"
        )
    if index >= count:
        have = "cuda:0" if count == 1 else f"cuda:0 to cuda:{count - 1}"
        who = f"--device {setting}" if ":" in setting else f"local rank {index} (--device {setting})"
        raise ConfigError(
            f"{who} asks for CUDA device {index} but this node has {count} ({have}); "
            "name one of them or start fewer ranks per node"
        )
    return torch.device("cuda", index)


def local_world_size() -> int:
    """How many ranks of this job run on this node: ``LOCAL_WORLD_SIZE`` (torchrun, ``--nprocs``), else 1."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def training_device(setting: str, distributed: bool, ranks_here: int | None = None) -> torch.device:
    """The device a training process puts its tensors on: :func:`resolve_device`'s for one
    process. In a distributed run (or one on part files) each rank takes its own GPU,
    ``cuda:LOCAL_RANK``: ``cuda`` asks for that, ``auto`` takes it when this node has a GPU for
    each of its ``ranks_here`` ranks (default ``LOCAL_WORLD_SIZE``) and the CPU otherwise, and
    ``cuda:N`` (one GPU for every rank) is refused."""
    check_device_setting(setting)
    if not distributed:
        return resolve_device(setting)
    here = local_world_size() if ranks_here is None else ranks_here
    if setting == "cpu" or (setting == "auto" and cuda_count() < here):
        return torch.device("cpu")
    if ":" in setting:
        raise ConfigError(
            f"--device {setting}: in distributed training each rank takes its own GPU (cuda:LOCAL_RANK); "
            "use --device cuda"
        )
    count = cuda_count()
    if count < here:
        raise ConfigError(
            f"--device {setting}: {here} ranks on this node need a GPU each, but it has {count}; "
            "start at most that many ranks per node, or use --device cpu"
        )
    return resolve_device("cuda")
