"""The bandwidth of a vertex order and the pipeline stages it needs (MixGCN §3.2.2, Prop. 3.5).

With vertex ``v`` at position ``p_v`` of an order, the bandwidth is ``b = max |p_v - p_u|`` over
the edges ``(u, v)``: a vertex's neighbours all lie within ``b`` positions of it. A fine-grained
pipeline that processes the vertices in ``s`` equal batches runs without idling when every vertex
of a batch depends only on vertices of the batches already received, which Prop. 3.5 states as
``(n - b) / (2 n) >= 1 / s``: the fewest stages are ``ceil(2 n / (n - b))`` (``b < n``). Reverse
Cuthill-McKee (RCM) makes ``b`` small; a partition's rank-block order (each part's vertices
together) usually makes it large. :func:`order_report` compares them, with the time RCM and the
partition take (Tables 4 and 5 of the paper)."""

from __future__ import annotations

import tempfile
import time
from typing import Any

import numpy as np

from tessera.graph.csr import CSRStructure, rows_of
from tessera.graph.order import inverse_permutation, rcm_order


def csr_bandwidth(indptr, indices, order=None) -> int:
    """``max |p_v - p_u|`` over the entries ``u -> v`` of a square CSR (``indptr``, ``indices``),
    ``p`` the position of each vertex in ``order`` (``order[new] = old``; None: the ids); 0 without edges."""
    indptr = np.asarray(indptr, dtype=np.int64)
    src = np.asarray(indices, dtype=np.int64)
    if src.size == 0:
        return 0
    dst = rows_of(indptr)
    if order is not None:
        pos = inverse_permutation(order)
        src, dst = pos[src], pos[dst]
    return int(np.abs(dst - src).max())


def bandwidth(graph: CSRStructure, order=None) -> int:
    """:func:`csr_bandwidth` of a graph's edges under ``order`` (``order[new] = old``; None: the ids)."""
    return csr_bandwidth(graph.indptr.numpy(), graph.indices.numpy(), order)


def min_stages(n: int, b: int) -> int | None:
    """The fewest pipeline stages ``s`` with ``(n - b) / (2 n) >= 1 / s`` (Prop. 3.5), i.e.
    ``ceil(2 n / (n - b))``; None when no ``s`` satisfies it (``b >= n``, so also an empty graph)."""
    n, b = int(n), int(b)
    if b >= n:
        return None
    return -(-2 * n // (n - b))


def order_report(graph, parts: int, method: str = "metis", seed: int = 0) -> dict[str, Any]:
    """Bandwidth and fewest idle-free stages of the original, RCM and partition-block orders
    (Table 4), and the seconds RCM and the ``method`` partition into ``parts`` take, both computed
    afresh, not read from a cache (Table 5)."""
    from tessera.graph.partition import partition

    t0 = time.perf_counter()
    rcm = rcm_order(graph)
    rcm_s = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as cache:
        t0 = time.perf_counter()
        part = partition(graph, parts, method, seed, cache_dir=cache)
        partition_s = time.perf_counter() - t0
    orders = {
        "original ids": None,
        "RCM": rcm,
        f"{method} blocks ({parts} parts)": np.argsort(part, kind="stable"),
        f"{method} blocks, RCM inside": np.lexsort((inverse_permutation(rcm), part)),
    }
    n = graph.num_nodes
    rows = []
    for name, order in orders.items():
        b = bandwidth(graph, order)
        rows.append({"order": name, "bandwidth": b, "min_stages": min_stages(n, b)})
    return {"vertices": n, "parts": parts, "method": method, "orders": rows, "rcm_s": rcm_s, "partition_s": partition_s}


def format_order_report(report: dict[str, Any]) -> str:
    """:func:`order_report` as text."""
    n = report["vertices"]
    lines = [
        "vertex orders for a fine-grained pipeline (MixGCN Prop. 3.5: s stages run idle-free when "
        "(n - b) / 2n >= 1/s, b = max |p_u - p_v| over edges):",
        f"  {'order':<30} {'bandwidth b':>12} {'b / n':>7} {'min stages':>11}",
    ]
    for r in report["orders"]:
        s = r["min_stages"]
        lines.append(
            f"  {r['order']:<30} {r['bandwidth']:>12,} {r['bandwidth'] / max(n, 1):>7.3f} "
            f"{format(s, ',') if s is not None else '-':>11}"
        )
    ratio = report["partition_s"] / report["rcm_s"] if report["rcm_s"] > 0 else float("inf")
    lines.append(
        f"preprocessing, computed afresh: RCM {report['rcm_s']:.3f} s, {report['method']} partition into "
        f"{report['parts']} parts {report['partition_s']:.3f} s ({ratio:.1f}x RCM)"
    )
    return "\n".join(lines)
