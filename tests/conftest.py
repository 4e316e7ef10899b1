"""Shared fixtures: where the real Planetoid files live."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

# Triton kernels run in Triton's interpreter on CPU tensors where no GPU is present; triton reads
# this when a kernel is defined, so it is set before any tessera module is imported.
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from tessera.memo import tuning  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def pytest_configure(config):
    # Partition and kernel-choice caches go to a fresh folder per test session, not ~/.cache.
    os.environ["TESSERA_CACHE"] = tempfile.mkdtemp(prefix="tessera-test-cache-")


def pytest_collection_modifyitems(config, items):
    # Modules that start worker processes are the longest: they go first (stable, so each module
    # keeps its order), and under pytest-xdist (make test) the shorter ones even out the end.
    items.sort(key=lambda item: item.get_closest_marker("distributed") is None)


def _planetoid_dir() -> Path | None:
    candidates = []
    for root in filter(None, os.environ.get("TESSERA_DATA", "").split(os.pathsep)):
        candidates += [Path(root) / "planetoid", Path(root)]
    candidates.append(REPO.parent / "shared" / "datasets" / "planetoid")
    return next((c.resolve() for c in candidates if (c / "ind.cora.x").is_file()), None)


@pytest.fixture
def fresh_tuning():
    """This process's tuning state (:data:`tessera.memo.tuning`) reset before and after the test:
    nothing decided, forced or cached in memory, as in a new process."""
    tuning.reset()
    yield tuning
    tuning.reset()


@pytest.fixture(scope="session")
def planetoid_root() -> Path:
    """The folder holding the real ``ind.cora.*`` / ``ind.citeseer.*`` files (via TESSERA_DATA or
    ``../shared/datasets/planetoid``); fails under CI=true when missing, else skips."""
    root = _planetoid_dir()
    if root is None:
        msg = "Planetoid files not found: set TESSERA_DATA or put them in ../shared/datasets/planetoid"
        if os.environ.get("CI") == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    return root


@pytest.fixture(scope="module")
def datasets(planetoid_root):
    """The distributed tests' graphs: Cora (with its data root) and synthetic:small."""
    return [("cora", str(planetoid_root.parent)), ("synthetic:small", "")]


@pytest.fixture(scope="module")
def hosts_ready() -> None:
    """Skip (fail under CI=true) where emulated hosts (``tests/hosts.py``) cannot be made: no root,
    no iproute2."""
    from hosts import unavailable

    why = unavailable()
    if why is not None:
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
