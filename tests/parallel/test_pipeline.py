"""Tensor parallelism's fine-grained pipeline (MixGCN §3.2.2) equals the unpipelined product bit
for bit, quantized tensor exchanges are counted as `tessera simulate` projects them, and the
graph bandwidth and Prop. 3.5's stage bound are what hand computation gives."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from helpers import PORT, spawn_with_retry

pytestmark = pytest.mark.distributed  # starts worker processes

STAGES = tuple(range(1, 8))


def _products(comm, pg, counts, order, variant, backend, x_full, gy_full, stages, bits=32):
    """This rank's rows of ``A x`` and of ``x``'s gradient through the tensor operand on ``pg``
    (the graph renumbered by ``order``), per stage count, and the same rows from one process."""
    from tessera.backends import local_operand
    from tessera.comm.accounting import CommLog
    from tessera.comm.exchange import BlockExchange
    from tessera.parallel.tensor import TensorOperand, TensorPlan
    from tessera.sparse.aggregate import aggregate

    def product(op, rows):
        op = op.gcn_normalized() if variant == "gcn" else op
        x = x_full[rows].clone().requires_grad_()
        y = aggregate(op, x)
        y.backward(gy_full[rows])
        return y.detach(), x.grad

    out = {}
    for s in stages:
        ex = BlockExchange(comm)
        log = CommLog(comm.rank, comm.world)
        ex.configure(bits, log)
        plan = TensorPlan(pg, counts, comm.rank, backend, log, ex, s)
        out[s] = product(TensorOperand(plan, comm, 0, local_operand(pg, backend)), torch.from_numpy(order[plan.rows]))
    # one process, same vertex order and kernel: the rank's rows of the whole-graph product
    y, grad = product(local_operand(pg, backend), torch.from_numpy(order))
    return out, (y[plan.rows], grad[plan.rows])


def _train_bytes(comm, bits, stages):
    """Every pair's bytes of one training step of a tensor-parallel GCN (the log of one epoch)."""
    from tessera.datasets import load
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    cfg = TrainConfig(
        strategy="tensor", dataset="synthetic:tiny", hidden=8, comm_bits=bits, pipeline_stages=stages, progress=False
    )
    t = Trainer(cfg, load("synthetic:tiny"), comm)
    loss = t.train_step()
    t.evaluate()  # evaluation forwards exchange too, but are not counted
    return {**t.log.gather(comm), "counts": t.strategy.plan.counts, "loss": loss}


def _phase(comm, world, planetoid):
    """One process group's checks: bitwise products (``CASES[world]``) and every run's bytes."""
    from tessera.datasets import load
    from tessera.graph import Graph
    from tessera.graph.order import inverse_permutation, permute_graph, rcm_order
    from tessera.graph.partition import partition

    report = {"equal": {}, "bytes": {}}
    if CASES[world]:
        os.environ["TESSERA_DATA"] = planetoid
        g = load("cora")
        part = partition(g, world, "metis", 0)
        counts = np.bincount(part, minlength=world).tolist()
        orders = {
            "id": np.argsort(part, kind="stable"),  # the tensor strategy's rank-block order
            "rcm": np.lexsort((inverse_permutation(rcm_order(g)), part)),  # each rank's rows in RCM order
        }
        graphs = {k: permute_graph(Graph(g.indptr, g.indices, g.num_nodes), o) for k, o in orders.items()}
        gen = torch.Generator().manual_seed(0)
        x_full, gy_full = torch.randn(g.num_nodes, 13, generator=gen), torch.randn(g.num_nodes, 13, generator=gen)
        for order, variant, backend, stages in CASES[world]:
            args = (comm, graphs[order], counts, orders[order], variant, backend, x_full, gy_full)
            got, one = _products(*args, stages)
            report["equal"][f"{order}|{variant}|{backend}"] = {
                str(s): [torch.equal(got[s][0], got[1][0]), torch.equal(got[s][1], got[1][1])] for s in stages
            } | {"one process": [torch.equal(got[1][0], one[0]), torch.equal(got[1][1], one[1])]}
        # quantized and pipelined: within a few quantization steps of the float32 product
        args = (comm, graphs["rcm"], counts, orders["rcm"], "gcn", "csr", x_full, gy_full, (3,))
        q, ref = _products(*args, bits=8)[0][3], _products(*args)[0][3]
        report["int8_err"] = [float((q[i] - ref[i]).abs().max()) for i in (0, 1)]
    for bits, stages in RUNS:
        report["bytes"][f"{bits}|{stages}"] = _train_bytes(comm, bits, stages)
    return report


def _worker(rank, world, port, out_dir, planetoid, ports):
    # One set of processes (imports and kernels loaded once) forms groups of 4, 3 and 2 ranks in turn.
    from tessera.comm.group import init_from_env, shutdown
    from tessera.threads import set_num_threads

    set_num_threads(1)  # numba's pool first, or it resets torch to every core
    for size, p in zip(range(world, 1, -1), (port, *ports)):
        if rank >= size:
            break
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(p), RANK=str(rank), WORLD_SIZE=str(size))
        comm = init_from_env(120)
        try:
            report = _phase(comm, size, planetoid)
        finally:
            shutdown()
        (Path(out_dir) / f"p{size}-rank{rank}.json").write_text(json.dumps(report))


# (order, variant, backend, stage counts): every s = 1..7 on the csr kernel with and without RCM
# order, fewer on the others; P = 3 repeats the RCM case only.
CASES = {
    2: [
        ("id", "gcn", "csr", STAGES),
        ("rcm", "gcn", "csr", STAGES),
        ("id", "pattern", "csr", (1, 2, 7)),
        ("id", "gcn", "reference", (1, 3)),
        ("id", "gcn", "auto", (1, 5)),
    ],
    3: [("rcm", "gcn", "csr", STAGES)],
    4: [],
}
RUNS = ((32, 1), (8, 3), (4, 1), (2, 3))  # every bit width, with and without pipelining


@pytest.fixture(scope="module")
def reports(planetoid_root, tmp_path_factory):
    out = tmp_path_factory.mktemp("pipeline")
    spawn_with_retry(_worker, args=(4, PORT, str(out), str(planetoid_root.parent), (PORT, PORT)), nprocs=4)
    return {w: [json.loads((out / f"p{w}-rank{r}.json").read_text()) for r in range(w)] for w in (2, 3, 4)}


@pytest.mark.parametrize("world", [2, 3])
def test_pipelined_product_equals_unpipelined_bit_for_bit(world, reports):
    # forward and gradient, s = 1..7, csr kernel with and without RCM order inside each rank's rows
    # (reference and auto backends at some s): pipelined == unpipelined == one process, exactly
    for rank, rep in enumerate(reports[world]):
        assert len(rep["equal"]) == len(CASES[world])
        for case, per_s in rep["equal"].items():
            assert len(per_s) == 1 + len(next(c[3] for c in CASES[world] if "|".join(c[:3]) == case))
            for s, (fwd, bwd) in per_s.items():
                assert fwd and bwd, (rank, case, s)
        assert 0 < max(rep["int8_err"]) < 0.05, rep["int8_err"]  # quantized and pipelined: close, not exact


@pytest.mark.parametrize("world", [2, 3, 4])
def test_tensor_bytes_equal_the_simulator_in_every_bit_width(world, reports):
    from tessera.datasets import load
    from tessera.nn import build_model
    from tessera.planner.volume import tensor_pair_bytes, tensor_volumes

    # measured bytes == tessera simulate's, per pair, layer, direction and kind (data, parameters)
    g = load("synthetic:tiny")
    specs = build_model("gcn", g.num_features, 8, g.num_classes, 2).describe()
    measured = reports[world][0]["bytes"]
    assert list(measured) == [f"{b}|{s}" for b, s in RUNS]
    for key, got in measured.items():
        bits, stages = map(int, key.split("|"))
        vol = tensor_volumes(g, world, specs, bits=(bits,), stages=stages).bits[bits]
        assert vol.data_bytes > 0 and (vol.param_bytes > 0) == (bits < 32), key
        for layer in vol.layers:
            i, width = layer.layer, layer.width
            pair = tensor_pair_bytes(got["counts"], width, bits, stages)
            for d, side in enumerate((layer.forward, layer.backward)):
                for kind, sim in zip(("bytes_data", "bytes_params"), pair):
                    want = sim if side else np.zeros_like(sim)
                    assert np.array_equal(np.array(got[kind][i][d]), want), (key, i, d, kind)
                if side:  # and the simulator's totals are those pairs' sums
                    assert side.data_bytes == pair[0].sum() and side.param_bytes == pair[1].sum()
        assert np.isfinite(got["loss"]), key
    # pipelining cuts the blocks back into shorter quantization groups: more parameter bytes
    one, three = (tensor_volumes(g, world, specs, bits=(2,), stages=s).bits[2] for s in (1, 3))
    assert three.data_bytes == one.data_bytes and three.param_bytes > one.param_bytes


def _path_graph():
    """The path 0 - 5 - 1 - 4 - 2 - 3 (both directions of each edge)."""
    from tessera.graph import Graph

    a, b = torch.tensor([0, 5, 1, 4, 2]), torch.tensor([5, 1, 4, 2, 3])
    return Graph.from_edge_index(torch.stack([torch.cat([a, b]), torch.cat([b, a])]), 6)


def test_bandwidth_and_min_stages_by_hand():
    from fractions import Fraction

    from tessera.graph.bandwidth import bandwidth, csr_bandwidth, min_stages
    from tessera.graph.order import rcm_order

    g = _path_graph()
    assert bandwidth(g) == 5  # edge 0 - 5 spans all six ids
    assert bandwidth(g, np.array([0, 5, 1, 4, 2, 3])) == 1  # along the path
    assert bandwidth(g, np.array([0, 1, 2, 3, 4, 5])) == 5
    assert bandwidth(g, rcm_order(g)) == 1  # RCM lays a path out end to end
    assert csr_bandwidth(np.zeros(4, dtype=np.int64), np.zeros(0, dtype=np.int64)) == 0
    # Prop. 3.5, (n - b) / 2n >= 1/s: n = 6, b = 1 gives 5/12, so s = 3 (1/3 = 4/12) but not 2 (6/12)
    assert min_stages(6, 1) == 3
    assert min_stages(6, 5) == 12 and min_stages(6, 0) == 2
    assert min_stages(6, 6) is None and min_stages(0, 0) is None
    for n in range(1, 25):
        for b in range(n):
            s = min_stages(n, b)
            assert Fraction(n - b, 2 * n) >= Fraction(1, s) > Fraction(n - b, 2 * n) - Fraction(1, s * (s - 1)), (n, b)
            assert Fraction(n - b, 2 * n) < Fraction(1, s - 1), (n, b)  # s - 1 stages would idle


def test_partition_command_reports_bandwidth_and_stages(capsys):
    from tessera.cli.main import main
    from tessera.datasets import load
    from tessera.graph.bandwidth import bandwidth, min_stages
    from tessera.graph.order import rcm_order

    assert main(["partition", "--dataset", "synthetic:tiny", "--parts", "2"]) == 0
    out = capsys.readouterr().out
    g = load("synthetic:tiny")
    lines = {line.split("  ")[1].strip(): line.split() for line in out.splitlines() if line.startswith("  ")}
    for name, order in (("original ids", None), ("RCM", rcm_order(g))):
        b = bandwidth(g, order)
        assert lines[name][-3:] == [f"{b:,}", f"{b / g.num_nodes:.3f}", f"{min_stages(g.num_nodes, b):,}"], out
    assert "metis blocks (2 parts)" in lines and "metis blocks, RCM inside" in lines
    assert "preprocessing, computed afresh: RCM" in out and "metis partition into 2 parts" in out


def test_simulate_tensor_per_bit_width_and_stages(capsys):
    from tessera.cli.main import main
    from tessera.datasets import load
    from tessera.nn import build_model
    from tessera.planner.volume import tensor_volumes

    argv = ["simulate", "--dataset", "synthetic:tiny", "--parts", "3", "--strategy", "tensor", "--hidden", "8"]
    assert main([*argv, "--comm-bits", "32,2", "--pipeline-stages", "3"]) == 0
    out = capsys.readouterr().out
    g = load("synthetic:tiny")
    specs = build_model("gcn", g.num_features, 8, g.num_classes, 2).describe()
    vol = tensor_volumes(g, 3, specs, bits=(32, 2), stages=3)
    lines = out.splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("tensor parallelism (MixGCN)"))
    row = lines[head + 2].split()
    assert row[1:3] == [f"{vol.bits[32].bytes / 1e6:.3f}", f"{vol.bits[2].bytes / 1e6:.3f}"], out
    assert "3 pipeline stages" in out
    assert main([*argv, "--pipeline-stages", "0"]) == 2
