"""Hostile inputs (issue #15): every loader, config path and flag refuses them with exit status 2
and exactly one ``tessera: error:`` line on stderr, creates no file, allocates nothing beyond a
small bound, and never runs a pickle's payload.

All cases run in ONE subprocess (``python tests/test_hostile_inputs.py WORKDIR PLANETOID``): it
builds each case's files, imports tessera once, caps its address space at what it already maps
plus :data:`HEADROOM` (so a 16 GiB or 800 GB allocation attempt fails the case with a MemoryError
instead of slipping through lazily mapped memory), calls ``tessera.cli.main.main(argv)`` per case
with stderr captured, and writes the outcomes as JSON; the tests read them. Two end-to-end runs of
``python -m tessera`` cover the real exit path.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import json
import os
import pickle
import signal
import subprocess
import sys
import time
import traceback
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.distributed  # starts worker processes

REPO = Path(__file__).resolve().parents[2]
PLANETOID = Path("/nonexistent")  # the real Planetoid folder; set by run_all in the runner
HEADROOM = 768 << 20  # bytes the runner may map beyond what importing tessera mapped
HANG_S = 60  # a case still running after this long is recorded as a hang (each takes well under 1 s)

# ------------------------------------------------------------------ case registry
# id -> (build(case_dir) -> argv, needle in the error line, expected exit status)
CASES: dict[str, tuple[Callable[[Path], list[str]], str, int]] = {}


def case(needle: str, code: int = 2) -> Callable:
    """Register a case builder under its function name (``needle``: text the error line holds)."""

    def register(build: Callable[[Path], list[str]]) -> Callable[[Path], list[str]]:
        CASES[build.__name__] = (build, needle, code)
        return build

    return register


class _Exploit:
    """Pickles as ``os.system("touch <sentinel>")``: unpickling it would create the sentinel."""

    def __init__(self, sentinel: Path):
        self.sentinel = str(sentinel)

    def __reduce__(self):
        return (os.system, (f"touch {self.sentinel}",))


def sentinel(d: Path) -> Path:
    return d / "PAYLOAD_RAN"


def out(d: Path) -> str:
    return str(d / "out")


TINY = ["--dataset", "synthetic:tiny", "--epochs", "1", "--no-progress"]

# ------------------------------------------------------------------ dataset builders


def planetoid(d: Path, **replace: bytes) -> str:
    """A Cora directory in ``d/cora``: links to the real files, except those in ``replace``."""
    folder = d / "cora"
    folder.mkdir()
    for f in PLANETOID.glob("ind.cora.*"):
        part = f.name[len("ind.cora.") :]
        target = folder / f.name
        if part.replace(".", "_") in replace:
            target.write_bytes(replace[part.replace(".", "_")])
        else:
            target.symlink_to(f)
    return str(folder)


def cora_test_index(last: str) -> bytes:
    lines = (PLANETOID / "ind.cora.test.index").read_text().split()
    return ("\n".join(lines[:-1] + [last]) + "\n").encode()


def write_npz(path: Path, n: int = 60, labels: np.ndarray | None = None, **extra: np.ndarray) -> str:
    """A gnn-benchmark style .npz: a ring of ``n`` vertices, 3 dense features, 3 balanced classes."""
    src = np.arange(n)
    indptr = np.arange(n + 1)
    arrays = {
        "adj_data": np.ones(n, np.float32),
        "adj_indices": (src + 1) % n,
        "adj_indptr": indptr,
        "adj_shape": np.array([n, n]),
        "attr_matrix": np.ones((n, 3), np.float32),
        "labels": np.arange(n) % 3 if labels is None else labels,
    }
    arrays.update(extra)
    np.savez(path, **arrays)
    return str(path)


def npz_replace_member(path: Path, key: str, payload: bytes) -> None:
    """Rewrite one member of an .npz with raw ``payload`` bytes (a crafted .npy)."""
    with zipfile.ZipFile(path) as z:
        members = {name: z.read(name) for name in z.namelist()}
    members[f"{key}.npy"] = payload
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


def npy_header_only(shape: tuple[int, ...], dtype: str = "<f4") -> bytes:
    """A .npy whose header declares ``shape`` but which carries 16 bytes of data."""
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, {"descr": dtype, "fortran_order": False, "shape": shape})
    return buf.getvalue() + b"\0" * 16


def edgelist(d: Path, text: str, features: bool = True, labels: np.ndarray | None = None) -> str:
    path = d / "g.txt"
    path.write_text(text)
    n = 4
    if features:
        np.save(d / "g.features.npy", np.ones((n, 2), np.float32))
    if labels is not None:
        np.save(d / "g.labels.npy", labels)
    return str(path)


def gz(path: Path, rows: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(("\n".join(rows) + "\n").encode()))


def ogb(d: Path, labels: list[str] | None = None, count: str | None = None, feat: bool = True, splits=()) -> str:
    root = d / "ogbn-toy"
    raw = root / "raw"
    gz(raw / "edge.csv.gz", ["0,1", "1,2", "2,3", "3,0"])
    if feat:
        gz(raw / "node-feat.csv.gz", ["1.0,0.5"] * 4)
    if labels is not None:
        gz(raw / "node-label.csv.gz", labels)
    if count is not None:
        gz(raw / "num-node-list.csv.gz", [count])
    for s in splits:
        gz(root / "split" / s / "train.csv.gz", ["0", "1"])
        gz(root / "split" / s / "valid.csv.gz", ["2"])
        gz(root / "split" / s / "test.csv.gz", ["3"])
    return str(root)


def toml(d: Path, text: str | bytes) -> str:
    path = d / "run.toml"
    path.write_bytes(text.encode() if isinstance(text, str) else text)
    return str(path)


# ------------------------------------------------------------------ item 2: labels versus classes


@case("implies 1,000,000,001 classes")
def npz_label_1e9(d):
    y = np.arange(60) % 3
    y[7] = 10**9
    return ["train", "--dataset", write_npz(d / "g.npz", labels=y), "--out", out(d)]


@case("implies 101 classes but only 8 distinct labels")
def npz_label_100_among_7(d):
    y = np.arange(70) % 7
    y[3] = 100
    return ["train", "--dataset", write_npz(d / "g.npz", n=70, labels=y), "--out", out(d)]


@case("names only 3 classes")
def npz_label_beyond_class_names(d):
    y = np.arange(60) % 4
    return ["info", "--dataset", write_npz(d / "g.npz", labels=y, class_names=np.array(["a", "b", "c"]))]


@case("labels are class ids")
def npz_label_below_minus_one(d):
    y = np.arange(60) % 3
    y[5] = -7
    return ["info", "--dataset", write_npz(d / "g.npz", labels=y)]


@case("implies 1,000,000,001 classes")
def edgelist_label_1e9(d):
    return ["info", "--dataset", edgelist(d, "0 1\n1 2\n2 3\n", labels=np.array([0, 1, 10**9, 1]))]


@case("implies 1,000,000,001 classes")
def ogb_label_1e9(d):
    return ["info", "--dataset", ogb(d, labels=["0", "1", "1000000000", "1"])]


@case("multi-label target of vertex 5, task 1 is 2")
def npz_multilabel_value_2(d):
    y = (np.arange(60 * 3).reshape(60, 3) % 2).astype(np.int64)
    y[5, 1] = 2
    return ["train", "--dataset", write_npz(d / "g.npz", labels=y), "--out", out(d)]


@case("multi-label target of vertex 2, task 0 is 0.5")
def ogb_multilabel_fraction(d):
    return ["info", "--dataset", ogb(d, labels=["0,1", "1,0", "0.5,1", "1,1"])]


# ------------------------------------------------------------------ item 3: sizes the file cannot justify


@case("test ids run 1708..3000000")
def planetoid_test_index_3e6(d):
    return ["train", "--dataset", planetoid(d, test_index=cora_test_index("3000000")), "--out", out(d)]


@case("test ids run 1708..4000000000")
def planetoid_test_index_4e9(d):
    return ["info", "--dataset", planetoid(d, test_index=cora_test_index("4000000000"))]


@case("test ids run -1..")
def planetoid_test_index_negative(d):
    return ["info", "--dataset", planetoid(d, test_index=cora_test_index("-1"))]


@case("within int64's range")
def planetoid_test_index_beyond_int64(d):
    return ["info", "--dataset", planetoid(d, test_index=cora_test_index("99999999999999999999"))]


@case("would need")
def planetoid_sparse_features_of_huge_width(d):
    import scipy.sparse as sp

    def wide(part: str) -> bytes:
        m = pickle.loads((PLANETOID / f"ind.cora.{part}").read_bytes(), encoding="latin1")
        return pickle.dumps(sp.csr_matrix((m.data, m.indices, m.indptr), shape=(m.shape[0], 10**9)), protocol=2)

    return ["info", "--dataset", planetoid(d, x=wide("x"), tx=wide("tx"), allx=wide("allx"))]


@case("lists shared between vertices are refused")
def planetoid_graph_with_shared_lists(d):
    shared = list(range(2708))
    return ["info", "--dataset", planetoid(d, graph=pickle.dumps({i: shared for i in range(2708)}, protocol=2))]


@case("the matrix shapes disagree")
def planetoid_x_of_wrong_width(d):
    return ["info", "--dataset", planetoid(d, x=pickle.dumps(np.zeros((140, 5), np.float32), protocol=2))]


@case("at most max(2 x edges, 2^20)")
def edgelist_id_1e11_without_features(d):
    return ["train", "--dataset", edgelist(d, "0 99999999999\n", features=False), "--out", out(d)]


@case("within int64's range")
def edgelist_id_beyond_int64(d):
    return ["info", "--dataset", edgelist(d, "0 99999999999999999999\n", features=False)]


@case("header claims an array of shape (10000000000, 4)")
def edgelist_features_header_lies(d):
    path = edgelist(d, "0 1\n", features=False)
    (d / "g.features.npy").write_bytes(npy_header_only((10**10, 4)))
    return ["info", "--dataset", path]


@case("at most max(2 x edges, 2^20)")
def ogb_declared_node_count_1e12(d):
    return ["info", "--dataset", ogb(d, count="1000000000000", feat=False)]


@case("decompresses to more than")
def ogb_gzip_bomb(d):
    root = Path(ogb(d))
    member = gzip.compress(b"\0" * (64 << 20), compresslevel=1)
    (root / "raw" / "node-feat.csv.gz").write_bytes(member * 12)  # 768 MiB of zeros
    return ["info", "--dataset", str(root)]


@case("header claims an array of shape (10000000000,)")
def npz_member_header_lies(d):
    path = d / "g.npz"
    write_npz(path)
    npz_replace_member(path, "labels", npy_header_only((10**10,), "<i8"))
    return ["info", "--dataset", str(path)]


@case("would need")
def npz_sparse_features_of_huge_width(d):
    n = 60
    feats = {
        "attr_data": np.ones(n, np.float32),
        "attr_indices": np.zeros(n, np.int64),
        "attr_indptr": np.arange(n + 1),
        "attr_shape": np.array([n, 10**9]),
    }
    path = d / "g.npz"
    write_npz(path, **feats)
    with np.load(path) as z:  # drop the dense attr_matrix so the CSR one is read
        arrays = {k: z[k] for k in z.files if k != "attr_matrix"}
    np.savez(path, **arrays)
    return ["info", "--dataset", str(path)]


@case("holds a single array")
def npz_that_is_one_huge_npy(d):
    path = d / "g.npz"
    path.write_bytes(npy_header_only((10**10, 10)))
    return ["info", "--dataset", str(path)]


@case("expected two non-negative integers")
def npz_adjacency_shape_nan(d):
    return ["info", "--dataset", write_npz(d / "g.npz", adj_shape=np.array([np.nan, np.nan]))]


@case("needs at least 16.0 GiB")
def hidden_activations_beyond_memory(d):
    n = 1 << 16
    arrays = {
        "adj_data": np.zeros(0, np.float32),
        "adj_indices": np.zeros(0, np.int64),
        "adj_indptr": np.zeros(n + 1, np.int64),
        "adj_shape": np.array([n, n]),
        "attr_matrix": np.ones((n, 1), np.float32),
        "labels": np.arange(n) % 2,
    }
    np.savez_compressed(d / "g.npz", **arrays)
    return ["train", "--dataset", str(d / "g.npz"), "--hidden", "65536", "--out", out(d)]


# ------------------------------------------------------------------ item 4: flags and config values


@case("'epochs' in")
def toml_epochs_inf(d):
    return ["train", "--config", toml(d, "epochs = inf\n"), *TINY, "--out", out(d)]


@case("must be the [train] table")
def toml_train_is_a_number(d):
    return ["train", "--config", toml(d, "train = 5\n"), *TINY, "--out", out(d)]


@case("is a directory")
def config_is_a_directory(d):
    return ["train", "--config", str(d), *TINY, "--out", out(d)]


@case("is not a regular file")
def config_is_a_device(d):
    return ["train", "--config", "/dev/zero", *TINY, "--out", out(d)]


@case("does not exist")
def config_is_missing(d):
    return ["train", "--config", str(d / "nope.toml"), *TINY, "--out", out(d)]


@case("not valid TOML")
def config_is_not_utf8(d):
    return ["train", "--config", toml(d, b"\xff\xfe hidden = 3\n"), *TINY, "--out", out(d)]


@case("cannot be created")
def out_under_proc(d):
    return ["train", *TINY, "--out", "/proc/tessera-hostile/x"]


@case("is an existing file")
def out_is_a_file(d):
    (d / "out").write_text("keep me\n")
    return ["train", *TINY, "--out", out(d)]


@case("is a file, not a directory")
def out_under_a_file(d):
    (d / "f").write_text("keep me\n")
    return ["train", *TINY, "--out", str(d / "f" / "run")]


@case("--seed must be in [0, 4294967295]")
def seed_beyond_uint32(d):
    return ["train", *TINY, "--seed", "99999999999999999999", "--out", out(d)]


@case("--seed must be in")
def seed_negative(d):
    return ["train", *TINY, "--seed", "-1", "--out", out(d)]


@case("--timeout must be a finite number")
def timeout_inf(d):
    return ["train", *TINY, "--timeout", "inf", "--out", out(d)]


@case("--timeout must be positive")
def timeout_beyond_a_week(d):
    return ["train", *TINY, "--timeout", "1e12", "--out", out(d)]


@case("--hidden must be in [1, 65536]")
def hidden_1e8(d):
    return ["train", *TINY, "--hidden", "100000000", "--out", out(d)]


@case("--layers must be in")
def layers_1e6(d):
    return ["train", *TINY, "--layers", "1000000", "--out", out(d)]


@case("--heads must be in")
def heads_1e6(d):
    return ["train", *TINY, "--model", "gat", "--heads", "1000000", "--out", out(d)]


@case("--threads must be in")
def threads_1e6(d):
    return ["train", *TINY, "--threads", "1000000", "--out", out(d)]


@case("--nprocs must be in")
def nprocs_1e6(d):
    return ["train", *TINY, "--nprocs", "1000000", "--out", out(d)]


@case("--lr must be a finite number")
def lr_inf(d):
    return ["train", *TINY, "--lr", "inf", "--out", out(d)]


@case("--lr must be")
def lr_nan(d):
    return ["train", *TINY, "--lr", "nan", "--out", out(d)]


@case("--weight-decay must be a finite number")
def weight_decay_inf(d):
    return ["train", *TINY, "--weight-decay", "inf", "--out", out(d)]


@case("--dropout must be")
def dropout_nan(d):
    return ["train", *TINY, "--dropout", "nan", "--out", out(d)]


@case("--seed must be in")
def partition_seed_beyond_uint32(d):
    return ["partition", "--dataset", "synthetic:tiny", "--parts", "2", "--seed", "99999999999999999999"]


@case("is an existing file")
def partition_out_is_a_file(d):
    (d / "out").write_text("keep me\n")
    return ["partition", "--dataset", "synthetic:tiny", "--parts", "2", "--out", out(d)]


# ------------------------------------------------------------------ item 5: late errors leave no run directory


@case("unknown aggregation backend")
def backend_nosuch(d):
    return ["train", *TINY, "--backend", "nosuch", "--out", out(d)]


@case("unknown model")
def model_nosuch(d):
    return ["train", *TINY, "--model", "nosuch", "--out", out(d)]


@case("line 2: edge weight -1.0 must be finite, non-negative")
def edgelist_negative_weight(d):
    path = edgelist(d, "0 1 1.0\n1 2 -1.0\n2 3 1.0\n", labels=np.array([0, 1, 0, 1]))
    return ["train", "--dataset", path, "--epochs", "1", "--no-progress", "--out", out(d)]


@case("line 1: edge weight 1e+300 must be finite")
def edgelist_weight_beyond_float32(d):
    return ["info", "--dataset", edgelist(d, "0 1 1e300\n")]


@case("line 1: edge weight nan must be finite")
def edgelist_weight_nan(d):
    return ["info", "--dataset", edgelist(d, "0 1 nan\n")]


# ------------------------------------------------------------------ item 8: the TOML file neither drops nor bends


@case("top-level keys (hidden) beside its [train] table")
def toml_top_level_beside_train_table(d):
    return ["train", "--config", toml(d, "hidden = 8\n[train]\nepochs = 1\n"), *TINY, "--out", out(d)]


@case("has a table [model]")
def toml_other_table(d):
    return ["train", "--config", toml(d, "[model]\nhidden = 8\n"), *TINY, "--out", out(d)]


@case("unknown setting 'hiden'")
def toml_unknown_key(d):
    return ["train", "--config", toml(d, "[train]\nhiden = 8\n"), *TINY, "--out", out(d)]


@case("setting 'hidden' in")
def toml_hidden_fraction(d):
    return ["train", "--config", toml(d, "hidden = 16.7\n"), *TINY, "--out", out(d)]


@case("must be an integer, got '16' (str)")
def toml_hidden_string(d):
    return ["train", "--config", toml(d, 'hidden = "16"\n'), *TINY, "--out", out(d)]


@case("must be an integer, got True (bool)")
def toml_epochs_bool(d):
    return ["train", "--config", toml(d, "epochs = true\n"), *TINY, "--out", out(d)]


@case("must be a number, got '0.1' (str)")
def toml_lr_string(d):
    return ["train", "--config", toml(d, 'lr = "0.1"\n'), *TINY, "--out", out(d)]


@case("must be true or false")
def toml_resume_number(d):
    return ["train", "--config", toml(d, "resume = 1\n"), *TINY, "--out", out(d)]


@case("--lr must be a finite number")
def toml_lr_inf(d):
    return ["train", "--config", toml(d, "[train]\nlr = inf\n"), *TINY, "--out", out(d)]


@case("must be a string")
def toml_dataset_number(d):
    return ["train", "--config", toml(d, "dataset = 5\n"), "--epochs", "1", "--out", out(d)]


# ------------------------------------------------------------------ item 10: usage errors and --split


@case("tessera: error: argument --hidden: invalid int value")
def usage_train_bad_int(d):
    return ["train", "--hidden", "abc"]


@case("the following arguments are required: --parts")
def usage_partition_missing_parts(d):
    return ["partition", "--dataset", "synthetic:tiny"]


@case("unrecognized arguments: --bogus")
def usage_info_unknown_flag(d):
    return ["info", "--bogus"]


@case("tessera: error:")
def usage_simulate_missing_parts(d):
    return ["simulate", "--dataset", "synthetic:tiny"]


@case("unrecognized arguments: --bogus")
def usage_kernels_unknown_flag(d):
    return ["kernels", "--bogus"]


@case("--seed must be in [0, 4294967295]")
def simulate_seed_beyond_range(d):
    return ["simulate", "--dataset", "synthetic:tiny", "--parts", "2", "--seed", "99999999999999999999"]


@case("--parts values must be at most")
def simulate_parts_beyond_range(d):
    return ["simulate", "--dataset", "synthetic:tiny", "--parts", str(10**12)]


@case("--placement takes auto, aggregate-first or transform-first")
def simulate_unknown_placement(d):
    return ["simulate", "--dataset", "synthetic:tiny-rel", "--model", "rgcn", "--parts", "2", "--placement", "sideways"]


@case("--width must be in [1, 65536]")
def kernels_width_beyond_range(d):
    return ["kernels", "--dataset", "synthetic:tiny", "--width", "1000000000"]


@case("--threads must be in [1, 1024]")
def kernels_threads_beyond_range(d):
    return ["kernels", "--dataset", "synthetic:tiny", "--threads", "1000000"]


@case("no command given")
def usage_no_command(d):
    return []


@case("choose one with --split")
def ogb_several_splits(d):
    return ["info", "--dataset", ogb(d, labels=["0", "1", "0", "1"], splits=("a", "b"))]


@case("has no split 'nosuch'")
def ogb_unknown_split(d):
    return ["info", "--dataset", ogb(d, labels=["0", "1", "0", "1"], splits=("a",)), "--split", "nosuch"]


@case("has none")
def split_on_a_planetoid_dataset(d):
    return ["train", "--dataset", planetoid(d), "--split", "time", "--out", out(d)]


# ------------------------------------------------------------------ crafted pickles, one per pickle-reading loader


def _planetoid_pickle(part: str) -> Callable[[Path], list[str]]:
    def build(d: Path) -> list[str]:
        crafted = pickle.dumps(_Exploit(sentinel(d)), protocol=2)
        return ["train", "--dataset", planetoid(d, **{part: crafted}), "--out", out(d)]

    build.__name__ = f"planetoid_pickle_{part}"
    return build


for _part in ("x", "y", "tx", "allx", "ty", "ally", "graph"):
    case("refusing to load posix.system")(_planetoid_pickle(_part))


@case("checkpoint")
def checkpoint_pickle(d):
    import torch

    (d / "out").mkdir()
    torch.save(_Exploit(sentinel(d)), d / "out" / "checkpoint.pt")
    return ["train", *TINY, "--resume", "--out", out(d)]


@case("pickle")
def npz_object_labels(d):
    y = np.array([_Exploit(sentinel(d))] * 60, dtype=object)
    return ["info", "--dataset", write_npz(d / "g.npz", labels=y)]


@case("pickle")
def edgelist_object_labels(d):
    path = edgelist(d, "0 1\n1 2\n")
    np.save(d / "g.labels.npy", np.array([_Exploit(sentinel(d))] * 4, dtype=object), allow_pickle=True)
    return ["info", "--dataset", path]


@case("pickle")
def parts_dir_object_array(d):
    from tessera.graph.partition import write_parts
    from tessera.graph.synthetic import generate

    g = generate("tiny", seed=0)
    parts = d / "parts"
    write_parts(g, np.zeros(g.num_nodes, np.int64), parts)
    with np.load(parts / "part-0.npz") as z:
        arrays = {k: z[k] for k in z.files}
    arrays["owned"] = np.array([_Exploit(sentinel(d))], dtype=object)
    np.savez(parts / "part-0.npz", **arrays)
    return ["train", "--parts-dir", str(parts), *TINY, "--out", out(d)]


# ------------------------------------------------------------------ controls: the same files, well formed, load


@case("", code=0)
def ok_npz_with_pickled_class_names_left_unread(d):
    names = np.array([_Exploit(sentinel(d))] * 3, dtype=object)
    return ["info", "--dataset", write_npz(d / "g.npz", class_names=names)]


@case("", code=0)
def ok_npz_with_class_names(d):
    return ["info", "--dataset", write_npz(d / "g.npz", class_names=np.array(["a", "b", "c", "d"]))]


@case("", code=0)
def ok_edgelist_with_zero_weight(d):
    return ["info", "--dataset", edgelist(d, "0 1 0.0\n1 2 2.5\n2 3 1\n", labels=np.array([0, 1, 0, 1]))]


@case("", code=0)
def ok_ogb_split_chosen(d):
    return ["info", "--dataset", ogb(d, labels=["0", "1", "0", "1"], splits=("a", "b")), "--split", "b"]


@case("", code=0)
def ok_planetoid(d):
    return ["info", "--dataset", planetoid(d)]


# ------------------------------------------------------------------ the runner (a subprocess)


def _listing(*roots: Path) -> list[str]:
    return sorted(str(p) for r in roots if r.exists() for p in [r, *r.rglob("*")])


def _mapped() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _run_case(main: Callable, argv: list[str], d: Path, cwd: Path) -> dict:
    before = _listing(d, cwd)
    err, outp = io.StringIO(), io.StringIO()
    rec: dict = {"argv": argv, "exception": None}
    t0 = time.perf_counter()
    signal.alarm(HANG_S)
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(outp):
        try:
            rec["code"] = main(argv)
        except SystemExit as e:
            rec["code"] = e.code
        except BaseException as e:  # a traceback is exactly what the case must not produce
            rec["code"] = None
            rec["exception"] = "".join(traceback.format_exception(e))[-3000:]
        finally:
            signal.alarm(0)
    rec["seconds"] = time.perf_counter() - t0
    rec["stderr"] = err.getvalue()
    rec["new_files"] = sorted(set(_listing(d, cwd)) - set(before))
    rec["payload_ran"] = sentinel(d).exists()
    return rec


def _no_launch(argv, nprocs):
    raise RuntimeError(f"the case reached the launcher with --nprocs {nprocs}")


def _hung(signum, frame):
    raise TimeoutError(f"no answer within {HANG_S} s: the input made tessera hang")


def run_all(work: Path, planetoid_dir: Path) -> None:
    """Build every case under ``work``, then run them all under the address-space cap, appending
    one JSON line per outcome to ``work/results.jsonl`` (so a crash loses only the cases after it)."""
    import resource

    global PLANETOID
    PLANETOID = planetoid_dir
    signal.signal(signal.SIGALRM, _hung)

    import torch

    import tessera.cli.launch
    import tessera.datasets  # noqa: F401  (imported before the cap, as the cases need them)
    import tessera.train.loop  # noqa: F401
    from tessera.cli.main import main

    torch.set_num_threads(1)
    # No case may start worker processes (a missed --nprocs cap would otherwise fork them).
    tessera.cli.launch.launch = _no_launch
    cwd = work / "cwd"
    cwd.mkdir()
    os.chdir(cwd)
    argvs = {}
    for name, (build, _, _) in CASES.items():
        d = work / name
        d.mkdir()
        argvs[name] = build(d)
    resource.setrlimit(resource.RLIMIT_AS, (_mapped() + HEADROOM, resource.RLIM_INFINITY))
    with open(work / "results.jsonl", "w") as log:
        try:
            np.ones(2 << 30, np.uint8)
            probe = "a 2 GiB allocation succeeded under the cap"
        except MemoryError:
            probe = "MemoryError"
        log.write(json.dumps({"probe": probe}) + "\n")
        for name, argv in argvs.items():
            log.write(json.dumps({"case": name, **_run_case(main, argv, work / name, cwd)}) + "\n")
            log.flush()


if __name__ == "__main__":
    run_all(Path(sys.argv[1]), Path(sys.argv[2]))

# ------------------------------------------------------------------ the tests (pytest)


@pytest.fixture(scope="module")
def results(tmp_path_factory, planetoid_root) -> dict:
    """The runner's outcomes by case name, plus ``probe`` and, if it died, its stderr tail."""
    work = tmp_path_factory.mktemp("hostile")
    env = {**os.environ, "PYTHONPATH": str(REPO), "TESSERA_CACHE": str(work / "cache")}
    r = subprocess.run(
        [sys.executable, __file__, str(work), str(planetoid_root)], capture_output=True, text=True, env=env
    )
    lines = (work / "results.jsonl").read_text().splitlines() if (work / "results.jsonl").exists() else []
    records = [json.loads(line) for line in lines]
    out = {"probe": records[0]["probe"] if records else None, "cases": {}}
    out["cases"] = {rec.pop("case"): rec for rec in records[1:]}
    out["died"] = None if r.returncode == 0 else f"runner exit {r.returncode}: {r.stderr[-2000:]}"
    return out


def _case(results: dict, name: str) -> dict:
    assert name in results["cases"], f"the runner died before this case ({results['died']})"
    return results["cases"][name]


def test_the_memory_cap_is_in_force(results):
    assert results["probe"] == "MemoryError"
    assert results["died"] is None, results["died"]


REFUSED = [name for name, (_, _, code) in CASES.items() if code == 2]
ACCEPTED = [name for name, (_, _, code) in CASES.items() if code == 0]


@pytest.mark.parametrize("name", REFUSED)
def test_hostile_input_is_refused_in_one_line(results, name):
    r = _case(results, name)
    assert r["exception"] is None, r["exception"]
    lines = r["stderr"].splitlines()
    assert r["code"] == 2, (r["code"], lines)
    assert len(lines) == 1 and lines[0].startswith("tessera: error: "), lines
    assert CASES[name][1] in lines[0], lines[0]
    assert r["new_files"] == [], r["new_files"]
    assert not r["payload_ran"]


@pytest.mark.parametrize("name", ACCEPTED)
def test_well_formed_control_loads(results, name):
    r = _case(results, name)
    assert r["exception"] is None, r["exception"]
    # a file with labels and no split announces the split it is given: information, on success only
    lines = [line for line in r["stderr"].splitlines() if not line.startswith("tessera: no split given")]
    assert (r["code"], lines) == (0, [])
    assert r["new_files"] == [] and not r["payload_ran"]


def _tessera(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-m", "tessera", *args], capture_output=True, text=True, env=env, cwd=cwd)


@pytest.mark.parametrize(
    "make, needle",
    [
        (lambda d: ["train", "--config", toml(d, "epochs = inf\n"), "--out", str(d / "out")], "'epochs'"),
        (
            lambda d: (
                ["train", "--dataset", edgelist(d, "0 1 -2\n1 0 1\n", labels=np.array([0, 1, 0, 1]))]
                + ["--out", str(d / "out")]
            ),
            "non-negative",
        ),
    ],
    ids=["toml-epochs-inf", "edgelist-negative-weight"],
)
def test_end_to_end_exit_status(tmp_path, make, needle):
    argv = make(tmp_path)
    before = _listing(tmp_path)
    r = _tessera(*argv, cwd=tmp_path)
    lines = r.stderr.splitlines()
    assert r.returncode == 2 and len(lines) == 1 and lines[0].startswith("tessera: error: "), r.stderr
    assert needle in lines[0]
    assert _listing(tmp_path) == before and r.stdout == ""
