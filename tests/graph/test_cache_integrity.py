"""Kept caches are trusted only for the bytes they were written with: a cache file whose values were
scaled, whose columns were shifted by one, that was truncated, or that holds JSON of another shape
is computed again (said in one line) and rewritten, and a real training's losses equal a clean
cache's; a named pipe or a directory where a cache file belongs is never opened, written or deleted
(the run computes without that cache and says so once); no temporary file is left behind, even when
a write fails for want of space. Every kind a one-process run keeps: GCN normalisations (``norms``),
vertex orders and renumbered structures (``orders``), generated graphs (``synthetic``), locality
chunkings (``chunks``) and backend choices (``kernels.json``); partitions and plans are in
``tests/planner/test_cache_faults.py`` (they need two processes)."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import signal
import stat
from pathlib import Path

import numpy as np
import pytest
import torch

import tessera
import tessera.datasets as datasets
import tessera.files as files
import tessera.graph.graph as graph_module
from tessera.backends import select
from tessera.graph import order as ro
from tessera.graph.partition import assign
from tessera.memo import tuning

# A kept structure of the renumbering and of the normalisation, the vertex order, the locality
# chunkings (dense_block) and the generated graph itself: every binary kind in one run.
KEPT = {"hidden": 16, "epochs": 2, "reorder": "rcm", "backend": "dense_block", "progress": False}
# Backend choices measured (a fake, fixed measurement: the choice does not depend on timing).
CHOSEN = {"hidden": 16, "epochs": 2, "backend": "auto", "progress": False}
TEMP = re.compile(r"\..+\.[a-z0-9_]{8}\.tmp|.*\.tmp.*")  # atomic_write's temporaries, and any other


def _fixed_measure(matrix, x, weight, names, transposed, reps=None):
    return {name: float(i + 1) for i, name in enumerate(sorted(names))}


def _keep_everything(mp: pytest.MonkeyPatch) -> None:
    """Keep every structure at synthetic:small's size and measure backend choices (fixed)."""
    mp.setattr(graph_module, "KEEP_EDGES", 0)
    mp.setattr(ro, "KEEP_EDGES", 0)
    mp.setattr(datasets, "_CACHED_MIN_EDGES", 0)
    mp.setattr(select, "_TRIAL_MIN_WORK", 0)
    mp.setattr(select, "measure", _fixed_measure)


def _losses(settings: dict, cache: Path, mp: pytest.MonkeyPatch) -> list[float]:
    """A real training of GCN on synthetic:small (a fresh Graph: nothing remembered in memory)."""
    mp.setenv("TESSERA_CACHE", str(cache))
    tuning.reset()
    try:
        run = tessera.fit("synthetic:small", "gcn", **settings)
    finally:
        tuning.reset()
    return [h["train_loss"] for h in run.history]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """Per setting, the losses of a run on an empty cache and the cache it left."""
    out = {}
    with pytest.MonkeyPatch.context() as mp:
        _keep_everything(mp)
        for name, settings in (("kept", KEPT), ("chosen", CHOSEN)):
            cache = tmp_path_factory.mktemp(f"clean-{name}")
            if out:  # this CPU's GEMM path, measured once (gemm.json)
                shutil.copy(out["kept"][1] / "gemm.json", cache)
            out[name] = (_losses(settings, cache, mp), cache)
    return out


@pytest.fixture
def no_hang():
    """Fail a test that blocks (opening a named pipe waits for a writer) instead of hanging."""

    def fail(*_):
        raise TimeoutError("the run blocked: a cache file was opened that should not have been")

    before = signal.signal(signal.SIGALRM, fail)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, before)


@pytest.fixture
def keep(monkeypatch, caplog, no_hang):
    _keep_everything(monkeypatch)
    monkeypatch.setattr(files, "_said", set())
    caplog.set_level(logging.WARNING, logger="tessera")
    return monkeypatch


def _notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tessera" and r.getMessage().startswith("cache ")]


def _temps(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if TEMP.fullmatch(p.name)]


def _replace(path: Path, write) -> None:
    """Change a cache file as another program would, as a new file (a run of this process may
    still map the old one: writing it in place would change those pages under it)."""
    tmp = path.with_name("corrupting")
    write(tmp)
    os.replace(tmp, path)


def _save(path: Path, arr: np.ndarray) -> None:
    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.save(f, arr)

    _replace(path, write)


def _resave_npz(path: Path, change) -> None:
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    change(arrays)

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:
            np.savez(f, **arrays)

    _replace(path, write)


def _swap_two(a: np.ndarray) -> np.ndarray:
    a = a.copy()
    a[[0, -1]] = a[[-1, 0]]
    return a


# what each case corrupts: (setting, glob under the cache, how); every case's change keeps the file
# of the right shape and dtype unless said (only the digest catches it)
def _scale(p: Path) -> None:
    _save(p, np.load(p) * np.float32(2))


def _shift(p: Path) -> None:
    a = np.load(p)
    _save(p, ((a + 1) % a.max()).astype(a.dtype))  # columns shifted by one, still in range


def _swap(p: Path) -> None:
    _save(p, _swap_two(np.load(p)))  # still a permutation


def _truncate(p: Path) -> None:
    data = p.read_bytes()
    _replace(p, lambda tmp: tmp.write_bytes(data[: len(data) // 2]))


def _scale_features(p: Path) -> None:
    _resave_npz(p, lambda a: a.update(x=a["x"] * np.float32(2)))


def _swap_chunk_order(p: Path) -> None:
    _resave_npz(p, lambda a: a.update(order=_swap_two(a["order"])))  # still a partition of the rows


def _fifo(p: Path) -> None:
    p.unlink()
    os.mkfifo(p)


def _directory(p: Path) -> None:
    p.unlink()
    p.mkdir()
    (p / "someone-elses").write_text("kept")


def _json(obj):
    def corrupt(p: Path) -> None:
        text = json.dumps(obj)
        _replace(p, lambda tmp: tmp.write_text(text))

    return corrupt


def _bad_entries(p: Path) -> None:
    data = json.loads(p.read_text())
    key = sorted(data)[0]
    _json({**data, key: {"choice": 3, "seconds": {"reference": "fast"}}})(p)


def _missing_keys(p: Path) -> None:
    data = json.loads(p.read_text())
    _json({k: {} for k in data})(p)


VERTEX_ORDER = "orders/" + "?" * 32 + ".npy"  # beside <digest>.csr.<name>.npy and the orders' choices
DIGEST = "did not match its digest; recomputed"
UNREAD = "could not be read; recomputed"
JSON_SHAPE = "could not be read or has the wrong shape; recomputed"
FOREIGN = "is not a regular file: not read or written; computed without caching"

CASES = {
    "norm values scaled": ("kept", "norms/*.values.npy", _scale, DIGEST),
    "norm columns shifted by one": ("kept", "norms/*.indices.npy", _shift, DIGEST),
    "norm values truncated": ("kept", "norms/*.values.npy", _truncate, DIGEST),
    "norm values a named pipe": ("kept", "norms/*.values.npy", _fifo, FOREIGN),
    "norm columns a directory": ("kept", "norms/*.indices.npy", _directory, FOREIGN),
    "norm manifest of the wrong shape": ("kept", "norms/*.digest.json", _json([1, 2]), UNREAD),
    "renumbered columns shifted by one": ("kept", "orders/*.csr.indices.npy", _shift, DIGEST),
    "renumbered row pointers truncated": ("kept", "orders/*.csr.indptr.npy", _truncate, DIGEST),
    "renumbered columns a named pipe": ("kept", "orders/*.csr.indices.npy", _fifo, FOREIGN),
    "vertex order with two vertices swapped": ("kept", VERTEX_ORDER, _swap, DIGEST),
    "vertex order a named pipe": ("kept", VERTEX_ORDER, _fifo, FOREIGN),
    "generated graph with features scaled": ("kept", "synthetic/*.npz", _scale_features, DIGEST),
    "generated graph truncated": ("kept", "synthetic/*.npz", _truncate, DIGEST),
    "generated graph a named pipe": ("kept", "synthetic/*.npz", _fifo, FOREIGN),
    "chunking with two rows swapped": ("kept", "chunks/*-0.npz", _swap_chunk_order, DIGEST),
    "chunking truncated": ("kept", "chunks/*-1.npz", _truncate, DIGEST),
    "chunking a directory": ("kept", "chunks/*-0.npz", _directory, FOREIGN),
    "kernel choices a list": ("chosen", "kernels.json", _json(["reference", "csr"]), JSON_SHAPE),
    "kernel choices of the wrong types": ("chosen", "kernels.json", _bad_entries, JSON_SHAPE),
    "kernel choices without their keys": ("chosen", "kernels.json", _missing_keys, JSON_SHAPE),
    "kernel choices a named pipe": ("chosen", "kernels.json", _fifo, FOREIGN),
    "kernel choices a directory": ("chosen", "kernels.json", _directory, FOREIGN),
}
AGAIN = ("norm values scaled", "norm manifest of the wrong shape", "kernel choices a list")


def _one(root: Path, pattern: str) -> Path:
    found = sorted(root.glob(pattern))
    assert found, f"the clean run kept nothing matching {pattern}"
    return found[0]


def _vouched(entry_file: Path) -> bool:
    """Whether some manifest beside ``entry_file`` vouches for its bytes as they are now."""
    size_sha = files.file_digest(entry_file)
    for m in entry_file.parent.glob("*" + files.MANIFEST_SUFFIX):
        item = json.loads(m.read_text())["files"].get(entry_file.name)
        if item is not None:
            return (item["bytes"], item["sha256"]) == size_sha
    return False


def test_a_clean_kept_cache_is_read_back_and_trains_the_same_without_a_word(clean, keep, caplog, tmp_path):
    for name, settings in (("kept", KEPT), ("chosen", CHOSEN)):
        want, template = clean[name]
        cache = tmp_path / name
        shutil.copytree(template, cache)
        assert _losses(settings, cache, keep) == want
        assert _temps(cache) == []
    assert _notes(caplog) == []
    kinds = {p.relative_to(tmp_path / "kept").parts[0] for p in (tmp_path / "kept").rglob("*.digest.json")}
    assert kinds == {"norms", "orders", "synthetic", "chunks"}  # each kept with its manifest


def test_a_kept_file_is_not_recomputed_when_its_digest_matches(clean, keep, tmp_path):
    cache = tmp_path / "kept"
    shutil.copytree(clean["kept"][1], cache)

    def boom(*a, **k):
        raise AssertionError("recomputed despite an intact cache")

    keep.setattr(graph_module, "gcn_values", boom)
    keep.setattr(ro, "renumbered_csr", boom)
    keep.setattr(ro, "_compute", boom)
    assert _losses(KEPT, cache, keep) == clean["kept"][0]


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_a_damaged_or_foreign_cache_file_trains_as_a_clean_cache_and_says_so_once(case, clean, keep, caplog, tmp_path):
    setting, pattern, corrupt, said = CASES[case]
    want, template = clean[setting]
    cache = tmp_path / "cache"
    shutil.copytree(template, cache)
    target = _one(cache, pattern)
    corrupt(target)
    foreign_before = None if said != FOREIGN else target.lstat()

    got = _losses(KEPT if setting == "kept" else CHOSEN, cache, keep)

    torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-6)
    assert _notes(caplog) == [f"cache {target} {said}"]  # once, naming the file
    assert _temps(cache) == []
    if foreign_before is not None:  # left as it was: not ours
        after = target.lstat()
        assert (after.st_mode, after.st_ino, after.st_mtime_ns) == (
            foreign_before.st_mode,
            foreign_before.st_ino,
            foreign_before.st_mtime_ns,
        )
        assert not stat.S_ISREG(after.st_mode)
        return
    # rewritten: a file its manifest vouches for (a choice file of the right shape)
    if target.name == "kernels.json":
        assert select._decisions(json.loads(target.read_text()))
    elif not target.name.endswith(files.MANIFEST_SUFFIX):
        assert _vouched(target)
    if case in AGAIN:  # and the next run reads it back without a word
        caplog.clear()
        assert _losses(KEPT if setting == "kept" else CHOSEN, cache, keep) == got
        assert _notes(caplog) == []


def test_an_entry_left_without_its_manifest_is_recomputed_quietly(clean, keep, caplog, tmp_path):
    """Files a run wrote before its manifest (killed between them), or an older tessera's: computed
    again and kept with a manifest, with no note (nothing in them was found wrong)."""
    cache = tmp_path / "cache"
    shutil.copytree(clean["kept"][1], cache)
    for m in (cache / "norms").glob("*" + files.MANIFEST_SUFFIX):
        m.unlink()
    assert _losses(KEPT, cache, keep) == clean["kept"][0]
    assert _notes(caplog) == []
    assert list((cache / "norms").glob("*" + files.MANIFEST_SUFFIX))


def test_a_failed_write_leaves_no_temporary_and_the_run_trains(clean, keep, caplog, tmp_path):
    """No space left on the device while a cache file is written: the temporary is removed, the
    run trains as with a clean cache (it says it could not keep the structure), and nothing half
    written is trusted next time."""
    cache = tmp_path / "cache"
    cache.mkdir()
    shutil.copy(clean["chosen"][1] / "gemm.json", cache)  # this CPU's GEMM path, measured once

    def full(f, arr, *a, **k):
        f.write(b"\x93NUMPY partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    keep.setattr(np, "save", full)
    with pytest.warns(RuntimeWarning, match="could not keep"):
        got = _losses(CHOSEN, cache, keep)
    assert got == clean["chosen"][0]
    assert _temps(cache) == []
    assert not list(cache.rglob("*.npy"))  # nothing of a failed write
    assert not list(cache.rglob("norms/*" + files.MANIFEST_SUFFIX))  # and nothing vouched for


def test_a_foreign_file_is_never_opened_or_replaced(tmp_path, keep, caplog):
    """The primitive under every kind: a named pipe where a partition belongs is neither opened
    (no hang) nor replaced by the computed one, and is said once however often it is met."""
    from tessera.datasets import load

    g = load("synthetic:tiny")
    first = assign.partition(g, 3, "random", cache_dir=tmp_path)
    (path,) = (tmp_path / "partitions").glob("*.npy")
    _fifo(path)
    for _ in range(3):
        assert np.array_equal(assign.partition(g, 3, "random", cache_dir=tmp_path), first)
    assert stat.S_ISFIFO(path.lstat().st_mode)
    assert _notes(caplog) == [f"cache {path} {FOREIGN}"]
    assert _temps(tmp_path) == []


def test_file_digest_reads_a_file_not_a_pipe(tmp_path):
    p = tmp_path / "a.bin"
    p.write_bytes(b"x" * 100)
    size, sha = files.file_digest(p)
    assert size == 100 and len(sha) == 64
    assert files.file_digest(p) == (size, sha)
    p.write_bytes(b"x" * 99 + b"y")
    assert files.file_digest(p) != (size, sha)
    q = tmp_path / "pipe"
    os.mkfifo(q)
    with pytest.raises(OSError):
        files.file_digest(q)  # refused without blocking
    assert files.foreign(q) and files.foreign(tmp_path) and not files.foreign(p)
    assert not files.foreign(tmp_path / "absent") and files.foreign(p / "below-a-file")


def test_a_temporary_a_killed_writer_left_is_removed_when_the_cache_is_written_again(tmp_path, keep):
    from tessera.datasets import load

    g = load("synthetic:tiny")
    first = assign.partition(g, 2, "random", cache_dir=tmp_path)
    (path,) = (tmp_path / "partitions").glob("*.npy")
    old, fresh = (path.with_name(f".{path.name}.{tag}.tmp") for tag in ("0badcafe", "1234abcd"))
    for p in (old, fresh):
        p.write_bytes(b"\x93NUMPY half")
    os.utime(old, (0, 0))  # long ago: its writer is gone
    _truncate(path)  # damaged: written again
    assert np.array_equal(assign.partition(g, 2, "random", cache_dir=tmp_path), first)
    assert not old.exists() and fresh.exists()  # a temporary this new may be another writer's


@pytest.mark.parametrize("damage", ["fifo", "list", "garbage"])
def test_the_gemm_and_vertex_order_decisions_survive_a_damaged_or_foreign_file(tmp_path, monkeypatch, caplog, damage):
    """``gemm.json`` and an order decision (``orders/choice-*.json``): a named pipe is neither
    opened nor replaced, JSON of another shape or bytes that are not JSON are decided again and
    rewritten, each said once."""
    from tessera.backends import ordering
    from tessera.datasets import load
    from tessera.dense import gemm_path

    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    g = load("synthetic:tiny")
    order_path = ordering._decision_path(g, ordering.order_widths(16), "csr", None)
    gemm = gemm_path.cache_file()
    for path in (gemm, order_path):
        path.parent.mkdir(parents=True, exist_ok=True)
        if damage == "fifo":
            os.mkfifo(path)
        else:
            path.write_text("[1, 2]" if damage == "list" else "{not json")
    calls = []
    monkeypatch.setattr(ordering, "time_orders", lambda *a, **k: {m: {"agg_s": 1.0} for m in ("none", "rcm")})
    with caplog.at_level("WARNING", logger="tessera"):
        decided = gemm_path._kept_on_disk("k", ("a", "b"), lambda: calls.append(1) or "b")
        chose = ordering.choose_order(g, 16, "csr", candidates=("rcm",))
    assert decided == "b" and calls == [1] and chose == "none"
    note = FOREIGN if damage == "fifo" else JSON_SHAPE
    assert _notes(caplog) == [f"cache {p} {note}" for p in (gemm, order_path)]
    for path in (gemm, order_path):
        if damage == "fifo":
            assert stat.S_ISFIFO(path.lstat().st_mode)
        else:
            assert isinstance(json.loads(path.read_text()), dict)  # rewritten whole
    assert _temps(tmp_path) == []
