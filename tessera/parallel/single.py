"""One process computes every row: the operand is the whole graph on this process's backends."""

from __future__ import annotations

from tessera.backends import local_operand
from tessera.graph import Graph
from tessera.parallel.base import Shard, Strategy
from tessera.sparse import LayerSpec, Operand


class SingleStrategy(Strategy):
    """No parallelism: the whole graph, every layer."""

    name = "single"

    def shard(self, graph: Graph) -> Shard:
        self.graph = graph
        return Shard.of_graph(graph)

    def operand(self, spec: LayerSpec, layer: int) -> Operand:
        return local_operand(self.graph, self.options.backend)
