"""PNG plots of training curves."""

from __future__ import annotations

from pathlib import Path

from tessera.files import atomic_write


def plot_curves(history: list[dict[str, float]], path: str | Path, title: str = "") -> None:
    """Loss (left) and train/val/test accuracy, or ROC-AUC for a multi-label run (right), per
    epoch, written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    epochs = [h["epoch"] for h in history]
    metric = "rocauc" if history and "val_rocauc" in history[0] else "acc"
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    ax_loss.plot(epochs, [h["train_loss"] for h in history], label="train loss")
    if history and history[0]["val_loss"] is not None:  # None: no validation split
        ax_loss.plot(epochs, [h["val_loss"] for h in history], label="val loss")
    ax_loss.set_xlabel("epoch")
    ax_loss.set_ylabel("binary cross-entropy" if metric == "rocauc" else "cross-entropy")
    ax_loss.legend()
    for split in ("train", "val", "test"):
        if history and history[0][f"{split}_{metric}"] is None:
            continue  # an empty split has no curve
        ax_acc.plot(epochs, [h[f"{split}_{metric}"] for h in history], label=split)
    ax_acc.set_xlabel("epoch")
    ax_acc.set_ylabel("ROC-AUC (mean over tasks)" if metric == "rocauc" else "accuracy")
    ax_acc.legend()
    fig.suptitle(title)
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=100))
    plt.close(fig)
