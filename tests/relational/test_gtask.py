"""gTasks (WiseGraph §4-6): the restriction language, the greedy scan against a brute-force
oracle, and the batched typed message sum against the edge-wise definition."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tessera.errors import ConfigError, GraphError
from tessera.graph import Graph
from tessera.relational.gtask import build_plan, edge_attributes, parse_restrictions
from tessera.relational.gtask_kernels import (
    OutlierPolicy,
    build_execution,
    typed_message_sum,
    typed_message_sum_reference,
)

PAPER_EXAMPLES = {
    "uniq(dst-id) = 1": "uniq(Dst.ID)=1",
    "uniq(edge-id) = 32": "uniq(Edge.ID)=32",
    "uniq(src-id) = min": "uniq(Src.ID)=min",
    "uniq(src-id)=32 & uniq(edge-type)=1": "uniq(Src.ID)=32 & uniq(Edge.Type)=1",
    "uniq(src-id) = 32 & uniq(dst-id) = 2": "uniq(Src.ID)=32 & uniq(Dst.ID)=2",
    "uniq(dst-degree)=min & uniq(dst-id)=8": "uniq(Dst.Degree)=min & uniq(Dst.ID)=8",
    "dst-id=1&edge-id=32": "uniq(Dst.ID)=1 & uniq(Edge.ID)=32",
    "src=32&edge-type=1": "uniq(Src.ID)=32 & uniq(Edge.Type)=1",
    "dst-id=1&edge-num=16": "uniq(Dst.ID)=1 & uniq(Edge.ID)=16",
    "uniq(Src.ID)=4, uniq(Edge.Type)=1": "uniq(Src.ID)=4 & uniq(Edge.Type)=1",
    "UNIQ(edge.type)=1 , uniq(SRC.Degree)=inf": "uniq(Edge.Type)=1 & uniq(Src.Degree)=inf",
}


@pytest.mark.parametrize("text", sorted(PAPER_EXAMPLES))
def test_parser_accepts_the_papers_notation(text):
    rs = parse_restrictions(text)
    assert str(rs) == PAPER_EXAMPLES[text]
    assert parse_restrictions(str(rs)) == rs  # the canonical form parses back to the same plan


def test_sort_keys():
    assert parse_restrictions("uniq(Src.ID)=32 & uniq(Edge.Type)=1").sort_keys() == ("Edge.Type", "Src.ID")
    assert parse_restrictions("uniq(dst-degree)=min & uniq(dst-id)=8").sort_keys() == ("Dst.Degree", "Dst.ID")
    assert parse_restrictions("dst-id=1&edge-id=32").sort_keys() == ("Dst.ID",)
    assert parse_restrictions("uniq(Src.ID)=32 & uniq(Dst.ID)=2").sort_keys() == ("Dst.ID", "Src.ID")


@pytest.mark.parametrize(
    ("text", "column", "what"),
    [
        ("", 1, "empty"),
        ("uniq(Src.Foo)=1", 1, "unknown attribute 'Src.Foo'"),
        ("uniq(Src.ID)=0", 14, "not a positive integer"),
        ("uniq(Src.ID)=K", 14, "not a positive integer"),
        ("uniq(Edge.Type)=1 & uniq(Src.ID)", 21, "expected uniq(ATTR)=VALUE"),
        ("uniq(Src.Type)=1", 1, "vertex types"),
        ("uniq(Edge.Degree)=2", 1, "no degree"),
        ("uniq(Src.ID)=1 & uniq(src-id)=2", 18, "restricted twice"),
        ("uniq(Src.ID)=1 && uniq(Dst.ID)=1", 17, "empty restriction"),
        ("uniq(Src.ID)=1 | uniq(Dst.ID)=1", 1, "expected uniq(ATTR)=VALUE"),
    ],
)
def test_parser_rejects_with_one_line(text, column, what):
    with pytest.raises(ConfigError) as err:
        parse_restrictions(text)
    msg = str(err.value)
    assert "\n" not in msg and f"column {column}:" in msg and what in msg
    assert "uniq(Edge.Type)=1 & uniq(Src.ID)=32" in msg  # says what is allowed


def _table(seed: int, n: int = 40, e: int = 300, types: int = 4):
    rng = np.random.default_rng(seed)
    src = (rng.pareto(1.2, e) * 3).astype(np.int64) % n  # a few hub sources
    dst = np.minimum((rng.pareto(1.5, e) * 4).astype(np.int64), n - 1)
    return src, dst, rng.integers(0, types, e), n


def _oracle(src, dst, etype, n, text):
    """Sorted with Python's sort and cut with sets: the paper's greedy scan, written plainly."""
    rs = parse_restrictions(text)
    attrs = edge_attributes(src, dst, etype, n, n)
    order = sorted(range(src.size), key=lambda i: tuple(int(attrs[k][i]) for k in rs.sort_keys()) + (i,))
    bounded = [r for r in rs.items if r.limit is not None]
    starts, seen = [], None
    for pos, i in enumerate(order):
        if seen is None or any(len(seen[j] | {int(attrs[r.attribute][i])}) > r.limit for j, r in enumerate(bounded)):
            starts.append(pos)
            seen = [set() for _ in bounded]
        for j, r in enumerate(bounded):
            seen[j].add(int(attrs[r.attribute][i]))
    return np.array(order), np.array(starts + [src.size])


SCAN_CASES = [
    "uniq(Src.ID)=3 & uniq(Edge.Type)=1",
    "uniq(Dst.ID)=1 & uniq(Edge.ID)=4",
    "uniq(Src.ID)=5 & uniq(Dst.ID)=2",
    "uniq(Dst.Degree)=min & uniq(Dst.ID)=3",
    "uniq(Src.Degree)=2, uniq(Edge.Type)=2, uniq(Dst.ID)=6",
    "uniq(Src.ID)=min & uniq(Edge.Type)=1",
    "uniq(Edge.ID)=7",
    "uniq(Edge.Type)=inf",
]


@pytest.mark.parametrize("text", SCAN_CASES)
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_scan_equals_brute_force(text, seed):
    src, dst, etype, n = _table(seed)
    plan = build_plan((src, dst, etype, n), text)
    order, bounds = _oracle(src, dst, etype, n, text)
    np.testing.assert_array_equal(plan.order, order)
    np.testing.assert_array_equal(plan.bounds, bounds)
    # every gTask satisfies every =k restriction; each but the last is maximal (the next edge breaks one)
    attrs = {k: v[plan.order] for k, v in edge_attributes(src, dst, etype, n, n).items()}
    rs = parse_restrictions(text)
    for t in range(plan.num_tasks):
        a, b = plan.bounds[t], plan.bounds[t + 1]
        assert all(np.unique(attrs[r.attribute][a:b]).size <= r.limit for r in rs.items if r.limit)
        if b < src.size:
            assert any(np.unique(attrs[r.attribute][a : b + 1]).size > r.limit for r in rs.items if r.limit)
    # per-gTask metadata: the unique values in first-appearance order, and each edge's index into them
    for uniq, col in ((plan.srcs, plan.src), (plan.dsts, plan.dst), (plan.types, plan.etype)):
        task = plan.task_of_edge()
        np.testing.assert_array_equal(uniq.values[uniq.ptr[task] + uniq.local], col)
        for t in range(plan.num_tasks):
            seg = col[plan.bounds[t] : plan.bounds[t + 1]]
            _, first = np.unique(seg, return_index=True)
            np.testing.assert_array_equal(uniq.values[uniq.ptr[t] : uniq.ptr[t + 1]], seg[np.sort(first)])


def test_scan_from_a_graph_keeps_csr_order_as_tie_break():
    src, dst, etype, n = _table(3)
    g = Graph.from_edge_index(np.stack([src, dst]), num_nodes=n, edge_type=etype)
    plan = build_plan(g, "uniq(Edge.Type)=1")
    np.testing.assert_array_equal(plan.order, np.argsort(g.edge_type.numpy(), kind="stable"))
    assert plan.num_tasks == np.unique(etype).size
    np.testing.assert_array_equal(plan.dst, g.dst_index().numpy()[plan.order])


POLICIES = [
    OutlierPolicy(),
    OutlierPolicy(handle=False),
    OutlierPolicy(underfill=0.9, overfill=1.0, frequent=2, batch_rows=8),
    OutlierPolicy(underfill=0.0, overfill=100.0, frequent=10**9, batch_rows=1),
]


@pytest.mark.parametrize("text", SCAN_CASES + ["uniq(Edge.Type)=1", "uniq(Edge.ID)=1", "uniq(Dst.ID)=1"])
def test_typed_message_sum_equals_edge_wise(text):
    src, dst, etype, n = _table(7, n=50, e=400, types=5)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, 6, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(6, 6, 3, generator=gen, dtype=torch.float64, requires_grad=True)  # one relation unused
    c = torch.rand(src.size, generator=gen, dtype=torch.float64, requires_grad=True)
    probe = torch.randn(n, 3, generator=gen, dtype=torch.float64)
    plan = build_plan((src, dst, etype, n), text)
    for weight in (None, c):
        ref = typed_message_sum_reference(x, w, src, dst, etype, n, weight)
        wanted = torch.autograd.grad((ref * probe).sum(), (x, w) if weight is None else (x, w, c))
        for policy in POLICIES:
            out = typed_message_sum(x, w, plan, policy, edge_weight=weight)
            got = torch.autograd.grad((out * probe).sum(), (x, w) if weight is None else (x, w, c))
            torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
            for a, b in zip(got, wanted, strict=True):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_float32_graph_input_and_errors():
    src, dst, etype, n = _table(4, n=30, e=200, types=3)
    g = Graph.from_edge_index(np.stack([src, dst]), num_nodes=n, edge_type=etype)
    x, w = torch.randn(n, 5), torch.randn(3, 5, 4)
    plan = build_plan(g, "uniq(Src.ID)=4 & uniq(Edge.Type)=1")
    ref = typed_message_sum_reference(x, w, src, dst, etype, n)
    torch.testing.assert_close(typed_message_sum(x, w, plan), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(GraphError, match="edge type 2 is out of range for 2 relation weights"):
        typed_message_sum(x, w[:2], plan)
    empty = build_plan((np.zeros(0, int), np.zeros(0, int), np.zeros(0, int), 4), "uniq(Edge.Type)=1")
    assert empty.num_tasks == 0
    assert torch.equal(typed_message_sum(torch.randn(4, 5), w, empty), torch.zeros(4, 4))


def test_outlier_handling_removes_padding_and_duplicate_products():
    """A power-law table under uniq(Dst.ID)=2 & uniq(Edge.Type)=1 has every outlier kind; the
    differentiated schedule computes fewer rows (frequent pairs once, no padding) for the same sum."""
    rng = np.random.default_rng(5)
    n, e = 1000, 4000
    p = (np.arange(n) + 1.0) ** -0.8
    p /= p.sum()
    src, dst, etype = rng.choice(n, e, p=p), rng.choice(n, e, p=p[rng.permutation(n)]), rng.integers(0, 3, e)
    plan = build_plan((src, dst, etype, n), "uniq(Dst.ID)=2 & uniq(Edge.Type)=1")
    policy = OutlierPolicy(frequent=8, batch_rows=64)
    uniform = build_execution(plan, OutlierPolicy(frequent=8, batch_rows=64, handle=False)).stats
    handled = build_execution(plan, policy).stats
    assert all(uniform[f"{c}_units"] > 0 for c in ("regular", "underfill", "overfill", "frequent"))
    assert uniform["rows"] == 3788 and handled["rows"] == 2725  # frequent (relation, source) pairs once
    assert handled["padding"] < uniform["padding"] // 8
    x, w = torch.randn(n, 4, dtype=torch.float64), torch.randn(3, 4, 2, dtype=torch.float64)
    ref = typed_message_sum_reference(x, w, src, dst, etype, n)
    torch.testing.assert_close(typed_message_sum(x, w, plan, policy), ref, rtol=1e-5, atol=1e-5)
