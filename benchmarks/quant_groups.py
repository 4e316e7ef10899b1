"""Choosing the quantization group size G (rows sharing one scale and zero point, issue 5).

Two measurements per G:

* ``bytes``: int2 versus fp32 bytes per training epoch on ``--dataset`` (default
  ``synthetic:arxiv``) at ``--parts`` ranks, from the simulator (the runtime sends exactly these
  bytes, tests/test_comm.py), for the plain 2-layer GCN and with ``--norm layer --label-prop``
  (which adds layer 0's backward exchange).
* ``accuracy``: Cora on 4 processes, GCN hidden 16 with LayerNorm and label propagation 0.5 (the
  acceptance test's settings), fp32 and int2 at each G, mean test accuracy over ``--seeds``; and
  the int2 quantization error of the blocks those runs actually exchanged, re-encoded at every G:
  relative RMS error ``sqrt(sum (dec - x)^2 / sum x^2)`` per layer and direction.

    TESSERA_DATA=../shared/datasets .venv/bin/python benchmarks/quant_groups.py bytes accuracy
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

GROUPS = (1, 2, 4, 8)


def bytes_table(dataset: str, parts: int, groups=GROUPS) -> None:
    """Print int2/fp32 epoch bytes per G, for the plain model and with the accuracy guards."""
    from tessera import datasets
    from tessera.comm import wire
    from tessera.graph.partition import partition
    from tessera.graph.partition.halo import pair_rows
    from tessera.nn import build_model
    from tessera.planner.volume import exchange_layers, summarize

    g = datasets.load(dataset)
    part = partition(g, parts, "metis", 0)
    rows = pair_rows(g.indptr.numpy(), g.indices.numpy(), part, parts)
    specs = build_model("gcn", g.num_features, 256, g.num_classes, 2).describe()
    settings = {"plain": exchange_layers(specs), "LN+LP": exchange_layers(specs, "layer", 0.5)}
    print(f"{dataset}, P={parts}, gcn hidden 256, 2 layers; int2 bytes per training epoch, parameters included")
    print()
    print(
        "| G | setting | exchanges (width) | prepost fp32 MB | prepost int2 MB | params share | fp32/int2 prepost | pre | post |"
    )
    print("|---:|---|---|---:|---:|---:|---:|---:|---:|")
    saved = wire.GROUP_ROWS
    try:
        for G in groups:
            wire.GROUP_ROWS = G
            for name, plan in settings.items():
                s = summarize(rows, plan, (32, 2))
                ratio = {m: s[m].bits[32].epoch.bytes / s[m].bits[2].epoch.bytes for m in s}
                e32, e2 = s["prepost"].bits[32].epoch, s["prepost"].bits[2].epoch
                desc = ", ".join(f"{w}{' fwd+bwd' if b else ' fwd'}" for w, b in plan)
                print(
                    f"| {G} | {name} | {desc} | {e32.bytes / 1e6:.2f} | {e2.bytes / 1e6:.2f} "
                    f"| {e2.param_bytes / e2.bytes:.1%} | {ratio['prepost']:.2f}x | {ratio['pre']:.2f}x "
                    f"| {ratio['post']:.2f}x |"
                )
    finally:
        wire.GROUP_ROWS = saved


def _worker(rank, world, port, root, groups, err_groups, fp32, seeds, out_dir):
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), TESSERA_DATA=root
    )
    from tessera.comm import quantize, wire
    from tessera.comm.group import init_from_env, shutdown
    from tessera.datasets import load
    from tessera.train.config import TrainConfig
    from tessera.train.loop import Trainer

    torch.set_num_threads(1)
    real_encode, err = quantize.encode, {}

    def measuring_encode(x, bits, seed, out=None, splits=None, group=None):
        # the block as sent, re-encoded at every G with the same seed
        for G in err_groups:
            dec = quantize.decode(real_encode(x, bits, seed, splits=splits, group=G), x.shape[1], bits, splits, group=G)
            key = f"{G}|{x.shape[1]}"
            e = err.setdefault(key, [0.0, 0.0])
            e[0] += float(((dec.double() - x.double()) ** 2).sum())
            e[1] += float((x.double() ** 2).sum())
        return real_encode(x, bits, seed, out=out, splits=splits, group=group)

    comm = init_from_env(300)
    g = load("cora")
    acc = {}
    try:
        configs = [("fp32", 32, wire.GROUP_ROWS)] * fp32 + [(f"int2 G={G}", 2, G) for G in groups]
        for name, bits, G in configs:
            wire.GROUP_ROWS = G
            quantize.encode = measuring_encode if bits < 32 else real_encode
            for seed in range(seeds):
                cfg = TrainConfig(
                    dataset="cora", hidden=16, dropout=0.5, lr=0.01, weight_decay=5e-4, epochs=200, seed=seed,
                    norm="layer", label_prop=0.5, comm_bits=bits, progress=False,
                    out=str(Path(out_dir) / f"{name.replace(' ', '_')}-{seed}"),
                )  # fmt: skip
                acc.setdefault(name, []).append(Trainer(cfg, g, comm).fit().get("test_acc"))
                if rank == 0:  # kept as it goes: a run killed midway still leaves its finished seeds
                    (Path(out_dir) / "acc.json").write_text(json.dumps(acc))
    finally:
        quantize.encode = real_encode
        shutdown()
    (Path(out_dir) / f"err-{rank}.json").write_text(json.dumps(err))


def accuracy_table(root: str, seeds: int, groups=GROUPS, err_groups=GROUPS, fp32: bool = True) -> None:
    """Cora, 4 ranks: test accuracy per configuration and int2 error per G (``err_groups``)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    world = 4
    # the ranks join a store this process serves (as torchrun's workers join their agent's): its
    # port is bound here before they start, so nothing else can take it
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        args = (world, store.port, root, tuple(groups), tuple(err_groups), fp32, seeds, d)
        mp.spawn(_worker, args=args, nprocs=world, join=True)
        wall = time.perf_counter() - t0
        acc = json.loads((Path(d) / "acc.json").read_text())
        err: dict[str, list[float]] = {}
        for r in range(world):
            for k, (num, den) in json.loads((Path(d) / f"err-{r}.json").read_text()).items():
                e = err.setdefault(k, [0.0, 0.0])
                e[0] += num
                e[1] += den
    print(
        f"Cora, {world} ranks, GCN hidden 16, LayerNorm + label propagation 0.5, 200 epochs, seeds 0..{seeds - 1} "
        f"({wall:.0f} s)"
    )
    print()
    print("| run | test accuracy per seed | mean | vs fp32 (points) |")
    print("|---|---|---:|---:|")
    base = statistics.mean(acc["fp32"]) if "fp32" in acc else None
    for name, a in acc.items():
        m = statistics.mean(a)
        diff = "-" if base is None else f"{100 * (m - base):+.2f}"
        print(f"| {name} | {', '.join(f'{v:.3f}' for v in a)} | {m:.4f} | {diff} |")
    widths = sorted({int(k.split("|")[1]) for k in err})
    print()
    print(
        "int2 relative RMS error of the exchanged blocks re-encoded at each G (all int2 runs above, every exchange, all ranks), per width:"
    )
    print()
    print("| G | " + " | ".join(f"width {w}" for w in widths) + " |")
    print("|---:|" + "---:|" * len(widths))
    for G in err_groups:
        cells = [np.sqrt(err[f"{G}|{w}"][0] / err[f"{G}|{w}"][1]) for w in widths]
        print(f"| {G} | " + " | ".join(f"{c:.4f}" for c in cells) + " |")


def main(argv: list[str] | None = None) -> None:
    """Run the requested measurements."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("what", nargs="+", choices=("bytes", "accuracy"))
    p.add_argument("--dataset", default="synthetic:arxiv")
    p.add_argument("--parts", type=int, default=8)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--groups", type=int, nargs="+", default=list(GROUPS), help="G values to train with")
    p.add_argument("--error-groups", type=int, nargs="+", default=list(GROUPS), help="G values to measure error at")
    p.add_argument("--no-fp32", action="store_true", help="skip the fp32 reference runs")
    a = p.parse_args(argv)
    if "bytes" in a.what:
        bytes_table(a.dataset, a.parts, a.groups)
        print()
    if "accuracy" in a.what:
        root = os.environ.get("TESSERA_DATA", str(Path(__file__).resolve().parents[2] / "shared" / "datasets"))
        accuracy_table(root, a.seeds, a.groups, a.error_groups, not a.no_fp32)


if __name__ == "__main__":
    main()
