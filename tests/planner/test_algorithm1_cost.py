"""NeutronAscend Algorithm 1's terms in the planner: the padding idle and the cache-reuse saving
against hand-computed values, the paper's own example, their place in every candidate's
modelled total (and so in the choice), their calibration, and `tessera plan`'s table of them."""

import json
import math

import numpy as np
import pytest
import torch

from tessera import Graph
from tessera.parallel.base import StrategyOptions
from tessera.planner import calibrate
from tessera.planner.calibrate import Rates, last_level_cache_bytes, measure_memory
from tessera.planner.candidates import Candidate, Context, layer_candidates
from tessera.planner.grouping import Algorithm1Terms, algorithm1, idle_time, padding, saved_time
from tessera.planner.plan import Plan
from tessera.sparse import LayerSpec

# Aggregation by value only at 1 ns, free GEMMs, a slow link without latency; cache 40 GB/s
# against main memory 10 GB/s: r = 4.
RATES = Rates(
    edge_s=0.0,
    value_s=1e-9,
    gemm_flops=1e15,
    bandwidth_gbps=1e-3,
    latency_us=0.0,
    cache_gbps=40.0,
    dram_gbps=10.0,
)


def _complete(sizes: list[int]) -> Graph:
    """Disjoint complete graphs (no self loops) of ``sizes`` vertices, in id order."""
    src, dst, start = [], [], 0
    for n in sizes:
        ids = torch.arange(start, start + n)
        s, d = torch.meshgrid(ids, ids, indexing="ij")
        keep = s != d
        src.append(s[keep])
        dst.append(d[keep])
        start += n
    return Graph.from_edge_index(torch.stack([torch.cat(src), torch.cat(dst)]), start)


def _candidates(graph: Graph, part: np.ndarray, rates: Rates, width: int) -> dict[str, Candidate]:
    # aggregating first with no input gradient: one aggregation pass
    ctx = Context(graph, 4, part, StrategyOptions(), rates)
    spec = LayerSpec(width, width, width, aggregates_first=True)
    return {c.label: c for c in layer_candidates(ctx, {True: spec}, True, False)}


def test_terms_by_hand_on_k40_in_four_ranges():
    # K_40 over 4 ranks of 10 rows, D = 40: every vertex has 39 in-edges.
    cands = _candidates(_complete([40]), np.repeat(np.arange(4), 10), RATES, 40)
    v, bw, r = 1e-9, 10e9, 4.0
    # hybrid:2: G-parts of 20 rows (780 in-edges), slices of 20 columns padded to 32, G = 2
    h = cands["hybrid:2:post:32"].alg1
    assert h is not None and (h.M, h.S, h.pad, h.G) == (2, 20, 12, 2) and h.r == r
    assert math.isclose(h.comp, 780 * 20 * v)
    assert math.isclose(h.idle, 12 / 20 * 780 * 20 * v)
    assert math.isclose(h.mem, 4 * 20 * (780 + 20) / bw)
    assert math.isclose(h.saved, 4 * 20 * 800 / bw * (1 - 1 / (1 + 1 * 3)))
    # partition (M = 1): 10 rows (390 in-edges) at all 40 columns, padded to 48, G = 4
    p = cands["partition:post:32"].alg1
    assert p is not None and (p.M, p.S, p.pad, p.G) == (1, 40, 8, 4)
    assert math.isclose(p.idle, 8 / 40 * 390 * 40 * v)
    assert math.isclose(p.saved, 4 * 40 * 400 / bw * (1 - 1 / (1 + 3 * 3)))
    # tensor (M = P): all 1560 edges at 10 columns, padded to 16; G = 1 saves nothing
    t = cands["tensor:32"].alg1
    assert t is not None and (t.M, t.S, t.pad, t.G) == (4, 10, 6, 1)
    assert math.isclose(t.idle, 6 / 10 * 1560 * 10 * v) and t.saved == 0.0
    assert math.isclose(t.mem, 4 * 10 * 1600 / bw)
    # the candidate's terms carry them, and its total adds the idle and subtracts the saving
    for c in cands.values():
        m = c.model_s
        assert c.alg1 is not None and (m.idle, m.saved) == (c.alg1.idle, c.alg1.saved)
        assert math.isclose(c.modelled_s, m.dense + m.aggregate + m.comm + m.memory + m.idle - m.saved)


def test_main_memory_time_is_at_most_the_slices_aggregation():
    # at 1 GB/s the hybrid slice's 64,000 bytes would take 64 us, more than its 15.6 us aggregation
    slow = Rates(**{**RATES.to_dict(), "dram_gbps": 1.0, "cache_gbps": 4.0})
    h = _candidates(_complete([40]), np.repeat(np.arange(4), 10), slow, 40)["hybrid:2:post:32"].alg1
    assert h is not None and math.isclose(h.mem, 780 * 20 * 1e-9)


def test_the_papers_example_through_the_planners_terms():
    # Reddit's 602 features on the 910B's 30 AI Cores, L2 at 20x HBM (§5.3), T_comp = T_mem = 1:
    # Algorithm 1 as printed and the planner's record of its terms agree wherever S is whole.
    best, rows = algorithm1(30, 602, 20, 1.0, 1.0)
    assert best == 1
    for row in rows[:2]:  # M = 1 (S = 602, pad 6) and M = 2 (S = 301, pad 3)
        terms = Algorithm1Terms.of(row.M, int(row.S), int(row.G), 20.0, 1.0, 1.0)
        assert (terms.pad, terms.idle, terms.saved) == (row.pad, row.T_idle, row.T_saved)
    assert (rows[0].pad, rows[1].pad) == (6, 3)
    assert math.isclose(rows[0].cost, 6 / 602 - (1 - 1 / (1 + 29 * 19)))
    # the hidden width 256 of Table 1 on 20 cores: M = 1, 2, 4 pad nothing, M = 20 (S = 12.8) does
    _, rows = algorithm1(20, 256, 20, 1.0, 1.0)
    assert [r.pad for r in rows[:3]] == [0, 0, 0] and math.isclose(rows[3].pad, 16 - 12.8)
    assert idle_time(12, 2.0) == 4 / 12 * 2.0 and padding(16) == 0 and padding(17) == 15
    assert saved_time(1, 20.0, 5.0) == 0.0 and saved_time(4, 1.0, 5.0) == 0.0
    assert math.isclose(saved_time(2, 3.0, 1.0), 1 - 1 / 3)


def test_the_terms_decide_between_hybrid_and_partition():
    # Four cliques of 12, 8, 8 and 12 vertices, one per rank: nothing crosses ranks, so partition
    # and the halo exchange send nothing; rank 0 aggregates 132 edges at 64 columns, hybrid:2's
    # G-parts 188 each at 32 columns (better balanced), for two 1 us all-to-alls, tensor 376 at
    # 16 for six. No width pads. Without the memory constants hybrid:2 is modelled fastest; with a
    # cache 100x main memory, capped at each slice's aggregation time, partition's four ranks per
    # group save more than hybrid's two, and it wins.
    graph, part = _complete([12, 8, 8, 12]), np.repeat(np.arange(4), [12, 8, 8, 12])
    base = dict(edge_s=0.0, value_s=1e-9, gemm_flops=1e15, bandwidth_gbps=float("inf"), latency_us=1.0)
    plain = _candidates(graph, part, Rates(**base), 64)
    reuse = _candidates(graph, part, Rates(**base, cache_gbps=1e-1, dram_gbps=1e-3), 64)
    assert min(plain.values(), key=lambda c: c.modelled_s).label.startswith("hybrid:2:")
    assert min(reuse.values(), key=lambda c: c.modelled_s).label.startswith("partition:")
    p, h = reuse["partition:post:32"], reuse["hybrid:2:post:32"]
    assert p.alg1 is not None and h.alg1 is not None and p.model_s.idle == h.model_s.idle == 0.0
    assert math.isclose(p.model_s.saved, 132 * 64e-9 * (1 - 1 / (1 + 3 * 99)))
    assert math.isclose(h.model_s.saved, 188 * 32e-9 * (1 - 1 / (1 + 1 * 99)))
    for label, c in reuse.items():  # only the terms moved
        assert math.isclose(c.modelled_s, plain[label].modelled_s - c.model_s.saved)


def test_cache_ratio_and_its_calibration(tmp_path, monkeypatch):
    assert RATES.cache_ratio == 4.0
    assert Rates(0.0, 1e-9, 1e9, 1.0, 1.0).cache_ratio == 1.0  # not measured: no reuse
    assert Rates(0.0, 1e-9, 1e9, 1.0, 1.0, 0.0, 5.0, 10.0).cache_ratio == 1.0  # a disturbed measurement
    for i, (level, kind, size) in enumerate([(1, "Data", "32K"), (1, "Instruction", "32K"), (3, "Unified", "8M")]):
        d = tmp_path / f"index{i}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{size}\n")
    monkeypatch.setattr(calibrate, "_CPU_CACHES", tmp_path)
    assert last_level_cache_bytes() == 8 << 20
    cache, dram = measure_memory(sharing=2)
    assert cache > 0 and dram > 0  # measured (their ratio depends on what else the machine runs)
    monkeypatch.setattr(calibrate, "_CPU_CACHES", tmp_path / "absent")
    assert last_level_cache_bytes() == 0 and measure_memory() == (0.0, 0.0)


@pytest.fixture
def plan_output(capsys):
    from tessera.cli.main import main

    argv = ["plan", "--dataset", "synthetic:tiny", "--nprocs", "4", "--model-only", "--hidden", "40", "--no-cache"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert main([*argv, "--json"]) == 0
    return text, json.loads(capsys.readouterr().out)


def test_plan_prints_the_terms_per_candidate(plan_output):
    text, rec = plan_output
    lines = text.splitlines()
    head = next(line for line in lines if "candidate" in line and "model ms" in line)
    assert head.split()[-7:-3] == ["memory", "idle", "saved", "model"]
    assert any(line.startswith("memory: cache ") and " r = " in line for line in lines)
    start = next(i for i, line in enumerate(lines) if line.startswith("NeutronAscend Algorithm 1 terms"))
    assert lines[start + 1].split() == [
        "layer", "candidate", "M", "S", "pad", "G", "r", "T_comp", "T_mem", "T_idle", "T_saved", "idle-saved",
    ]  # fmt: skip
    table = {}
    for line in lines[start + 3 :]:
        if line.startswith("--strategy"):
            break
        layer, label, *values = line.split()
        table[(int(layer), label)] = values
    hybrid = [(k, v) for k, v in table.items() if k[1].startswith("hybrid:2:")]
    assert hybrid
    widths = {(la["layer"], c["label"]): c["width"] for la in rec["layers"] for c in la["candidates"]}
    for key, (m, s, pad, g, *_) in hybrid:
        width = widths[key]
        assert (int(m), int(s), int(pad), int(g)) == (2, -(-width // 2), padding(-(-width // 2)), 2)
    # the JSON record has the same terms, and a plan read back keeps them
    for la in rec["layers"]:
        for c in la["candidates"]:
            a, m = c["alg1"], c["model_ms"]
            assert (m["idle"], m["saved"]) == (a["idle"], a["saved"])
            total = m["dense"] + m["aggregate"] + m["comm"] + m["memory"] + m["idle"] - m["saved"]
            assert math.isclose(c["modelled_ms"], total)
    back = Plan.from_dict({k: v for k, v in rec.items() if k != "total_s"})
    assert back.layers is not None and back.layers[0].candidates[0].alg1 is not None
