"""GAT under tensor parallelism equals one process: the attention terms are all-gathered, every
rank computes every edge's coefficient and aggregates its column slice (which may cut across
heads, or be empty), and one reduce-scatter of the terms' gradient shares makes backward exact."""

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import compile_quantize_kernels, each_dataset, single_thread, spawn_groups
from tessera.datasets import load
from tessera.nn import build_model
from tessera.parallel.tensor_attention import head_runs
from tessera.planner.volume import tensor_volumes
from tessera.train.config import TrainConfig
from tessera.train.loop import Trainer

pytestmark = pytest.mark.distributed  # starts worker processes

EPOCHS = 6
WORLDS = (2, 3, 4)
# Cora: 4 heads of 4 (P = 3 cuts heads), then 7 classes in one head; synthetic:small: 2 heads of 1
# (P = 3, 4 leave ranks without columns), then 8 classes.
SHAPES = {"cora": (16, 4), "synthetic:small": (2, 2)}
QUANTIZED = ("synthetic:small", 4)  # one run with 4-bit feature all-to-alls: its bytes, not its values


def _config(dataset, out, bits=32, epochs=EPOCHS):
    hidden, heads = SHAPES[dataset]
    return TrainConfig(
        strategy="tensor",
        dataset=dataset,
        model="gat",
        hidden=hidden,
        heads=heads,
        dropout=0.5,  # feature dropout, and attention dropout (which defaults to it)
        epochs=epochs,
        patience=0,
        comm_bits=bits,
        out=str(out),
        progress=False,
        checkpoint_every=1000,
    )


def _run(trainer, epochs):
    """Epoch 1's loss, parameter gradients (all-reduced) and logits of the trainer's rows after it,
    then the losses of the epochs after; the bytes each training epoch sent (distributed runs)."""
    t = trainer
    losses = [t.train_step()]
    grads = {name: p.grad.clone() for name, p in t.model.named_parameters()}
    bytes_per_epoch = [t.log.gather(t.comm)] if t.log is not None else []
    if t.log is not None:
        t.log.start_forward("eval")
    logits = t.predict()
    for _ in range(epochs - 1):
        losses.append(t.train_step())
        if t.log is not None:
            bytes_per_epoch.append(t.log.gather(t.comm))
    sent = [
        sum(sum(map(sum, d)) for layer in e["bytes_data"] + e["bytes_params"] for d in layer) for e in bytes_per_epoch
    ]
    return losses, grads, logits, sent


def _worker(rank, world, port, datasets, out_dir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from tessera.comm.group import init_from_env, shutdown
    from tessera.threads import set_num_threads

    set_num_threads(1)
    comm = init_from_env(120)
    results = {}
    try:
        for ds, g in each_dataset(datasets):
            t = Trainer(_config(ds, Path(out_dir) / f"{world}-{ds}"), g, comm)
            losses, grads, logits, sent = _run(t, EPOCHS)
            results[ds] = {
                "loss": losses,
                "grads": {k: v.tolist() for k, v in grads.items()},
                "ids": t.global_ids.tolist(),
                "logits": logits.tolist(),
                "sent": sent,
            }
            if ds == QUANTIZED[0]:
                q = Trainer(_config(ds, Path(out_dir) / f"{world}-q", QUANTIZED[1], 2), g, comm)
                results["quantized"] = {"loss": (r := _run(q, 2))[0], "sent": r[3]}
    finally:
        shutdown()
    (Path(out_dir) / f"gat-{world}-{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def single_process(datasets, tmp_path_factory):
    ref = {}
    with single_thread():
        for ds, g in each_dataset(datasets):
            t = Trainer(_config(ds, tmp_path_factory.mktemp("ref")), g)
            losses, grads, logits, _ = _run(t, EPOCHS)
            ref[ds] = {"loss": losses, "grads": grads, "logits": logits}
    compile_quantize_kernels()
    return ref


@pytest.fixture(scope="module")
def group_runs(datasets, single_process, tmp_path_factory):
    """``{P: [rank 0's results, rank 1's, ...]}`` from one spawn covering every P in WORLDS."""
    out = tmp_path_factory.mktemp("groups")
    spawn_groups(_worker, WORLDS, (datasets, str(out)))
    return {w: [json.loads((out / f"gat-{w}-{r}.json").read_text()) for r in range(w)] for w in WORLDS}


def _simulated(ds, world, bits):
    g = load(ds)
    hidden, heads = SHAPES[ds]
    specs = build_model("gat", g.num_features, hidden, g.num_classes, 2, heads=heads).describe()
    return tensor_volumes(g, world, specs, bits=(bits,)).bits[bits].bytes


@pytest.mark.parametrize("world", WORLDS)
def test_tensor_gat_matches_single_process_and_simulated_bytes(world, group_runs, datasets, single_process):
    ranks = group_runs[world]
    for ds, _ in datasets:
        ref, res, key = single_process[ds], ranks[0][ds], f"{ds} P={world}"
        # losses of every epoch, with feature and attention dropout on
        torch.testing.assert_close(torch.tensor(res["loss"]), torch.tensor(ref["loss"]), rtol=1e-4, atol=0, msg=key)
        # epoch 1's gradients: the attention vectors' come from the reduce-scattered term shares
        for name, want in ref["grads"].items():
            got = torch.tensor(res["grads"][name])
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-6, msg=f"{key} {name}")
        assert {n for n in ref["grads"] if "att_" in n} == {
            f"convs.{i}.att_{s}" for i in (0, 1) for s in ("src", "dst")
        }
        # logits after epoch 1, every rank's rows in place
        logits = torch.zeros_like(ref["logits"])
        for r in ranks:
            logits[torch.tensor(r[ds]["ids"])] = torch.tensor(r[ds]["logits"])
        assert sum(len(r[ds]["ids"]) for r in ranks) == logits.shape[0]
        torch.testing.assert_close(logits, ref["logits"], rtol=0, atol=1e-5, msg=key)
        # bytes every training epoch sent == tessera simulate's tensor volume
        assert res["sent"] == [_simulated(ds, world, 32)] * EPOCHS, key
    q, fp32 = ranks[0]["quantized"], ranks[0][QUANTIZED[0]]
    assert q["sent"] == [_simulated(QUANTIZED[0], world, QUANTIZED[1])] * 2
    assert q["sent"][0] < fp32["sent"][0]
    # 4-bit features (the attention terms stay float32): near the float32 losses, not equal
    torch.testing.assert_close(torch.tensor(q["loss"]), torch.tensor(fp32["loss"][:2]), rtol=2e-2, atol=0)


def test_column_slices_cut_at_heads_and_join_whole_ones():
    assert head_runs(0, 16, 4) == [(0, 16, 0, 4)]  # whole heads: one product
    assert head_runs(5, 10, 4) == [(5, 8, 1, 2), (8, 10, 2, 3)]  # the end of head 1, the start of head 2
    assert head_runs(2, 13, 4) == [(2, 4, 0, 1), (4, 12, 1, 3), (12, 13, 3, 4)]
    assert head_runs(3, 3, 4) == []  # an empty slice
