"""Conversion to and from ``torch_geometric.data.Data`` (torch_geometric is imported lazily)."""

from __future__ import annotations

import importlib
import pickle
import re
import warnings
import zipfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch

from tessera.errors import DatasetError
from tessera.graph.formats._common import MASKS, announce_split, default_split, multilabel_from_array
from tessera.graph.formats._limits import check_vertex_count
from tessera.graph.graph import Graph


def _require_pyg() -> Any:
    try:
        import torch_geometric.data
    except ImportError as e:
        raise DatasetError(f"PyG conversion requires torch_geometric: pip install torch_geometric ({e})") from e
    return torch_geometric.data


def from_pyg(data: Any, name: str = "pyg") -> Graph:
    """A Graph from a PyG ``Data`` (edge_index, x, y, masks, edge_weight, edge_type, and
    num_relations when the data declares it)."""
    _require_pyg()
    return _from_fields(data, name)


def _from_fields(data: Any, name: str, source: str = "PyG data") -> Graph:
    """A Graph from an object with PyG ``Data``'s attribute names (see :func:`from_pyg`)."""
    if getattr(data, "edge_index", None) is None:
        raise DatasetError(f"{source} has no edge_index")
    node: dict[str, Any] = {"name": name}
    if getattr(data, "x", None) is not None:
        node["x"] = data.x.to(torch.float32) if data.x.dtype != torch.float32 else data.x
    y = getattr(data, "y", None)
    if y is not None:
        if y.dim() == 2 and y.size(1) == 1:  # OGB stores labels as (N, 1)
            y = y.view(-1)
        elif y.dim() == 2:  # multi-label targets (N x C 0/1, as ogbn-proteins): checked and made int64 here
            y = torch.from_numpy(multilabel_from_array(y.detach().cpu().numpy(), f"{source}: y"))
        node["y"] = y
    n = int(data.num_nodes)
    backed = [len(v) for v in (node.get("x"), node.get("y")) if v is not None]
    if not backed or n > max(backed):
        check_vertex_count(n, int(data.edge_index.shape[-1]), source, "set data.x or data.y for every vertex")
    for m in MASKS:
        mask = getattr(data, m, None)
        if mask is None:
            continue
        if mask.dim() != 1:
            raise DatasetError(
                f"{source}: {m} has shape {tuple(mask.shape)} (several splits); select one first, e.g. data.{m} = data.{m}[:, 0]"
            )
        node[m] = mask
    edge_type = getattr(data, "edge_type", None)
    relations = getattr(data, "num_relations", None) if edge_type is not None else None
    if relations is not None and not isinstance(relations, int):
        raise DatasetError(f"{source}: num_relations must be an int, got {relations!r}")
    return Graph.from_edge_index(
        data.edge_index,
        n,
        edge_weight=getattr(data, "edge_weight", None),
        edge_type=edge_type,
        num_relations=relations,
        **node,
    )


def to_pyg(graph: Graph) -> Any:
    """A PyG ``Data`` holding the graph's edges (CSR order), node data and edge data."""
    pyg_data = _require_pyg()
    fields: dict[str, Any] = {"edge_index": graph.edge_index(), "num_nodes": graph.num_nodes}
    for k in ("x", "y", *MASKS, "edge_weight", "edge_type"):
        v = getattr(graph, k)
        if v is not None:
            fields[k] = v
    if graph.num_relations is not None:
        fields["num_relations"] = graph.num_relations
    return pyg_data.Data(**fields)


# ---------------------------------------------------------------------------- torch.save files

_TORCH_SUFFIXES = (".pt", ".pth")
# PyG's own classes that a pickled homogeneous ``Data`` references (PyG >= 2.4 registers most of
# them with torch.serialization itself); admitted only while loading a file that names PyG.
_PYG_CLASSES = (
    ("torch_geometric.data.data", "Data"),
    ("torch_geometric.data.data", "DataEdgeAttr"),
    ("torch_geometric.data.data", "DataTensorAttr"),
    ("torch_geometric.data.storage", "GlobalStorage"),
)
_FIELDS = ("edge_index", "x", "y", *MASKS, "edge_weight", "edge_attr", "edge_type", "num_nodes", "num_relations")


def is_torch_file(path: str | Path) -> bool:
    """Whether ``path`` looks like a ``torch.save`` file: a ``.pt`` / ``.pth`` name or a zip holding ``data.pkl``."""
    path = Path(path)
    if path.suffix.lower() in _TORCH_SUFFIXES:
        return True
    try:
        if not zipfile.is_zipfile(path):
            return False
        with zipfile.ZipFile(path) as z:
            return any(n == "data.pkl" or n.endswith("/data.pkl") for n in z.namelist())
    except (OSError, zipfile.BadZipFile):
        return False


def _pickle_bytes(path: Path) -> bytes:
    """The pickle stream of a torch.save file (the zip's ``data.pkl``, or a legacy file's first 16 MiB)."""
    try:
        if zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as z:
                names = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
                return z.read(names[0]) if names else b""
        with open(path, "rb") as f:  # a legacy file: class references come before the tensor data
            return f.read(1 << 24)
    except (OSError, zipfile.BadZipFile):
        return b""


def _pyg_safe_globals() -> list[Any]:
    """PyG's ``Data`` classes listed in :data:`_PYG_CLASSES` (empty without torch_geometric)."""
    out = []
    for module, cls in _PYG_CLASSES:
        try:
            out.append(getattr(importlib.import_module(module), cls))
        except (ImportError, AttributeError):
            continue
    return out


_SAVE_HINT = (
    "tessera reads torch.save files with weights_only=True and never runs pickled code: save tensors only, "
    "e.g. torch.save(data.to_dict(), path) for a PyG Data (a saved homogeneous Data also loads when "
    "torch_geometric is installed)"
)


def _refusal(text: str) -> str:
    """Why torch's weights-only unpickler refused a file, from its error message, in one phrase."""
    m = re.search(r"GLOBAL ([\w.]+)", text)
    if m:
        return f"it references {m.group(1)}, which only an unrestricted unpickler would run"
    lines = [ln.strip() for ln in text.splitlines()[1:]]
    skip = ("Check the documentation", "Please file an issue")
    lines = [ln for ln in lines if ln and not ln.startswith(skip)]
    return lines[0] if lines else "it is not a plain tensor file"


def read_torch_file(path: str | Path) -> Any:
    """``torch.load(path, weights_only=True)`` on the CPU, admitting PyG's ``Data`` classes when the
    file names them; anything else that needs unpickling code is one DatasetError."""
    path = Path(path)
    with ExitStack() as stack:
        if b"torch_geometric" in _pickle_bytes(path):
            stack.enter_context(torch.serialization.safe_globals(_pyg_safe_globals()))
        # A pickle protocol above 2 only makes torch warn; the restricted unpickler still decides.
        stack.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="Detected pickle protocol", category=UserWarning)
        try:
            return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise DatasetError(f"{path}: refused to load ({_refusal(str(e))}); {_SAVE_HINT}") from None
        except (OSError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as e:
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DatasetError(f"cannot read {path} with torch.load: {first}") from None


class _Fields:
    """Attribute access to a dict of PyG field names (what ``Data.to_dict()`` returns)."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)

    def __getattr__(self, key: str) -> Any:
        return None


def _num_nodes(d: dict[str, Any]) -> int:
    n = d.get("num_nodes")
    if n is not None:
        return int(n)
    for k in ("x", "y", *MASKS):
        v = d.get(k)
        if isinstance(v, torch.Tensor) and v.dim() >= 1:
            return int(v.shape[0])
    ei = d["edge_index"]
    return int(ei.max()) + 1 if isinstance(ei, torch.Tensor) and ei.numel() else 0


def _as_fields(obj: Any, source: str) -> dict[str, Any]:
    """The PyG fields of a loaded object: a ``Data`` or a dict of tensors."""
    cls = type(obj)
    if cls.__module__.startswith("torch_geometric"):
        if cls.__name__ != "Data":
            raise DatasetError(
                f"{source} holds a PyG {cls.__name__}; tessera reads a homogeneous Data "
                "(for HeteroData: data.to_homogeneous())"
            )
        d = {k: obj[k] for k in obj.keys()}  # noqa: SIM118 (Data.keys() is a method, not a dict view)
        d.setdefault("num_nodes", obj.num_nodes)
        return d
    if isinstance(obj, dict) and all(isinstance(k, str) for k in obj):
        return dict(obj)
    raise DatasetError(
        f"{source} holds a {cls.__name__}, not a graph: expected a PyG Data or a dict such as data.to_dict() "
        "with edge_index and optionally x, y, train_mask, val_mask, test_mask, edge_weight, edge_type"
    )


def load_pt(path: str | Path, *, seed: int = 0, name: str | None = None) -> Graph:
    """Load a ``torch.save``d PyG ``Data`` or dict of its tensors (``data.to_dict()``) safely
    (:func:`read_torch_file`); a labelled graph without masks gets the seeded 20/30-per-class split."""
    path = Path(path)
    source = str(path)
    d = _as_fields(read_torch_file(path), source)
    if not isinstance(d.get("edge_index"), torch.Tensor):
        raise DatasetError(f"{source} has no edge_index tensor; it holds: {', '.join(sorted(d)) or 'nothing'}")
    for k, v in d.items():
        if k in _FIELDS and k not in ("num_nodes", "num_relations") and v is not None:
            if not isinstance(v, torch.Tensor):
                raise DatasetError(f"{source}: {k} is a {type(v).__name__}, expected a tensor")
    ignored = sorted(k for k in d if k not in _FIELDS)
    edge_attr = d.pop("edge_attr", None)
    if edge_attr is not None and d.get("edge_weight") is None:
        if edge_attr.dim() == 1 or (edge_attr.dim() == 2 and edge_attr.shape[1] == 1):
            d["edge_weight"] = edge_attr.reshape(-1).to(torch.float32)  # one value per edge: its weight
        else:
            ignored.append(f"edge_attr of shape {tuple(edge_attr.shape)}")
    if ignored:
        warnings.warn(f"{source}: ignoring {', '.join(ignored)} (tessera uses {', '.join(_FIELDS)})", stacklevel=2)
    y = d.get("y")
    if y is not None and y.dim() == 1 and (y.dtype.is_floating_point or y.dtype == torch.bool):
        raise DatasetError(f"{source}: y has dtype {y.dtype}; labels must be integer class ids (-1: unlabelled)")
    d["num_nodes"] = _num_nodes(d)
    g = _from_fields(_Fields(d), name or path.stem, source)
    if g.y is not None and all(getattr(g, m) is None for m in MASKS):
        split = default_split(g.y, g.num_classes or 0, seed)
        announce_split(split, seed, source, multilabel=g.multilabel)
        g = g.replace(**split)
    return g
