"""Whole-graph structure held once per host: the graphs every rank multiplies by, built on one
rank of each host and mapped read-only by all of them (:mod:`tessera.comm.shared_arrays`).

:func:`shared_graph` shares a graph's CSR arrays (row pointers, sources, edge weights).
:class:`SharedOperand` is the single-process operand over such a graph whose variants are shared
too: GCN's normalised graph (with its self loops and edge values) and the self-looped graph are
built once per host, and every graph a variant multiplies by comes with its transposed CSR and,
where it has edge weights, the weights in transposed order (what ``spmm_t`` reads) shared with
it. Each is shared the first time a layer asks for it; every rank asks at the same point, as they
run the same model. Values are bit for bit those each rank would build on its own.
"""

from __future__ import annotations

from collections.abc import Callable

from tessera.backends import LocalOperand, get_backend
from tessera.backends.cpu_csr import CSRBackend
from tessera.comm.group import Comm
from tessera.comm.shared_arrays import share_arrays
from tessera.graph import Graph
from tessera.graph.csr import TransposedCSR


def shared_graph(comm: Comm, make: Callable[[], Graph], what: str = "graph structure") -> Graph:
    """The structure of ``make()`` (CSR, edge weights and types; no node data), built on one rank
    per host and mapped read-only into every rank of it."""

    def arrays() -> dict:
        g = make()
        out = {"indptr": g.indptr, "indices": g.indices, "edge_weight": g.edge_weight, "edge_type": g.edge_type}
        return {k: v for k, v in out.items() if v is not None}

    a = share_arrays(comm, arrays, what)
    n = a["indptr"].numel() - 1
    return Graph(a["indptr"], a["indices"], n, edge_weight=a.get("edge_weight"), edge_type=a.get("edge_type"))


def with_shared_transpose(comm: Comm, graph: Graph, what: str = "transposed graph structure") -> Graph:
    """``graph`` (the same arrays) with its transposed CSR, and its edge weights in transposed
    order, built on one rank per host and mapped read-only into every rank of it."""
    csr = get_backend("csr")

    def arrays() -> dict:
        twin = graph.replace()  # transposing caches int64 endpoint arrays: on the twin, dropped after
        t = twin.transpose()
        out = {"indptr": t.indptr, "indices": t.indices, "perm": t.perm}
        if twin.edge_weight is None or not isinstance(csr, CSRBackend):
            return out
        return {**out, "weight": csr.transposed_weight(twin, twin.edge_weight)}

    a = share_arrays(comm, arrays, what)
    g = graph.replace()
    g.set_transpose(TransposedCSR(a["indptr"], a["indices"], a["perm"]))
    if "weight" in a and g.edge_weight is not None:  # shared only for a weighted graph
        csr.keep_transposed_weight(g, g.edge_weight, a["weight"])
    return g


class SharedOperand(LocalOperand):
    """:class:`LocalOperand` over a shared graph whose variants' graphs are shared as well."""

    def __init__(self, matrix: Graph, comm: Comm, backend: str = "auto") -> None:
        super().__init__(matrix, backend)
        self.comm = comm

    def _derived_graph(self, key: tuple, what: str, make: Callable[[Graph], Graph]) -> Graph:
        comm = self.comm

        def shared(m: Graph) -> Graph:
            # built from a twin of m, so the arrays building caches on it go with the twin
            g = shared_graph(comm, lambda: make(m.replace()), what)
            return with_shared_transpose(comm, g, f"transposed {what}")

        return super()._derived_graph(key, what, shared)

    def _transposable(self) -> Graph:
        """This graph with its transpose shared (made the first time a variant needs it)."""
        comm = self.comm
        return super()._derived_graph(("transposable",), "graph structure", lambda m: with_shared_transpose(comm, m))

    def pattern(self) -> LocalOperand:
        return LocalOperand(self._transposable(), self.backend)

    def weighted(self) -> LocalOperand:
        g = self._transposable()
        return LocalOperand(g, self.backend, g.edge_weight)
