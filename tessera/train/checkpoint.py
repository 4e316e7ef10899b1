"""Checkpoints: written atomically, read back with ``weights_only=True``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tessera.errors import TesseraError
from tessera.files import atomic_write


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> None:
    """Write a checkpoint (tensors, numbers, strings, lists and dicts only) atomically."""
    atomic_write(path, lambda tmp: torch.save(state, tmp))


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read a checkpoint with ``weights_only=True``: no arbitrary code runs while loading."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise
    except Exception as e:  # torch raises several types for corrupt or foreign files
        raise TesseraError(
            f"checkpoint {path} is unreadable ({type(e).__name__}); delete it or drop --resume"
        ) from None
