"""gnn-benchmark / CitationFull ``.npz`` graphs (scipy CSR arrays stored by key)."""

from __future__ import annotations

import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessera.errors import DatasetError
from tessera.graph.csr import rows_of
from tessera.graph.formats._common import (
    edges_to_graph,
    integer_array,
    label_data,
    labels_from_array,
    split_mask,
)
from tessera.graph.formats._limits import check_npy_size, npy_header, require_memory
from tessera.graph.graph import Graph

# Accepted spellings of a stored split, per mask: index arrays first, then boolean masks.
_SPLIT_KEYS = {
    "train_mask": ("train_idx", "idx_train", "train_mask"),
    "val_mask": ("val_idx", "valid_idx", "idx_val", "val_mask", "valid_mask"),
    "test_mask": ("test_idx", "idx_test", "test_mask"),
}


def _member_dtype(f: Any, key: str, path: Path) -> np.dtype | None:
    """The dtype of array ``key`` (None for a member that is not an array), after checking that its
    header's size is backed by the member's stored bytes, so that reading never allocates more."""
    if key not in f.files:
        raise DatasetError(f"{path} has no array {key!r} (keys: {', '.join(sorted(f.files))})")
    name = key + ".npy" if key + ".npy" in f.zip.namelist() else key
    info, source = f.zip.getinfo(name), f"{path} ({key})"
    if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        raise DatasetError(
            f"{source} uses zip compression method {info.compress_type}; np.savez writes stored or deflated members"
        )
    try:
        with f.zip.open(name) as m:
            if m.read(len(np.lib.format.MAGIC_PREFIX)) != np.lib.format.MAGIC_PREFIX:
                return None
            m.seek(0)
            shape, dtype, nbytes = npy_header(m, source)
    except (OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
        raise DatasetError(f"cannot read {key!r} from {path}: {e}") from e
    stored = min(info.compress_size, path.stat().st_size)
    check_npy_size(nbytes, stored, source, shape, expands=info.compress_type == zipfile.ZIP_DEFLATED)
    return dtype


def _get(f: Any, key: str, path: Path) -> np.ndarray:
    _member_dtype(f, key, path)
    try:
        return np.asarray(f[key])
    except (ValueError, OSError, EOFError, zipfile.BadZipFile) as e:
        # Object arrays need pickle, which stays disabled: np.load raises ValueError for them.
        raise DatasetError(f"cannot read {key!r} from {path}: {e}") from e


def _csr(f: Any, prefix: str, path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray, tuple[int, int]]:
    data, indices, indptr = (_get(f, f"{prefix}_{k}", path) for k in ("data", "indices", "indptr"))
    raw_shape = _get(f, f"{prefix}_shape", path).ravel()
    if raw_shape.dtype.kind not in "iu" or raw_shape.size != 2 or (raw_shape < 0).any():
        raise DatasetError(f"{path}: {prefix}_shape is {raw_shape.tolist()}, expected two non-negative integers")
    shape = (int(raw_shape[0]), int(raw_shape[1]))
    # Whole-number floats (12.0) are read as integers; a fractional one is refused, never truncated.
    indices = integer_array(indices, str(path), f"{prefix}_indices (column ids)")
    indptr = integer_array(indptr, str(path), f"{prefix}_indptr (row offsets)")
    if indptr.ndim != 1 or indptr.size != shape[0] + 1 or indices.size != data.size:
        raise DatasetError(f"{path}: {prefix}_* arrays do not form a CSR matrix of shape {shape}")
    if indptr.size and (indptr[0] != 0 or indptr[-1] != indices.size or np.any(np.diff(indptr) < 0)):
        raise DatasetError(f"{path}: {prefix}_indptr is not a valid CSR row pointer")
    if indices.size and (indices.min() < 0 or indices.max() >= shape[1]):
        raise DatasetError(f"{path}: {prefix}_indices has a column outside [0, {shape[1]})")
    return data, indices, indptr, shape


def _features(f: Any, path: Path, n: int) -> np.ndarray | None:
    if "attr_data" in f.files:
        import scipy.sparse as sp

        data, indices, indptr, shape = _csr(f, "attr", path)
        if data.dtype.kind not in "biuf":
            raise DatasetError(f"{path}: attr_data is a {data.dtype} array, expected numbers")
        require_memory(
            shape[0] * shape[1] * 4, f"the dense {shape[0]:,} x {shape[1]:,} feature matrix (attr_shape)", str(path)
        )
        m = sp.csr_matrix((data, indices, indptr), shape=shape)
        del data, indices, indptr
        if m.has_canonical_format:  # no duplicate entries: each dense value is one stored value
            # PyG's parse_npz binarises bag-of-words counts (x[x > 0] = 1): done on the stored
            # values, so the dense matrix is written once, in float32, with no mask beside it
            m.data = m.data.astype(np.float32, copy=False)  # the file's array: ours to change
            m.data[m.data > 0] = 1
            x = m.toarray()
        else:  # duplicates add up first, in the file's own precision, as PyG's todense does
            x = m.toarray().astype(np.float32, copy=False)
            x[x > 0] = 1
    elif "attr_matrix" in f.files:
        x = _get(f, "attr_matrix", path)
        if x.ndim != 2 or x.dtype.kind not in "biuf":
            raise DatasetError(f"{path}: attr_matrix is a {x.dtype} array of shape {x.shape}, expected numeric 2-D")
        x = x.astype(np.float32, copy=False)
    else:
        return None
    if x.shape[0] != n:
        raise DatasetError(f"{path}: features have {x.shape[0]} rows but the adjacency has {n}")
    return x


def _declared_classes(f: Any, path: Path) -> int | None:
    """How many classes ``class_names`` lists, when the file has it as a plain string array (an
    object array would need pickle, so it is left unread)."""
    if "class_names" not in f.files:
        return None
    dtype = _member_dtype(f, "class_names", path)
    if dtype is None or dtype.hasobject:
        return None
    names = _get(f, "class_names", path)
    if names.ndim != 1:
        raise DatasetError(f"{path}: class_names has shape {names.shape}, expected one name per class")
    return int(names.size)


def load_npz(path: str | Path, *, seed: int = 0, undirected: bool = True, name: str | None = None) -> Graph:
    """Load a gnn-benchmark ``.npz`` the way PyG's ``read_npz`` does (self loops dropped, made
    undirected); the stored split if any, else the seeded 20/30-per-class split."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            magic = fh.read(len(np.lib.format.MAGIC_PREFIX))
        if magic == np.lib.format.MAGIC_PREFIX:
            raise DatasetError(f"{path} holds a single array, not an .npz archive of named arrays")
        f = np.load(path, allow_pickle=False)
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as e:
        raise DatasetError(f"cannot read {path} as .npz: {e}") from e
    with f:
        _, cols, indptr, shape = _csr(f, "adj", path)
        n = shape[0]
        if shape[0] != shape[1]:
            raise DatasetError(f"{path}: adjacency has shape {shape}, expected a square matrix")
        x = _features(f, path, n)
        node_data: dict = {"name": name or path.stem}
        if x is not None:
            node_data["x"] = torch.from_numpy(x)
        if "labels" in f.files:
            y = labels_from_array(_get(f, "labels", path), f"{path} (labels)")
            if y.shape[0] != n:
                raise DatasetError(f"{path}: {y.shape[0]} labels for {n} vertices")
            masks = {}
            for mask, keys in _SPLIT_KEYS.items():
                key = next((k for k in keys if k in f.files), None)
                if key is not None:
                    masks[mask] = split_mask(_get(f, key, path), n, key, str(path))
            node_data.update(label_data(y, masks or None, seed, f"{path} (labels)", _declared_classes(f, path)))
        elif any(k in f.files for keys in _SPLIT_KEYS.values() for k in keys):
            raise DatasetError(f"{path} has a split but no labels")
    return edges_to_graph(
        rows_of(indptr), cols, n, source=str(path), undirected=undirected, drop_self_loops=True, **node_data
    )
