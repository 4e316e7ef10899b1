"""A coordinate edge list (PyG's ``edge_index``, the entries of a ``torch.sparse`` adjacency) as
the validated destination-major graph :func:`~tessera.sparse.as_operand` wraps: how a layer called
with PyG's inputs reaches the primitives (:mod:`tessera.nn.conv.inputs` checks and caches them)."""

from __future__ import annotations

import torch

from tessera.graph.csr import CSRStructure
from tessera.graph.graph import Graph


def coo_graph(
    src: torch.Tensor,
    dst: torch.Tensor,
    num_nodes: int,
    edge_weight: torch.Tensor | None = None,
    edge_type: torch.Tensor | None = None,
) -> CSRStructure:
    """The graph of the edges ``src[e] -> dst[e]`` over ``num_nodes`` vertices, on the host (where
    every graph lives), with one weight or relation id per edge when given."""
    host = [None if t is None else t.detach().cpu() for t in (edge_weight, edge_type)]
    edges = torch.stack([src.detach().cpu(), dst.detach().cpu()])
    return Graph.from_edge_index(edges, num_nodes, edge_weight=host[0], edge_type=host[1])
