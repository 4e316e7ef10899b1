"""``tessera --version`` and the package metadata."""

from __future__ import annotations

import importlib.metadata
import subprocess
import sys
from pathlib import Path

from tessera.cli.main import SOURCE_VERSION, main, package_version

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def test_version_prints_the_package_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"tessera {package_version()}\n"


def test_version_from_a_source_tree_falls_back_to_the_projects(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    assert package_version() == SOURCE_VERSION == PROJECT["version"]


def test_the_console_command_prints_it(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tessera", "--version"], capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0 and proc.stdout.startswith("tessera ") and proc.stderr == ""


def test_the_package_metadata_describes_the_project():
    assert PROJECT["description"] and PROJECT["keywords"] and PROJECT["readme"] == "README.md"
    classifiers = PROJECT["classifiers"]
    assert any(c.startswith("Topic :: Scientific/Engineering") for c in classifiers)
    # a licence is declared only with a licence file to back it
    has_file = any((REPO / name).exists() for name in ("LICENSE", "LICENSE.txt", "LICENSE.md", "COPYING"))
    assert ("license" in PROJECT) == has_file


def test_the_program_skips_the_interpreter_teardown_only_in_a_rank_of_a_job():
    # a finished rank's native teardown can abort it; the program leaves before it, with its status
    # and its output flushed, while a single process ends normally (atexit handlers run)
    code = (
        "import atexit, sys; atexit.register(lambda: print('teardown', flush=True));"
        "sys.argv = ['tessera', '--version']; import tessera.__main__"
    )
    for world, teardown in (("1", True), ("2", False)):
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), "WORLD_SIZE": world}
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        assert r.stdout.startswith("tessera ") and ("teardown" in r.stdout) == teardown, r.stdout
    assert PROJECT["scripts"]["tessera"] == "tessera.cli:program"
