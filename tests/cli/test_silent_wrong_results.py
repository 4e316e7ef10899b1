"""Runs that would succeed with wrong results, silently (issue #48, class 1): each is either
refused in one ``tessera: error:`` line with exit status 2 and no run directory, or trains on
what the file means (the same losses as a clean run).

- split arrays are read by meaning: a 0/1 mask is a mask, an index list holds distinct whole
  vertex ids in range, and an index-named array the length of the graph holding only 0/1 is refused
  as ambiguous; fractional floats in any index array are refused, never truncated;
- an empty test split reports ``null`` and "no test split", never 0.0; an empty validation split
  is refused unless ``--patience 0`` (which keeps the last epoch's weights);
- part files own in-range vertex ids, each vertex in exactly one part (``parts.npy``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tessera.cli.main import main
from tessera.datasets import load_path
from tessera.errors import DatasetError
from tessera.graph.partition import load_part, write_parts

N = 90
TRAIN, VAL, TEST = np.arange(0, 30), np.arange(30, 60), np.arange(60, 90)
RUN = ["--epochs", "2", "--hidden", "8", "--no-progress", "--seed", "1"]


def write_npz(path: Path, *, float_index: bool = False, **split: np.ndarray) -> Path:
    """A ring of N vertices with seeded features and 3 classes, plus the ``split`` arrays;
    ``float_index`` stores the adjacency's index arrays as whole-number floats."""
    rng = np.random.default_rng(0)
    indices, indptr = (np.arange(N) + 1) % N, np.arange(N + 1)
    arrays = {
        "adj_data": np.ones(N, np.float32),
        "adj_indices": indices.astype(np.float64) if float_index else indices,
        "adj_indptr": indptr.astype(np.float64) if float_index else indptr,
        "adj_shape": np.array([N, N]),
        "attr_matrix": rng.standard_normal((N, 5)).astype(np.float32),
        "labels": np.arange(N) % 3,
        **split,
    }
    np.savez(path, **arrays)
    return path


def mask_of(idx: np.ndarray, dtype: type = bool) -> np.ndarray:
    m = np.zeros(N, dtype=dtype)
    m[idx] = 1
    return m


def clean(path: Path) -> Path:
    return write_npz(path, train_idx=TRAIN, val_idx=VAL, test_idx=TEST)


def refused(capsys, argv: list[str], out: Path) -> str:
    """Run ``argv``; assert one ``tessera: error:`` line, exit status 2 and no run directory."""
    code = main([*argv, "--out", str(out)])
    cap = capsys.readouterr()
    lines = cap.err.strip().splitlines()
    assert code == 2, (code, lines)
    assert len(lines) == 1 and lines[0].startswith("tessera: error: "), lines
    assert not out.exists(), sorted(p.name for p in out.iterdir())
    return lines[0]


def trained(capsys, dataset: Path, out: Path, *extra: str) -> tuple[dict, list[float], str]:
    """Train on ``dataset``; the result, the per-epoch training losses and the summary line."""
    code = main(["train", "--dataset", str(dataset), *RUN, *extra, "--out", str(out)])
    cap = capsys.readouterr()
    assert code == 0, cap.err
    result = json.loads((out / "result.json").read_text())
    losses = [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    return result, losses, cap.out.strip().splitlines()[-1]


# ------------------------------------------------------------------ 1. masks vs index lists


@pytest.mark.parametrize("dtype", [bool, np.uint8, np.int64, np.float32])
def test_a_0_1_train_mask_beside_index_lists_is_a_mask(tmp_path, capsys, dtype):
    path = write_npz(tmp_path / "g.npz", train_mask=mask_of(TRAIN, dtype), val_idx=VAL, test_idx=TEST)
    g = load_path(path)
    assert int(g.train_mask.sum()) == TRAIN.size and bool(g.train_mask[TRAIN].all())
    _, losses, _ = trained(capsys, path, tmp_path / "run")
    _, reference, _ = trained(capsys, clean(tmp_path / "clean.npz"), tmp_path / "clean")
    assert losses == reference


def test_an_index_named_0_1_array_of_graph_length_is_refused(tmp_path, capsys):
    path = write_npz(tmp_path / "g.npz", train_idx=mask_of(TRAIN, np.uint8), val_idx=VAL, test_idx=TEST)
    msg = refused(capsys, ["train", "--dataset", str(path), *RUN], tmp_path / "run")
    assert "train_idx" in msg and "may be a mask" in msg and "boolean" in msg and "*_mask" in msg


@pytest.mark.parametrize(
    "split, needle",
    [
        ({"train_mask": mask_of(TRAIN, np.uint8) * 2}, "mask train_mask holds 2"),  # neither 0 nor 1
        ({"train_mask": TRAIN}, "mask train_mask has shape (30,)"),  # ids under a mask's name
        ({"train_idx": TRAIN.astype(np.float64) + 0.5}, "entry 0 is 0.5"),  # fractional ids
        ({"train_idx": np.concatenate([TRAIN, TRAIN[:1]])}, "lists vertex 0 2 times"),  # duplicates
        ({"train_idx": np.append(TRAIN, N)}, f"vertex id {N}, outside [0, {N})"),
    ],
    ids=["mask-of-2s", "ids-named-mask", "fractional-ids", "duplicate-ids", "id-out-of-range"],
)
def test_split_arrays_of_unclear_meaning_are_refused(tmp_path, capsys, split, needle):
    arrays = {"train_idx": TRAIN, "val_idx": VAL, "test_idx": TEST}
    for key in split:
        arrays.pop(key.replace("_mask", "_idx"), None)
    path = write_npz(tmp_path / "g.npz", **arrays, **split)
    msg = refused(capsys, ["train", "--dataset", str(path), *RUN], tmp_path / "run")
    assert needle in msg, msg


@pytest.mark.parametrize("key", ["adj_indices", "adj_indptr", "attr_indices"])
def test_fractional_index_arrays_are_refused_not_truncated(tmp_path, capsys, key):
    path = clean(tmp_path / "g.npz")
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    if key == "attr_indices":  # the features as a sparse CSR matrix instead
        x = arrays.pop("attr_matrix")
        arrays.update(
            attr_data=x.ravel(),
            attr_indices=np.tile(np.arange(5), N).astype(np.float64),
            attr_indptr=np.arange(0, 5 * N + 1, 5),
            attr_shape=np.array([N, 5]),
        )
    arrays[key] = arrays[key].astype(np.float64)
    arrays[key][1] += 0.7  # 1.7 (or 2.7 for a row offset) must not become 1
    np.savez(path, **arrays)
    msg = refused(capsys, ["train", "--dataset", str(path), *RUN], tmp_path / "run")
    assert key in msg and "must be integers" in msg and "entry 1" in msg, msg


def test_whole_number_float_indices_train_as_integers(tmp_path, capsys):
    path = write_npz(
        tmp_path / "g.npz", float_index=True, train_idx=TRAIN * 1.0, val_idx=VAL * 1.0, test_idx=TEST * 1.0
    )
    _, losses, _ = trained(capsys, path, tmp_path / "run")
    _, reference, _ = trained(capsys, clean(tmp_path / "clean.npz"), tmp_path / "clean")
    assert losses == reference


# ------------------------------------------------------------------ 2. empty splits


def test_an_empty_test_split_reports_null_not_zero(tmp_path, capsys):
    path = write_npz(tmp_path / "g.npz", train_idx=TRAIN, val_idx=VAL, test_idx=np.zeros(0, np.int64))
    result, _, summary = trained(capsys, path, tmp_path / "run")
    assert result["test_acc"] is None and result["metric"] == "acc"
    assert "no test split" in summary and "test acc" not in summary, summary
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(r["test_acc"] is None for r in records)
    # the run resumes from its checkpoint (whose history holds the nulls) and goes on
    code = main(["train", "--dataset", str(path), *RUN[:1], "3", *RUN[2:], "--resume", "--out", str(tmp_path / "run")])
    assert code == 0, capsys.readouterr().err


def test_an_empty_multilabel_test_split_reports_null_rocauc(tmp_path, capsys):
    y = np.stack([np.arange(N) % 2, (np.arange(N) // 2) % 2], 1)
    path = write_npz(tmp_path / "g.npz", train_idx=TRAIN, val_idx=VAL, test_idx=np.zeros(0, np.int64))
    with np.load(path) as z:
        arrays = {k: z[k] for k in z.files}
    np.savez(path, **{**arrays, "labels": y})
    result, _, summary = trained(capsys, path, tmp_path / "run")
    assert result["metric"] == "rocauc" and result["test_rocauc"] is None
    assert "no test split" in summary, summary


def test_an_empty_validation_split_is_refused_unless_patience_0(tmp_path, capsys):
    path = write_npz(tmp_path / "g.npz", train_idx=TRAIN, val_idx=np.zeros(0, np.int64), test_idx=TEST)
    msg = refused(capsys, ["train", "--dataset", str(path), *RUN], tmp_path / "run")
    assert "validation split" in msg and "--patience 0" in msg, msg
    # with --patience 0 it trains every epoch and keeps the last epoch's weights
    result, losses, summary = trained(capsys, path, tmp_path / "ok", "--patience", "0")
    assert result["val_acc"] is None and result["best_epoch"] == 2 and len(losses) == 2
    assert result["test_acc"] is not None and "no validation split" in summary, summary


@pytest.mark.distributed
def test_a_distributed_run_refused_at_set_up_says_only_why(tmp_path, capfd):
    """Its ranks hold the generated split's announcement until set-up has passed: a refused run's
    whole stderr (the workers' included) is the one error line."""
    n = 40
    path = tmp_path / "iso.npz"  # isolated vertices and no split: the generated one has no validation vertices
    np.savez(
        path, adj_data=np.zeros(0, np.float32), adj_indices=np.zeros(0, np.int64), adj_indptr=np.zeros(n + 1, np.int64),
        adj_shape=np.array([n, n]), attr_matrix=np.ones((n, 4), np.float32), labels=np.arange(n) % 2,
    )  # fmt: skip
    argv = ["train", "--dataset", str(path), *RUN, "--nprocs", "2", "--partition", "range"]
    assert main([*argv, "--out", str(tmp_path / "run")]) == 2
    lines = capfd.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessera: error: ") and "--patience 0" in lines[0], lines
    assert not (tmp_path / "run").exists()
    # with --patience 0 the same ranks train (no exchange between isolated parts: nothing sent)
    assert main([*argv, "--patience", "0", "--out", str(tmp_path / "ok")]) == 0
    assert json.loads((tmp_path / "ok" / "result.json").read_text())["val_acc"] is None


# ------------------------------------------------------------------ 3. part files


def _parts(tmp_path: Path, name: str, assignment: np.ndarray) -> Path:
    return write_parts(load_path(clean(tmp_path / "g.npz")), assignment, tmp_path / name, method="range")


@pytest.mark.distributed  # its last case starts two workers
def test_part_files_own_each_vertex_once_and_in_range(tmp_path, capsys):
    half = (np.arange(N) >= N // 2).astype(np.int64)
    good = _parts(tmp_path, "good", half)
    for k in range(2):
        assert np.array_equal(load_part(good, k, expect_parts=2)["owned"], np.flatnonzero(half == k))
    # a part file cut from another assignment: part 0 also owns vertex 45, which parts.npy gives part 1
    moved = half.copy()
    moved[N // 2] = 0
    shared = _parts(tmp_path, "shared", half)
    (shared / "part-0.npz").write_bytes((_parts(tmp_path, "moved", moved) / "part-0.npz").read_bytes())
    with pytest.raises(DatasetError, match=r"part-0\.npz owns vertex 45, which parts\.npy gives part 1"):
        load_part(shared, 0)
    # ... or lacks a vertex: part 0 without vertex 0, which then no part trains
    lost = half.copy()
    lost[0] = 1
    uncovered = _parts(tmp_path, "uncovered", half)
    (uncovered / "part-0.npz").write_bytes((_parts(tmp_path, "lost", lost) / "part-0.npz").read_bytes())
    with pytest.raises(DatasetError, match=r"part-0\.npz owns no entry for vertex 0"):
        load_part(uncovered, 0)
    # without parts.npy ownership cannot be checked: refused, naming the file
    (good / "parts.npy").rename(tmp_path / "kept.npy")
    with pytest.raises(DatasetError, match=r"parts\.npy is missing"):
        load_part(good, 1)
    # an owned id out of range, end to end: one line from the launcher, exit 2, no run directory
    (tmp_path / "kept.npy").rename(good / "parts.npy")
    with np.load(good / "part-1.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["owned"] = arrays["owned"].copy()
    arrays["owned"][-1] = 10**6
    np.savez(good / "part-1.npz", **arrays)
    argv = ["train", "--parts-dir", str(good), "--nprocs", "2", "--epochs", "1", "--no-progress"]
    msg = refused(capsys, argv, tmp_path / "run")
    assert "part-1.npz" in msg and "owned holds 1000000, outside [0, 90)" in msg, msg
