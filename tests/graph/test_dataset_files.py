"""Data roots after ``pip install``, ``torch.save``d PyG files, and the announced generated split."""

from __future__ import annotations

import logging
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch

from tessera import datasets
from tessera.errors import DatasetError, GraphError
from tessera.graph.formats import from_pyg, is_torch_file, load_pt

# ---------------------------------------------------------------------------- data roots


@pytest.fixture
def bare_env(tmp_path, monkeypatch):
    """No TESSERA_DATA, HOME and the working directory in ``tmp_path``, XDG_CACHE_HOME unset."""
    monkeypatch.delenv("TESSERA_DATA", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    work = tmp_path / "elsewhere"
    work.mkdir()
    monkeypatch.chdir(work)
    return home


def test_data_roots_order(bare_env, tmp_path, monkeypatch):
    a, b = tmp_path / "a", tmp_path / "b"
    monkeypatch.setenv("TESSERA_DATA", f"{a}{os.pathsep}{b}")
    roots = datasets.data_roots(tmp_path / "explicit")
    user = bare_env / ".cache" / "tessera" / "datasets"
    assert roots[:4] == [tmp_path / "explicit", a, b, user]
    checkout = datasets.checkout_data_root()
    # Run from the repository: the development fallback beside the checkout comes last.
    assert checkout == Path(__file__).resolve().parents[2].parent / "shared" / "datasets"
    assert roots[4:] == [Path(os.path.normpath(checkout))]
    # The working directory plays no part.
    assert not any("elsewhere" in str(r) for r in roots)


def test_user_data_root_respects_xdg(bare_env, tmp_path, monkeypatch):
    assert datasets.user_data_root() == bare_env / ".cache" / "tessera" / "datasets"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert datasets.user_data_root() == tmp_path / "xdg" / "tessera" / "datasets"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/ignored")  # the XDG spec ignores relative paths
    assert datasets.user_data_root() == bare_env / ".cache" / "tessera" / "datasets"


def test_installed_package_has_no_checkout_root(bare_env, monkeypatch, tmp_path):
    fake = tmp_path / "site-packages" / "tessera" / "datasets.py"
    fake.parent.mkdir(parents=True)
    monkeypatch.setattr(datasets, "__file__", str(fake))
    assert datasets.checkout_data_root() is None
    assert datasets.data_roots() == [bare_env / ".cache" / "tessera" / "datasets"]


def test_named_dataset_from_user_data_root(bare_env, planetoid_root, monkeypatch, tmp_path):
    fake = tmp_path / "site-packages" / "tessera" / "datasets.py"
    fake.parent.mkdir(parents=True)
    monkeypatch.setattr(datasets, "__file__", str(fake))  # as after pip install: no checkout fallback
    with pytest.raises(DatasetError) as info:
        datasets.load("cora")
    msg = str(info.value)
    user = bare_env / ".cache" / "tessera" / "datasets"
    assert "\n" not in msg and f"{user} (missing)" in msg and "export TESSERA_DATA=" in msg
    dest = user / "planetoid"
    dest.mkdir(parents=True)
    for f in planetoid_root.glob("ind.cora.*"):
        shutil.copy(f, dest / f.name)
    assert datasets.load("cora").num_nodes == 2708


def test_missing_dataset_names_every_root(bare_env, tmp_path, monkeypatch):
    monkeypatch.setenv("TESSERA_DATA", str(tmp_path / "mine"))
    with pytest.raises(DatasetError) as info:
        datasets.load("ogbn-products")
    msg = str(info.value)
    for root in datasets.data_roots():
        assert str(root) in msg
    assert "TESSERA_DATA" in msg


# ---------------------------------------------------------------------------- torch.save files


def _pyg_data(**extra):
    pyg = pytest.importorskip("torch_geometric.data")
    g = torch.Generator().manual_seed(0)
    n = 60
    ei = torch.randint(0, n, (2, 300), generator=g)
    fields = {"x": torch.randn(n, 4, generator=g), "edge_index": ei, "y": torch.arange(n) % 3, **extra}
    return pyg.Data(**fields)


def test_torch_saved_pyg_data_and_dict(tmp_path):
    n = 60
    train = torch.zeros(n, dtype=torch.bool)
    train[:30] = True
    val = torch.zeros(n, dtype=torch.bool)
    val[30:40] = True
    test = ~(train | val)
    w = torch.rand(300)
    d = _pyg_data(train_mask=train, val_mask=val, test_mask=test, edge_weight=w)
    expect = from_pyg(d, name="my")
    torch.save(d, tmp_path / "my.pt")
    torch.save(d.to_dict(), tmp_path / "dict.pth")
    for f in ("my.pt", "dict.pth"):
        g = datasets.load(str(tmp_path / f), name="my")
        assert g.fingerprint() == expect.fingerprint()
        for k in ("x", "y", "train_mask", "val_mask", "test_mask", "edge_weight", "indptr", "indices"):
            assert torch.equal(getattr(g, k), getattr(expect, k)), k


def test_torch_saved_edge_attr_and_edge_type(tmp_path):
    d = _pyg_data(edge_attr=torch.rand(300, 1), edge_type=torch.arange(300) % 4)
    torch.save(d.to_dict(), tmp_path / "typed.pt")
    g = load_pt(tmp_path / "typed.pt")
    assert g.num_relations == 4 and g.edge_weight is not None
    assert sorted(g.edge_weight.tolist()) == sorted(d.edge_attr.view(-1).tolist())
    wide = _pyg_data(edge_attr=torch.rand(300, 5))
    torch.save(wide.to_dict(), tmp_path / "wide.pt")
    with pytest.warns(UserWarning, match=r"ignoring edge_attr of shape \(300, 5\)"):
        assert load_pt(tmp_path / "wide.pt").edge_weight is None


def test_torch_saved_without_split_gets_announced_split(tmp_path, caplog):
    torch.save(_pyg_data().to_dict(), tmp_path / "nosplit.pt")
    with caplog.at_level(logging.INFO, logger="tessera"):
        g = datasets.load(str(tmp_path / "nosplit.pt"), seed=3)
    assert int(g.train_mask.sum()) == 60 and g.val_mask is not None
    assert "no split given" in caplog.text and "20 training and 30 validation" in caplog.text


class _Payload:
    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (Path.touch, (self.sentinel,))


@pytest.mark.parametrize("how", ["torch.save", "pickle"])
def test_torch_file_with_pickle_payload_is_refused(tmp_path, how):
    sentinel = tmp_path / "SENTINEL"
    evil = {"edge_index": torch.tensor([[0], [1]]), "y": _Payload(sentinel)}
    path = tmp_path / "evil.pt"
    if how == "torch.save":
        torch.save(evil, path)
    else:
        path.write_bytes(pickle.dumps(evil))
    assert not sentinel.exists()
    with pytest.raises(DatasetError) as info:
        datasets.load(str(path))
    msg = str(info.value)
    assert "\n" not in msg and "refused to load" in msg and "weights_only=True" in msg and "to_dict()" in msg
    assert not sentinel.exists()


def test_torch_file_detected_by_content(tmp_path):
    torch.save(_pyg_data().to_dict(), tmp_path / "graph.bin")
    assert is_torch_file(tmp_path / "graph.bin")
    assert datasets.load(str(tmp_path / "graph.bin")).num_nodes == 60
    (tmp_path / "edges.txt").write_text("0 1\n")
    assert not is_torch_file(tmp_path / "edges.txt")


def test_torch_file_wrong_contents(tmp_path):
    torch.save(torch.zeros(3), tmp_path / "t.pt")
    with pytest.raises(DatasetError, match="holds a Tensor, not a graph"):
        load_pt(tmp_path / "t.pt")
    torch.save({"x": torch.zeros(3, 2)}, tmp_path / "noedges.pt")
    with pytest.raises(DatasetError, match="has no edge_index tensor; it holds: x"):
        load_pt(tmp_path / "noedges.pt")
    (tmp_path / "junk.pt").write_bytes(b"not a torch file")
    with pytest.raises(DatasetError, match="junk.pt"):
        load_pt(tmp_path / "junk.pt")
    hetero = pytest.importorskip("torch_geometric.data").HeteroData()
    hetero["a"].x = torch.zeros(2, 2)
    torch.save(hetero, tmp_path / "hetero.pt")
    with pytest.raises(DatasetError, match="refused to load"):
        load_pt(tmp_path / "hetero.pt")


def test_multi_label_targets_load(tmp_path, caplog):
    y = torch.tensor([[1, 0, 1], [0, 1, 0]] * 10)
    ei = torch.tensor([list(range(20)), [(i + 1) % 20 for i in range(20)]])
    torch.save({"edge_index": ei, "y": y.float()}, tmp_path / "m.pt")
    with caplog.at_level(logging.INFO, logger="tessera"):
        g = load_pt(tmp_path / "m.pt")
    assert g.multilabel and g.num_classes == 3 and g.y.dtype == torch.int64 and torch.equal(g.y, y)
    assert (int(g.train_mask.sum()), int(g.val_mask.sum()), int(g.test_mask.sum())) == (12, 4, 4)
    assert "multi-label targets" in caplog.text and "train / val / test: 12 / 4 / 4" in caplog.text
    # NaN marks an unlabelled target (-1 stored); a split holds no vertex without any labelled target
    partial = y.float()
    partial[0, 1] = float("nan")
    partial[1] = float("nan")
    mask = torch.arange(20) < 10
    torch.save({"edge_index": ei, "y": partial, "train_mask": mask & (torch.arange(20) != 1)}, tmp_path / "nan.pt")
    g = load_pt(tmp_path / "nan.pt")
    assert int(g.y[0, 1]) == -1 and bool((g.y[1] == -1).all()) and int(g.train_mask.sum()) == 9
    torch.save({"edge_index": ei, "y": partial, "train_mask": mask}, tmp_path / "bad.pt")
    with pytest.raises(GraphError, match="train_mask contains unlabelled vertices"):
        load_pt(tmp_path / "bad.pt")


@pytest.mark.parametrize("bad", [2.0, 0.5, -3.0])
def test_multi_label_values_other_than_0_1_are_one_clear_error(tmp_path, bad):
    y = torch.ones(2, 3)
    y[1, 2] = bad
    torch.save({"edge_index": torch.tensor([[0], [1]]), "y": y}, tmp_path / "m.pt")
    with pytest.raises(DatasetError, match=r"target of vertex 1, task 2 is .*must be 0 or 1") as e:
        load_pt(tmp_path / "m.pt")
    assert "\n" not in str(e.value)


# ---------------------------------------------------------------------------- edge-list split


def test_edgelist_generated_split_is_announced(tmp_path, caplog):
    import numpy as np

    (tmp_path / "g.txt").write_text("".join(f"{i} {(i + 1) % 90}\n" for i in range(90)))
    np.save(tmp_path / "g.labels.npy", np.arange(90) % 2)
    with caplog.at_level(logging.INFO, logger="tessera"):
        g = datasets.load(str(tmp_path / "g.txt"))
    assert (int(g.train_mask.sum()), int(g.val_mask.sum()), int(g.test_mask.sum())) == (40, 50, 0)
    assert "train / val / test: 40 / 50 / 0" in caplog.text and "g.labels.npy" in caplog.text


def test_split_announcement_dropped_when_loading_fails(caplog):
    from tessera.graph.formats._common import announce_split, announce_when_loaded

    split = {k: torch.ones(2, dtype=torch.bool) for k in ("train_mask", "val_mask", "test_mask")}
    with caplog.at_level(logging.INFO, logger="tessera"), pytest.raises(DatasetError):
        with announce_when_loaded():
            announce_split(split, 0, "bad.txt")
            raise DatasetError("bad.txt: broken later")
    assert "no split given" not in caplog.text
    with caplog.at_level(logging.INFO, logger="tessera"), announce_when_loaded():
        announce_split(split, 0, "good.txt")
        assert "good.txt" not in caplog.text  # held until the load completes
    assert "no split given for the labels in good.txt" in caplog.text
