"""An operating-system error in any command is one ``tessera: error:`` line naming the path, the
reason and what to do, exit status 2, no traceback and no half-written file; a broken connection
inside a distributed rank stays a peer's failure (status 3)."""

import errno
import importlib
import os
from pathlib import Path

import pytest

from tessera.cli.launch import PEER_FAILED
from tessera.cli.main import main, os_error_line

cli = importlib.import_module("tessera.cli.main")


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    base = tmp_path_factory.mktemp("oserrors")
    (base / "afile").write_text("x")
    (base / "adir").mkdir()
    (base / "loop").symlink_to(base / "loop")
    run = base / "run"
    assert main(["train", "--dataset", "synthetic:tiny", "--epochs", "2", "--out", str(run), "--no-progress"]) == 0
    return base


LONG = "n" * 300  # a name longer than the 255 bytes a file system allows
TINY = ["--dataset", "synthetic:tiny"]
# (command line with {base} for the scratch directory, what the line must say): every command,
# and ENOTDIR, EISDIR, ENAMETOOLONG, ELOOP, and a dataset that is a directory (as root EACCES and
# EROFS do not happen; the clause's own text for those is checked below)
CASES = {
    "info: dataset path too long": (["info", "--dataset", "{base}/" + LONG + ".npz"], "File name too long"),
    "info: dataset is a directory": (["info", "--dataset", "{base}/adir"], "{base}/adir"),
    "kernels: dataset is a directory": (["kernels", "--dataset", "{base}/adir", "--width", "8"], "{base}/adir"),
    "plan: dataset under a file": (
        ["plan", "--dataset", "{base}/afile/g.npz", "--nprocs", "2", "--model-only"],
        "{base}/afile/g.npz",
    ),
    "partition: --out through a link loop": (
        ["partition", *TINY, "--parts", "2", "--out", "{base}/loop/parts"],
        "Too many levels of symbolic links",
    ),
    "partition: --out under a file": (["partition", *TINY, "--parts", "2", "--out", "{base}/afile/p"], "{base}/afile"),
    "simulate: --plot is a directory": (["simulate", *TINY, "--parts", "2", "--plot", "{base}/adir"], "Is a directory"),
    "simulate: --plot under a file": (
        ["simulate", *TINY, "--parts", "2", "--plot", "{base}/afile/p.png"],
        "is a file, not a directory",
    ),
    "predict: --out name too long": (
        ["predict", "--run", "{base}/run", "--out", "{base}/" + LONG + ".npy"],
        "too long",
    ),
    "predict: --run is a file": (["predict", "--run", "{base}/afile"], "{base}/afile"),
    "train: --config name too long": (["train", "--config", "{base}/" + LONG + ".toml"], "File name too long"),
    "train: --config is a directory": (["train", "--config", "{base}/adir"], "{base}/adir"),
    "train: --config through a link loop": (["train", "--config", "{base}/loop"], "{base}/loop"),
    "train: --out under a file": (["train", *TINY, "--epochs", "1", "--out", "{base}/afile/r"], "{base}/afile"),
    "train: --out through a link loop": (["train", *TINY, "--epochs", "1", "--out", "{base}/loop"], "{base}/loop"),
    "train: --parts-dir is a file": (["train", "--parts-dir", "{base}/afile", "--epochs", "1"], "{base}/afile"),
}


def _files(base: Path) -> set[str]:
    return {str(p.relative_to(base)) for p in base.rglob("*") if not p.is_symlink()}


@pytest.mark.parametrize("case", list(CASES))
def test_an_os_error_is_one_line_naming_the_path_with_exit_status_2(case, paths, capfd):
    argv, said = CASES[case]
    before = _files(paths)
    code = main([a.replace("{base}", str(paths)) for a in argv])
    out, err = capfd.readouterr()
    lines = err.strip().splitlines()
    assert code == 2, err
    assert len(lines) == 1 and lines[0].startswith("tessera: error: "), err
    assert said.replace("{base}", str(paths)) in lines[0], err
    assert "Traceback" not in err + out
    assert _files(paths) == before, "a file was left behind"


@pytest.mark.parametrize(
    ("code", "said"),
    [
        (errno.EACCES, "check its permissions"),
        (errno.EROFS, "read-only"),
        (errno.ENOSPC, "free some space"),
        (errno.EDQUOT, "free some space"),
        (errno.EIO, "check the disk"),
    ],
)
def test_errors_root_cannot_provoke_are_one_line_too(code, said, paths, capsys, monkeypatch):
    # as root permissions never refuse and no test disk fills up: the same clause, from a command
    def fail(args):
        raise OSError(code, os.strerror(code), str(paths / "result.json"))

    monkeypatch.setattr(cli, "_cmd_info", fail)
    assert main(["info"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines == [f"tessera: error: {paths / 'result.json'}: {os.strerror(code)} ({lines[0].split('(', 1)[1]}"]
    assert said in lines[0]


def test_a_rename_names_the_destination_not_the_temporary():
    e = OSError(errno.EISDIR, "Is a directory", "/runs/.plot.png.1a2b3c4d.tmp", None, "/runs/plot.png")
    assert os_error_line(e).startswith("/runs/plot.png: Is a directory (")


def test_a_broken_connection_in_a_distributed_rank_stays_a_peer_failure(monkeypatch, capsys):
    def fail(args):
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    monkeypatch.setattr(cli, "_cmd_info", fail)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("TESSERA_LAUNCHER_PID", raising=False)
    assert main(["info"]) == PEER_FAILED
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "a peer died or timed out" in lines[0]
