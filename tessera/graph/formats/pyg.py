"""Conversion to and from ``torch_geometric.data.Data`` (torch_geometric is imported lazily)."""

from __future__ import annotations

from typing import Any

import torch

from tessera.errors import DatasetError
from tessera.graph.formats._common import MASKS
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
    if getattr(data, "edge_index", None) is None:
        raise DatasetError("PyG data has no edge_index")
    node: dict[str, Any] = {"name": name}
    if getattr(data, "x", None) is not None:
        node["x"] = data.x.to(torch.float32) if data.x.dtype != torch.float32 else data.x
    y = getattr(data, "y", None)
    if y is not None:
        if y.dim() == 2 and y.size(1) == 1:  # OGB stores labels as (N, 1)
            y = y.view(-1)
        node["y"] = y
    n = int(data.num_nodes)
    backed = [len(v) for v in (node.get("x"), node.get("y")) if v is not None]
    if not backed or n > max(backed):
        check_vertex_count(n, int(data.edge_index.shape[-1]), "PyG data", "set data.x or data.y for every vertex")
    for m in MASKS:
        mask = getattr(data, m, None)
        if mask is None:
            continue
        if mask.dim() != 1:
            raise DatasetError(
                f"PyG {m} has shape {tuple(mask.shape)} (several splits); select one first, e.g. data.{m} = data.{m}[:, 0]"
            )
        node[m] = mask
    edge_type = getattr(data, "edge_type", None)
    relations = getattr(data, "num_relations", None) if edge_type is not None else None
    if relations is not None and not isinstance(relations, int):
        raise DatasetError(f"PyG data.num_relations must be an int, got {relations!r}")
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
