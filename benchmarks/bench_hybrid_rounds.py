"""Per-layer step times of fixed strategy candidates on P local ranks, interleaved over rounds.

Each round measures every candidate on every layer with the planner's own
``measure_candidate`` (the least of 2 steps after a warm-up), rotating the candidates' order
from round to round so machine noise hits them alike; it prints the least and the median per
layer and candidate. What docs/design/algorithm1-hybrid.md's tables come from:

    python benchmarks/bench_hybrid_rounds.py --dataset synthetic:arxiv --partition random \\
        --hidden 256 --nprocs 4 --rounds 10 \\
        --candidates partition:prepost:32 tensor:32 hybrid:2:prepost:32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    from tessera.backends import select
    from tessera.comm.group import init_from_env, shutdown
    from tessera.datasets import load
    from tessera.nn import build_model
    from tessera.parallel.base import StrategyOptions
    from tessera.parallel.mixed import StrategyPool, parse_entry
    from tessera.planner.plan import measure_candidate
    from tessera.threads import set_num_threads
    from tessera.train.config import TrainConfig
    from tessera.train.planning import model_probe

    set_num_threads(max(1, (os.cpu_count() or 1) // world))
    comm = init_from_env(600)
    g = load(args.dataset)
    cfg = TrainConfig(dataset=args.dataset, hidden=args.hidden, nprocs=world, partition=args.partition, progress=False)
    probe = model_probe(build_model("gcn", g.num_features, args.hidden, int(g.num_classes), 2), cfg)
    pool = StrategyPool(comm, StrategyOptions("auto", "post", args.partition, 0, 32, 1))
    labels, times = list(args.candidates), {}
    for r in range(args.rounds):
        order = labels[r % len(labels) :] + labels[: r % len(labels)]
        for layer in range(len(probe.placements)):
            for label in order:
                with select.modelled_only():
                    t = measure_candidate(comm, pool, g, probe, layer, parse_entry(label))
                times.setdefault(f"{layer} {label}", []).append(1e3 * t)
    shutdown()
    if rank == 0:
        Path(out).write_text(json.dumps(times))


def main() -> None:
    """Parse the arguments, run the ranks and print the table."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dataset", default="synthetic:arxiv")
    p.add_argument("--partition", default="random")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--nprocs", type=int, default=4)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--candidates", nargs="+", default=["partition:prepost:32", "tensor:32", "hybrid:2:prepost:32"])
    args = p.parse_args()
    # the ranks join a store served here, bound before they start (as torchrun's agent serves one)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    os.environ["TORCHELASTIC_USE_AGENT_STORE"] = "True"
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "times.json")
        t0 = time.perf_counter()
        mp.spawn(_worker, (args.nprocs, store.port, args, out), nprocs=args.nprocs)
        times = json.loads(Path(out).read_text())
    print(f"{args.dataset} {args.partition} hidden {args.hidden} P={args.nprocs} rounds={args.rounds} "
          f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    for key, v in times.items():
        print(f"{key:<36} min {min(v):8.2f} ms  median {statistics.median(v):8.2f} ms")


if __name__ == "__main__":
    main()
