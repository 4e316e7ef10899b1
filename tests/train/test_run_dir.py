"""Run directories: a run never overwrites one with other settings unasked, files follow the
umask, and config.toml feeds the same settings back through --config."""

from __future__ import annotations

import dataclasses
import json
import os
import stat
from pathlib import Path

import pytest

from tessera.cli.main import main
from tessera.files import atomic_write, write_json
from tessera.train.config import TrainConfig, make_config, read_toml
from tessera.train.loop import CONFIG, run_dir

TINY = ["train", "--dataset", "synthetic:tiny", "--epochs", "2", "--no-progress"]


def _train(capsys, *extra: str) -> tuple[int, list[str], list[str]]:
    code = main([*TINY, *extra])
    cap = capsys.readouterr()
    return code, cap.out.splitlines(), cap.err.splitlines()


def _hidden(d: Path) -> int:
    return json.loads((d / "result.json").read_text())["config"]["hidden"]


def test_other_settings_take_a_suffixed_default_directory_and_say_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    # settings that change the numbers name their own directory; the others (here --epochs, not in
    # the name so that --resume --epochs extends a run in place) take -2, -3, ...
    base = Path("runs") / "gcn-synthetic-tiny-s0-h8"
    assert _train(capsys, "--hidden", "8")[0] == 0
    code, out, err = _train(capsys, "--hidden", "8", "--epochs", "3")
    assert code == 0
    assert err == [f"tessera: {base} holds a run with other settings; this run writes {base}-2"]
    assert out[-1].endswith(f" | {base}-2")  # the summary line names the run directory
    epochs = [json.loads((d / "result.json").read_text())["epochs_run"] for d in (base, Path(f"{base}-2"))]
    assert epochs == [2, 3]  # both runs kept
    # the same settings again reuse their own directory; a third set takes -3
    code, out, err = _train(capsys, "--hidden", "8", "--epochs", "3")
    assert code == 0 and len(err) == 1 and out[-1].endswith(f" | {base}-2")
    assert _train(capsys, "--hidden", "8")[2] == []
    assert _train(capsys, "--hidden", "8", "--epochs", "1")[1][-1].endswith(f" | {base}-3")
    assert _train(capsys, "--hidden", "16")[1][-1].endswith(" | runs/gcn-synthetic-tiny-s0-h16")
    assert sorted(p.name for p in Path("runs").iterdir()) == sorted(
        [base.name, f"{base.name}-2", f"{base.name}-3", "gcn-synthetic-tiny-s0-h16"]
    )


def test_an_out_holding_other_settings_is_refused_unless_resumed_or_overwritten(tmp_path, capsys):
    out = tmp_path / "run"
    assert _train(capsys, "--hidden", "8", "--out", str(out))[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    code, _, err = _train(capsys, "--hidden", "16", "--out", str(out))
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"tessera: error: --out {out} holds a run with other settings (hidden=8 (this run 16))")
    assert "--resume" in err[0] and "--overwrite" in err[0]
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before  # nothing written
    # --resume continues it (its checkpoint's own check refuses other model settings) ...
    code, _, err = _train(capsys, "--hidden", "8", "--epochs", "3", "--out", str(out), "--resume")
    assert code == 0 and err == []
    # ... and --overwrite replaces it, saying so
    code, out_lines, err = _train(capsys, "--hidden", "16", "--out", str(out), "--overwrite")
    assert code == 0 and _hidden(out) == 16
    assert len(err) == 1 and err[0].startswith(f"tessera: --overwrite: replacing the run in {out} (hidden=8")
    assert out_lines[-1].endswith(f" | {out}")
    assert main([*TINY, "--out", str(out), "--overwrite", "--resume"]) == 2  # one or the other
    assert "give one of them" in capsys.readouterr().err


def test_a_run_from_before_config_toml_is_compared_by_its_result_json(tmp_path):
    out = tmp_path / "old"
    write_json(out / "result.json", {"config": {"dataset": "synthetic:tiny", "hidden": 8, "epochs": 2}})
    cfg = TrainConfig(dataset="synthetic:tiny", hidden=8, epochs=2, out=str(out))
    assert run_dir(cfg).path == out  # the same settings (the rest at their defaults)
    with pytest.raises(Exception, match=r"hidden=8 \(this run 16\)"):
        run_dir(dataclasses.replace(cfg, hidden=16))
    (out / "result.json").write_text("not json")  # unreadable settings are never taken for equal
    with pytest.raises(Exception, match="settings not recorded"):
        run_dir(cfg)
    # display, output and thread settings do not make another run
    (out / "result.json").unlink()
    atomic_write(out / CONFIG, lambda tmp: tmp.write_text(cfg.to_toml()))
    same = dataclasses.replace(cfg, progress=False, plot=True, threads=1, checkpoint_every=1, timeout=9.0)
    assert run_dir(same).path == out


def test_files_follow_the_umask(tmp_path, monkeypatch, capsys):
    old = os.umask(0o022)
    try:
        out = tmp_path / "run"
        assert _train(capsys, "--out", str(out), "--plot")[0] == 0
        atomic_write(tmp_path / "x", lambda tmp: tmp.write_text("x"))
        os.umask(0o077)
        atomic_write(tmp_path / "private", lambda tmp: tmp.write_text("x"))
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert set(modes) >= {"config.toml", "checkpoint.pt", "metrics.jsonl", "metrics.csv", "result.json", "curves.png"}
    assert set(modes.values()) == {0o644}, modes
    assert stat.S_IMODE((tmp_path / "x").stat().st_mode) == 0o644
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o600


def test_config_toml_gives_back_the_same_settings(tmp_path, capsys):
    out = tmp_path / "run"
    flags = ["--hidden", "8", "--lr", "0.02", "--weight-decay", "1e-05", "--dropout", "0.25", "--seed", "3"]
    flags += [
        "--model",
        "sage",
        "--label-prop",
        "0.5",
        "--norm",
        "layer",
        "--checkpoint-every",
        "1",
        "--name",
        'a "b"\\c',
    ]
    argv = [*TINY, *flags, "--out", str(out)]
    original = make_config({}, {"dataset": "synthetic:tiny", "epochs": 2, "progress": False, "out": str(out)} | {
        "hidden": 8, "lr": 0.02, "weight_decay": 1e-05, "dropout": 0.25, "seed": 3, "model": "sage",
        "label_prop": 0.5, "norm": "layer", "checkpoint_every": 1, "name": 'a "b"\\c',
    })  # fmt: skip
    assert main(argv) == 0  # synthetic presets ignore --name
    capsys.readouterr()
    text = (out / "config.toml").read_text()
    assert "out" not in read_toml(out / "config.toml") and "resume" not in text and "groups" not in text
    again = make_config(read_toml(out / "config.toml"), {"out": str(out)})
    assert again == original
    assert dataclasses.asdict(again) == json.loads((out / "result.json").read_text())["config"]
    # and --config runs it again in the same directory (same settings: no refusal)
    assert main(["train", "--config", str(out / "config.toml"), "--out", str(out)]) == 0
    assert capsys.readouterr().err == ""
