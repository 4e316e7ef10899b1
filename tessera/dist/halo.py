"""A rank's view of a partitioned graph and its halo-exchange aggregation (SuperGCN §5.2).

For owned features ``h`` the rank computes ``A h + R . all_to_all(S h)`` where ``A`` holds the
in-edges among owned vertices, ``S`` builds the rows this rank sends (a source row for
post-aggregated edges, a partial sum for pre-aggregated ones) and ``R`` adds the received rows
into their destinations. Backward is the transpose through the reverse exchange. The exchange
starts asynchronously and the local product runs while it is in flight.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from tessera.errors import ConfigError
from tessera.graph import Graph
from tessera.ops.registry import get_backend
from tessera.ops.sparse import CSRMatrix


class _HaloAggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, dg: DistGraph, backend: str):
        be = get_backend(backend)
        ctx.dg, ctx.be = dg, be
        send = be.spmm(dg.S, h, dg.S.weight)
        recv = h.new_empty((dg.S_recv_rows, *h.shape[1:]))
        work = dg.exchange(recv, send, forward=True)
        out = be.spmm(dg.A, h, dg.A.weight)
        if work is not None:
            work.wait()
        return out + be.spmm(dg.R, recv, dg.R.weight)

    @staticmethod
    def backward(ctx, g):
        dg, be = ctx.dg, ctx.be
        g = g.contiguous()
        g_recv = be.spmm_t(dg.R, g, dg.R.weight)
        g_send = g.new_empty((dg.S.num_rows, *g.shape[1:]))
        work = dg.exchange(g_send, g_recv, forward=False)
        gh = be.spmm_t(dg.A, g, dg.A.weight)
        if work is not None:
            work.wait()
        return gh + be.spmm_t(dg.S, g_send, dg.S.weight), None, None


class DistGraph:
    """Rank ``rank``'s share of ``graph`` under partition ``part``: owned vertices in local order,
    their node data, and the plan matrices for ``mode`` (``post``, ``pre`` or ``prepost``)."""

    def __init__(self, graph: Graph, part: np.ndarray, rank: int, world: int, mode: str):
        from tessera.dist.plan import build_rank_plan

        self.graph, self.part, self.rank, self.world, self.mode = graph, part, rank, world, mode
        w = None if graph.edge_weight is None else graph.edge_weight.numpy()
        plan = build_rank_plan(graph.indptr.numpy(), graph.indices.numpy(), w, part, mode, rank, world=world)
        self.plan = plan
        self.owned = torch.from_numpy(plan.owned).long()
        n = int(plan.owned.size)
        self.num_nodes = n
        self.A = CSRMatrix.from_numpy(*plan.A[:3], n, n)
        self.S = CSRMatrix.from_numpy(*plan.S[:3], plan.S[3], n)
        self.R = CSRMatrix.from_numpy(*plan.R[:3], n, plan.R[3])
        self.S_recv_rows = int(plan.R[3])
        self.send_counts = [int(c) for c in plan.send_counts]
        self.recv_counts = [int(c) for c in plan.recv_counts]
        self._in_degree = torch.from_numpy(np.asarray(plan.in_degree_global, dtype=np.int64))
        self.x = None if graph.x is None else graph.x[self.owned]
        self.y = None if graph.y is None else graph.y[self.owned]
        for name in ("train_mask", "val_mask", "test_mask"):
            m = getattr(graph, name)
            setattr(self, name, None if m is None else m[self.owned])
        self.num_classes, self.name = graph.num_classes, graph.name
        self._cache: dict = {}
        self.sent_rows: list[int] = []  # rows sent per exchange, for accounting

    # ---- the Graph surface the layers use
    edge_weight = None  # weights live in the plan matrices

    @property
    def num_rows(self) -> int:
        return self.num_nodes

    @property
    def num_cols(self) -> int:
        return self.num_nodes

    @property
    def num_features(self) -> int:
        return 0 if self.x is None else int(self.x.shape[1])

    def cached(self, key: object, make):
        """Memoise a derived structure on this rank's view."""
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]

    def fingerprint(self) -> str:
        """The global graph's fingerprint."""
        return self.graph.fingerprint()

    def in_degree(self) -> torch.Tensor:
        """Global in-degree of each owned vertex (local and remote in-edges)."""
        return self._in_degree

    def gcn_norm(self, add_self_loops: bool = True, improved: bool = False) -> DistGraph:
        """The same partition of the globally normalised graph."""
        return DistGraph(self.graph.gcn_norm(add_self_loops, improved), self.part, self.rank, self.world, self.mode)

    def add_self_loops(self, fill_value: float = 1.0) -> DistGraph:
        """The same partition of the graph with self loops."""
        return DistGraph(self.graph.add_self_loops(fill_value), self.part, self.rank, self.world, self.mode)

    # ---- communication
    def exchange(self, out: torch.Tensor, inp: torch.Tensor, forward: bool):
        """Start the all-to-all of ``inp`` into ``out`` (reverse splits when not ``forward``)."""
        send, recv = (self.send_counts, self.recv_counts) if forward else (self.recv_counts, self.send_counts)
        self.sent_rows.append(sum(send))
        if self.world == 1:
            out.copy_(inp)
            return None
        return dist.all_to_all_single(out, inp.contiguous(), output_split_sizes=recv, input_split_sizes=send, async_op=True)

    def distributed_aggregate(self, x: torch.Tensor, reduce: str, weight: torch.Tensor | None, backend: str) -> torch.Tensor:
        """``ops.aggregate`` on this rank: local product plus the halo exchange."""
        if weight is not None:
            raise ConfigError("edge-weighted aggregation (GAT attention) is single-process only for now; run GAT without --nprocs")
        if x.shape[0] != self.num_nodes:
            raise ValueError(f"x has {x.shape[0]} rows but rank {self.rank} owns {self.num_nodes} vertices")
        out = _HaloAggregate.apply(x, self, backend)
        if reduce == "mean":
            d = self._in_degree.to(out.dtype)
            out = out * torch.where(d > 0, 1.0 / d.clamp(min=1), torch.zeros_like(d)).view(-1, *([1] * (out.dim() - 1)))
        return out
