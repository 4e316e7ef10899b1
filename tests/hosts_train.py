"""One rank of the emulated-host tests, started by torchrun: ``python hosts_train.py SPEC OUT``.

SPEC is a JSON list of ``[dataset, strategy]`` pairs; the rank joins the job once, trains each
pair with :func:`config` (dropout 0.5) and writes ``OUT/rank<R>.json``: its host name, each run's
per-epoch training losses (rank 0: and its final weights), and, for the tensor strategy, the ``/proc/self/maps`` fields of the
mapping that holds its shared graph (the same file for every rank of a host).
"""

from __future__ import annotations

import json
import os
import socket
import sys
from pathlib import Path

from tessera.train.config import TrainConfig

EPOCHS = 3


def config(dataset: str, strategy: str, out: Path) -> TrainConfig:
    """The settings every emulated-host run and its one-process reference train with."""
    return TrainConfig(
        dataset=dataset,
        strategy=strategy,
        groups=2 if strategy == "hybrid" else 1,
        hidden=16,
        dropout=0.5,
        epochs=EPOCHS,
        patience=0,
        out=str(out),
        progress=False,
        checkpoint_every=1000,
    )


def mapping_of(ptr: int) -> list[str]:
    """The ``/proc/self/maps`` fields of the mapping holding address ``ptr``."""
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        lo, hi = (int(a, 16) for a in fields[0].split("-"))
        if lo <= ptr < hi:
            return fields
    raise LookupError(f"no mapping holds {ptr:#x}")


def main(spec: list[list[str]], out_dir: Path) -> None:
    """Train every ``[dataset, strategy]`` of ``spec`` in one process group; write this rank's results."""
    from tessera.comm.group import init_from_env, shutdown
    from tessera.datasets import load
    from tessera.threads import set_num_threads
    from tessera.train.loop import Trainer

    set_num_threads(1)
    comm = init_from_env(120)
    rank = comm.rank
    res: dict = {"host": socket.gethostname(), "runs": {}}
    graphs: dict = {}
    for dataset, strategy in spec:
        graph = graphs.get(dataset) or graphs.setdefault(dataset, load(dataset))
        t = Trainer(config(dataset, strategy, out_dir / f"{dataset.replace(':', '-')}-{strategy}"), graph, comm)
        t.fit()
        run: dict = {"loss": [h["train_loss"] for h in t.history], "strategy": t.strategy.name}
        if strategy == "tensor":
            from tessera.parallel.tensor import TensorStrategy

            assert isinstance(t.strategy, TensorStrategy)
            run["graph_map"] = mapping_of(t.strategy.plan.graph.indices.data_ptr())
        if rank == 0:  # every rank holds the same weights
            run["params"] = {k: v.tolist() for k, v in t.model.state_dict().items()}
        res["runs"][f"{dataset}|{strategy}"] = run
    shutdown()
    (out_dir / f"rank{rank}.json").write_text(json.dumps(res))


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main(json.loads(sys.argv[1]), Path(sys.argv[2]))
