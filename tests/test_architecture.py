"""The package's shape, checked from its source: imports follow the declared layer order with no
cycles, layers speak only in primitives, and nothing dispatches by probing attributes."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "tessera"

# Lower layers never import higher ones (same layer is fine). Data flows one way: kernel support ->
# graph -> dense products | sparse primitives -> relational sums -> backends -> comm -> parallel
# strategies -> planner -> nn -> train -> cli. dense and sparse are siblings: neither imports the other.
LAYERS = [
    "base",
    "kernels",
    "graph",
    "dense",
    "sparse",
    "relational",
    "backends",
    "comm",
    "parallel",
    "planner",
    "nn",
    "train",
    "cli",
]
LAYER_OF_TOP = {
    "errors": "base",
    "digest": "base",
    "files": "base",
    "memo": "base",
    "threads": "base",
    "devices": "base",
    "workspace": "base",
    "bfloat16": "base",
    "phases": "base",
    "datasets": "graph",  # loaders by name: a graph-layer module kept at the top for `tessera.datasets.load`
}
# The primitives over an operand know neither the dense products nor relational sums (so the core
# Operand never depends on gTasks); graph layers receive their operand and speak only in primitives.
ONLY = {
    "sparse": {"base", "kernels", "graph", "sparse"},
    "nn": {"base", "dense", "sparse", "relational", "nn"},
}
# The facade (`import tessera`) registers the backends: it may import anything and nothing imports it.
FACADES = {"tessera", "tessera.__main__"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in PACKAGE.rglob("*.py")}


def layer_of(module: str) -> str:
    top = module.split(".")[1] if "." in module else ""
    return LAYER_OF_TOP.get(top, top)


def imports_of(path: Path) -> set[str]:
    """Every tessera module ``path`` imports, at any depth of the file (functions included)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("tessera")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("tessera"):
            for a in node.names:
                sub = f"{node.module}.{a.name}"
                found.add(sub if sub in MODULES else node.module)
    return found


GRAPH = {m: imports_of(p) - {m} for m, p in MODULES.items()}


def test_every_module_has_a_declared_layer():
    unknown = {m for m in MODULES if m not in FACADES and layer_of(m) not in LAYERS}
    assert not unknown, f"modules outside the declared layers {LAYERS}: {sorted(unknown)}"


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import in ``graph`` that runs against the layer order or a layer's allowed set."""
    bad = []
    for m, deps in graph.items():
        if m in FACADES:
            continue
        mine = LAYERS.index(layer_of(m))
        for d in deps:
            if d in FACADES:
                bad.append(f"{m} imports the facade {d}; import the defining module")
            elif LAYERS.index(layer_of(d)) > mine:
                bad.append(f"{m} ({layer_of(m)}) imports {d} ({layer_of(d)}), a layer above it")
            elif layer_of(m) in ONLY and layer_of(d) not in ONLY[layer_of(m)]:
                bad.append(f"{m} may use only {sorted(ONLY[layer_of(m)])}, not {d}")
    return sorted(bad)


def test_imports_follow_the_layer_order():
    bad = violations(GRAPH)
    assert not bad, "\n".join(bad)


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle as a list of modules (first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return stack[stack.index(d) :] + [d]
            if d not in state and (cycle := visit(d)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycles():
    inside = {m: {d for d in deps if d not in FACADES} for m, deps in GRAPH.items() if m not in FACADES}
    assert find_cycle(inside) is None, " -> ".join(find_cycle(inside))


def test_the_checks_catch_what_they_claim(tmp_path):
    # The walker sees imports inside functions and resolves `from package import module`.
    f = tmp_path / "probe.py"
    f.write_text("def late():\n    from tessera.parallel import partition\n    from tessera.sparse import aggregate\n")
    assert imports_of(f) == {"tessera.parallel.partition", "tessera.sparse.aggregate"}
    # Planted violations are reported: a strategy importing the trainer, a layer using a backend,
    # a module importing the facade; a planted cycle is found.
    planted = {
        "tessera.parallel.single": {"tessera.train.loop"},
        "tessera.nn.conv.gcn": {"tessera.backends.local"},
        "tessera.graph.graph": {"tessera"},
        "tessera.sparse.aggregate": {"tessera.graph.csr"},
        "tessera.sparse.attend": {"tessera.dense.linear"},
        "tessera.sparse.operand": {"tessera.relational.gtask"},
        "tessera.nn.conv.sage": {"tessera.kernels.dropout"},
    }
    bad = violations(planted)
    assert len(bad) == 6 and not any(b.startswith("tessera.sparse.aggregate") for b in bad), bad
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    g = tmp_path / "probe2.py"
    g.write_text("a = hasattr(b, 'c')\nd = getattr(b, 'c')\ne = getattr(b, 'c', None)\n")
    assert probes(g) == [1, 3]


# Attribute probing is allowed only where the object is foreign (a user's PyG Data, an unpickled
# file, a ctypes library, torch builds) or a field is read by name; never to find a backend,
# strategy or layer capability.
PROBING_ALLOWED = {
    "graph/formats/pyg.py": "a user's torch_geometric Data: optional attributes",
    "graph/formats/planetoid.py": "unpickled arrays: scipy sparse or numpy",
    "graph/formats/npz.py": "np.load returns an NpzFile or an array",
    "graph/partition/metis.py": "ctypes symbol lookup in pymetis's bundled METIS",
    "dense/gemm_path.py": "torch builds without oneDNN lack torch.ops.mkldnn",
    "datasets.py": "a synthetic generator module's optional PRESETS",
    "nn/conv/gin.py": "resetting the parameters of any torch module inside a user's MLP",
}


def probes(path: Path) -> list[int]:
    """Lines calling ``hasattr`` or a three-argument ``getattr`` (a default: probing)."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            if node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3):
                lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("rel", sorted(str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")))
def test_no_attribute_probing_dispatch(rel):
    found = probes(PACKAGE / rel)
    if rel in PROBING_ALLOWED:
        return
    assert not found, f"{rel}: hasattr/getattr-with-default at lines {found}; declare the capability instead"


def readme_backend_example() -> str:
    """The python block of docs/architecture.md's "Adding a backend or a strategy" section."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    section = text.split("### Adding a backend or a strategy", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def test_readme_example_backend_is_one_file_and_matches_the_reference(monkeypatch):
    import torch

    from tessera import sparse
    from tessera.backends import base
    from tessera.datasets import load

    monkeypatch.setattr(base, "_BACKENDS", dict(base._BACKENDS))  # the registration ends with the test
    exec(compile(readme_backend_example(), "docs/architecture.md", "exec"), {})
    assert "scatter" in base.available_backends()
    g = load("synthetic:tiny")
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(g.num_nodes, 2, 5, dtype=torch.float64, generator=gen, requires_grad=True)
    w = torch.rand(g.num_edges, 2, dtype=torch.float64, generator=gen, requires_grad=True)
    for reduce in ("sum", "mean"):
        got = sparse.aggregate(g, x, reduce, w, backend="scatter")
        want = sparse.aggregate(g, x, reduce, w, backend="reference")
        torch.testing.assert_close(got, want)
        go = torch.randn_like(got)
        gx, gw = torch.autograd.grad(got, (x, w), go)
        rx, rw = torch.autograd.grad(want, (x, w), go)
        torch.testing.assert_close(gx, rx)
        torch.testing.assert_close(gw, rw)


def test_process_group_backend_follows_the_tensors_device(monkeypatch):
    import torch

    from tessera.comm.exchange import Exchange
    from tessera.comm.group import Comm, backend_for, init_from_env
    from tessera.errors import ConfigError

    assert backend_for(torch.device("cpu")) == "gloo" and backend_for(torch.device("cuda", 0)) == "nccl"
    assert Comm(0, 2, torch.device("cpu")).backend == "gloo"
    # A rank that asks for a GPU its node lacks is refused in one line before any collective.
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "64")
    with pytest.raises(ConfigError, match="CUDA device 64"):
        init_from_env(5.0, device="cuda")
    # The exchange's buffers live on the group's device, at every bit width (the encoder's torch
    # form runs there: tests/comm/test_quantize_torch.py, tests/parallel/test_fake_device_dist.py).
    ex = Exchange(Comm(0, 1, torch.device("cpu")), [0], [0])
    ex.configure(2, None)
    assert ex._buffer(("probe",), (3,), torch.uint8).device == torch.device("cpu")
