"""Two emulated hosts x two ranks (``tests/hosts.py``) train exactly as one process, and each host
maps one read-only copy of the shared graph."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from helpers import single_thread
from hosts import EmulatedHosts
from hosts_train import EPOCHS, config

pytestmark = [pytest.mark.distributed, pytest.mark.multihost]  # starts torchrun on emulated hosts

HOSTS, RANKS_PER_HOST = 2, 2
STRATEGIES = ("partition", "tensor", "hybrid", "auto")
DATASETS = ("cora", "synthetic:small")
#: the configuration also run through the CLI (``python -m tessera train`` under torchrun)
CLI_RUN = ("synthetic:small", "auto")
TIMEOUT_S = 240
SLOW_LINK = "100mbit"


@pytest.fixture(scope="module")
def single_process(datasets, tmp_path_factory) -> dict:
    """One process's losses and weights per dataset (the strategy does not change one process's run)."""
    from tessera.datasets import load
    from tessera.train.loop import Trainer

    ref = {}
    with single_thread():
        for ds, root in datasets:
            if root:
                os.environ["TESSERA_DATA"] = root
            t = Trainer(config(ds, "partition", tmp_path_factory.mktemp("ref")), load(ds))
            t.fit()
            ref[ds] = {"loss": [h["train_loss"] for h in t.history], "params": t.model.state_dict()}
    return ref


def _env(datasets) -> dict[str, str]:
    return {"TESSERA_DATA": next(root for _, root in datasets if root)}


def _failed(runs) -> str:
    return "\n".join(f"{r.host}: exit {r.returncode}\n{r.stderr[-3000:]}" for r in runs)


@pytest.fixture(scope="module")
def host_runs(hosts_ready, datasets, single_process, tmp_path_factory) -> dict:
    """``{"ranks": [rank results], "cli": run directory}``: every (dataset, strategy) in one
    torchrun job over the emulated hosts, then :data:`CLI_RUN` through ``tessera train``.
    (After ``single_process``, which leaves the numba kernels in numba's cache for the ranks.)"""
    out = tmp_path_factory.mktemp("hosts")
    spec = [[ds, s] for ds in DATASETS for s in STRATEGIES]
    worker = str(Path(__file__).resolve().parents[1] / "hosts_train.py")
    cli_out = out / "cli"
    ds, strategy = CLI_RUN
    cli = ["-m", "tessera", "train", "--dataset", ds, "--strategy", strategy, "--hidden", "16", "--dropout", "0.5",
           "--epochs", str(EPOCHS), "--patience", "0", "--checkpoint-every", "1000", "--no-progress",
           "--out", str(cli_out)]  # fmt: skip
    with EmulatedHosts(HOSTS) as hosts:
        runs = hosts.run([worker, json.dumps(spec), str(out)], RANKS_PER_HOST, TIMEOUT_S, _env(datasets), out / "logs")
        assert all(r.returncode == 0 for r in runs), _failed(runs)
        runs = hosts.run(cli, RANKS_PER_HOST, TIMEOUT_S, _env(datasets), out / "cli-logs")
        assert all(r.returncode == 0 for r in runs), _failed(runs)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(HOSTS * RANKS_PER_HOST)]
    return {"ranks": ranks, "cli": cli_out}


def _assert_matches(loss: list[float], params: dict | None, ref: dict, key: str) -> None:
    assert len(loss) == EPOCHS, key
    torch.testing.assert_close(torch.tensor(loss), torch.tensor(ref["loss"]), rtol=1e-4, atol=0, msg=key)
    if params is None:
        return
    for name, value in ref["params"].items():
        torch.testing.assert_close(torch.tensor(params[name]), value, rtol=1e-4, atol=1e-4, msg=f"{key} {name}")


def test_ranks_see_two_hosts(host_runs):
    hosts = [r["host"] for r in host_runs["ranks"]]
    assert sorted(hosts) == sorted([f"h{h}" for h in range(HOSTS)] * RANKS_PER_HOST), hosts


@pytest.mark.parametrize("dataset", DATASETS)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_two_hosts_train_as_one_process(host_runs, single_process, dataset, strategy):
    key = f"{dataset}|{strategy}"
    for rank, res in enumerate(host_runs["ranks"]):
        run = res["runs"][key]
        _assert_matches(run["loss"], run.get("params"), single_process[dataset], f"rank {rank} {key}")
        assert rank > 0 or "params" in run


def test_cli_under_torchrun_on_two_hosts_trains_as_one_process(host_runs, single_process):
    out = host_runs["cli"]
    result = json.loads((out / "result.json").read_text())
    assert result["world_size"] == HOSTS * RANKS_PER_HOST and result["epochs_run"] == EPOCHS
    loss = [json.loads(line)["train_loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    _assert_matches(loss, None, single_process[CLI_RUN[0]], f"tessera train {CLI_RUN}")


@pytest.mark.parametrize("dataset", DATASETS)
def test_each_host_maps_one_read_only_graph(host_runs, dataset):
    # /proc/self/maps fields: address, perms, offset, device, inode, path
    maps = {}
    for res in host_runs["ranks"]:
        fields = res["runs"][f"{dataset}|tensor"]["graph_map"]
        assert fields[1] == "r--s" and fields[5].endswith("(deleted)"), fields
        maps.setdefault(res["host"], set()).add((fields[3], fields[4], fields[5]))
    assert all(len(files) == 1 for files in maps.values()), maps  # one file per host, every rank maps it
    assert len(set.union(*maps.values())) == HOSTS, maps  # two mappings, not four (nor one)


def test_comm_bits_auto_quantizes_exchanges_across_a_slow_link(hosts_ready, datasets, tmp_path):
    # 100 Mbit/s between the hosts: the planner's calibrated link makes 32-bit exchanges the bulk of
    # a step, so --comm-bits auto takes a narrower width for some layer and logs each layer's choice
    # (with --pipeline-stages auto beside it: tensor and hybrid candidates at 1, 2, 4, 8 stages)
    from tessera.parallel.base import StrategyOptions
    from tessera.parallel.mixed import parse_entry

    out = tmp_path / "run"
    cli = ["-m", "tessera", "train", "--dataset", "synthetic:small", "--comm-bits", "auto", "--pipeline-stages", "auto", "--hidden", "16",
           "--epochs", "2", "--patience", "0", "--checkpoint-every", "1000", "--no-progress", "--out", str(out)]  # fmt: skip
    with EmulatedHosts(HOSTS, rate=SLOW_LINK) as hosts:
        runs = hosts.run(cli, RANKS_PER_HOST, TIMEOUT_S, _env(datasets), tmp_path / "logs")
    assert all(r.returncode == 0 for r in runs), _failed(runs)
    result = json.loads((out / "result.json").read_text())
    assert result["config"]["comm_bits"] == "auto" and result["epochs_run"] == 2
    bits = [tuple(b) for b in result["comm_bits"]]
    assert any(b != (32, 32) for b in bits), (bits, result["plan"]["choices"])
    planned = [parse_entry(c).options(StrategyOptions()).exchange_bits() for c in result["plan"]["choices"]]
    assert planned == bits, (planned, bits)
    assert 'comm-bits = "auto"' in (out / "config.toml").read_text()
    assert 'pipeline-stages = "auto"' in (out / "config.toml").read_text()
    # the planner measured the two links apart: each host's ranks numbered together, the capped
    # link between the hosts (100 Mbit/s = 0.0125 GB/s; tbf lets a burst through) far below loopback
    rates = result["plan"]["rates"]
    assert rates["hosts"] in ([0, 0, 1, 1], [0, 1, 0, 1]) and len(set(rates["hosts"])) == HOSTS, rates
    assert 0.004 < rates["inter_gbps"] < 0.04 and rates["bandwidth_gbps"] > 10 * rates["inter_gbps"], rates
    summary = "".join(r.stdout for r in runs)
    assert any(f" fwd {bits[0][0]:>4} " in line for line in summary.splitlines()), summary[-2000:]


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
