"""The two-link calibration on real ranks with hosts of uneven size: ranks named onto hosts (their
host names replaced in each process), every rank joins each all-to-all, a rank alone on its host
sends nothing on-host, and a rank per host measures one link only."""

import json
import os
import socket
from pathlib import Path

import pytest

from helpers import PORT, spawn_with_retry

pytestmark = pytest.mark.distributed  # starts worker processes

LAYOUTS = {"uneven": ["a", "a", "b"], "one per host": ["a", "b", "c"], "one host": ["a", "a", "a"]}


def _worker(rank, world, ports, out_dir):
    from tessera.comm.group import init_from_env, shutdown
    from tessera.planner.calibrate import measure_links

    for (name, hosts), port in zip(LAYOUTS.items(), ports, strict=True):
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
        socket.gethostname = lambda name=hosts[rank]: name  # type: ignore[assignment]  # this process's host
        comm = init_from_env(60)
        try:
            indices = comm.host_indices()
            links = measure_links(comm, indices, values=1 << 14)
        finally:
            shutdown()
        (Path(out_dir) / f"{name}-{rank}.json").write_text(json.dumps({"hosts": indices, "links": links}))


def test_hosts_of_uneven_size_measure_two_links_and_a_rank_per_host_one(tmp_path):
    spawn_with_retry(_worker, (3, tuple(PORT for _ in LAYOUTS), str(tmp_path)), 3)
    got = {name: [json.loads((tmp_path / f"{name}-{r}.json").read_text()) for r in range(3)] for name in LAYOUTS}
    uneven, alone, one = got["uneven"], got["one per host"], got["one host"]
    assert all(r["hosts"] == [0, 0, 1] for r in uneven), uneven
    bw, lat, inter_bw, inter_lat = uneven[0]["links"]
    assert bw > 0 and lat > 0 and inter_bw > 0 and inter_lat > 0, uneven[0]
    assert all(r["hosts"] == [0, 1, 2] for r in alone) and alone[0]["links"][2:] == [0.0, 0.0], alone
    assert all(r["hosts"] == [0, 0, 0] for r in one) and one[0]["links"][2:] == [0.0, 0.0], one
    assert all(r["links"] == got[name][0]["links"] for name in LAYOUTS for r in got[name])  # every rank agrees
