"""Dataset loaders: Planetoid (vs PyG), safe pickles, .npz, OGB, edge lists, PyG conversion, dispatch."""

from __future__ import annotations

import gzip
import os
import pickle
import shutil
import sys
import types
from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import scipy.sparse as sp
import torch

from tessera import datasets
from tessera.errors import DatasetError, GraphError, TesseraError, UnsafePickleError
from tessera.graph import Graph
from tessera.graph.formats import (
    from_pyg,
    load_edgelist,
    load_npz,
    load_ogb,
    load_planetoid,
    safe_load,
    to_pyg,
)

MASKS = ("train_mask", "val_mask", "test_mask")


def edge_set(ei: torch.Tensor, n: int) -> torch.Tensor:
    return torch.unique(ei[0].long() * n + ei[1].long())


def graph_edges(g: Graph) -> torch.Tensor:
    return edge_set(g.edge_index(), g.num_nodes)


# ----------------------------------------------------------------------------- Planetoid


@pytest.fixture(scope="module")
def cora(planetoid_root: Path) -> Graph:
    return load_planetoid(planetoid_root, "cora")


@pytest.fixture(scope="module")
def citeseer(planetoid_root: Path) -> Graph:
    return load_planetoid(planetoid_root, "citeseer")


@pytest.mark.parametrize(
    "which, n, e, f, c, counts",
    [("cora", 2708, 10556, 1433, 7, (140, 500, 1000)), ("citeseer", 3327, 9104, 3703, 6, (120, 500, 1000))],
)
def test_planetoid_counts(request, which, n, e, f, c, counts):
    g = request.getfixturevalue(which)
    assert (g.name, g.num_nodes, g.num_edges, g.num_features, g.num_classes) == (which, n, e, f, c)
    assert tuple(int(getattr(g, m).sum()) for m in MASKS) == counts
    assert g.is_undirected()
    assert not bool((g.src_index() == g.dst_index()).any())


@pytest.mark.parametrize("which", ["cora", "citeseer"])
def test_planetoid_matches_pyg(request, planetoid_root, which):
    pyg_io = pytest.importorskip("torch_geometric.io")
    g = request.getfixturevalue(which)
    d = pyg_io.read_planetoid_data(str(planetoid_root), which)
    assert torch.equal(g.x, d.x)
    labelled = g.y >= 0
    assert torch.equal(g.y[labelled], d.y[labelled])
    for m in MASKS:
        assert torch.equal(getattr(g, m), getattr(d, m)), m
    assert torch.equal(graph_edges(g), edge_set(d.edge_index, g.num_nodes))


def test_citeseer_isolated_test_range_vertices(citeseer):
    # The 15 vertices test.index skips get zero features, label -1, and no split.
    unlabelled = (citeseer.y < 0).nonzero().view(-1)
    assert unlabelled.numel() == 15
    assert not bool(citeseer.x[unlabelled].any())
    for m in MASKS:
        assert not bool(getattr(citeseer, m)[unlabelled].any())


class _Evil:
    def __init__(self, cmd: str):
        self.cmd = cmd

    def __reduce__(self):
        return (os.system, (self.cmd,))


@pytest.fixture
def cora_copy(planetoid_root, tmp_path) -> Path:
    d = tmp_path / "planetoid"
    d.mkdir()
    for f in planetoid_root.glob("ind.cora.*"):
        shutil.copy(f, d / f.name)
    return d


def test_malicious_pickle_is_refused(cora_copy, tmp_path):
    marker = tmp_path / "pwned"
    (cora_copy / "ind.cora.graph").write_bytes(pickle.dumps(_Evil(f"touch {marker}"), protocol=2))
    with pytest.raises(UnsafePickleError, match=r"refusing to load \w+\.system from .*ind\.cora\.graph"):
        load_planetoid(cora_copy, "cora")
    assert not marker.exists()


@pytest.mark.parametrize("target", [eval, getattr, __import__, shutil.rmtree])
def test_safe_load_refuses_other_globals(target):
    with pytest.raises(UnsafePickleError, match=target.__name__):
        safe_load(pickle.dumps(target, protocol=2))


def test_safe_load_bytes_only_via_latin1():
    assert safe_load(pickle.dumps(b"\x00\xffab", protocol=2)) == b"\x00\xffab"
    evil = pickle.dumps(b"x", protocol=2).replace(b"latin1", b"rot_13")
    with pytest.raises(UnsafePickleError, match="rot_13"):
        safe_load(evil)


def test_truncated_pickle_is_dataset_error(cora_copy):
    f = cora_copy / "ind.cora.allx"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(DatasetError, match="ind.cora.allx") as info:
        load_planetoid(cora_copy, "cora")
    assert not isinstance(info.value, UnsafePickleError)
    with pytest.raises(DatasetError, match="not a valid pickle"):
        safe_load(b"")


def test_missing_planetoid_file(cora_copy):
    (cora_copy / "ind.cora.ty").unlink()
    with pytest.raises(DatasetError, match=r"ind\.cora\.ty not found"):
        load_planetoid(cora_copy, "cora")


@pytest.mark.parametrize("protocol", [2, 5])
def test_safe_load_admits_arrays_and_containers(protocol):
    obj = {
        "a": np.arange(5, dtype=np.float32),
        "m": sp.csr_matrix(np.eye(3)),
        "d": defaultdict(list, {1: [2, 3]}),
        "s": np.float64(2.5),
        "t": (1, 2.0, {3}),
    }
    out = safe_load(pickle.dumps(obj, protocol=protocol))
    assert np.array_equal(out["a"], obj["a"]) and out["a"].dtype == np.float32
    assert np.array_equal(out["m"].toarray(), np.eye(3))
    assert out["d"] == obj["d"] and out["d"].default_factory is list
    assert out["s"] == 2.5 and out["t"] == (1, 2.0, {3})


# ----------------------------------------------------------------------------- .npz


def _class_graph(per_class: int = 70, classes: int = 3, seed: int = 0):
    rng = np.random.default_rng(seed)
    n = per_class * classes
    y = np.repeat(np.arange(classes), per_class)
    rng.shuffle(y)
    adj = sp.random(n, n, density=0.03, format="csr", random_state=seed)
    adj.setdiag(1.0)  # self loops, which the loader must drop
    adj = adj.tocsr()
    attr = sp.random(n, 12, density=0.3, format="csr", random_state=seed + 1)
    attr.data = np.ceil(attr.data * 3)  # bag-of-words counts 1..3
    return n, y, adj, attr


def _write_npz(path: Path, adj, attr=None, dense=None, **extra) -> Path:
    arrays = dict(adj_data=adj.data, adj_indices=adj.indices, adj_indptr=adj.indptr, adj_shape=np.array(adj.shape))
    if attr is not None:
        arrays.update(attr_data=attr.data, attr_indices=attr.indices, attr_indptr=attr.indptr, attr_shape=attr.shape)
    if dense is not None:
        arrays["attr_matrix"] = dense
    np.savez(path, **arrays, **extra)
    return path


def test_npz_sparse_attrs_match_pyg(tmp_path):
    n, y, adj, attr = _class_graph()
    path = _write_npz(tmp_path / "toy.npz", adj, attr, labels=y)
    g = load_npz(path, seed=3)
    assert (g.name, g.num_nodes, g.num_features, g.num_classes) == ("toy", n, 12, 3)
    assert g.is_undirected()
    assert not bool((g.src_index() == g.dst_index()).any())
    pyg_npz = pytest.importorskip("torch_geometric.io.npz")
    d = pyg_npz.read_npz(str(path))
    assert torch.equal(g.x, d.x)
    assert torch.equal(g.y, d.y)
    assert torch.equal(graph_edges(g), edge_set(d.edge_index, n))
    assert g.num_edges == d.edge_index.shape[1]
    # The default split: 20 train / 30 val per class, the rest test; reproducible for one seed.
    for c in range(3):
        in_c = g.y == c
        assert int((g.train_mask & in_c).sum()) == 20
        assert int((g.val_mask & in_c).sum()) == 30
        assert int((g.test_mask & in_c).sum()) == 20
    again = load_npz(path, seed=3)
    other = load_npz(path, seed=4)
    assert torch.equal(g.train_mask, again.train_mask)
    assert not torch.equal(g.train_mask, other.train_mask)


@pytest.mark.parametrize("canonical", [True, False])
def test_npz_features_equal_pygs_with_duplicates_and_negative_values(canonical, tmp_path):
    # a stored entry may repeat (PyG sums them before it binarises) and values may be negative
    n, y, adj, attr = _class_graph()
    attr = attr.astype(np.float64)
    attr.data[::4] *= -0.37
    if not canonical:
        attr = _with_duplicates(attr)
        assert not attr.has_canonical_format
    path = _write_npz(tmp_path / "dup.npz", adj, attr, labels=y)
    want = torch.from_numpy(attr.toarray()).to(torch.float)  # PyG's parse_npz: todense, float, x[x > 0] = 1
    want[want > 0] = 1
    assert torch.equal(load_npz(path).x, want)
    pyg_npz = pytest.importorskip("torch_geometric.io.npz")
    assert torch.equal(load_npz(path).x, pyg_npz.read_npz(str(path)).x)


def _with_duplicates(m):
    """``m`` with each row's first stored entry stored twice more: once as is, once negated."""
    data, indices, indptr = [], [], [0]
    for r in range(m.shape[0]):
        lo, hi = m.indptr[r], m.indptr[r + 1]
        d, i = list(m.data[lo:hi]), list(m.indices[lo:hi])
        if hi > lo:
            d += [m.data[lo], -2 * m.data[lo]]
            i += [m.indices[lo], m.indices[lo]]
        data += d
        indices += i
        indptr.append(len(data))
    out = sp.csr_matrix((np.array(data), np.array(indices, dtype=np.int32), np.array(indptr)), shape=m.shape)
    out.has_canonical_format = False
    return out


def test_npz_features_are_written_once_in_float32(tmp_path):
    # the loader's peak is the stored CSR arrays plus the float32 matrix: no float64 or converted
    # copy of the dense matrix and no dense mask beside it (numpy reports to tracemalloc)
    import tracemalloc

    n, f = 3000, 400
    rng = np.random.default_rng(0)
    attr = sp.random(n, f, density=0.3, format="csr", random_state=1, dtype=np.float32)
    attr.data -= 0.5
    adj = sp.csr_matrix((np.ones(n, np.float32), (np.arange(n), (np.arange(n) + 1) % n)), shape=(n, n))
    path = _write_npz(tmp_path / "wide.npz", adj, attr, labels=rng.integers(0, 3, n))
    stored = attr.data.nbytes + attr.indices.nbytes + attr.indptr.nbytes
    tracemalloc.start()
    try:
        x = load_npz(path).x
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert x.dtype == torch.float32 and x.shape == (n, f)
    assert peak < stored + n * f * 4 + 1_000_000, (peak, stored, n * f * 4)


def test_npz_dense_attrs_directed_and_stored_split(tmp_path):
    n, y, adj, attr = _class_graph()
    dense = attr.toarray() * 0.5
    idx = np.random.default_rng(0).permutation(n)
    path = _write_npz(
        tmp_path / "dense.npz", adj, dense=dense, labels=y, train_idx=idx[:10], val_idx=idx[10:25], test_idx=idx[25:]
    )
    g = load_npz(path, undirected=False, name="mine")
    assert g.name == "mine"
    assert torch.equal(g.x, torch.from_numpy(dense.astype(np.float32)))  # dense values are kept as stored
    coo = adj.tocoo()
    keep = coo.row != coo.col
    assert torch.equal(graph_edges(g), edge_set(torch.from_numpy(np.stack([coo.row[keep], coo.col[keep]])), n))
    assert [int(getattr(g, m).sum()) for m in MASKS] == [10, 15, n - 25]
    assert bool(g.train_mask[torch.from_numpy(idx[:10])].all())


def test_npz_rejects_object_arrays_and_bad_files(tmp_path):
    n, y, adj, attr = _class_graph()
    path = _write_npz(tmp_path / "obj.npz", adj, attr, labels=np.array([str(v) for v in y], dtype=object))
    with pytest.raises(DatasetError, match="labels"):
        load_npz(path)
    (tmp_path / "junk.npz").write_bytes(b"not a zip file")
    with pytest.raises(DatasetError, match="junk.npz"):
        load_npz(tmp_path / "junk.npz")
    np.savez(tmp_path / "noadj.npz", labels=y)
    with pytest.raises(DatasetError, match="adj_data"):
        load_npz(tmp_path / "noadj.npz")


# ----------------------------------------------------------------------------- OGB


def _gz(path: Path, lines: list[str]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))


def _make_ogb(root: Path, edges=((0, 1), (1, 2), (2, 0), (3, 4), (4, 5), (1, 0))) -> Path:
    raw = root / "raw"
    _gz(raw / "edge.csv.gz", [f"{s},{d}" for s, d in edges])
    _gz(raw / "num-node-list.csv.gz", ["6"])
    _gz(raw / "num-edge-list.csv.gz", [str(len(edges))])
    _gz(raw / "node-feat.csv.gz", [f"{i}.5,{-i},1e-3" for i in range(6)])
    _gz(raw / "node-label.csv.gz", ["0", "1", "nan", "1", "0", "2"])
    _gz(raw / "edge-feat.csv.gz", ["1.0"] * len(edges))
    split = root / "split" / "time"
    _gz(split / "train.csv.gz", ["0", "1", "5"])
    _gz(split / "valid.csv.gz", ["3"])
    _gz(split / "test.csv.gz", ["2", "4"])
    return root


def test_ogb_loads_undirected(tmp_path):
    g = load_ogb(_make_ogb(tmp_path / "ogbn_toy"))
    assert (g.name, g.num_nodes, g.num_features, g.num_classes) == ("ogbn_toy", 6, 3, 3)
    expected = {(0, 1), (1, 0), (1, 2), (2, 1), (2, 0), (0, 2), (3, 4), (4, 3), (4, 5), (5, 4)}
    assert g.num_edges == len(expected)
    assert set(map(tuple, g.edge_index().t().tolist())) == expected
    assert g.y.tolist() == [0, 1, -1, 1, 0, 2]
    assert torch.allclose(g.x[3], torch.tensor([3.5, -3.0, 1e-3]))
    assert g.train_mask.nonzero().view(-1).tolist() == [0, 1, 5]
    assert g.val_mask.nonzero().view(-1).tolist() == [3]
    assert g.test_mask.nonzero().view(-1).tolist() == [4]  # vertex 2 is unlabelled, dropped


def test_ogb_directed(tmp_path):
    g = load_ogb(_make_ogb(tmp_path / "toy"), undirected=False)
    assert g.num_edges == 6
    assert not g.is_undirected()


def test_ogb_bad_files(tmp_path):
    root = _make_ogb(tmp_path / "toy")
    edge = root / "raw" / "edge.csv.gz"
    good = edge.read_bytes()
    edge.write_bytes(good[: len(good) // 2])
    with pytest.raises(DatasetError, match=r"edge\.csv\.gz is not a valid gzip file"):
        load_ogb(root)
    _gz(edge, ["0,1", "1,6"])
    with pytest.raises(DatasetError, match=r"references vertex 6.*num-node-list\.csv\.gz says 6 nodes"):
        load_ogb(root)
    _gz(edge, ["0,1", "1,2,3"])
    with pytest.raises(DatasetError, match=r"edge\.csv\.gz, line 2: expected 2 comma-separated columns, found 3"):
        load_ogb(root)
    _gz(edge, ["0,1", "1,x"])
    with pytest.raises(DatasetError, match=r"edge\.csv\.gz, line 2: 'x' is not an integer"):
        load_ogb(root)
    _gz(edge, ["0,1"])
    _gz(root / "raw" / "node-feat.csv.gz", ["1,2,3"] * 5)
    with pytest.raises(DatasetError, match=r"node-feat\.csv\.gz has 5 rows but the graph has 6 nodes"):
        load_ogb(root)
    with pytest.raises(DatasetError, match="not an OGB dataset directory"):
        load_ogb(tmp_path)


def _gz_text(path: Path, text: bytes) -> Path:
    path.write_bytes(gzip.compress(text))
    return path


@pytest.mark.parametrize("piece", [7, 64, 1 << 24])
def test_a_gzip_table_parsed_a_piece_at_a_time_equals_the_whole_texts(piece, tmp_path, monkeypatch):
    from tessera.graph.formats import _text

    monkeypatch.setattr(_text, "_PIECE", piece)  # pieces cut inside lines, numbers and line ends
    rng = np.random.default_rng(0)
    table = rng.normal(size=(50, 3)).astype(np.float32)
    text = "\n".join(",".join(repr(float(v)) for v in row) for row in table).encode()
    for body in (text + b"\n", text.replace(b"\n", b"\r\n") + b"\r\n  \n", text):
        path = _gz_text(tmp_path / "t.csv.gz", body)
        want = _text.parse_csv(body, np.float32, "t")
        for rows in (None, 50):
            assert np.array_equal(_text.read_csv_gz(path, np.float32, 3, rows), want)
    with pytest.raises(_text.RowCountError, match="has 50 rows, not 51"):
        _text.read_csv_gz(path, np.float32, 3, 51)
    with pytest.raises(_text.RowCountError, match="has more than 49 rows, not 49"):
        _text.read_csv_gz(path, np.float32, 3, 49)
    # errors name the line of the whole file, whichever piece holds it
    lines = text.split(b"\n")
    bad = b"\n".join([*lines[:40], b"1.0,x,2.0", *lines[41:]])
    with pytest.raises(DatasetError, match=r"t\.csv\.gz, line 41: 'x' is not a number"):
        _text.read_csv_gz(_gz_text(tmp_path / "t.csv.gz", bad), np.float32, 3)
    blank = b"\n".join([*lines[:30], b"", *lines[30:]])
    with pytest.raises(DatasetError, match=r"line 31: expected 3 comma-separated columns, found 1"):
        _text.read_csv_gz(_gz_text(tmp_path / "t.csv.gz", blank), np.float32, 3)


def test_a_gzip_table_holds_the_table_and_one_piece_of_text(tmp_path):
    # an OGB node-feat.csv.gz is parsed into its final array a piece at a time: never the whole
    # text (about 3x the table's bytes) beside a converted copy (Python and numpy report to tracemalloc)
    import tracemalloc

    from tessera.graph.formats import _text

    table = np.random.default_rng(1).normal(size=(20_000, 50)).astype(np.float32)
    body = "\n".join(",".join(f"{v:.6f}" for v in row) for row in table).encode()
    path = _gz_text(tmp_path / "feat.csv.gz", body)
    tracemalloc.start()
    try:
        got = _text.read_csv_gz(path, np.float32, 50, 20_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.allclose(got, table, atol=1e-6)
    assert len(body) > 2 * table.nbytes
    assert peak < table.nbytes + 6 * _text._PIECE, (peak, table.nbytes, len(body))


# ----------------------------------------------------------------------------- edge lists


EDGES = """# toy graph
0 1
1,2

  2 3   # not a comment: a third column
% another comment
3\t0
"""


def test_edgelist_with_comments_and_sibling_npy(tmp_path):
    path = tmp_path / "toy.txt"
    path.write_text(EDGES.replace("   # not a comment: a third column", ""))
    x = np.arange(20, dtype=np.float64).reshape(5, 4)
    np.save(tmp_path / "toy.features.npy", x)
    np.save(tmp_path / "toy.labels.npy", np.array([0, 1, 0, 1, -1]))
    g = load_edgelist(path)
    assert (g.name, g.num_nodes, g.num_edges, g.num_classes) == ("toy", 5, 4, 2)  # vertex 4 from features
    assert set(map(tuple, g.edge_index().t().tolist())) == {(0, 1), (1, 2), (2, 3), (3, 0)}
    assert torch.equal(g.x, torch.from_numpy(x).float())
    assert g.y.tolist() == [0, 1, 0, 1, -1]
    assert int(g.train_mask.sum()) == 4 and not bool(g.train_mask[4])
    u = load_edgelist(path, undirected=True)
    assert u.is_undirected() and u.num_edges == 8


def test_edgelist_weights_and_explicit_paths(tmp_path):
    path = tmp_path / "w.edges"
    path.write_text("0 1 0.5\n1 2 2\n2 0 1.25\n")
    np.save(tmp_path / "feat.npy", np.ones((3, 2), dtype=np.float32))
    g = load_edgelist(path, features=tmp_path / "feat.npy")
    order = {tuple(e): float(w) for e, w in zip(g.edge_index().t().tolist(), g.edge_weight, strict=True)}
    assert order == {(0, 1): 0.5, (1, 2): 2.0, (2, 0): 1.25}
    assert g.y is None and g.train_mask is None


@pytest.mark.parametrize(
    "text, match",
    [
        ("0 1\n1 x\n", r"line 2: 'x' is not an integer"),
        ("# c\n0 1\n\n1 2.5\n", r"line 4: '2.5' is not an integer"),
        ("0 1\n1 2 3\n", r"line 2: found 3 columns but line 1 has 2"),
        ("0 1 1.0\n1.5 2 1.0\n", r"line 2: vertex ids must be integers"),
        ("0 1\n-1 2\n", r"line 2: negative vertex id"),
        ("0 1 2 3\n", r"line 1: expected 2 or 3 columns, found 4"),
    ],
)
def test_edgelist_errors_name_the_line(tmp_path, text, match):
    path = tmp_path / "bad.txt"
    path.write_text(text)
    with pytest.raises(DatasetError, match=match):
        load_edgelist(path)


def test_edgelist_vertex_beyond_features(tmp_path):
    path = tmp_path / "g.txt"
    path.write_text("0 1\n1 3\n")
    np.save(tmp_path / "g.features.npy", np.ones((3, 2)))
    with pytest.raises(TesseraError, match=r"references vertex 3.*features for only 3 vertices"):
        load_edgelist(path)
    np.save(tmp_path / "g.features.npy", np.ones((4, 2)))
    np.save(tmp_path / "g.labels.npy", np.zeros(3, dtype=np.int64))
    with pytest.raises(DatasetError, match="3 labels but the graph has 4 vertices"):
        load_edgelist(path)


def test_edgelist_labels_need_no_pickle(tmp_path):
    path = tmp_path / "g.txt"
    path.write_text("0 1\n")
    np.save(tmp_path / "g.labels.npy", np.array(["a", None], dtype=object), allow_pickle=True)
    with pytest.raises(DatasetError, match="allow_pickle"):
        load_edgelist(path)


# ----------------------------------------------------------------------------- PyG conversion


def test_pyg_round_trip(cora):
    pytest.importorskip("torch_geometric")
    d = to_pyg(cora)
    assert d.num_nodes == cora.num_nodes and d.edge_index.shape == (2, cora.num_edges)
    back = from_pyg(d, name="cora")
    assert torch.equal(back.indptr, cora.indptr) and torch.equal(back.indices, cora.indices)
    for k in ("x", "y", *MASKS):
        assert torch.equal(getattr(back, k), getattr(cora, k)), k
    assert back.num_classes == cora.num_classes


def test_pyg_edge_data_round_trip():
    pytest.importorskip("torch_geometric")
    ei = torch.tensor([[0, 1, 2, 2], [1, 2, 0, 1]])
    g = Graph.from_edge_index(
        ei, 4, edge_weight=torch.tensor([1.0, 2.0, 3.0, 4.0]), edge_type=torch.tensor([0, 1, 1, 0])
    )
    d = to_pyg(g)
    assert torch.equal(d.edge_weight, g.edge_weight) and torch.equal(d.edge_type, g.edge_type)
    back = from_pyg(d)
    assert back.num_nodes == 4
    assert torch.equal(back.edge_weight, g.edge_weight) and torch.equal(back.edge_type, g.edge_type)


def test_pyg_missing_is_dataset_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch_geometric.data", None)
    with pytest.raises(DatasetError, match="pip install torch_geometric"):
        to_pyg(Graph.from_edge_index(torch.tensor([[0], [1]]), 2))


# ----------------------------------------------------------------------------- datasets.load


@pytest.fixture
def fake_synthetic(monkeypatch):
    calls = []

    def generate(preset, seed=0):
        calls.append((preset, seed))
        return Graph.from_edge_index(torch.tensor([[0, 1], [1, 0]]), 3, name=preset)

    mod = types.ModuleType("tessera.graph.synthetic")
    mod.PRESETS = {"tiny": None, "small": None}
    mod.generate = generate
    monkeypatch.setitem(sys.modules, "tessera.graph.synthetic", mod)
    return calls


def test_load_synthetic(fake_synthetic):
    g = datasets.load("synthetic:tiny", seed=7)
    assert (g.name, g.num_nodes) == ("tiny", 3)
    assert fake_synthetic == [("tiny", 7)]
    with pytest.raises(DatasetError, match="small, tiny"):
        datasets.load("synthetic:huge")


def test_load_real_synthetic_module():
    pytest.importorskip("tessera.graph.synthetic")
    g = datasets.load("synthetic:tiny", seed=1)
    assert isinstance(g, Graph) and g.num_nodes > 0


def test_load_named_planetoid_via_tessera_data(monkeypatch, planetoid_root):
    for root in (planetoid_root, planetoid_root.parent):
        monkeypatch.setenv("TESSERA_DATA", str(root))
        assert datasets.data_roots()[0] == Path(os.path.normpath(root))
        g = datasets.load("CiteSeer")
        assert (g.name, g.num_nodes, g.num_edges) == ("citeseer", 3327, 9104)


def test_load_named_pyg_layout(tmp_path, planetoid_root):
    raw = tmp_path / "Cora" / "raw"
    raw.mkdir(parents=True)
    for f in planetoid_root.glob("ind.cora.*"):
        shutil.copy(f, raw / f.name)
    assert datasets._find_named("cora", datasets.data_roots(tmp_path)) == ("planetoid", raw)
    assert datasets.load("cora", root=str(tmp_path)).num_edges == 10556


def test_load_planetoid_dir_needs_name(planetoid_root):
    with pytest.raises(DatasetError, match=r"several Planetoid datasets \(citeseer, cora\).*--name"):
        datasets.load(str(planetoid_root))
    assert datasets.load(str(planetoid_root), name="Cora").num_nodes == 2708
    with pytest.raises(DatasetError, match="holds: citeseer, cora"):
        datasets.load(str(planetoid_root), name="pubmed")


def test_load_paths_by_format(tmp_path):
    n, y, adj, attr = _class_graph()
    npz = _write_npz(tmp_path / "toy.npz", adj, attr, labels=y)
    assert datasets.load(str(npz)).num_nodes == n
    ogb = _make_ogb(tmp_path / "ogbn_arxiv")
    assert datasets.load(str(ogb)).name == "ogbn_arxiv"
    g = datasets.load("OGBN-ARXIV", root=str(tmp_path))
    assert (g.name, g.num_nodes) == ("ogbn-arxiv", 6)
    el = tmp_path / "edges.txt"
    el.write_text("0 1\n1 2\n")
    g = datasets.load(str(el), name="named")
    assert (g.name, g.num_nodes, g.num_edges) == ("named", 3, 2)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="not a dataset"):
        datasets.load(str(tmp_path / "empty"))


def test_load_unknown_spec_explains_fixes(fake_synthetic, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DatasetError) as info:
        datasets.load("no-such-dataset")
    msg = str(info.value)
    assert "\n" not in msg  # the CLI prints errors as one line
    assert "no-such-dataset" in msg and "TESSERA_DATA" in msg and "synthetic:<preset> (presets: small, tiny)" in msg
    assert "cora" in msg  # lists the known names
    with pytest.raises(DatasetError, match=r"ogbn_papers100M/raw/edge\.csv\.gz") as info:
        datasets.load("ogbn-papers100m", root=str(tmp_path))
    assert str(tmp_path) in str(info.value)


def test_known_names():
    names = datasets.known_names()
    assert {"cora", "citeseer", "pubmed", "ogbn-arxiv", "ogbn-products"} <= set(names)


def test_errors_are_tessera_errors():
    assert issubclass(UnsafePickleError, DatasetError) and issubclass(GraphError, TesseraError)
