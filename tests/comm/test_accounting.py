"""The exchange counters: a layer that is timed but sends nothing (one part, or a graph without
edges between parts) is gathered like any other, and a one-part run trains as one process."""

from __future__ import annotations

import json

import pytest
import torch

from tessera.cli.main import main
from tessera.comm.accounting import BACKWARD, FORWARD, CommLog
from tessera.comm.group import single_process


def test_a_layer_timed_without_bytes_is_gathered():
    log = CommLog(rank=0, world=1)
    log.add_time(1, BACKWARD, "compute_s", 0.25)
    log.record(0, FORWARD, [0], 8, 32)  # no rows to any peer: no bytes
    got = log.gather(single_process())
    assert got["compute_s"][1][BACKWARD] == [0.25] and got["compute_s"][0][FORWARD] == [0.0]
    assert torch.tensor(got["bytes_data"]).sum() == 0


def _losses(out) -> list[float]:
    return [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_one_part_directory_trains_as_one_process(tmp_path, capsys):
    assert main(["partition", "--dataset", "synthetic:tiny", "--parts", "1", "--out", str(tmp_path / "parts")]) == 0
    run = ["train", "--epochs", "3", "--no-progress", "--reorder", "none"]
    assert main([*run, "--parts-dir", str(tmp_path / "parts"), "--out", str(tmp_path / "part")]) == 0
    assert main([*run, "--dataset", "synthetic:tiny", "--out", str(tmp_path / "whole")]) == 0
    capsys.readouterr()
    assert _losses(tmp_path / "part") == pytest.approx(_losses(tmp_path / "whole"), abs=1e-4)
