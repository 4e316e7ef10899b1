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
