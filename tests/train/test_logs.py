"""What a run tells and records: a log file gets a few whole lines, TQDM_DISABLE hides progress,
messages go through the ``tessera`` logger, early stopping is announced, metrics.csv and
TensorBoard scalars hold the per-epoch numbers, a cold kernel cache is announced on a terminal."""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
import subprocess
import sys
import time
import types
from pathlib import Path

from tessera.cli.main import main
from tessera.datasets import load
from tessera.train import loop
from tessera.train.config import TrainConfig
from tessera.train.loop import CSV_COLUMNS, Trainer
from tessera.train.progress import progress

REPO = Path(__file__).resolve().parents[2]
TINY = ["train", "--dataset", "synthetic:tiny", "--epochs", "3"]
# synthetic:tiny stops early under these settings (tests/train/test_train.py)
EARLY = ["train", "--dataset", "synthetic:tiny", "--epochs", "300", "--patience", "5", "--lr", "0.05"]
STOP_LINE = re.compile(
    r"tessera: early stopping at epoch (\d+): no better validation accuracy in the last (\d+) epochs "
    r"\(--patience (\d+)\); best epoch (\d+)"
)


def test_a_log_file_gets_a_few_whole_lines_per_run(tmp_path):
    log, epochs = tmp_path / "log", 40
    cmd = [sys.executable, "-m", "tessera", *TINY[:-1], str(epochs), "--patience", "0", "--out", str(tmp_path / "r")]
    t0 = time.monotonic()
    with open(log, "w") as f:  # tessera train ... > log 2>&1
        code = subprocess.call(cmd, stdout=f, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO)})
    wall = time.monotonic() - t0
    text = log.read_text()
    assert code == 0, text
    assert "\r" not in text and text.endswith("\n")
    lines = text.splitlines()
    # the first and last epoch's lines, one per 5 s between them, the summary line
    assert 3 <= len(lines) <= 3 + wall / 5, lines
    assert lines[-1].startswith("gcn on synthetic:tiny: test acc ") and lines[-1].endswith(f" | {tmp_path / 'r'}")


def test_tqdm_disable_hides_the_progress(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TQDM_DISABLE", "1")
    assert main([*TINY, "--out", str(tmp_path / "a")]) == 0
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("TQDM_DISABLE", "0")  # 0 leaves it on
    assert main([*TINY, "--out", str(tmp_path / "b")]) == 0
    assert "train: epoch 3/3 " in capsys.readouterr().err


def test_tqdm_disable_hides_the_bar_on_a_terminal_too(monkeypatch):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    monkeypatch.setenv("TQDM_DISABLE", "1")
    bar = progress(10)
    bar.update(5)
    bar.close()
    assert sys.stderr.getvalue() == ""


def test_early_stopping_is_one_line_naming_the_epoch_patience_and_best_epoch(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*EARLY, "--out", str(out), "--no-progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    res = json.loads((out / "result.json").read_text())
    assert res["stopped_early"] and len(err) == 1, err
    stopped, bad, patience, best = map(int, STOP_LINE.fullmatch(err[0]).groups())
    assert (stopped, bad, patience, best) == (res["epochs_run"], 5, 5, res["best_epoch"])


def test_messages_go_through_the_tessera_logger(tmp_path, caplog, capsys):
    cfg = TrainConfig(dataset="synthetic:tiny", epochs=300, patience=5, lr=0.05, out=str(tmp_path), progress=False)
    with caplog.at_level(logging.INFO, logger="tessera"):
        Trainer(cfg, load("synthetic:tiny")).fit()
    stops = [r for r in caplog.records if r.getMessage().startswith("early stopping at epoch ")]
    assert len(stops) == 1 and stops[0].name == "tessera.train.loop" and stops[0].levelno == logging.INFO
    # a level set on the logger is kept by the CLI: the user silences it
    logger = logging.getLogger("tessera")
    level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        capsys.readouterr()
        assert main([*EARLY, "--out", str(tmp_path / "quiet"), "--no-progress"]) == 0
        assert capsys.readouterr().err == ""
    finally:
        logger.setLevel(level)


def test_metrics_csv_holds_the_numbers_of_metrics_jsonl_also_after_a_resume(tmp_path, capsys):
    out = tmp_path / "run"
    assert main([*TINY, "--out", str(out), "--no-progress", "--checkpoint-every", "1"]) == 0
    assert main([*TINY[:-1], "5", "--out", str(out), "--no-progress", "--resume"]) == 0
    with open(out / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert list(rows[0]) == list(CSV_COLUMNS)
    assert [int(r["epoch"]) for r in rows] == [1, 2, 3, 4, 5]
    for row, rec in zip(rows, recs, strict=True):
        assert {k: float(v) for k, v in row.items()} == {k: rec[k] for k in CSV_COLUMNS}  # exact: repr digits


def test_tensorboard_without_the_package_is_one_line_and_nothing_written(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as when not installed
    code = main([*TINY, "--out", str(tmp_path / "run"), "--tensorboard", str(tmp_path / "tb")])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and err == ["tessera: error: --tensorboard needs the tensorboard package: pip install tensorboard"]
    assert not (tmp_path / "run").exists() and not (tmp_path / "tb").exists()


def test_tensorboard_gets_each_epochs_scalars_and_a_resume_purges_what_followed_the_checkpoint(
    tmp_path, monkeypatch, capsys
):
    writers: list[dict] = []

    class SummaryWriter:
        def __init__(self, log_dir, purge_step=None):
            self.rec = {"log_dir": log_dir, "purge_step": purge_step, "scalars": [], "closed": False}
            writers.append(self.rec)

        def add_scalar(self, tag, value, step):
            self.rec["scalars"].append((tag, step, value))

        def flush(self):
            pass

        def close(self):
            self.rec["closed"] = True

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    out, tb = tmp_path / "run", str(tmp_path / "tb")
    assert main([*TINY, "--out", str(out), "--no-progress", "--tensorboard", tb]) == 0
    assert main([*TINY[:-1], "5", "--out", str(out), "--no-progress", "--tensorboard", tb, "--resume"]) == 0
    first, resumed = writers
    # the resumed writer starts after the checkpoint's last epoch, dropping any events past it
    assert (first["log_dir"], first["purge_step"], resumed["purge_step"]) == (tb, None, 4)
    assert first["closed"] and resumed["closed"]
    tags = ["loss/train", "acc/train", "acc/val", "acc/test", "loss/val", "time/epoch_s"]
    assert [t for t, step, _ in first["scalars"] if step == 1] == tags
    assert sorted({step for _, step, _ in resumed["scalars"]}) == [4, 5]
    recs = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert ("acc/val", 5, recs[4]["val_acc"]) in resumed["scalars"]


def test_a_cold_kernel_cache_is_announced_once_on_a_terminal(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(loop, "kernels_compiled", lambda: False)
    assert main([*TINY, "--out", str(tmp_path / "log"), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""  # a log's lines do not depend on the cache
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main([*TINY, "--out", str(tmp_path / "tty"), "--no-progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["tessera: compiling kernels for this machine (first run only: numba caches them for later runs)"]
    monkeypatch.setattr(loop, "kernels_compiled", lambda: True)
    assert main([*TINY, "--out", str(tmp_path / "warm"), "--no-progress"]) == 0
    assert capsys.readouterr().err == ""


def test_the_kernel_cache_check_reads_numbas_index(monkeypatch):
    from tessera.backends import cpu_csr

    assert isinstance(loop.kernels_compiled(), bool)
    monkeypatch.setattr(cpu_csr._spmm._cache._cache_file, "_load_index", lambda: {})
    assert loop.kernels_compiled() is False
    monkeypatch.setattr(cpu_csr, "_spmm", None)  # internals it cannot read: nothing is said
    assert loop.kernels_compiled() is True
