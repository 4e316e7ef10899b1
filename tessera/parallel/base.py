"""What a parallel strategy is: it gives this rank its rows of the graph (a :class:`Shard`) and,
per layer, the operand that layer aggregates with. Every strategy starts and ends a layer on the
same row split of the vertices, so strategies can change between layers without extra traffic."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch

from tessera.comm.accounting import BACKWARD, FORWARD, CommLog
from tessera.comm.group import Comm
from tessera.graph import Graph
from tessera.graph.partition import partition
from tessera.sparse import LayerSpec, Operand

SPLITS = ("train", "val", "test")


@dataclass
class Shard:
    """The vertices this rank computes, in local order: their global ids, node data, and facts
    about the whole graph (sizes, fingerprint) that checkpoints and metrics are keyed by."""

    ids: torch.Tensor  # global vertex id of every local row (int64)
    x: torch.Tensor
    y: torch.Tensor
    masks: dict[str, torch.Tensor]  # split name -> bool per local row
    num_classes: int
    name: str
    fingerprint: str
    num_nodes: int  # of the whole graph
    num_edges: int

    @classmethod
    def of_graph(cls, graph: Graph, ids: torch.Tensor | None = None) -> Shard:
        """Rows ``ids`` of ``graph`` (every row when ``ids`` is None)."""
        graph.require("x", "y", "train_mask", "val_mask", "test_mask")

        def rows(t: torch.Tensor | None) -> torch.Tensor:
            assert t is not None  # required above
            return t if ids is None else t[ids]

        assert graph.num_classes is not None  # set with the labels
        return cls(
            ids=torch.arange(graph.num_nodes) if ids is None else ids,
            x=rows(graph.x),
            y=rows(graph.y),
            masks={k: rows(getattr(graph, f"{k}_mask")) for k in SPLITS},
            num_classes=int(graph.num_classes),
            name=graph.name,
            fingerprint=graph.fingerprint(),
            num_nodes=graph.num_nodes,
            num_edges=graph.num_edges,
        )


@dataclass(frozen=True)
class StrategyOptions:
    """The settings a strategy reads: aggregation backend, remote aggregation mode, partition
    method and seed, the exchange's bit width (``grad_bits``: the backward exchange's, when it
    differs from the forward's ``comm_bits``), the tensor strategy's pipeline stages and the
    hybrid strategy's column groups."""

    backend: str = "auto"
    remote_agg: str = "prepost"
    partition: str = "metis"
    seed: int = 0
    comm_bits: int = 32
    pipeline_stages: int = 1
    groups: int = 1
    grad_bits: int | None = None

    def exchange_bits(self) -> tuple[int, int]:
        """Bits per exchanged value ``(forward, backward)``."""
        return self.comm_bits, self.comm_bits if self.grad_bits is None else self.grad_bits


def row_split(graph: Graph, comm: Comm, options: StrategyOptions) -> np.ndarray:
    """The rank of every vertex (int64): rank 0 partitions (``options.partition``, seeded) and
    broadcasts, so every rank holds the same split."""
    part = torch.zeros(graph.num_nodes, dtype=torch.int64)
    if comm.rank == 0:
        part = torch.from_numpy(partition(graph, comm.world, options.partition, seed=options.seed).astype("int64"))
    comm.broadcast(part)
    return part.numpy()


class ExchangeOperand(Operand):
    """An operand whose product exchanges rows between ranks: both directions are one
    :meth:`_product`, and per-edge values (attention) are refused, as ranks hold no whole edge list."""

    @abstractmethod
    def _product(self, h: torch.Tensor, direction: int) -> torch.Tensor:
        """``A h`` (``direction`` FORWARD) or ``A^T h`` (BACKWARD) for this rank's rows."""

    def spmm(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if weight is not None:
            self.edge_structure()
        return self._product(x, FORWARD)

    def spmm_t(self, g: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        if weight is not None:
            self.edge_structure()
        return self._product(g, BACKWARD)

    def sddmm_dot(self, g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        self.edge_structure()  # raises: no rank holds every edge's endpoints
        raise NotImplementedError(f"{type(self).__name__} computes no per-edge products")


class Strategy(ABC):
    """One way of splitting a layer's work over the ranks of ``comm``."""

    name: ClassVar[str]
    #: the options of some strategies only (``remote_agg``, ``pipeline_stages``, ``groups``) this one reads
    reads: ClassVar[tuple[str, ...]] = ()

    def __init__(self, comm: Comm, options: StrategyOptions) -> None:
        self.comm, self.options = comm, options
        #: the byte and time counters of this strategy's exchanges (None: it exchanges nothing)
        self.log: CommLog | None = None

    def check(self, specs: list[LayerSpec]) -> None:
        """Raise :class:`~tessera.errors.ConfigError` for a layer this strategy cannot run
        (before any partitioning work); every layer runs unless a strategy says otherwise."""
        return None

    @abstractmethod
    def shard(self, graph: Graph) -> Shard:
        """This rank's rows of ``graph`` (partitioning it as the strategy needs)."""

    def shard_from_part(self, part: dict) -> Shard:
        """This rank's rows from its own part file (``tessera partition --out``)."""
        from tessera.errors import ConfigError

        raise ConfigError(f"the {self.name} strategy cannot train from a partition directory")

    @abstractmethod
    def operand(self, spec: LayerSpec, layer: int) -> Operand:
        """The operand layer ``layer`` (described by ``spec``) aggregates with, after :meth:`shard`."""
