"""A rank's view of a partitioned graph and its halo-exchange aggregation (SuperGCN §5.2).

For owned features ``h`` the rank computes ``A h + R . all_to_all(S h)`` where ``A`` holds the
in-edges among owned vertices, ``S`` builds the rows this rank sends (a source row for
post-aggregated edges, a partial sum for pre-aggregated ones) and ``R`` adds the received rows
into their destinations. Backward is the transpose through the reverse exchange. The exchange
starts asynchronously and the local product runs while it is in flight.

Everything a view needs is local to the rank: self loops only touch ``A``, and GCN's symmetric
normalisation factorises as ``D^-1/2 Â D^-1/2 x = dis * (Â (dis * x))`` with ``dis_i`` computed
from ``i``'s own in-edges, so a rank built from its part file alone trains the same model.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from tessera.dist.accounting import BACKWARD, FORWARD, CommLog, Timer
from tessera.dist.plan import RankPlan, build_rank_plan, plan_from_part
from tessera.dist.wire import check_bits, wire_bytes
from tessera.errors import ConfigError, GraphError
from tessera.graph import Graph
from tessera.graph.graph import Memo
from tessera.ops.registry import get_backend
from tessera.ops.sparse import CSRMatrix

_MASKS = ("train_mask", "val_mask", "test_mask")


class _HaloAggregate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, dg: DistGraph, backend: str):
        be = get_backend(backend)
        layer = dg.log.next_layer() if dg.log is not None else 0
        ctx.dg, ctx.be, ctx.layer = dg, be, layer
        with Timer(dg.log, layer, FORWARD, "compute_s"):
            send = be.spmm(dg.S, h, dg.S.weight)
        pending = dg.exchange(send, dg.R.num_cols, FORWARD, layer)
        with Timer(dg.log, layer, FORWARD, "compute_s"):
            out = be.spmm(dg.A, h, dg.A.weight)
        recv = dg.finish(pending, layer, FORWARD)
        with Timer(dg.log, layer, FORWARD, "compute_s"):
            return out + be.spmm(dg.R, recv, dg.R.weight)

    @staticmethod
    def backward(ctx, g):
        dg, be, layer = ctx.dg, ctx.be, ctx.layer
        g = g.contiguous()
        with Timer(dg.log, layer, BACKWARD, "compute_s"):
            g_recv = be.spmm_t(dg.R, g, dg.R.weight)
        pending = dg.exchange(g_recv, dg.S.num_rows, BACKWARD, layer)
        with Timer(dg.log, layer, BACKWARD, "compute_s"):
            gh = be.spmm_t(dg.A, g, dg.A.weight)
        g_send = dg.finish(pending, layer, BACKWARD)
        with Timer(dg.log, layer, BACKWARD, "compute_s"):
            return gh + be.spmm_t(dg.S, g_send, dg.S.weight), None, None


def _csr_rows(indptr: np.ndarray) -> np.ndarray:
    return np.repeat(np.arange(indptr.size - 1, dtype=np.int64), np.diff(indptr))


class DistGraph(Memo):
    """Rank ``plan.rank``'s share of a partitioned graph: owned vertices in local order, their
    node data, and the plan matrices. Quacks like :class:`Graph` for the layers; ``ops.aggregate``
    sends it to :meth:`distributed_aggregate`."""

    edge_weight = None  # weights live in the plan matrices

    def __init__(
        self,
        plan: RankPlan,
        in_weight: np.ndarray,
        node_data: dict[str, Any],
        fingerprint: str,
        name: str,
        num_classes: int | None,
        scale: torch.Tensor | None = None,
        global_size: tuple[int, int] = (0, 0),
    ) -> None:
        self.plan, self.rank, self.world, self.mode = plan, plan.rank, plan.world, plan.mode
        self.owned = torch.from_numpy(plan.owned.astype(np.int64))
        n = self.num_nodes = int(plan.owned.size)
        self.A = CSRMatrix.from_numpy(*plan.A[:3], n, n)
        self.S = CSRMatrix.from_numpy(*plan.S[:3], plan.S[3], n)
        self.R = CSRMatrix.from_numpy(*plan.R[:3], n, plan.R[3])
        self.send_counts = [int(c) for c in plan.send_counts]
        self.recv_counts = [int(c) for c in plan.recv_counts]
        self._in_degree = torch.from_numpy(np.asarray(plan.in_degree_global, dtype=np.int64))
        self._in_weight = np.asarray(in_weight, dtype=np.float64)  # weighted in-degree (= count unweighted)
        self.node_data = node_data
        for key in ("x", "y", *_MASKS):
            setattr(self, key, node_data.get(key))
        self._fingerprint, self.name, self.num_classes = fingerprint, name, num_classes
        self.scale = scale  # GCN's dis, applied to the input and the output rows
        self.bits = 32  # --comm-bits of the exchange
        self.log: CommLog | None = None
        self._buffers: dict = {}  # persistent quantized send/receive buffers, see _buffer
        self.global_num_nodes, self.global_num_edges = global_size
        self._cache: dict = {}

    # ------------------------------------------------------------------ factories
    @classmethod
    def from_graph(cls, graph: Graph, part: np.ndarray, rank: int, world: int, mode: str) -> DistGraph:
        """Rank ``rank``'s view built from the whole graph and a partition vector."""
        w = None if graph.edge_weight is None else graph.edge_weight.numpy()
        plan = build_rank_plan(graph.indptr.numpy(), graph.indices.numpy(), w, part, mode, rank, world=world)
        owned = torch.from_numpy(plan.owned.astype(np.int64))
        data = {k: getattr(graph, k)[owned] for k in ("x", "y", *_MASKS) if getattr(graph, k) is not None}
        deg = graph.in_degree()[owned].numpy().astype(np.float64)
        if w is not None:
            wsum = np.zeros(graph.num_nodes)
            np.add.at(wsum, graph.dst_index().numpy(), w.astype(np.float64))
            deg = wsum[plan.owned]
        return cls(
            plan,
            deg,
            data,
            graph.fingerprint(),
            graph.name,
            graph.num_classes,
            global_size=(graph.num_nodes, graph.num_edges),
        )

    @classmethod
    def from_part(cls, data: dict[str, Any], mode: str) -> DistGraph:
        """Rank ``data['rank']``'s view from its own part file (``partition.load_part``) alone."""
        meta = data.get("meta", {})
        plan = plan_from_part(data, mode)
        indptr = data["indptr"].astype(np.int64)
        w = data.get("weight")
        deg = np.diff(indptr).astype(np.float64)
        if w is not None:
            deg = np.bincount(_csr_rows(indptr), weights=w.astype(np.float64), minlength=indptr.size - 1)
        node = {}
        for key in ("x", "y", *_MASKS):
            if key in data:
                node[key] = torch.from_numpy(np.ascontiguousarray(data[key]))
        if "x" in node:
            node["x"] = node["x"].float()
        if "y" in node:
            node["y"] = node["y"].long()
        size = (int(meta.get("num_nodes", data["num_nodes"])), int(meta.get("num_edges", 0)))
        return cls(
            plan,
            deg,
            node,
            str(data["fingerprint"]),
            meta.get("name", "graph"),
            meta.get("num_classes"),
            global_size=size,
        )

    # ------------------------------------------------------------------ the Graph surface
    @property
    def num_rows(self) -> int:
        return self.num_nodes

    @property
    def num_cols(self) -> int:
        return self.num_nodes

    @property
    def num_features(self) -> int:
        return 0 if self.x is None else int(self.x.shape[1])

    @property
    def global_size(self) -> tuple[int, int]:
        """(vertices, edges) of the whole graph."""
        return self.global_num_nodes, self.global_num_edges

    def fingerprint(self) -> str:
        """The global graph's fingerprint."""
        return self._fingerprint

    def in_degree(self) -> torch.Tensor:
        """Global in-degree of each owned vertex (local and remote in-edges)."""
        return self._in_degree

    def require(self, *names: str) -> None:
        """Raise :class:`GraphError` unless each named node field is present on this rank."""
        for nm in names:
            if getattr(self, nm, None) is None:
                raise GraphError(f"partition of {self.name!r} has no {nm}; this task needs it")

    def add_self_loops(self, fill_value: float = 1.0) -> DistGraph:
        """Every owned vertex gets exactly one self loop (as :meth:`Graph.add_self_loops`)."""
        indptr, cols, w = self.plan.A.indptr, self.plan.A.indices, self.plan.A.weight
        rows = _csr_rows(indptr)
        loop = rows == cols
        n = self.num_nodes
        loop_w = np.full(n, float(fill_value), dtype=np.float64)
        old_loop_w = np.bincount(rows[loop], weights=None if w is None else w[loop], minlength=n)
        if w is not None:
            loop_w[rows[loop]] = w[loop]
        keep = ~loop
        r = np.concatenate([rows[keep], np.arange(n)])
        c = np.concatenate([cols[keep], np.arange(n)])
        weighted = w is not None or fill_value != 1.0
        vals = None
        if weighted:
            base = w[keep].astype(np.float64) if w is not None else np.ones(int(keep.sum()))
            vals = np.concatenate([base, loop_w])
        order = np.lexsort((c, r))
        new_indptr = np.concatenate([[0], np.cumsum(np.bincount(r, minlength=n))]).astype(np.int64)
        A = type(self.plan.A)(new_indptr, c[order], None if vals is None else vals[order].astype(np.float32))
        loops_per_row = np.bincount(rows[loop], minlength=n)
        deg = self.plan.in_degree_global - loops_per_row + 1
        plan = replace(self.plan, A=A, in_degree_global=deg)
        in_weight = self._in_weight - (old_loop_w if w is not None else loops_per_row) + loop_w
        return self._derive(
            DistGraph(
                plan,
                in_weight,
                self.node_data,
                self._fingerprint,
                self.name,
                self.num_classes,
                global_size=self.global_size,
            )
        )

    def gcn_norm(self, add_self_loops: bool = True, improved: bool = False) -> DistGraph:
        """The view with GCN's symmetric normalisation, as row/column scales by ``D^-1/2``."""
        g = self.add_self_loops(2.0 if improved else 1.0) if add_self_loops else self
        dis = np.where(g._in_weight > 0, 1.0 / np.sqrt(np.maximum(g._in_weight, 1e-300)), 0.0)
        scale = torch.from_numpy(dis.astype(np.float32))
        return self._derive(
            DistGraph(g.plan, g._in_weight, g.node_data, g._fingerprint, g.name, g.num_classes, scale, self.global_size)
        )

    def _derive(self, view: DistGraph) -> DistGraph:
        view.bits, view.log = self.bits, self.log
        return view

    def configure_comm(self, bits: int, log: CommLog | None) -> DistGraph:
        """Set the exchange's bit width and the log that counts its bytes; returns self."""
        self.bits, self.log = check_bits(bits), log
        return self

    # ------------------------------------------------------------------ communication
    def _buffer(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A tensor kept across calls for ``key`` = (kind, layer, direction, width): the quantized
        exchange reuses its send, receive and decoded buffers every epoch instead of allocating
        (and page-faulting) them per call. Safe because a (layer, direction) exchange is finished
        and its decoded rows consumed (``R``/``S`` products) before the same exchange runs again."""
        buf = self._buffers.get(key)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype:
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype)
        return buf

    def exchange(self, inp: torch.Tensor, out_rows: int, direction: int, layer: int):
        """Start sending ``inp``'s rows (forward splits, or reversed for backward): quantized to
        ``bits`` when below 32, each peer's block in its slice of one flat byte buffer
        (``tessera.dist.wire.block_bytes`` sizes them), counted in the log. Returns a handle for
        :meth:`finish`."""
        send, recv = (
            (self.send_counts, self.recv_counts) if direction == FORWARD else (self.recv_counts, self.send_counts)
        )
        width = int(np.prod(inp.shape[1:])) if inp.dim() > 1 else 1
        if self.log is not None:
            self.log.record(layer, direction, send, width, self.bits)
        if self.bits == 32:
            payload, out = inp.contiguous(), inp.new_empty((out_rows, *inp.shape[1:]))
            send_split, recv_split = send, recv
        else:
            from tessera.dist.quantize import encode

            send_split = [int(b) for b in wire_bytes(np.asarray(send), width, self.bits)]
            recv_split = [int(b) for b in wire_bytes(np.asarray(recv), width, self.bits)]
            seed = int(torch.randint(0, 2**62, (1,)).item())
            key = (layer, direction, width)
            payload = self._buffer(("send", *key), (sum(send_split),), torch.uint8)
            with Timer(self.log, layer, direction, "quantize_s"):
                encode(inp.reshape(inp.shape[0], width).float(), self.bits, seed, out=payload, splits=send)
            out = self._buffer(("recv", *key), (sum(recv_split),), torch.uint8)
        with Timer(self.log, layer, direction, "exchange_s"):
            if self.world == 1:
                out.copy_(payload)
                work = None
            else:
                work = dist.all_to_all_single(
                    out, payload, output_split_sizes=recv_split, input_split_sizes=send_split, async_op=True
                )
        return work, out, recv, tuple(inp.shape[1:]), inp.dtype

    def finish(self, pending, layer: int, direction: int) -> torch.Tensor:
        """Wait for :meth:`exchange` and return the received rows as floats (below 32 bits, in a
        buffer reused by the next exchange of the same layer and direction)."""
        work, out, recv, shape, dtype = pending
        with Timer(self.log, layer, direction, "exchange_s"):
            if work is not None:
                work.wait()
        if self.bits == 32:
            return out
        from tessera.dist.quantize import decode

        width = int(np.prod(shape)) if shape else 1
        rows = self._buffer(("decoded", layer, direction, width), (sum(recv), width), torch.float32)
        with Timer(self.log, layer, direction, "quantize_s"):
            decode(out, width, self.bits, recv, out=rows)
        return rows.view(rows.shape[0], *shape).to(dtype)

    def distributed_aggregate(
        self, x: torch.Tensor, reduce: str, weight: torch.Tensor | None, backend: str
    ) -> torch.Tensor:
        """``ops.aggregate`` on this rank: local product plus the halo exchange."""
        if weight is not None:
            raise ConfigError(
                "edge-weighted aggregation (GAT attention) is single-process only for now; run GAT without --nprocs"
            )
        if x.shape[0] != self.num_nodes:
            raise ValueError(f"x has {x.shape[0]} rows but rank {self.rank} owns {self.num_nodes} vertices")
        shape = (-1, *([1] * (x.dim() - 1)))
        if self.scale is not None:
            x = x * self.scale.to(x.dtype).view(shape)
        out = _HaloAggregate.apply(x, self, backend)
        if self.scale is not None:
            out = out * self.scale.to(out.dtype).view(shape)
        if reduce == "mean":
            d = self._in_degree.to(out.dtype)
            out = out * torch.where(d > 0, 1.0 / d.clamp(min=1), torch.zeros_like(d)).view(shape)
        return out
