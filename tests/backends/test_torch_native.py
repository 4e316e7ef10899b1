"""The torch-native backend: every product against the reference backend in values and gradients
(hub rows, empty rows, isolated vertices, rectangular and int64 matrices; float32, float64 and
bfloat16), GAT attention and RGCN through it, no NumPy on its path, its place in ``auto``, and
training with ``backend="torch"`` to the default path's losses."""

from __future__ import annotations

import types

import pytest
import torch

from helpers import awkward_graph
from tessera import Graph, sparse
from tessera.backends import get_backend, select
from tessera.backends.local import LocalOperand
from tessera.graph.csr import CSRMatrix
from tessera.graph.synthetic import generate

F32_REL, F64_REL, BF16_REL = 1e-5, 1e-12, 2e-2


@pytest.fixture(scope="module")
def hub() -> Graph:
    """Vertex 3 holds a third of the edges; empty rows, isolated vertices, self loops, duplicates."""
    return awkward_graph(n=120, e=1500, seed=1)


def _graphs(hub: Graph) -> dict[str, object]:
    rows = 40  # the first rows only: a rectangular matrix, int64 indices
    stop = int(hub.indptr[rows])
    rect = CSRMatrix(hub.indptr[: rows + 1].long(), hub.indices[:stop].long(), None, rows, hub.num_nodes)
    # vertices 0..9 send three edges each and receive none (empty rows that are not isolated),
    # 10..39 receive one each and send none
    src = torch.arange(0, 10).repeat_interleave(3)
    dst = torch.arange(10, 40).roll(7)
    one_way = Graph.from_edge_index(torch.stack([src, dst]), 40)
    return {"hub": hub, "rect": rect, "one_way": one_way, "symmetric": generate("tiny", seed=0)}


def _close(got: torch.Tensor, want: torch.Tensor, rel: float) -> None:
    # relative to the largest magnitude: sums that cancel to ~0 are not held to rel of themselves
    assert got.dtype == want.dtype and got.shape == want.shape
    scale = float(want.detach().abs().max()) if want.numel() else 1.0
    torch.testing.assert_close(got, want, rtol=rel, atol=rel * max(scale, 1e-30))


def _rel(dtype: torch.dtype) -> float:
    return {torch.float32: F32_REL, torch.float64: F64_REL, torch.bfloat16: BF16_REL}[dtype]


def _aggregate_both(m, x, w, reduce, backend, weight_grad=True):
    """``aggregate``'s output and the gradients of ``x`` and (when given and ``weight_grad``) ``w``."""
    xr = x.clone().requires_grad_(True)
    wr = None if w is None else w.clone().requires_grad_(weight_grad)
    out = sparse.aggregate(m, xr, reduce, wr, backend)
    go = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape)
    out.backward(go)
    return out.detach(), xr.grad, None if wr is None else wr.grad


def _check_aggregate(m, x, w, reduce, weight_grad=True):
    """torch against reference in values and gradients; bfloat16 against the reference's float32
    sums rounded to bfloat16 (the weight's gradient stays float32)."""
    if x.dtype == torch.bfloat16:  # the reference has no bfloat16
        out, gx, gw = _aggregate_both(m, x.float(), w, reduce, "reference", weight_grad)
        want = (out.bfloat16(), gx.bfloat16(), gw)
    else:
        want = _aggregate_both(m, x, w, reduce, "reference", weight_grad)
    got = _aggregate_both(m, x, w, reduce, "torch", weight_grad)
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
        else:
            _close(a, b, _rel(x.dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("kind", ["hub", "rect", "one_way", "symmetric"])
def test_products_equal_the_reference_in_values_and_gradients(hub, kind, dtype):
    m = _graphs(hub)[kind]
    gen = torch.Generator().manual_seed(len(kind))
    n, e = m.num_cols, m.num_edges
    x = torch.randn(n, 24, generator=gen).to(dtype)
    w = torch.rand(e, generator=gen, dtype=torch.float64).to(torch.float32 if dtype == torch.bfloat16 else dtype)
    for weight, reduce in ((None, "sum"), (None, "mean"), (w, "sum"), (w, "mean")):
        _check_aggregate(m, x, weight, reduce)  # forward, transposed (x's gradient), SDDMM (w's)
    x3 = torch.randn(n, 3, 5, generator=gen).to(dtype)
    w2 = torch.rand(e, 3, generator=gen, dtype=torch.float64).to(w.dtype)
    # 3-D heads: unweighted, one weight for every head (no gradient: aggregate has none for it), per head
    for weight in (None, w, w2):
        _check_aggregate(m, x3, weight, "sum", weight_grad=weight is not w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_direct_products_and_sddmm(hub, dtype):
    tb, ref = get_backend("torch"), get_backend("reference")
    gen = torch.Generator().manual_seed(2)
    wide = torch.float32 if dtype == torch.bfloat16 else dtype
    for shape in ((40,), (3, 16)):
        g = torch.randn(hub.num_nodes, *shape, generator=gen).to(dtype)
        x = torch.randn(hub.num_nodes, *shape, generator=gen).to(dtype)
        got = tb.sddmm_dot(hub, g, x)
        assert got.dtype == wide  # bfloat16 rows give float32 scores, as the csr backend's
        _close(got, ref.sddmm_dot(hub, g.to(wide), x.to(wide)), _rel(dtype))
        w = torch.rand(hub.num_edges, *shape[:-1], generator=gen).to(wide)
        for fn in ("spmm", "spmm_t"):
            out = getattr(tb, fn)(hub, x, w)
            assert out.dtype == dtype
            _close(out, getattr(ref, fn)(hub, x.to(wide), w).to(dtype), _rel(dtype))
    if dtype == torch.bfloat16:  # summed in float32 and rounded once, as the csr kernel does
        x = torch.randn(hub.num_nodes, 64, generator=gen).to(dtype)
        _close(tb.spmm(hub, x, None), get_backend("csr").spmm(hub, x, None), BF16_REL)


def test_empty_matrices_and_zero_width():
    tb = get_backend("torch")
    g = Graph.from_edge_index(torch.zeros(2, 0, dtype=torch.int64), 4)
    x = torch.randn(4, 8)
    assert torch.equal(tb.spmm(g, x, None), torch.zeros(4, 8))
    assert torch.equal(tb.spmm_t(g, x, None), torch.zeros(4, 8))
    assert tb.sddmm_dot(g, x, x).shape == (0,)
    h = awkward_graph(n=10, e=20)
    assert tb.spmm(h, torch.randn(h.num_nodes, 0), None).shape == (h.num_nodes, 0)
    with pytest.raises(ValueError, match="per-head weights"):
        tb.spmm(h, torch.randn(h.num_nodes, 4), torch.rand(h.num_edges, 2))


def test_fixed_weights_are_permuted_once_and_mirrored_ones_not_at_all(hub):
    tb, ref = get_backend("torch"), get_backend("reference")
    x = torch.randn(hub.num_nodes, 8)
    w = torch.rand(hub.num_edges)
    first = tb.spmm_t(hub, x, w)
    memo = tb.plans.entries(hub)["transposed_weight"]
    kept = memo[torch.float32][2]
    assert kept is not None and memo[torch.float32][0]() is w
    assert torch.equal(tb.spmm_t(hub, x, w), first) and memo[torch.float32][2] is kept  # reused
    w.mul_(2.0)  # changed in place: permuted again
    _close(tb.spmm_t(hub, x, w), ref.spmm_t(hub, x, w), F32_REL)
    trainable = w.clone().requires_grad_()
    _close(tb.spmm_t(hub, x, trainable), ref.spmm_t(hub, x, w), F32_REL)
    assert memo[torch.float32][0]() is w  # nothing kept for a weight of one step
    # GCN's values of a symmetric graph are their own transpose: no copy, the structure shared
    norm = generate("tiny", seed=0).gcn_norm()
    xs = torch.randn(norm.num_nodes, 8)
    _close(tb.spmm_t(norm, xs, norm.edge_weight), ref.spmm_t(norm, xs, norm.edge_weight), F32_REL)
    t = tb._transpose(norm, xs.device)
    assert t.symmetric and t.indices is norm.indices
    assert tb.plans.entries(norm)["transposed_weight"][torch.float32][2] is None


def test_no_numpy_on_the_torch_path(monkeypatch):
    """Every product on a fresh matrix (its plans built inside) without any tensor read through
    NumPy: the path a CUDA tensor takes, where ``.numpy()`` fails."""
    g = awkward_graph(n=50, e=300, seed=9)
    gen = torch.Generator().manual_seed(0)
    x, x3 = torch.randn(g.num_nodes, 6, generator=gen), torch.randn(g.num_nodes, 2, 3, generator=gen)
    w, w2 = torch.rand(g.num_edges, generator=gen), torch.rand(g.num_edges, 2, generator=gen)
    products = [
        ("spmm", x, w), ("spmm_t", x, w), ("spmm", x3, w2), ("spmm_t", x3, w2), ("spmm_t", x, None),
        ("sddmm_dot", x3, x3),
    ]  # fmt: skip
    ref, tb = get_backend("reference"), get_backend("torch")
    want = [getattr(ref, fn)(g, a, b) for fn, a, b in products]

    def refuse(self, *a, **k):
        raise AssertionError("the torch backend read a tensor through NumPy")

    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    tb.plans.drop(g)
    got = [getattr(tb, fn)(g, a, b) for fn, a, b in products]
    tb.spmm_t(g, x.bfloat16(), w)
    for a, b in zip(got, want, strict=True):
        _close(a, b, F32_REL)


@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("p", [0.0, 0.4])
def test_gat_attention_through_the_torch_backend(hub, heads, dtype, p):
    """``attend`` (attention, its dropout and the weighted sum) and the composition CUDA tensors
    take (edge scores and softmax in torch ops, then ``aggregate``) against the reference."""
    gen = torch.Generator().manual_seed(heads)
    a_src, a_dst = (torch.randn(hub.num_nodes, heads, generator=gen, dtype=dtype) for _ in range(2))
    h = torch.randn(hub.num_nodes, heads, 5, generator=gen, dtype=dtype)
    go = torch.randn(hub.num_nodes, heads, 5, generator=gen, dtype=dtype)
    keys = sparse.edge_keys(hub, torch.arange(hub.num_nodes), torch.arange(hub.num_nodes))

    def run(backend: str, fused: bool):
        ins = [t.clone().requires_grad_() for t in (a_src, a_dst, h)]
        a = sparse.as_operand(hub, backend)
        torch.manual_seed(5)
        if fused:
            out = sparse.attend(a, hub, *ins, 0.2, p, keys if p else None)
        else:
            scores = torch.nn.functional.leaky_relu(sparse.edge_score(hub, ins[0], ins[1]), 0.2)
            alpha = sparse.edge_softmax(hub, scores)
            out = sparse.aggregate(a, ins[2], "sum", alpha)
        return (out, *torch.autograd.grad(out, ins, go))

    for fused in (True, False) if p == 0.0 else (True,):
        for a, b in zip(run("torch", fused), run("reference", fused), strict=True):
            _close(a, b, 1e-5 if dtype == torch.float32 else F64_REL)


def test_gat_layer_forward_and_backward_through_the_torch_backend():
    from tessera.nn import build_model

    g = generate("tiny", seed=0)
    results = {}
    for backend in ("torch", "reference"):
        torch.manual_seed(0)
        m = build_model("gat", g.x.shape[1], 8, int(g.y.max()) + 1, 2, 0.5, heads=2, backend=backend)
        torch.manual_seed(1)
        out = m(g.x, g)
        out.square().sum().backward()
        results[backend] = (out.detach(), [p.grad for p in m.parameters()])
    (a, ga), (b, gb) = results["torch"], results["reference"]
    _close(a, b, 1e-5)
    for x, y in zip(ga, gb, strict=True):
        _close(x, y, 1e-4)


@pytest.mark.parametrize("reduce", ["sum", "mean"])
def test_relational_products_run_through_the_torch_backend(monkeypatch, reduce):
    from tessera.backends.torch_native import TorchBackend
    from tessera.relational.variants import relational_aggregate

    gen = torch.Generator().manual_seed(0)
    ei = torch.randint(0, 40, (2, 300), generator=gen)
    et = torch.randint(0, 4, (300,), generator=gen)
    g = Graph.from_edge_index(ei, 43, edge_type=et, num_relations=5)  # relation 4 empty, 3 isolated
    x, w = torch.randn(g.num_nodes, 7, generator=gen), torch.randn(5, 7, 6, generator=gen)
    calls = []
    real = TorchBackend.spmm_t
    monkeypatch.setattr(TorchBackend, "spmm_t", lambda self, *a: calls.append(1) or real(self, *a))
    for variant in ("transform_first", "unique_source", "aggregate_first"):
        got = []
        for backend in ("torch", "reference"):
            xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
            out = relational_aggregate(LocalOperand(g, backend), xr, wr, reduce, variant)
            got.append((out, *torch.autograd.grad(out, (xr, wr), torch.ones_like(out))))
        for a, b in zip(*got, strict=True):
            _close(a, b, F32_REL)
    assert len(calls) == 3


def test_auto_leaves_the_cpu_choice_alone_and_takes_torch_on_cuda(monkeypatch, tmp_path):
    monkeypatch.setenv("TESSERA_CACHE", str(tmp_path))  # no decision stored by another test
    g = generate("tiny", seed=0)
    x = torch.randn(g.num_nodes, 32)
    assert "torch" in select.candidates(x) and "torch" not in select.auto_candidates(x)
    cuda = types.SimpleNamespace(device=torch.device("cuda"), dtype=torch.float32)
    assert "torch" in select.auto_candidates(cuda)  # type: ignore[arg-type]
    assert all(get_backend(n).supports(cuda) for n in select.auto_candidates(cuda))  # type: ignore[arg-type]
    monkeypatch.setattr(select, "_TRIAL_MIN_WORK", 0)  # a measured trial even on a tiny graph
    measured = []
    real = select.measure
    monkeypatch.setattr(
        select, "measure", lambda m, x, w, names, *a: measured.append(names) or real(m, x, w, names, *a)
    )
    select.clear_memo(g)
    assert select.choose(g, x, None, "forward") != "torch"
    assert measured and all("torch" not in names for names in measured)
    with select.forced("torch"):
        assert select.choose(g, x, None, "forward") == "torch"


def test_cli_accepts_backend_torch(tmp_path, capsys):
    from tessera.cli.main import main

    argv = ["train", "--dataset", "synthetic:tiny", "--backend", "torch", "--epochs", "2", "--hidden", "8"]
    assert main([*argv, "--out", str(tmp_path), "--no-progress"]) == 0
    capsys.readouterr()


MODELS = ("gcn", "sage", "gin", "gat", "rgcn", "sage-lstm")


@pytest.mark.parametrize(
    ("dataset", "model", "precision"),
    [("synthetic:small", m, "fp32") for m in MODELS]
    + [("cora", m, "fp32") for m in MODELS if m != "rgcn"]  # Cora has no edge types
    + [("synthetic:small", "gcn", "bf16"), ("synthetic:small", "gat", "bf16")],
)
def test_training_with_backend_torch_equals_the_default_path(dataset, model, precision, tmp_path, monkeypatch, request):
    """``--backend torch`` runs every kernel of the step as the portable torch op a GPU runs (the
    products on this backend, dropout through torch's integer ops, SAGE-LSTM's recurrence in torch
    ops) and trains to the default path's losses."""
    from helpers import single_thread
    from tessera.backends.torch_native import TorchBackend
    from tessera.datasets import load
    from tessera.kernels import dropout as keyed_dropout
    from tessera.memo import tuning
    from tessera.sparse import lstm_kernels
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    if dataset == "cora":
        monkeypatch.setenv("TESSERA_DATA", str(request.getfixturevalue("planetoid_root")))
    calls: dict[str, int] = {"spmm": 0, "dropout": 0, "lstm": 0}

    def counted(name, fn):
        def call(*a, **k):
            calls[name] += 1
            return fn(*a, **k)

        return call

    monkeypatch.setattr(TorchBackend, "spmm", counted("spmm", TorchBackend.spmm))
    monkeypatch.setattr(keyed_dropout, "run_hashed_torch", counted("dropout", keyed_dropout.run_hashed_torch))
    monkeypatch.setattr(lstm_kernels, "cell_state_torch", counted("lstm", lstm_kernels.cell_state_torch))
    name = "synthetic:small-rel" if model == "rgcn" else dataset  # RGCN needs typed edges
    g = load(name)
    # SAGE-LSTM's recurrence on Cora is 1,433 wide (its LSTM is as wide as its input): one step,
    # whose gradients are compared, stands in for the second step's loss there
    steps = 1 if (dataset, model) == ("cora", "sage-lstm") else 2
    losses, grads = {}, {}
    with single_thread():
        for backend in ("auto", "torch"):
            cfg = TrainConfig(
                dataset=name, model=model, hidden=16, heads=2, epochs=2, seed=0, backend=backend,
                reorder="none", precision=precision, progress=False, out=str(tmp_path / backend),
                checkpoint_every=1000,
            )  # fmt: skip
            t = Trainer(cfg.validate(), g)
            losses[backend] = [t.train_step() for _ in range(steps)]
            grads[backend] = [p.grad.float() for p in t.model.parameters() if p.grad is not None]
    assert not tuning.portable  # the run's kernels were its own: nothing is left set after it
    torch.testing.assert_close(torch.tensor(losses["torch"]), torch.tensor(losses["auto"]), rtol=1e-4, atol=0)
    assert len(grads["torch"]) == len(grads["auto"]) > 0
    rtol, share = (1e-3, 1e-4) if precision == "fp32" else (3e-2, 3e-2)  # bf16: activations rounded to 8 bits
    for got, want in zip(grads["torch"], grads["auto"], strict=True):  # the last step's gradients
        torch.testing.assert_close(got, want, rtol=rtol, atol=share * float(want.abs().max()) + 1e-12)
    # SAGE-LSTM aggregates by its LSTM over each vertex's sequence: no backend product
    assert (calls["spmm"] > 0) == (model != "sage-lstm")
    assert calls["dropout"] > 0 and (calls["lstm"] > 0) == (model == "sage-lstm")


@pytest.mark.parametrize("model", MODELS)
def test_a_steady_portable_step_reads_nothing_through_numpy(model, tmp_path, monkeypatch):
    """On a GPU every ``.numpy()`` in a step is a host round trip (or an error): once the first step
    has made the host's structures (transposes, row selections, sequence plans), a portable step
    and evaluation call none. (Label propagation draws new training rows every step, whose
    structure is cut on the host: docs/devices.md.)"""
    from tessera.datasets import load
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    name = "synthetic:small-rel" if model == "rgcn" else "synthetic:small"
    cfg = TrainConfig(
        dataset=name, model=model, hidden=16, heads=2, epochs=3, backend="torch",
        progress=False, out=str(tmp_path), checkpoint_every=1000,
    )  # fmt: skip
    t = Trainer(cfg.validate(), load(name))
    t.train_step()
    t.evaluate()

    def refuse(self, *a, **k):
        raise AssertionError(f"a steady step read a {tuple(self.shape)} tensor through NumPy")

    monkeypatch.setattr(torch.Tensor, "numpy", refuse)
    t.train_step()
    t.evaluate()


@pytest.mark.parametrize("variant", ["auto", "unique_source", "aggregate_first", "edge_wise", "gtask"])
def test_rgcn_variants_under_the_portable_kernels(variant, tmp_path):
    """Every RGCN variant but gTasks runs in portable torch ops (and trains as on the CPU's
    kernels); gTasks run on the CPU's kernels only, which a portable run says in one line."""
    from tessera.datasets import load
    from tessera.errors import ConfigError
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    g = load("synthetic:tiny-rel")
    losses = {}
    for backend in ("auto", "torch"):
        cfg = TrainConfig(
            dataset="synthetic:tiny-rel", model="rgcn", hidden=8, epochs=2, backend=backend, rgcn_variant=variant,
            progress=False, out=str(tmp_path / backend),
        )  # fmt: skip
        t = Trainer(cfg.validate(), g)
        if variant == "gtask" and backend == "torch":
            with pytest.raises(ConfigError, match="--rgcn-variant gtask runs on the CPU's kernels"):
                t.train_step()
            return
        losses[backend] = [t.train_step() for _ in range(2)]
    torch.testing.assert_close(torch.tensor(losses["torch"]), torch.tensor(losses["auto"]), rtol=1e-4, atol=0)
