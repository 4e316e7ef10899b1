"""Typed (relational) graphs: validation, edge types kept through every transformation, the typed
loaders (``src rel dst`` text, N-Triples, PyG) and the typed synthetic presets."""

import numpy as np
import pytest
import torch

from tessera import Graph, GraphError
from tessera.cli.main import main
from tessera.datasets import load
from tessera.errors import DatasetError
from tessera.graph.formats import from_pyg, load_ntriples, load_typed_edgelist, to_pyg, write_typed_edgelist
from tessera.graph.order import permute_graph
from tessera.graph.partition import load_part, write_parts
from tessera.graph.synthetic import generate, relation_kinds

pytestmark = pytest.mark.distributed  # starts worker processes


def typed(seed=0, n=30, e=120, r=5):
    gen = torch.Generator().manual_seed(seed)
    ei = torch.randint(0, n, (2, e), generator=gen)
    ei = torch.cat([ei, torch.tensor([[4, 4, 9], [4, 4, 9]])], 1)  # a duplicated loop and one more
    et = torch.cat([torch.randint(0, r - 1, (e,), generator=gen), torch.tensor([2, 3, 1])])  # r - 1 unused
    return Graph.from_edge_index(ei, n, edge_type=et, num_relations=r, x=torch.randn(n, 3, generator=gen))


def triples(g):
    """The multiset of (src, rel, dst) of a typed graph."""
    return sorted(zip(g.src_index().tolist(), g.edge_type.tolist(), g.dst_index().tolist()))


def one_line(capsys, argv):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


# ---------------------------------------------------------------------------------------- validation
def test_num_relations_defaults_to_largest_id_and_may_be_declared_larger():
    ei = torch.tensor([[0, 1, 2], [1, 2, 0]])
    assert Graph.from_edge_index(ei, 3, edge_type=torch.tensor([0, 2, 2])).num_relations == 3
    g = Graph.from_edge_index(ei, 3, edge_type=torch.tensor([0, 2, 2]), num_relations=5)
    assert g.num_relations == 5 and g.relation_counts().tolist() == [1, 0, 2, 0, 0]
    assert Graph.from_edge_index(ei, 3).num_relations is None


@pytest.mark.parametrize(
    "edge_type, relations, message",
    [
        ([0, 3, 1], 3, r"edge type 3 of edge 1 -> 2 is outside \[0, 3\)"),
        ([0, -1, 1], None, r"edge type -1 of edge 1 -> 2 is outside"),
        ([0.0, 1.0, 1.0], None, "must be an integer array"),
        ([True, False, True], None, "must be an integer array"),
        ([0, 1], None, "entries for 3 edges"),
        ([0, 1, 1], -2, "non-negative integer"),
        ([0, 1, 1], 2.5, "non-negative integer"),
    ],
)
def test_bad_edge_types_are_one_clear_graph_error(edge_type, relations, message):
    with pytest.raises(GraphError, match=message):
        Graph.from_edge_index(
            torch.tensor([[0, 1, 2], [1, 2, 0]]), 3, edge_type=torch.tensor(edge_type), num_relations=relations
        )


def test_num_relations_without_edge_types_is_refused():
    with pytest.raises(GraphError, match="without edge_type"):
        Graph.from_edge_index(torch.tensor([[0], [1]]), 2, num_relations=3)


# ---------------------------------------------------------------------------------------- transformations
def test_permutation_keeps_every_edge_with_its_relation():
    g = typed()
    perm = np.random.default_rng(0).permutation(g.num_nodes)
    p = permute_graph(g, perm)
    inv = np.argsort(perm)
    moved = sorted((int(inv[s]), t, int(inv[d])) for s, t, d in triples(g))
    assert triples(p) == moved and p.num_relations == g.num_relations == 5


def test_self_loops_keep_their_relation_and_new_ones_get_loop_type():
    g = typed()
    h = g.add_self_loops(loop_type=4)
    loops = {s: t for s, t, d in triples(h) if s == d}
    assert len(loops) == g.num_nodes and h.num_relations == 5
    had = {}
    for s, t, d in triples(g):
        if s == d:
            had.setdefault(s, set()).add(t)
    assert {4, 9} <= set(had) and had[9] == {1}
    assert all(t in had[v] if v in had else t == 4 for v, t in loops.items())  # existing loops keep theirs
    assert [x for x in triples(h) if x[0] != x[2]] == [x for x in triples(g) if x[0] != x[2]]
    with pytest.raises(GraphError, match="outside"):
        g.add_self_loops(loop_type=5)
    assert not any(s == d for s, _, d in triples(g.remove_self_loops()))


def test_coalesce_and_undirected_keep_parallel_edges_of_different_relations():
    g = Graph.from_edge_index(
        torch.tensor([[0, 0, 0, 1], [1, 1, 1, 2]]), 3, edge_type=torch.tensor([1, 0, 1, 2]), num_relations=4
    )
    assert triples(g.coalesce()) == [(0, 0, 1), (0, 1, 1), (1, 2, 2)]
    u = g.to_undirected()
    assert triples(u) == sorted([(0, 0, 1), (0, 1, 1), (1, 2, 2), (1, 0, 0), (1, 1, 0), (2, 2, 1)])
    assert u.num_relations == 4


def test_fingerprint_depends_on_relations():
    g = typed()
    assert g.fingerprint() != g.replace(edge_type=None, num_relations=None).fingerprint()
    assert g.fingerprint() != g.replace(num_relations=6).fingerprint()
    assert g.fingerprint() != g.replace(edge_type=torch.flip(g.edge_type, [0])).fingerprint()


def test_part_files_carry_edge_types(tmp_path):
    g = typed()
    part = np.arange(g.num_nodes) % 3
    write_parts(g, part, tmp_path)
    seen = []
    for k in range(3):
        d = load_part(tmp_path, k)
        dst = np.repeat(d["owned"], np.diff(d["indptr"]))
        seen += zip(d["src"].tolist(), d["etype"].tolist(), dst.tolist())
        src, dst_out = d["owned"][d["out_src"]], d["out_dst"]
        want = [x for x in triples(g) if part[x[0]] == k and part[x[2]] != k]
        assert sorted(zip(src.tolist(), d["out_etype"].tolist(), dst_out.tolist())) == want
    assert sorted(seen) == triples(g)
    assert d["meta"]["num_relations"] == 5


# ---------------------------------------------------------------------------------------- loaders
def test_typed_edge_list_round_trip(tmp_path):
    g = typed()
    path = tmp_path / "kg.rel"
    write_typed_edgelist(g, path)
    np.save(tmp_path / "kg.features.npy", g.x.numpy())
    back = load(str(path))
    assert triples(back) == triples(g) and back.num_relations == 4  # the unused last relation is not in the file
    assert torch.equal(back.x, g.x)
    declared = load_typed_edgelist(path, num_relations=5)
    assert declared.relation_counts().tolist() == g.relation_counts().tolist()


@pytest.mark.parametrize(
    "text, message",
    [
        ("0 1 2\n3 x 4\n", "line 2: 'x' is not an integer"),
        ("0 1 2\n3 4\n", "line 2: found 2 columns but line 1 has 3"),
        ("0 1 2\n3 -1 4\n", "line 2: negative id"),
        ("0 1\n", "expected 3 columns"),
    ],
)
def test_bad_typed_edge_lists_are_one_line_errors(tmp_path, capsys, text, message):
    path = tmp_path / "bad.rel"
    path.write_text(text)
    with pytest.raises(DatasetError, match=message):
        load_typed_edgelist(path)
    assert message.split(": ", 1)[-1].split("'")[0] in one_line(capsys, ["info", "--dataset", str(path)])


def test_declared_relation_count_is_checked(tmp_path):
    path = tmp_path / "kg.rel"
    path.write_text("0 1 2\n1 3 0\n")
    with pytest.raises(DatasetError, match=r"edge 1 has relation 3, outside the declared \[0, 2\)"):
        load_typed_edgelist(path, num_relations=2)


NT = """# a small knowledge graph
<http://x/a> <http://p/knows> <http://x/b> .
<http://x/b> <http://p/likes> <http://x/c> .
<http://x/a> <http://p/name> "Alice"@en .
_:n1 <http://p/knows> <http://x/a> .
<http://x/c> <http://p/likes> <http://x/a> .   # trailing comment

<http://x/d> <http://p/age> "42"^^<http://www.w3.org/2001/XMLSchema#int> .
"""


def test_ntriples_ids_in_first_seen_order_with_labels(tmp_path):
    (tmp_path / "kg.nt").write_text(NT)
    (tmp_path / "kg.labels").write_text("<http://x/a> person\n<http://x/c> thing\n_:n1 person\n")
    g = load(str(tmp_path / "kg.nt"))
    # vertices a=0 b=1 c=2 _:n1=3 d=4 (d only has a literal); relations knows=0 likes=1
    assert g.num_nodes == 5 and g.num_relations == 2
    assert triples(g) == sorted([(0, 0, 1), (1, 1, 2), (3, 0, 0), (2, 1, 0)])
    assert g.y.tolist() == [0, -1, 1, 0, -1] and g.num_classes == 2
    assert g.name == "kg"


def test_ntriples_integer_classes_and_errors(tmp_path):
    (tmp_path / "kg.nt").write_text(NT)
    labels = tmp_path / "int.labels"
    labels.write_text("<http://x/b> 1\n<http://x/a> 0\n")
    assert load_ntriples(tmp_path / "kg.nt", labels).y.tolist() == [0, 1, -1, -1, -1]
    (tmp_path / "bad.nt").write_text("<http://x/a> <http://p/knows> <http://x/b>\n")
    with pytest.raises(DatasetError, match="line 1: not an N-Triples statement"):
        load_ntriples(tmp_path / "bad.nt")
    labels.write_text("<http://x/zzz> 1\n")
    with pytest.raises(DatasetError, match="does not occur in the triples"):
        load_ntriples(tmp_path / "kg.nt", labels)


def test_pyg_data_edge_type_round_trip():
    g = typed()
    d = to_pyg(g)
    assert torch.equal(d.edge_type, g.edge_type) and d.num_relations == 5
    back = from_pyg(d)
    assert triples(back) == triples(g) and back.num_relations == 5
    del d.num_relations
    assert from_pyg(d).num_relations == 4
    d.edge_type = d.edge_type + 10
    d.num_relations = 5
    with pytest.raises(GraphError, match="outside"):
        from_pyg(d)


# ---------------------------------------------------------------------------------------- synthetic
def test_typed_preset_is_deterministic_and_relations_differ_in_homophily():
    g = generate("small-rel", seed=3)
    assert g.fingerprint() == generate("small-rel", seed=3).fingerprint()
    assert g.fingerprint() != generate("small-rel", seed=4).fingerprint()
    assert g.num_relations == 8 and g.is_undirected() and g.num_nodes == 10_000
    assert generate("small-rel16").num_relations == 16
    kinds = relation_kinds(8, 8, np.random.default_rng(np.random.SeedSequence(3).spawn(4)[3]))
    same = (g.y[g.src_index()] == g.y[g.dst_index()]).double()
    share = torch.zeros(8, dtype=torch.float64).index_add_(0, g.edge_type, same) / g.relation_counts()
    for r, kind in enumerate(kinds.kind):  # same-class share per relation follows its rule
        if kind == "same":
            assert share[r] > 0.55
        elif kind == "mapped":
            assert share[r] < 0.2
    assert set(kinds.kind) == {"same", "mapped", "noise"}


def test_bad_typed_preset_and_info_counts(capsys):
    assert "use 1 to 64" in one_line(capsys, ["info", "--dataset", "synthetic:small-rel65"])
    assert main(["info", "--dataset", "synthetic:small-rel"]) == 0
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith("relations"))
    counts = [int(c.split(":")[1].replace(",", "")) for c in line.split("relation: ")[1].split()]
    assert len(counts) == 8 and sum(counts) == 100_000
    assert main(["info", "--dataset", "synthetic:tiny"]) == 0
    assert "relations    - (untyped)" in capsys.readouterr().out
