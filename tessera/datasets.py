"""Resolve a dataset spec (``synthetic:<preset>``, a known name, or a path) to a Graph."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import re
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

from tessera.errors import DatasetError
from tessera.files import atomic_write, default_cache_dir, kept
from tessera.graph import graph as graph_module
from tessera.graph.formats import (
    is_ntriples,
    is_ogb_dir,
    is_torch_file,
    is_typed_edgelist,
    load_edgelist,
    load_npz,
    load_ntriples,
    load_ogb,
    load_planetoid,
    load_pt,
    load_typed_edgelist,
)
from tessera.graph.formats._common import announce_when_loaded
from tessera.graph.graph import Graph

# Lower-case spec name -> directory spelling used by PyG / OGB downloads.
PLANETOID = {"cora": "Cora", "citeseer": "CiteSeer", "pubmed": "PubMed"}
OGB = {"ogbn-arxiv": "ogbn-arxiv", "ogbn-products": "ogbn-products", "ogbn-papers100m": "ogbn-papers100M"}
_PLANETOID_FILE = re.compile(r"ind\.(.+)\.(x|tx|allx|y|ty|ally|graph|test\.index)$")


def known_names() -> list[str]:
    """Dataset names that :func:`load` looks up in the data roots."""
    return sorted([*PLANETOID, *OGB])


def user_data_root() -> Path:
    """The default per-user data root: ``$XDG_CACHE_HOME/tessera/datasets`` or ``~/.cache/tessera/datasets``."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg).expanduser() if xdg and Path(xdg).expanduser().is_absolute() else Path.home() / ".cache"
    return base / "tessera" / "datasets"


def checkout_data_root() -> Path | None:
    """``../shared/datasets`` beside a source checkout of tessera (the development and CI
    fallback); None when tessera is imported from an installed package rather than a checkout."""
    project = Path(__file__).resolve().parents[1]
    if not (project / "pyproject.toml").is_file() or not (project / "tessera" / "__init__.py").is_file():
        return None
    return project.parent / "shared" / "datasets"


def data_roots(root: str | os.PathLike | None = None) -> list[Path]:
    """Folders searched for named datasets, in order: ``root``, ``$TESSERA_DATA`` (``os.pathsep``
    separated), :func:`user_data_root`, then :func:`checkout_data_root` when running from a checkout."""
    candidates = [Path(root)] if root is not None else []
    candidates += [Path(p) for p in os.environ.get("TESSERA_DATA", "").split(os.pathsep) if p]
    candidates.append(user_data_root())
    checkout = checkout_data_root()
    if checkout is not None:
        candidates.append(checkout)
    out: list[Path] = []
    for c in candidates:
        c = Path(os.path.normpath(c.expanduser().absolute()))
        if c not in out:
            out.append(c)
    return out


def _synthetic() -> ModuleType | None:
    try:
        return importlib.import_module("tessera.graph.synthetic")
    except ModuleNotFoundError as e:
        if e.name in ("tessera.graph.synthetic", "tessera.graph"):
            return None
        raise


def _load_synthetic(preset: str, seed: int, name: str | None) -> Graph:
    mod = _synthetic()
    if mod is None:
        raise DatasetError("synthetic graphs are unavailable: tessera.graph.synthetic is not installed")
    presets = [
        *getattr(mod, "PRESETS", {}),
        *getattr(mod, "TYPED_PRESETS", ()),
        *getattr(mod, "MULTILABEL_PRESETS", ()),
    ]
    known = getattr(mod, "is_preset", lambda name: name in presets)
    if not known(preset) and known(preset.lower()):
        preset = preset.lower()
    if not known(preset):
        raise DatasetError(f"unknown synthetic preset {preset!r}; choose one of: {', '.join(sorted(presets))}")
    path = _synthetic_cache_path(mod, preset, seed)
    if path is None:
        g = mod.generate(preset, seed=seed)
    else:
        g = kept(
            path,
            [path],
            lambda: _read_cached(path),
            lambda g: True,  # a Graph: validated as it was built
            lambda: mod.generate(preset, seed=seed),
            lambda g: g.num_edges >= _CACHED_MIN_EDGES and _write_cached(path, g),
            "synthetic graph",
        )
    return g.replace(name=name) if name and name != g.name else g


_CACHED_MIN_EDGES = 1_000_000  # smaller synthetic graphs generate in under a second
_GRAPH_ARRAYS = ("indptr", "indices", "edge_weight", "edge_type", "x", "y", "train_mask", "val_mask", "test_mask")


def _synthetic_cache_path(mod: ModuleType, preset: str, seed: int) -> Path | None:
    """Where a generated graph is kept (``$TESSERA_CACHE/synthetic``): keyed by the preset, the
    seed, NumPy's version and the source of the generator and of Graph, so a changed generator or
    CSR convention never reads an old file. None (not cached) for a generator without a source file."""
    h = hashlib.blake2b(f"{preset}|{seed}|numpy {np.__version__}".encode(), digest_size=16)
    for m in (mod, graph_module):
        source = m.__spec__.origin if m.__spec__ is not None else None
        if source is None or not Path(source).is_file():
            return None
        h.update(Path(source).read_bytes())
    return default_cache_dir() / "synthetic" / f"{preset}-s{seed}-{h.hexdigest()}.npz"


def _read_cached(path: Path) -> Graph:
    """The graph :func:`_write_cached` stored at ``path`` (OSError, ValueError, KeyError, ... if the
    file is not one: :func:`tessera.files.kept` then generates it again and rewrites it)."""
    with np.load(path, allow_pickle=False) as z:
        arrays: dict[str, Any] = {k: torch.from_numpy(z[k]) for k in _GRAPH_ARRAYS if k in z.files}
        facts = json.loads(str(z["facts"]))
    n = int(facts.pop("num_nodes"))
    return Graph(arrays.pop("indptr"), arrays.pop("indices"), n, **facts, **arrays)


def _write_cached(path: Path, g: Graph) -> bool:
    """Keep ``g`` at ``path`` (atomically); True (OSError if it could not be written)."""
    arrays = {k: getattr(g, k).numpy() for k in _GRAPH_ARRAYS if getattr(g, k) is not None}
    facts = {"num_nodes": g.num_nodes, "num_classes": g.num_classes, "num_relations": g.num_relations, "name": g.name}

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as f:  # a file object, so numpy does not append ".npz"
            np.savez(f, facts=np.array(json.dumps(facts)), **arrays)

    atomic_write(path, write)
    return True


def _planetoid_names(folder: Path) -> list[str]:
    return sorted({p.name[4:-2] for p in folder.glob("ind.*.x")})


def _planetoid_candidates(root: Path, key: str) -> list[Path]:
    spelled = PLANETOID.get(key, key)
    dirs = [root / "planetoid", root, root / key / "raw", root / spelled / "raw", root / key, root / spelled]
    return list(dict.fromkeys(dirs))


def _ogb_candidates(root: Path, key: str) -> list[Path]:
    spelled = OGB.get(key, key)
    names = [key, spelled, key.replace("-", "_"), spelled.replace("-", "_")]
    return [root / n for n in dict.fromkeys(names)]


def _find_named(key: str, roots: list[Path]) -> tuple[str, Path] | None:
    for r in roots:
        if key.startswith("ogbn-"):
            for d in _ogb_candidates(r, key):
                if is_ogb_dir(d):
                    return "ogb", d
        else:
            for d in _planetoid_candidates(r, key):
                if (d / f"ind.{key}.x").is_file():
                    return "planetoid", d
    return None


def _pick_planetoid(folder: Path, names: list[str], name: str | None) -> Graph:
    if name is not None:
        if name.lower() not in names:
            raise DatasetError(f"{folder} has no Planetoid dataset {name!r}; it holds: {', '.join(names)}")
        return load_planetoid(folder, name.lower())
    if len(names) > 1:
        raise DatasetError(
            f"{folder} holds several Planetoid datasets ({', '.join(names)}); choose one with --name (name=...)"
        )
    return load_planetoid(folder, names[0])


def _no_split(split: str | None, what: str) -> None:
    if split is not None:
        raise DatasetError(f"--split {split!r} chooses among an OGB directory's split/ folders; {what} has none")


def load_path(path: str | os.PathLike, *, name: str | None = None, seed: int = 0, split: str | None = None) -> Graph:
    """Load a dataset file or directory, detecting its format from the layout and suffix (``.npz``;
    ``.pt`` / ``.pth`` ``torch.save``d PyG Data or ``data.to_dict()``; ``.nt`` N-Triples with a ``<stem>.labels`` file; ``.rel`` typed ``src rel dst`` edge lists;
    other files plain edge lists); ``split`` picks one of an OGB directory's ``split/<name>`` folders."""
    with announce_when_loaded():
        return _load_path(Path(path).expanduser(), name, seed, split)


def _load_path(p: Path, name: str | None, seed: int, split: str | None) -> Graph:
    if p.is_dir():
        for folder in (p, p / "raw"):
            names = _planetoid_names(folder)
            if names:
                _no_split(split, f"the Planetoid directory {folder}")
                return _pick_planetoid(folder, names, name)
        if is_ogb_dir(p):
            return load_ogb(p, name=name, seed=seed, split=split)
        raise DatasetError(
            f"{p} is a directory but not a dataset: expected Planetoid files (ind.<name>.x, ...) "
            "or an OGB layout (raw/edge.csv.gz)"
        )
    if not p.is_file():
        raise DatasetError(f"{p} does not exist")
    _no_split(split, f"the file {p}")
    if p.suffix.lower() == ".npz":
        return load_npz(p, seed=seed, name=name)
    if is_ntriples(p):
        return load_ntriples(p, seed=seed, name=name)
    if is_torch_file(p):
        return load_pt(p, seed=seed, name=name)
    if is_typed_edgelist(p):
        return load_typed_edgelist(p, seed=seed, name=name)
    m = _PLANETOID_FILE.match(p.name)
    if m and (p.parent / f"ind.{m.group(1)}.x").is_file():
        return load_planetoid(p.parent, name or m.group(1))
    return load_edgelist(p, seed=seed, name=name)


def load(
    spec: str, *, name: str | None = None, seed: int = 0, root: str | None = None, split: str | None = None
) -> Graph:
    """Load ``synthetic:<preset>``, a known dataset name (searched in :func:`data_roots`), or a
    path to a ``.npz`` / edge-list file or a Planetoid / OGB directory; ``split`` picks one of an
    OGB directory's ``split/<name>`` folders."""
    spec = str(spec).strip()
    if spec.lower().startswith("synthetic:"):
        _no_split(split, f"the synthetic graph {spec}")
        return _load_synthetic(spec.split(":", 1)[1], seed, name)
    key = spec.lower()
    roots = data_roots(root)
    if key in PLANETOID or key in OGB or key.startswith("ogbn-"):
        found = _find_named(key, roots)
        if found is not None:
            kind, folder = found
            if kind == "planetoid":
                _no_split(split, f"the Planetoid dataset {key}")
                return load_planetoid(folder, key)
            with announce_when_loaded():
                return load_ogb(folder, name=OGB.get(key, key), seed=seed, split=split)
    path = Path(spec).expanduser()
    if path.exists():
        return load_path(path, name=name, seed=seed, split=split)
    raise DatasetError(_not_found_message(spec, key, roots))


def _not_found_message(spec: str, key: str, roots: list[Path]) -> str:
    here = Path(".")
    if key.startswith("ogbn-"):
        patterns = [str(d / "raw" / "edge.csv.gz") for d in _ogb_candidates(here, key)]
    elif key in PLANETOID:
        patterns = [str(d / f"ind.{key}.x") for d in _planetoid_candidates(here, key)]
    else:
        patterns = []
    # One line: the CLI prints a TesseraError as a single line.
    msg = f"cannot find dataset {spec!r}: no file or directory {str(Path(spec).expanduser().absolute())!r}"
    if patterns:
        where = ", ".join(str(r) + ("" if r.is_dir() else " (missing)") for r in roots)
        msg += f"; looked for {', '.join(patterns)} under the data roots {where}"
    else:
        msg += f", and it is not a known dataset name ({', '.join(known_names())})"
    fixes = [
        "set TESSERA_DATA to the folder that holds planetoid/ (or the ind.<name>.* files) or OGB dirs such as "
        f"ogbn_arxiv/ (export TESSERA_DATA=/path/to/datasets; several folders separated by {os.pathsep!r}), "
        f"or put them in {user_data_root()}",
        "pass a path to a .npz file, an edge-list file, or a Planetoid/OGB directory",
    ]
    try:
        mod = _synthetic()
    except Exception:  # a broken synthetic module must not hide the real problem
        mod = None
    presets = (
        sorted(
            [*getattr(mod, "PRESETS", {}), *getattr(mod, "TYPED_PRESETS", ()), *getattr(mod, "MULTILABEL_PRESETS", ())]
        )
        if mod is not None
        else []
    )
    fixes.append("use synthetic:<preset>" + (f" (presets: {', '.join(presets)})" if presets else ""))
    return f"{msg}. To fix: " + "; or ".join(fixes)
