"""RGCN: the layer against PyG's RGCNConv (outputs and every gradient), the relational variants
against each other and the per-relation reference, the variant choice, the model on the CLI,
and accuracy against GCN on the typed synthetic preset."""

import json

import pytest
import torch
from torch_geometric.nn import RGCNConv as PygRGCNConv

from tessera import Graph, GraphError
from tessera.backends import relational as choice
from tessera.backends.select import cache_file
from tessera.cli.main import main
from tessera.datasets import load
from tessera.errors import ConfigError
from tessera.nn.conv import RGCNConv
from tessera.relational import block_matmul
from tessera.relational.plan import VARIANTS, _plans, ranked_variants, variant_memory
from tessera.relational.variants import (
    relational_aggregate,
    relational_aggregate_reference,
    run_variant,
    segment_matmul,
    segment_matmul_reference,
)
from tessera.sparse import as_operand
from tessera.train.config import TrainConfig
from tessera.train.loop import train

R = 5


def awkward_typed(seed=0, n=40, e=260):
    """Random typed edges over ``n + 3`` vertices: relation ``R - 1`` empty, self loops (one
    duplicated, of two relations), duplicate edges, and isolated vertices ``n .. n + 2``."""
    gen = torch.Generator().manual_seed(seed)
    ei = torch.cat([torch.randint(0, n, (2, e), generator=gen), torch.tensor([[3, 3, 7, 1, 1], [3, 3, 7, 2, 2]])], 1)
    et = torch.cat([torch.randint(0, R - 1, (e,), generator=gen), torch.tensor([0, 2, 1, 3, 3])])
    return Graph.from_edge_index(ei, n + 3, edge_type=et, num_relations=R), ei, et


@pytest.fixture(scope="module")
def graph():
    return awkward_typed()


@pytest.mark.parametrize("decomposition", [{}, {"num_bases": 3}, {"num_blocks": 2}], ids=["plain", "bases", "blocks"])
@pytest.mark.parametrize("aggr", ["mean", "sum"])
def test_equals_pyg_in_outputs_and_gradients_for_every_variant(graph, aggr, decomposition):
    g, ei, et = graph
    torch.manual_seed(1)
    pyg = PygRGCNConv(12, 6, R, aggr="add" if aggr == "sum" else aggr, **decomposition)
    with torch.no_grad():
        pyg.bias.uniform_(-1, 1)  # PyG starts the bias at zero, which would hide a missing bias gradient
    x = torch.randn(g.num_nodes, 12)
    xp = x.clone().requires_grad_()
    out_p = pyg(xp, ei, et)
    seed = torch.randn_like(out_p)
    grads_p = torch.autograd.grad(out_p, [xp, *pyg.parameters()], seed)
    for variant in (*VARIANTS, "auto"):
        ours = RGCNConv(12, 6, R, aggr=aggr, variant=variant, **decomposition)
        ours.load_state_dict(pyg.state_dict())
        xo = x.clone().requires_grad_()
        out = ours(xo, g)
        torch.testing.assert_close(out, out_p, rtol=1e-5, atol=1e-5, msg=variant)
        grads = torch.autograd.grad(out, [xo, *ours.parameters()], seed)
        for name, a, b in zip(["x", *dict(pyg.named_parameters())], grads, grads_p, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=f"{variant}: gradient of {name}")


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_variants_equal_the_per_relation_reference(graph, reduce):
    g, ei, et = graph
    x, w = torch.randn(g.num_nodes, 7), torch.randn(R, 7, 9)  # float32: the operand's 1 / |N_r(i)| are float32
    want = relational_aggregate_reference(ei, et, x.double(), w.double(), reduce, g.num_nodes).float()
    assert want[g.num_nodes - 3 :].abs().max() == 0  # isolated vertices receive nothing
    custom = ("gtask:uniq(Dst.ID)=2 & uniq(Edge.Type)=1", "gtask:uniq(Src.ID)=min", "gtask:edge-num=3")
    for v in (*VARIANTS, *custom):  # the gtask variant on plans of other restrictions too
        torch.testing.assert_close(relational_aggregate(as_operand(g), x, w, reduce, v), want, msg=v)


def test_segment_matmul_and_its_gradients_match_the_reference():
    x = torch.randn(11, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, 5, dtype=torch.float64, requires_grad=True)
    ptr = torch.tensor([0, 4, 4, 11])  # an empty middle segment
    torch.testing.assert_close(segment_matmul(x, ptr, w), segment_matmul_reference(x, ptr, w))
    assert torch.autograd.gradcheck(lambda a, b: segment_matmul(a, ptr, b), (x, w))


def test_cost_model_prunes_by_flops_and_the_measured_choice_is_cached(graph, monkeypatch, tmp_path):
    g, _, _ = graph
    rel = as_operand(g).relations()
    stats = rel.stats()
    # 32 relations of a 100-vertex graph with 5 edges each: transforming every vertex for every
    # relation does 32 x 100 rows of GEMM for 160 edges; it must be pruned.
    from dataclasses import replace

    assert "transform_first" not in ranked_variants(replace(stats, relations=32, rows=100, cols=100), 256, 256)
    assert "edge_wise" not in ranked_variants(replace(stats, edges=10**6), 64, 64)
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    monkeypatch.setattr(choice, "_TRIAL_MIN_FLOPS", 0)
    monkeypatch.setattr(choice, "ranked_variants", lambda *a: list(VARIANTS))
    monkeypatch.setattr(choice, "MEMORY_FACTOR", float("inf"))  # every variant tried
    monkeypatch.setattr(choice, "WARMUP_FLOOR", float("inf"))  # a cold numba cache must not drop one
    calls = []
    real = choice.measure
    monkeypatch.setattr(choice, "measure", lambda *a: calls.append(1) or real(*a))
    fresh = Graph.from_edge_index(g.edge_index(), g.num_nodes, edge_type=g.edge_type, num_relations=R)
    x, w = torch.randn(g.num_nodes, 8), torch.randn(R, 8, 3)
    first = choice.choose_variant(as_operand(fresh).relations(), x, w, "mean")
    assert first in VARIANTS and len(calls) == 1
    entries = json.loads(cache_file().read_text())
    key = choice.decision_key(as_operand(fresh).relations(), 8, 3, "mean")
    assert entries[key]["choice"] == first and set(entries[key]["seconds"]) == set(VARIANTS)
    again = Graph.from_edge_index(g.edge_index(), g.num_nodes, edge_type=g.edge_type, num_relations=R)
    assert choice.choose_variant(as_operand(again).relations(), x, w, "mean") == first and len(calls) == 1


def test_a_variant_whose_warm_up_is_far_slower_gets_no_timed_passes(graph, monkeypatch, tmp_path):
    assert choice.warm_survivors({"a": 2.0, "b": 5.9, "c": 6.1}) == ["a", "b"]  # cap 3 x 2.0 s
    assert choice.warm_survivors({"a": 0.01, "b": 0.9}) == ["a", "b"]  # under the 1 s floor
    g, _, _ = graph
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    monkeypatch.setattr(choice, "_TRIAL_MIN_FLOPS", 0)
    monkeypatch.setattr(choice, "ranked_variants", lambda *a: ["unique_source", "gtask", "aggregate_first"])
    monkeypatch.setattr(choice, "MEMORY_FACTOR", float("inf"))
    now, runs = [0.0], []  # a clock that each pass advances: gtask 30 s, the others 2 s
    real = choice.run_variant

    def run(rel, name, *args):
        runs.append(name)
        now[0] += 30.0 if name == "gtask" else 2.0
        return real(rel, name, *args)

    monkeypatch.setattr(choice, "run_variant", run)
    monkeypatch.setattr(choice, "_clock", lambda: now[0])
    fresh = Graph.from_edge_index(g.edge_index(), g.num_nodes, edge_type=g.edge_type, num_relations=R)
    rel = as_operand(fresh).relations()
    x, w = torch.randn(g.num_nodes, 6), torch.randn(R, 6, 4)
    assert choice.choose_variant(rel, x, w, "sum") == "unique_source"
    assert runs.count("gtask") == 1  # its warm-up only
    assert runs.count("unique_source") == runs.count("aggregate_first") == 1 + choice._TRIAL_REPS
    entry = json.loads(cache_file().read_text())[choice.decision_key(rel, 6, 4, "sum")]
    assert entry["seconds"] == {"unique_source": 2.0, "aggregate_first": 2.0} and entry["dropped"] == {"gtask": 30.0}


def test_a_trial_skips_memory_hungry_variants_and_releases_the_losers_structures(graph, monkeypatch, tmp_path):
    g, _, _ = graph
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))
    monkeypatch.setattr(choice, "_TRIAL_MIN_FLOPS", 0)
    monkeypatch.setattr(choice, "ranked_variants", lambda *a: list(VARIANTS))
    monkeypatch.setattr(choice, "WARMUP_FLOOR", float("inf"))
    fresh = Graph.from_edge_index(g.edge_index(), g.num_nodes, edge_type=g.edge_type, num_relations=R)
    rel = as_operand(fresh).relations()
    x, w = torch.randn(g.num_nodes, 8), torch.randn(R, 8, 3)
    mem = {v: variant_memory(rel.stats(), 8, 3, v) for v in VARIANTS}
    lean = min(mem.values())
    tried = {v for v in VARIANTS if mem[v] <= choice.MEMORY_FACTOR * lean}
    assert "edge_wise" not in tried and len(tried) >= 2  # 2.6 E (fi + fo) floats against 8 P fo
    ran = []
    real = choice.run_variant
    monkeypatch.setattr(choice, "run_variant", lambda r, name, *a: ran.append(name) or real(r, name, *a))
    chosen = choice.choose_variant(rel, x, w, "mean")
    assert set(ran) == tried and chosen in tried
    # the structures of the variants not chosen are gone; the chosen one's stay, and a dropped one is rebuilt
    side = {"transform_first": "all", "unique_source": "source", "aggregate_first": "destination", "gtask": "gtask"}
    held = {k[1] for k in _plans.entries(rel.matrix)}
    assert side[chosen] in held and not (held & {side[v] for v in tried - {chosen}})
    other = next(iter(tried - {chosen}))
    torch.testing.assert_close(run_variant(rel, other, x, w, "mean"), run_variant(rel, chosen, x, w, "mean"))


@pytest.mark.parametrize("variant", ["unique_source", "gtask"])
def test_chunked_gathered_products_equal_the_reference_with_hubs_and_empty_relations(variant, monkeypatch):
    # relation 1 and R - 1 empty, vertex 0 a hub (source of 200 edges, destination of 150), and
    # chunks of 3 rows: every relation's rows (and the gTask batches) cut into many chunks
    gen = torch.Generator().manual_seed(3)
    n, e = 50, 300
    ei = torch.randint(0, n, (2, e), generator=gen)
    ei[0, :200], ei[1, 100:250] = 0, 0
    et = torch.randint(0, R, (e,), generator=gen)
    et[(et == 1) | (et == R - 1)] = 2
    g = Graph.from_edge_index(ei, n, edge_type=et, num_relations=R)
    # float32, as the operand's 1 / |N_r(i)| are; the reference in float64, rounded
    x = torch.randn(n, 7, generator=gen, requires_grad=True)
    w = torch.randn(R, 7, 4, generator=gen, requires_grad=True)
    x64, w64 = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    want64 = relational_aggregate_reference(ei, et, x64, w64, "mean", n)
    probe = torch.randn(want64.shape, generator=gen)
    want = want64.float()
    grads = [t.float() for t in torch.autograd.grad((want64 * probe.double()).sum(), (x64, w64))]
    real, rows = block_matmul.chunk_blocks, []
    monkeypatch.setattr(block_matmul, "chunk_blocks", lambda b, m: rows.append(m) or real(b, m))
    for chunk in (3 * 7 * 4, None):  # 3 rows of 7 float32 values
        monkeypatch.setattr(block_matmul, "GATHER_CHUNK_BYTES", chunk or 2**27)
        out = relational_aggregate(as_operand(g), x, w, "mean", variant)
        assert rows[-1] == (3 if chunk else 2**27 // 28)
        torch.testing.assert_close(out, want)
        for a, b in zip(torch.autograd.grad((out * probe).sum(), (x, w)), grads, strict=True):
            torch.testing.assert_close(a, b)


def test_untyped_graph_and_wrong_relation_count_are_clear_errors(graph):
    g, _, _ = graph
    with pytest.raises(GraphError, match="no edge types"):
        RGCNConv(4, 2, R)(torch.randn(g.num_nodes, 4), g.replace(edge_type=None, num_relations=None))
    with pytest.raises(ConfigError, match="graph has 5 relations but this RGCN layer was built for 3"):
        RGCNConv(4, 2, 3)(torch.randn(g.num_nodes, 4), g)
    with pytest.raises(ConfigError, match="must divide"):
        RGCNConv(4, 3, R, num_blocks=2)


def one_line(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


def test_cli_refuses_rgcn_on_untyped_graph_and_bad_edge_types(capsys, tmp_path):
    msg = one_line(capsys, ["train", "--dataset", "synthetic:tiny", "--model", "rgcn", "--out", str(tmp_path / "a")])
    assert "needs a typed graph" in msg
    bad = tmp_path / "bad.rel"
    bad.write_text("0 0 1\n1 -2 0\n")
    assert "negative id" in one_line(
        capsys, ["train", "--dataset", str(bad), "--model", "rgcn", "--out", str(tmp_path / "b")]
    )
    msg = one_line(
        capsys, ["train", "--dataset", "synthetic:small-rel", "--num-bases", "2", "--out", str(tmp_path / "c")]
    )
    assert "RGCN options" in msg
    rgcn = ["train", "--dataset", "synthetic:small-rel", "--model", "rgcn", "--out", str(tmp_path / "d")]
    msg = one_line(capsys, [*rgcn, "--rgcn-variant", "gtask:uniq(Dst.ID)=8 &"])
    assert "bad gTask restriction" in msg and "column 17" in msg
    assert "unknown RGCN variant 'fast'" in one_line(capsys, [*rgcn, "--rgcn-variant", "fast"])
    gcn = ["train", "--dataset", "synthetic:small-rel", "--rgcn-variant", "gtask", "--out", str(tmp_path / "e")]
    assert "RGCN options" in one_line(capsys, gcn)
    assert not (tmp_path / "d").exists() and not (tmp_path / "e" / "checkpoint.pt").exists()


def test_rgcn_beats_gcn_on_typed_synthetic_graph(tmp_path):
    g = load("synthetic:small-rel")
    acc = {}
    for model in ("rgcn", "gcn"):
        for seed in (0, 1):
            cfg = TrainConfig(
                dataset="synthetic:small-rel", model=model, hidden=32, epochs=25, lr=0.03, seed=seed, threads=1,
                progress=False, out=str(tmp_path / f"{model}{seed}"), checkpoint_every=1000,
            )  # fmt: skip
            acc[model, seed] = train(cfg.validate(), g)["test_acc"]
    for seed in (0, 1):  # measured: RGCN 0.78-0.79, GCN 0.39-0.40
        assert acc["rgcn", seed] > acc["gcn", seed] + 0.25, acc
