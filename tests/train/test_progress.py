"""Progress output: a bar on a terminal, a few complete lines in a log."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import time
from pathlib import Path

from tqdm import tqdm

from tessera.train.progress import LineProgress, progress

REPO = Path(__file__).resolve().parents[2]


class _Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def _lines(epochs: int, seconds_per_epoch: float, stop_at: int | None = None) -> list[str]:
    out, clock = io.StringIO(), _Clock()
    p = LineProgress(epochs, stream=out, interval=5.0, clock=clock)
    for epoch in range(1, (stop_at or epochs) + 1):
        clock.t += seconds_per_epoch
        p.set_postfix(loss=f"{1 / epoch:.4f}")
        p.update(1)
    p.close()
    text = out.getvalue()
    assert "\r" not in text and text.endswith("\n")
    return text.splitlines()


def test_log_lines_are_the_first_epoch_one_per_interval_and_the_last():
    lines = _lines(100, 0.3)  # 30 s of training
    epochs = [int(line.split()[2].split("/")[0]) for line in lines]
    assert epochs[0] == 1 and epochs[-1] == 100
    assert epochs == [1, 18, 35, 52, 69, 86, 100]  # the first, then >= 5 s (17 epochs) apart, the last
    assert lines[-1] == "train: epoch 100/100 loss=0.0100 [30.0s]"


def test_a_run_stopped_early_still_ends_with_its_last_epoch():
    lines = _lines(200, 0.01, stop_at=37)
    assert [line.split()[2] for line in lines] == ["1/200", "37/200"]


def test_a_terminal_gets_the_bar(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    bar = progress(10)
    assert isinstance(bar, tqdm)
    bar.close()


def test_training_into_a_pipe_writes_a_few_complete_lines(tmp_path):
    epochs = 20
    cmd = [sys.executable, "-m", "tessera", "train", "--dataset", "synthetic:tiny", "--epochs", str(epochs)]
    cmd += ["--patience", "0", "--out", str(tmp_path / "run")]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert "\r" not in err
    assert err.endswith("\n")
    lines = [line for line in err.splitlines() if line.startswith("train: epoch ")]
    # the first epoch, at most one per 5 s after it, and the last
    assert 2 <= len(lines) <= 2 + wall / 5
    assert lines[0].startswith("train: epoch 1/20 ") and lines[-1].startswith(f"train: epoch {epochs}/{epochs} ")
    for line in lines:
        assert all(f" {key}=" in line for key in ("loss", "train", "val", "t")), line
        assert line.endswith("s]"), line
