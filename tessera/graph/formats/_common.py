"""Helpers shared by the format loaders: edge arrays to a Graph, labels, masks, .npy files."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessera.errors import DatasetError
from tessera.graph.formats._limits import check_npy_size, npy_header
from tessera.graph.graph import Graph, stratified_split

MASKS = ("train_mask", "val_mask", "test_mask")

log = logging.getLogger(__name__)
_deferred: ContextVar[list[tuple[str, tuple[Any, ...]]] | None] = ContextVar("tessera_deferred_logs", default=None)


@contextmanager
def announce_when_loaded() -> Iterator[None]:
    """Hold :func:`announce_split` messages until the block ends without an error (so a file that
    fails later in its loading, or a run refused at set-up, prints only its error), then log them;
    inside an enclosing block they are handed on to it."""
    outer = _deferred.get()
    held: list[tuple[str, tuple[Any, ...]]] = []
    token = _deferred.set(held)
    try:
        yield
    finally:
        _deferred.reset(token)
    if outer is not None:
        outer.extend(held)
        return
    for msg, args in held:
        log.info(msg, *args)


def check_edge_range(src: np.ndarray, dst: np.ndarray, num_nodes: int, source: str, bound: str = "") -> None:
    """Raise DatasetError naming the first edge whose endpoint is outside ``[0, num_nodes)``."""
    if src.size == 0:
        return
    lo = min(int(src.min()), int(dst.min()))
    hi = max(int(src.max()), int(dst.max()))
    if lo >= 0 and hi < num_nodes:
        return
    bad = np.flatnonzero((src < 0) | (src >= num_nodes) | (dst < 0) | (dst >= num_nodes))[0]
    s, d = int(src[bad]), int(dst[bad])
    v = s if not 0 <= s < num_nodes else d
    why = f" ({bound})" if bound else ""
    raise DatasetError(f"{source}: edge {bad} ({s} -> {d}) references vertex {v}, out of range [0, {num_nodes}){why}")


def edges_to_graph(
    src: Any,
    dst: Any,
    num_nodes: int,
    *,
    source: str,
    coalesce: bool = False,
    undirected: bool = False,
    drop_self_loops: bool = False,
    bound: str = "",
    **node_data: Any,
) -> Graph:
    """Build a Graph from source/destination arrays, optionally without self loops, symmetrised
    (which also removes duplicates, as PyG's ``to_undirected``) or just deduplicated."""
    src = np.asarray(src, dtype=np.int64).ravel()
    dst = np.asarray(dst, dtype=np.int64).ravel()
    n = int(num_nodes)
    check_edge_range(src, dst, n, source, bound)
    if drop_self_loops:
        keep = src != dst
        src, dst = src[keep], dst[keep]
        del keep
    # One int64 key per edge, destination-major, is the whole working set: sorted in place, made
    # unique by one mask, its row pointer found by binary search and its remainder taken in place
    # (a graph file's edges, three copies of them at most, never src/dst/key/row/column side by side).
    m = max(n, 1)
    e = src.size
    key = np.empty(2 * e if undirected else e, dtype=np.int64)
    np.multiply(dst, m, out=key[:e])
    key[:e] += src
    if undirected:
        np.multiply(src, m, out=key[e:])
        key[e:] += dst
    del src, dst
    key.sort()
    if (coalesce or undirected) and key.size > 1:
        fresh = np.empty(key.size, dtype=bool)
        fresh[0] = True
        np.not_equal(key[1:], key[:-1], out=fresh[1:])
        if not fresh.all():
            key = key[fresh]
        del fresh
    indptr = np.searchsorted(key, np.arange(n + 1, dtype=np.int64) * m)
    np.remainder(key, m, out=key)
    return Graph.from_csr(torch.from_numpy(indptr), torch.from_numpy(key), n, **node_data)


def labels_from_array(arr: np.ndarray, source: str) -> np.ndarray:
    """Integer labels as int64; in float input NaN (an unlabelled vertex) becomes -1. An ``N x C``
    array (C > 1) holds multi-label targets (C binary tasks, as ogbn-proteins): see
    :func:`multilabel_from_array`."""
    arr = np.asarray(arr)
    if arr.ndim == 2 and arr.shape[1] == 1:
        arr = arr[:, 0]
    if arr.ndim == 2:
        return multilabel_from_array(arr, source)
    if arr.ndim != 1:
        raise DatasetError(
            f"{source}: labels have shape {arr.shape}; expected one label per vertex or an N x C matrix of 0/1 targets"
        )
    if arr.dtype.kind in "iu":
        y = arr.astype(np.int64)
    elif arr.dtype.kind == "f":
        nan = np.isnan(arr)
        filled = np.where(nan, -1.0, arr)
        frac = filled != np.floor(filled)
        if frac.any():
            i = int(np.flatnonzero(frac)[0])
            raise DatasetError(f"{source}: label of vertex {i} is {arr[i]!r}, not an integer class id")
        y = filled.astype(np.int64)
    else:
        raise DatasetError(f"{source}: labels have dtype {arr.dtype}; expected integers")
    return y


def multilabel_from_array(arr: np.ndarray, source: str) -> np.ndarray:
    """Multi-label targets ``N x C`` (bool, integer or float) as int64 0/1, an unlabelled entry
    (NaN, or -1 in integer input, as OGB and single labels mark them) as -1; any other value is
    refused in one line."""
    arr = np.asarray(arr)
    if arr.ndim != 2 or arr.shape[1] < 1:
        raise DatasetError(f"{source}: multi-label targets have shape {arr.shape}; expected N x C with C >= 1")
    if arr.dtype.kind == "b":
        return arr.astype(np.int64)
    if arr.dtype.kind == "f":
        filled = np.where(np.isnan(arr), -1.0, arr)
    elif arr.dtype.kind in "iu":
        filled = arr
    else:
        raise DatasetError(f"{source}: multi-label targets have dtype {arr.dtype}; expected 0/1 numbers or booleans")
    bad = (filled != 0) & (filled != 1) & (filled != -1)
    if bad.any():
        i, j = (int(v) for v in np.argwhere(bad)[0])
        raise DatasetError(
            f"{source}: multi-label target of vertex {i}, task {j} is {arr[i, j].item()!r}; "
            "each target must be 0 or 1 (NaN: unlabelled)"
        )
    return filled.astype(np.int64)


def index_mask(idx: Any, num_nodes: int, source: str) -> torch.Tensor:
    """Boolean mask of the vertex ids in ``idx``, each checked to lie in ``[0, num_nodes)``."""
    idx = np.asarray(idx).ravel()
    if idx.dtype.kind not in "iu":
        if idx.dtype.kind != "f" or (idx.size and not np.all(idx == np.floor(idx))):
            raise DatasetError(f"{source}: split indices must be integers, got {idx.dtype}")
    idx = idx.astype(np.int64)
    if idx.size and (idx.min() < 0 or idx.max() >= num_nodes):
        bad = int(idx[(idx < 0) | (idx >= num_nodes)][0])
        raise DatasetError(f"{source}: split index {bad} outside [0, {num_nodes})")
    mask = torch.zeros(num_nodes, dtype=torch.bool)
    mask[torch.from_numpy(idx)] = True
    return mask


def integer_array(arr: np.ndarray, source: str, what: str) -> np.ndarray:
    """``arr`` as int64 when it holds integers: an integer array, or a float array whose values are
    all whole numbers (12.0); a fractional (12.7), NaN or infinite value, or any other dtype, is
    refused naming the first offending entry instead of being truncated."""
    arr = np.asarray(arr)
    if arr.dtype.kind in "iu":
        return arr.astype(np.int64)
    if arr.dtype.kind != "f":
        raise DatasetError(f"{source}: {what} must be integers, got a {arr.dtype} array")
    flat = arr.ravel()
    bad = ~np.isfinite(flat)
    bad[~bad] = flat[~bad] != np.floor(flat[~bad])
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DatasetError(
            f"{source}: {what} must be integers, but entry {i} is {flat[i].item()!r} (store them as an integer array)"
        )
    if flat.size and (flat.min() < np.iinfo(np.int64).min or flat.max() >= 2.0**63):
        raise DatasetError(f"{source}: {what} hold a value beyond the int64 range")
    return arr.astype(np.int64)


def _says_mask(key: str) -> bool:
    return key.endswith("_mask") or key.startswith("mask_")


def split_mask(arr: Any, num_nodes: int, key: str, source: str, *, ids_only: bool = False) -> torch.Tensor:
    """The boolean mask that the stored split array ``key`` means, deciding mask or index list by
    meaning, not by dtype alone: a boolean array is a mask (one entry per vertex); a numeric array
    named ``*_mask`` is a mask when it has one 0/1 entry per vertex and is refused otherwise; any
    other numeric array is a list of vertex ids, which must be whole numbers in
    ``[0, num_nodes)`` without duplicates. A list of ids the length of the graph holding only 0s
    and 1s (a mask stored under an index name) is ambiguous and refused, naming the fix, unless
    ``ids_only`` (a format whose split files only ever list ids, as OGB's)."""
    arr = np.asarray(arr)
    if arr.ndim == 2 and arr.shape[1] == 1:  # OGB-style (k, 1) columns
        arr = arr[:, 0]
    n = int(num_nodes)
    fix_mask = f"store a mask as a boolean array of {n} entries (or 0/1 numbers named *_mask), vertex ids as *_idx"
    if arr.dtype.kind == "b" or _says_mask(key):
        if arr.dtype.kind not in "biuf":
            raise DatasetError(f"{source}: {key} is a {arr.dtype} array; {fix_mask}")
        if arr.shape != (n,):
            raise DatasetError(f"{source}: mask {key} has shape {tuple(arr.shape)}, expected ({n},); {fix_mask}")
        if arr.dtype.kind != "b":
            bad = (arr != 0) & (arr != 1)
            if bad.any():
                i = int(np.flatnonzero(bad)[0])
                raise DatasetError(
                    f"{source}: mask {key} holds {arr[i].item()!r} at vertex {i}, not 0 or 1; {fix_mask}"
                )
        return torch.from_numpy(np.ascontiguousarray(arr != 0))
    if arr.ndim > 1:
        raise DatasetError(f"{source}: {key} has shape {tuple(arr.shape)}; a list of vertex ids is 1-D")
    idx = integer_array(arr, source, f"the vertex ids in {key}")
    if not ids_only and n > 0 and idx.size == n and not ((idx != 0) & (idx != 1)).any():
        raise DatasetError(
            f"{source}: {key} has one 0/1 entry per vertex, so it may be a mask rather than vertex ids; "
            f"save it as a boolean array (np.bool_) or under a *_mask name if it is a mask, or list distinct vertex ids"
        )
    if idx.size and (idx.min() < 0 or idx.max() >= n):
        bad_id = int(idx[(idx < 0) | (idx >= n)][0])
        raise DatasetError(f"{source}: {key} holds vertex id {bad_id}, outside [0, {n})")
    mask = torch.zeros(n, dtype=torch.bool)
    mask[torch.from_numpy(idx)] = True
    if int(mask.sum()) != idx.size:
        counts = np.bincount(idx, minlength=n)
        dup = int(np.flatnonzero(counts > 1)[0])
        raise DatasetError(
            f"{source}: {key} lists vertex {dup} {int(counts[dup])} times; a split lists each vertex id once"
        )
    return mask


def labelled_only(masks: dict[str, torch.Tensor], y: torch.Tensor) -> tuple[dict[str, torch.Tensor], int]:
    """Remove unlabelled vertices (label -1; multi-label: every target -1) from each mask; also
    return how many were removed."""
    unlabelled = (y < 0).all(1) if y.dim() == 2 else y < 0
    dropped = 0
    out = {}
    for k, m in masks.items():
        bad = m & unlabelled
        dropped += int(bad.sum())
        out[k] = m & ~bad
    return out, dropped


#: the seeded split of multi-label vertices when a file carries none: train, validation (rest: test)
MULTILABEL_SPLIT = (0.6, 0.2)


def default_split(y: torch.Tensor, num_classes: int, seed: int) -> dict[str, torch.Tensor]:
    """The seeded 20-train / 30-val per-class split used when a file carries no split; of
    multi-label targets (``N x C``), a seeded random :data:`MULTILABEL_SPLIT` of the labelled vertices."""
    if y.dim() == 2:
        return _multilabel_split(y, seed)
    if not bool((y >= 0).any()):
        return {}
    return dict(zip(MASKS, stratified_split(y, num_classes, 20, 30, seed), strict=True))


def _multilabel_split(y: torch.Tensor, seed: int) -> dict[str, torch.Tensor]:
    labelled = np.flatnonzero((y >= 0).any(1).numpy())
    if labelled.size == 0:
        return {}
    order = np.random.default_rng(seed).permutation(labelled)
    n_train = max(1, round(MULTILABEL_SPLIT[0] * order.size))
    n_val = round(MULTILABEL_SPLIT[1] * order.size)
    out = {}
    for k, part in zip(
        MASKS, (order[:n_train], order[n_train : n_train + n_val], order[n_train + n_val :]), strict=True
    ):
        m = torch.zeros(y.shape[0], dtype=torch.bool)
        m[torch.from_numpy(part)] = True
        out[k] = m
    return out


def announce_split(split: dict[str, torch.Tensor], seed: int, source: str, multilabel: bool = False) -> None:
    """Log (INFO, on the ``tessera`` logger the CLI prints to stderr) that ``source`` had no split
    and got the seeded :func:`default_split` ``split``."""
    if not split:
        return
    sizes = " / ".join(str(int(split[k].sum())) for k in MASKS)
    if multilabel:
        train, val = (round(100 * f) for f in MULTILABEL_SPLIT)
        msg = (
            "no split given for the multi-label targets in %s: using a seeded random one (seed %d) of "
            f"{train}%% training and {val}%% validation vertices, the rest for testing (train / val / test: %s)"
        )
    else:
        msg = (
            "no split given for the labels in %s: using a seeded one (seed %d) of 20 training and 30 validation "
            "vertices per class, the rest for testing (train / val / test: %s)"
        )
    held = _deferred.get()
    if held is not None:
        held.append((msg, (source, seed, sizes)))
    else:
        log.info(msg, source, seed, sizes)


def label_data(
    y: np.ndarray, masks: dict[str, torch.Tensor] | None, seed: int, source: str, declared: int | None = None
) -> dict[str, Any]:
    """Node data of labels ``y``: ``y``, ``num_classes`` (see :func:`check_classes`; of
    multi-label targets ``N x C``, the C tasks) and the split, either the stored ``masks`` without
    unlabelled vertices or, where ``masks`` is None, the seeded :func:`default_split`."""
    if y.ndim == 2:
        c = int(y.shape[1])
        if declared is not None and declared != c:
            raise DatasetError(
                f"{source}: the file names {declared} classes but its multi-label targets have {c} tasks"
            )
    else:
        c = check_classes(y, source, declared)
    yt = torch.from_numpy(y)
    if masks is not None:
        split = labelled_only(masks, yt)[0]
    else:
        split = default_split(yt, c, seed)
        announce_split(split, seed, source, multilabel=y.ndim == 2)
    return {"y": yt, "num_classes": c, **split}


def check_classes(y: np.ndarray, source: str, declared: int | None = None) -> int:
    """The number of classes of labels ``y`` (-1 marks an unlabelled vertex): ``declared`` where the
    file names its classes, else one more than the largest label, which then needs at least half of
    its classes to occur, so a stray label (100 among classes 0..6) is refused instead of training
    a 101-class model."""
    bad = np.flatnonzero(y < -1)
    if bad.size:
        raise DatasetError(
            f"{source}: label of vertex {bad[0]} is {y[bad[0]]}; labels are class ids >= 0 (-1: unlabelled)"
        )
    lab = y[y >= 0]
    if declared is not None:
        if lab.size and int(lab.max()) >= declared:
            i = int(np.flatnonzero(y >= declared)[0])
            raise DatasetError(f"{source}: label of vertex {i} is {y[i]} but the file names only {declared} classes")
        return declared
    if lab.size == 0:
        return 0
    c = int(lab.max()) + 1
    # More classes than twice the labelled vertices cannot have half of them used; that check
    # comes first so that bincount never allocates for a stray huge label.
    if c > 2 * lab.size or c > 2 * np.count_nonzero(np.bincount(lab, minlength=c)):
        used = np.unique(lab).size
        i = int(np.argmax(y))
        raise DatasetError(
            f"{source}: label {y[i]} of vertex {i} implies {c:,} classes but only {used:,} distinct labels occur; "
            "class ids must be 0..C-1 with at least half of the C classes used (relabel the classes densely)"
        )
    return c


def load_npy(path: Path, what: str) -> np.ndarray:
    """``np.load`` with ``allow_pickle=False`` after checking that the header's size fits the
    file; every failure becomes a DatasetError."""
    try:
        with open(path, "rb") as f:
            shape, _, nbytes = npy_header(f, f"{what} file {path}")
            check_npy_size(nbytes, os.fstat(f.fileno()).st_size - f.tell(), f"{what} file {path}", shape)
        return np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError) as e:
        raise DatasetError(f"cannot read {what} from {path}: {e}") from e
