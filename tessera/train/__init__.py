"""Training: setup (features, model, strategy, order), the loop, checkpoints and configs."""

from tessera.train.loop import Trainer, train

__all__ = ["Trainer", "train"]
