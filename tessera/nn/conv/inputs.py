"""A graph given to a layer as PyG users hold it, turned into the graph the layer's ``forward``
takes (:class:`~tessera.nn.conv.base.GraphConv` calls :func:`pyg_inputs` for anything that is not a
tessera graph or operand).

Accepted: ``conv(x, edge_index)`` with ``edge_index`` ``(2, E)`` (row 0 the sources, row 1 the
destinations); the per-edge tensor the layer declares (:attr:`GraphConv.edge_data
<tessera.nn.conv.base.GraphConv.edge_data>`) after it, positionally or by name; a ``torch.sparse``
adjacency (COO, CSR or CSC) in PyG's ``adj_t`` layout, ``N x N`` with row ``i`` holding the sources
of vertex ``i``'s in-edges and its values the layer's per-edge data (GCN: weights; RGCN: relation
ids; other layers: all 1); and ``size=(N, N)``. The vertex count is ``x.shape[0]``. Each edge index
or adjacency is converted once while it lives unmodified (its per-edge tensor likewise), so a
training loop pays the conversion on its first step. Wrong sizes, devices or argument orders are a
:class:`~tessera.errors.GraphError` (a ``ValueError``) or a ``TypeError`` saying what to pass."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

import torch

from tessera.errors import GraphError
from tessera.memo import TensorMemo
from tessera.sparse import GraphOperand
from tessera.sparse.coo import coo_graph

# per edge index or adjacency and vertex count: {the per-edge data's name, or None: (a weak
# reference to that tensor, its version, the graph)}
_graphs: TensorMemo[dict[str | None, tuple[weakref.ref | None, int, GraphOperand]]] = TensorMemo()


def pyg_inputs(
    layer: str, edge_data: str | None, x: object, graph: object, args: tuple, kwargs: dict[str, Any]
) -> tuple[GraphOperand, tuple, dict[str, Any]]:
    """``(graph, args, kwargs)`` for the ``forward`` of the layer class named ``layer`` from a call
    ``conv(x, graph, *args, **kwargs)`` with PyG's inputs; ``edge_data`` names the per-edge tensor
    the layer takes (``edge_weight``, ``edge_type``, or None)."""
    if not isinstance(x, torch.Tensor):
        if isinstance(graph, torch.Tensor):
            raise TypeError(
                f"{layer} takes the node features first and the graph second (PyG's order): call conv(x, graph), "
                "not conv(graph, x); a DGL graph g goes in as its edge index, conv(x, torch.stack(g.edges()))"
            )
        raise TypeError(f"{layer} takes node features x of shape (N, F) first, got {type(x).__name__}")
    if x.dim() == 0:
        raise GraphError(f"{layer} takes node features x of shape (N, F), got a scalar")
    kwargs = dict(kwargs)
    size = kwargs.pop("size", None)
    data = kwargs.pop(edge_data, None) if edge_data is not None else None
    if args and isinstance(args[0], torch.Tensor):
        if edge_data is None:
            raise TypeError(
                f"{layer} takes no per-edge tensor: call conv(x, edge_index) (or conv(x, edge_index, hints))"
            )
        if data is not None:
            raise TypeError(f"{layer} got {edge_data} twice, by position and by name")
        data, args = args[0], args[1:]
    unknown = sorted(set(kwargs) - {"hints"})
    if unknown:
        takes = f"conv(x, edge_index, {edge_data}=None, size=None)" if edge_data else "conv(x, edge_index, size=None)"
        raise TypeError(f"{layer} got an unexpected keyword argument {unknown[0]!r}; its PyG-style call is {takes}")
    n = int(x.shape[0])
    if size is not None and tuple(size) != (n, n):
        raise GraphError(
            f"{layer} aggregates over one vertex set: size must be None or (N, N) with N = x.shape[0] = {n}, "
            f"got {tuple(size)} (bipartite graphs are not supported)"
        )
    if not isinstance(graph, torch.Tensor):
        raise TypeError(
            f"{layer} takes the graph as a (2, E) edge_index tensor, a torch.sparse adjacency (adj_t: row i holds "
            f"the sources of vertex i's in-edges), a tessera Graph or an operand; got {type(graph).__name__}"
        )
    if graph.device != x.device:
        what = "edge_index" if graph.layout == torch.strided else "the adjacency"
        raise GraphError(
            f"{layer}: {what} is on {graph.device} but x on {x.device}: put them on one device "
            f"(conv(x, {'edge_index' if graph.layout == torch.strided else 'adj_t'}.to(x.device)))"
        )
    if graph.layout == torch.strided:
        return _edge_index_graph(layer, edge_data, graph, n, data), args, kwargs
    return _adjacency_graph(layer, edge_data, graph, n, data), args, kwargs


def _edge_index_graph(
    layer: str, edge_data: str | None, edge_index: torch.Tensor, n: int, data: torch.Tensor | None
) -> GraphOperand:
    """The graph of ``edge_index`` over ``n`` vertices with ``data`` as its ``edge_data``."""
    dtype = edge_index.dtype
    if (
        edge_index.dim() != 2
        or edge_index.shape[0] != 2
        or dtype.is_floating_point
        or dtype.is_complex
        or dtype == torch.bool
    ):
        order = "; the features go first: conv(x, edge_index)" if dtype.is_floating_point else ""
        raise GraphError(
            f"{layer}: edge_index must be an integer tensor of shape (2, E), row 0 the sources and row 1 the "
            f"destinations; got {dtype} of shape {tuple(edge_index.shape)}{order}"
        )
    _check_edge_data(layer, edge_data, data, int(edge_index.shape[1]), edge_index.device)

    def make() -> GraphOperand:
        if edge_index.numel():
            lo, hi = int(edge_index.min()), int(edge_index.max())
            if lo < 0:
                raise GraphError(f"{layer}: edge_index holds vertex {lo}; vertices are numbered from 0")
            if hi >= n:
                raise GraphError(
                    f"{layer}: edge_index refers to vertex {hi} but x has {n} rows: pass features for every "
                    f"vertex (x.shape[0] at least max(edge_index) + 1 = {hi + 1})"
                )
        weight, types = (data, None) if edge_data == "edge_weight" else (None, data)
        return coo_graph(edge_index[0], edge_index[1], n, weight, types)

    return _cached(edge_index, n, edge_data, data, make)


def _adjacency_graph(
    layer: str, edge_data: str | None, adj: torch.Tensor, n: int, data: torch.Tensor | None
) -> GraphOperand:
    """The graph of the ``adj_t``-layout sparse adjacency ``adj`` (``n x n``): its values are the
    layer's ``edge_data`` unless an ``edge_type`` tensor is given."""
    if adj.dim() != 2 or adj.layout not in (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc):
        raise GraphError(
            f"{layer}: the adjacency must be one N x N sparse matrix in COO, CSR or CSC layout, got {adj.layout} "
            f"of shape {tuple(adj.shape)} (convert it with adj.to_sparse_csr())"
        )
    if tuple(adj.shape) != (n, n):
        raise GraphError(
            f"{layer}: the adjacency is {adj.shape[0]} x {adj.shape[1]} but x has {n} rows: pass the N x N adjacency "
            "with N = x.shape[0] (adj_t: row i holds the sources of vertex i's in-edges)"
        )
    if edge_data == "edge_weight" and data is not None:
        raise TypeError(
            f"{layer}: a sparse adjacency's values are its edge weights; call conv(x, adj_t) without edge_weight"
        )
    if edge_data == "edge_weight" and adj.requires_grad:
        raise GraphError(_no_weight_gradient(layer, "adj_t"))
    _check_edge_data(layer, edge_data, data, int(adj._nnz()), adj.device)

    def make() -> GraphOperand:
        dst, src, values = _entries(adj)
        weight = types = None
        if edge_data == "edge_weight":
            weight = values if values.is_floating_point() else values.float()
        elif edge_data == "edge_type":
            types = data if data is not None else values
            if types.is_floating_point() or types.is_complex() or types.dtype == torch.bool:
                raise GraphError(
                    f"{layer} needs relation ids: pass edge_type= (one per stored entry, in the adjacency's storage "
                    "order) or an adjacency whose integer values are the relation ids"
                )
        elif bool((values != 1).any()):
            raise GraphError(
                f"{layer} aggregates without edge weights, but the adjacency has values other than 1: pass its "
                "pattern (all values 1), or use GCNConv for weighted aggregation"
            )
        return coo_graph(src, dst, n, weight, types)

    return _cached(adj, n, edge_data, data, make)


def _entries(adj: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The stored entries of a 2-D sparse matrix in storage order: rows, columns, values."""
    if adj.layout == torch.sparse_coo:
        # the stored entries as they are: an uncoalesced adjacency keeps its repeated entries
        # (parallel edges), as PyG reads it
        rows, cols = adj._indices()
        return rows.long(), cols.long(), adj._values()
    if adj.layout == torch.sparse_csr:
        counts = adj.crow_indices().diff().long()
        rows = torch.repeat_interleave(torch.arange(adj.shape[0], device=adj.device), counts)
        return rows, adj.col_indices().long(), adj.values()
    counts = adj.ccol_indices().diff().long()
    cols = torch.repeat_interleave(torch.arange(adj.shape[1], device=adj.device), counts)
    return adj.row_indices().long(), cols, adj.values()


def _check_edge_data(
    layer: str, edge_data: str | None, data: torch.Tensor | None, edges: int, device: torch.device
) -> None:
    """A GraphError naming the fix unless ``data`` (if given) is one ``edge_data`` value per edge on ``device``."""
    if data is None:
        return
    if data.dim() != 1 or data.numel() != edges:
        raise GraphError(f"{layer}: {edge_data} must hold one value per edge ({edges}), got shape {tuple(data.shape)}")
    if data.device != device:
        raise GraphError(f"{layer}: {edge_data} is on {data.device} but the edges on {device}: put them on one device")
    if edge_data == "edge_weight":
        if not data.is_floating_point():
            raise GraphError(f"{layer}: edge_weight must be floating point, got {data.dtype}")
        if data.requires_grad:
            raise GraphError(_no_weight_gradient(layer, "edge_weight"))
    elif data.is_floating_point() or data.is_complex() or data.dtype == torch.bool:
        raise GraphError(f"{layer}: edge_type must hold integer relation ids, got {data.dtype}")


def _no_weight_gradient(layer: str, name: str) -> str:
    return f"{layer} takes edge weights as fixed graph data and computes no gradient for them: pass {name}.detach()"


def _cached(
    t: torch.Tensor, n: int, edge_data: str | None, data: torch.Tensor | None, make: Callable[[], GraphOperand]
) -> GraphOperand:
    """``make()``, kept for ``t`` at its version with ``n`` vertices and for ``data`` at its version."""
    found = _graphs.find(t, n)
    table = found[0] if found is not None else _graphs.put(t, {}, n)
    name = None if data is None else edge_data
    hit = table.get(name)
    if hit is not None:
        ref, version, graph = hit
        if data is None or (ref is not None and version == data._version and ref() is data):
            return graph
    graph = make()
    table[name] = (None, 0, graph) if data is None else (weakref.ref(data), data._version, graph)
    return graph
