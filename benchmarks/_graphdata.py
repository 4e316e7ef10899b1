"""The benchmark graph as plain ``.npy`` files, so every framework trains on the identical graph.

The parent writes the files once per graph with tessera (``dump``); each child, in whatever
virtual environment it runs (the DGL one has numpy < 2 and no numba), reads them back with
numpy alone (``load_arrays``). Arrays (all C-contiguous):

* ``indptr`` (N + 1,) int64 and ``indices`` (E,) int64: destination-major CSR, row ``i`` lists
  the in-neighbours (message sources) of vertex ``i``, exactly tessera's ``Graph`` layout.
* ``x`` (N, F) float32, ``y`` (N,) int64, ``train_mask`` (N,) bool.
* ``meta.json``: name, num_nodes, num_edges, num_features, num_classes, fingerprint.

    python benchmarks/_graphdata.py synthetic:arxiv /tmp/arxiv
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ARRAYS = ("indptr", "indices", "x", "y", "train_mask")


def dump(spec: str, out_dir: str | Path, seed: int = 0) -> dict[str, Any]:
    """Load ``spec`` with tessera (e.g. ``synthetic:arxiv``) and write its arrays to ``out_dir``."""
    from tessera.datasets import load  # imported here: children never need tessera

    t0 = time.perf_counter()
    g = load(spec, seed=seed)
    gen_s = time.perf_counter() - t0
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    arrays = {
        "indptr": g.indptr.numpy().astype(np.int64),
        "indices": g.indices.numpy().astype(np.int64),
        "x": g.x.numpy().astype(np.float32),
        "y": g.y.numpy().astype(np.int64),
        "train_mask": g.train_mask.numpy().astype(bool),
    }
    for k, a in arrays.items():
        np.save(out / f"{k}.npy", np.ascontiguousarray(a))
    meta = {
        "spec": spec,
        "name": g.name,
        "seed": seed,
        "num_nodes": int(g.num_nodes),
        "num_edges": int(g.num_edges),
        "num_features": int(g.num_features),
        "num_classes": int(g.num_classes),
        "num_train": int(arrays["train_mask"].sum()),
        "self_loops": int((arrays["indices"] == np.repeat(np.arange(g.num_nodes), np.diff(arrays["indptr"]))).sum()),
        "fingerprint": g.fingerprint(),
        "generate_s": round(gen_s, 2),
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=1))
    return meta


def load_arrays(data_dir: str | Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The arrays written by :func:`dump` and the metadata, read with numpy only."""
    d = Path(data_dir)
    arrays = {k: np.load(d / f"{k}.npy") for k in ARRAYS}
    meta = json.loads((d / "meta.json").read_text())
    return arrays, meta


def dst_of_edges(indptr: np.ndarray) -> np.ndarray:
    """The destination vertex of every CSR entry (int64), i.e. PyG's ``edge_index[1]``."""
    return np.repeat(np.arange(len(indptr) - 1, dtype=np.int64), np.diff(indptr))


if __name__ == "__main__":
    if len(sys.argv) not in (3, 4):
        sys.exit("usage: python benchmarks/_graphdata.py SPEC OUT_DIR [SEED]")
    print(json.dumps(dump(sys.argv[1], sys.argv[2], int(sys.argv[3]) if len(sys.argv) == 4 else 0)))
