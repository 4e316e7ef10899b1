"""Run-directory paths and writes (issue "Reliability round 2", item 3): an ``--out`` no run
directory can have, and a run file (result.json, metrics.jsonl, checkpoint.pt, ...) that exists as
a directory or a named pipe, are refused at set-up, before anything is loaded or trained, in one
``tessera: error:`` line naming the path and the fix, exit status 2, nothing written (and no pipe
ever opened: a FIFO checkpoint used to hang). A full disk while a checkpoint or a metrics record is
written is one line too; the previous checkpoint stays whole and metrics.jsonl holds only whole
lines, and once there is space ``--resume`` ends as a clean run does. The full disk is a real
1 MiB tmpfs (skipped only where it cannot be mounted outside CI; in CI it must run)."""

from __future__ import annotations

import contextlib
import errno
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

from tessera.cli.main import main
from tessera.errors import TesseraError
from tessera.train import rundir
from tessera.train.checkpoint import load_checkpoint

RUN = ["train", "--dataset", "synthetic:tiny", "--no-progress", "--threads", "1", "--checkpoint-every", "1"]


def _tree(root: Path) -> list[tuple[str, str]]:
    """Every entry under ``root`` (links not followed) with its kind and, for files, its bytes' size."""
    out = []
    for d, dirs, files in os.walk(root, followlinks=False):
        for name in sorted(dirs + files):
            p = Path(d, name)
            st = os.lstat(p)
            out.append((str(p.relative_to(root)), f"{st.st_mode:o}:{st.st_size if not os.path.isdir(p) else 0}"))
    return sorted(out)


@contextlib.contextmanager
def _no_hang(seconds: int = 60):
    """Fail (not hang) if the block takes longer than ``seconds``: a pipe opened blocks forever."""

    def alarm(*_):
        raise TimeoutError("hung: the run opened a named pipe or waited on something else")

    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _refused(capsys, argv: list[str], root: Path) -> str:
    """Run ``argv``: one ``tessera: error:`` line, exit status 2, nothing under ``root`` changed."""
    before = _tree(root)
    with _no_hang():
        code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("tessera: error: "), err
    assert _tree(root) == before
    return err[0]


# ------------------------------------------------------------------ --out paths


def _dangling(d: Path) -> str:
    (d / "link").symlink_to(d / "missing")
    return str(d / "link")


def _dangling_parent(d: Path) -> str:
    (d / "link").symlink_to(d / "missing")
    return str(d / "link" / "run")


def _looping(d: Path) -> str:
    (d / "loop").symlink_to(d / "loop")
    return str(d / "loop")


def _regular_file(d: Path) -> str:
    (d / "file").write_text("keep me\n")
    return str(d / "file")


def _under_a_file(d: Path) -> str:
    (d / "file").write_text("keep me\n")
    return str(d / "file" / "run")


#: name -> (build(dir) -> --out, text the line holds)
OUT_CASES = {
    "unknown user": (lambda d: "~nosuchuser/x", "no user 'nosuchuser'"),
    "name over NAME_MAX": (lambda d: str(d / ("n" * 300) / "run"), "300 bytes, longer than the 255"),
    "path over PATH_MAX": (lambda d: str(d / "/".join(["p" * 200] * 25)), "more than the 4,095 a path may have"),
    "NUL byte": (lambda d: str(d / "a\0b"), "contains a NUL byte"),
    "dangling symlink": (_dangling, "which does not exist; create the link's target or name another directory"),
    "dangling symlink above": (_dangling_parent, "which does not exist"),
    "looping symlink": (_looping, "is a symbolic link that loops"),
    "regular file": (_regular_file, "is an existing file, not a directory"),
    "path under a file": (_under_a_file, "is a file, not a directory"),
}


@pytest.mark.parametrize("case", sorted(OUT_CASES))
def test_an_out_no_run_directory_can_have_is_refused_at_set_up(case, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    build, needle = OUT_CASES[case]
    out = build(tmp_path)
    line = _refused(capsys, [*RUN, "--epochs", "1", "--out", out], tmp_path)
    assert needle in line, line
    if case != "NUL byte":
        assert out[:40] in line, line  # the path is named


def test_a_tilde_out_is_expanded(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert main([*RUN, "--epochs", "1", "--hidden", "8", "--out", "~/run"]) == 0
    assert capsys.readouterr().out.strip().endswith(f"| {tmp_path / 'run'}")
    assert (tmp_path / "run" / "result.json").is_file()


# ------------------------------------------------------------------ run files that are not regular files


def _fifo(p: Path) -> None:
    os.mkfifo(p)


def _directory(p: Path) -> None:
    p.mkdir()
    (p / "inside").write_text("keep me\n")


@pytest.mark.parametrize("name", ["result.json", "metrics.jsonl", "checkpoint.pt", "config.toml", "metrics.csv"])
@pytest.mark.parametrize("kind", ["fifo", "directory"])
@pytest.mark.parametrize("resume", [False, True], ids=["fresh", "resume"])
def test_a_run_file_that_is_a_directory_or_a_pipe_is_refused_before_training(name, kind, resume, tmp_path, capsys):
    out = tmp_path / "run"
    out.mkdir()
    (_fifo if kind == "fifo" else _directory)(out / name)
    line = _refused(capsys, [*RUN, "--epochs", "1", "--out", str(out), *(["--resume"] if resume else [])], tmp_path)
    shown = "a named pipe (FIFO)" if kind == "fifo" else "a directory"
    assert f"{out / name} is {shown}, not a regular file" in line, line
    assert "remove it or name another --out" in line


def test_a_checkpoint_that_is_not_a_regular_file_is_never_opened_as_one(tmp_path):
    fifo, folder = tmp_path / "fifo.pt", tmp_path / "dir.pt"
    os.mkfifo(fifo)
    folder.mkdir()
    with _no_hang(30):
        with pytest.raises(TesseraError, match="is a named pipe, not a regular file"):
            load_checkpoint(fifo)
        with pytest.raises(TesseraError, match="is a directory, not a regular file"):
            load_checkpoint(folder)


# ------------------------------------------------------------------ a full disk


@pytest.fixture
def small_disk(tmp_path):
    """A 1 MiB tmpfs mounted at ``tmp_path/disk`` (unmounted afterwards)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(disk)], capture_output=True)
    if mounted.returncode != 0:
        why = f"cannot mount a tmpfs here ({mounted.stderr.decode().strip() or mounted.returncode}): needs root"
        if os.environ.get("CI") == "true":
            pytest.fail(why + "; CI must run the full-disk test")
        pytest.skip(why)
    try:
        yield disk
    finally:
        if subprocess.run(["umount", str(disk)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(disk)], capture_output=True)


def _fill(disk: Path, leave: int) -> Path:
    """Fill ``disk`` with one file, then give back ``leave`` bytes (whole pages)."""
    filler = disk / "filler"
    with open(filler, "wb", buffering=0) as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\0" * 4096)
    size = filler.stat().st_size
    os.truncate(filler, max(0, size - leave))
    return filler


def _lines(p: Path) -> list[dict]:
    text = p.read_text()
    assert text.endswith("\n"), "a partial last line"
    return [json.loads(line) for line in text.splitlines()]


def test_a_full_disk_is_one_line_keeps_the_checkpoint_and_resumes_exactly(small_disk, tmp_path, capsys):
    wide = [*RUN, "--hidden", "256"]  # a checkpoint of ~140 KB: half of it is room for every small file
    clean = tmp_path / "clean"
    assert main([*wide, "--epochs", "4", "--out", str(clean)]) == 0
    run = small_disk / "run"
    assert main([*wide, "--epochs", "2", "--out", str(run)]) == 0
    checkpoint = (run / "checkpoint.pt").read_bytes()
    # room for the small files the resumed run rewrites, not for a second checkpoint beside the first
    filler = _fill(small_disk, leave=len(checkpoint) // 2)
    capsys.readouterr()
    code = main([*wide, "--epochs", "4", "--out", str(run), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1, err
    assert err[0].startswith(
        f"tessera: error: cannot write the checkpoint {run / 'checkpoint.pt'}: No space left on device"
    )
    assert "--resume" in err[0]
    assert (run / "checkpoint.pt").read_bytes() == checkpoint  # the previous checkpoint, whole
    assert sorted(p.name for p in run.iterdir() if p.name.startswith(".")) == []  # no temporaries, no lock
    records = _lines(run / "metrics.jsonl")  # whole lines only
    assert [r["epoch"] for r in records] == list(range(1, len(records) + 1))
    # space again: the run continues from its checkpoint and ends as the clean run did
    filler.unlink()
    assert main([*wide, "--epochs", "4", "--out", str(run), "--resume"]) == 0
    losses = [r["train_loss"] for r in _lines(run / "metrics.jsonl")]
    assert losses == [r["train_loss"] for r in _lines(clean / "metrics.jsonl")]


def test_a_metrics_record_the_disk_cannot_take_is_cut_off_whole(tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    assert main([*RUN, "--epochs", "1", "--hidden", "8", "--out", str(out)]) == 0
    capsys.readouterr()
    real_write = os.write
    calls = {"n": 0}

    def half_then_full(fd: int, data) -> int:
        # epoch 2's record goes out whole; of epoch 3's, half is taken, then the disk is full
        if os.readlink(f"/proc/self/fd/{fd}").endswith("metrics.jsonl"):
            calls["n"] += 1
            if calls["n"] == 2:
                return real_write(fd, bytes(data[: len(data) // 2]))
            if calls["n"] == 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(fd, data)

    monkeypatch.setattr(rundir.os, "write", half_then_full)
    code = main([*RUN, "--epochs", "3", "--hidden", "8", "--out", str(out), "--resume"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"tessera: error: cannot write the metrics file {out / 'metrics.jsonl'}: No space left")
    records = _lines(out / "metrics.jsonl")  # epoch 3's half record was cut off again
    assert [r["epoch"] for r in records] == [1, 2]
