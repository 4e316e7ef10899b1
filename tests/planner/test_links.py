"""Links of two speeds in the cost model: pairs on one host at the intra-host link, a host's traffic
to the others through its one shared link, and every candidate kind charged by where its pairs
sit (hybrid's row groups on one host, its column groups across hosts)."""

import math

import numpy as np
import torch

from tessera import Graph
from tessera.parallel.base import StrategyOptions
from tessera.planner.calibrate import Rates, two_links
from tessera.planner.candidates import Context, layer_candidates
from tessera.planner.model import CommModel, sender_time
from tessera.planner.plan import Plan
from tessera.planner.report import format_plan
from tessera.sparse import LayerSpec

HOSTS = (0, 0, 1, 1)  # two hosts x two ranks, numbered host by host as torchrun numbers them


def test_a_host_shares_one_link_to_the_others():
    # every rank sends 1000 bytes to every other: rank 0's local pair at 1 GB/s, its host's
    # 2 x 2000 bytes leaving host 0 at 0.1 GB/s, latencies 1 us local and 10 us across
    data = np.full((4, 4), 1000.0)
    np.fill_diagonal(data, 0)
    m = CommModel(1.0, 1.0, 25.8, HOSTS, 0.1, 10.0)
    comm, quant = sender_time(data, np.zeros((4, 4)), np.zeros(4), np.zeros(4), 32, m)
    expect = 1000 / 1e9 + 1e-6 + 4000 / 1e8 + 2 * 10e-6
    assert np.allclose(comm, expect) and not quant.any()
    # no hosts known, or all ranks on one host: one link for all pairs, the paper's Eq. 2
    for hosts in ((), (0, 0, 0, 0)):
        one = CommModel(1.0, 1.0, 25.8, hosts, 0.1, 10.0)
        assert np.allclose(sender_time(data, np.zeros((4, 4)), np.zeros(4), np.zeros(4), 32, one)[0], 3e-6 + 3e-6)
    # a rank per host: every pair crosses, each host's link carries its one rank's bytes
    alone = CommModel(1.0, 1.0, 25.8, (0, 1, 2, 3), 0.1, 10.0)
    assert np.allclose(sender_time(data, np.zeros((4, 4)), np.zeros(4), np.zeros(4), 32, alone)[0], 3000 / 1e8 + 30e-6)
    # shares: two exchanges like rank 0's cross host 0's link at once
    shared = CommModel(1.0, 1.0, 25.8, (0, 1, 2, 3), 0.1, 10.0, (2, 1, 1, 1))
    got = sender_time(data, np.zeros((4, 4)), np.zeros(4), np.zeros(4), 32, shared)[0]
    assert np.isclose(got[0], 6000 / 1e8 + 30e-6) and np.isclose(got[1], 3000 / 1e8 + 30e-6)
    # calibration measures two links only where both kinds of pairs exist
    assert two_links([0, 0, 1, 1]) and not two_links([0, 1]) and not two_links([0, 0])


def test_among_keeps_the_hosts_of_the_ranks_it_names():
    m = CommModel(1.0, 1.0, 25.8, HOSTS, 0.1, 10.0)
    assert m.among([0, 2]).hosts == (0, 1) and m.among([2, 3]).hosts == (1, 1)
    assert m.among([0, 2], [2, 2]).shares == (2, 2) and m.among([0, 2]).shares == ()
    assert CommModel().among([1, 0]) == CommModel() and not CommModel().two_links()


def _ring(n: int = 4000) -> Graph:
    """A ring with chords to the second neighbours: a range split cuts few edges."""
    i = torch.arange(n)
    src = torch.cat([i, i, i, i])
    dst = torch.cat([(i + 1) % n, (i - 1) % n, (i + 2) % n, (i - 2) % n])
    return Graph.from_edge_index(torch.stack([src, dst]), n)


def _comm(hosts: tuple[int, ...], inter_gbps: float) -> dict[str, float]:
    rates = Rates(1e-9, 1e-10, 1e11, 10.0, 1.0, hosts=hosts, inter_gbps=inter_gbps, inter_latency_us=1.0)
    g = _ring()
    ctx = Context(g, 4, np.repeat(np.arange(4), g.num_nodes // 4), StrategyOptions(), rates)
    spec = LayerSpec(256, 256, 256, aggregates_first=True)
    return {c.label: c.model_s.comm for c in layer_candidates(ctx, {True: spec}, True, True)}


def test_hybrid_row_groups_on_one_host_pay_the_slow_link_only_for_their_halo():
    fast_within = _comm(HOSTS, 0.01)  # 10 GB/s within a host, 10 MB/s between hosts
    slow_all = {k: v * 10.0 / 0.01 for k, v in _comm((), 0.0).items()}  # one link for all, at the slow speed
    h, t = "hybrid:2:prepost:32", "tensor:32"
    # hybrid:2's all-to-all stays on each host, and only its small halo crosses: far cheaper than
    # at the slow link for every pair; tensor's all-to-all has half its pairs across hosts
    assert fast_within[h] < 0.2 * slow_all[h], (fast_within[h], slow_all[h])
    assert fast_within[h] / slow_all[h] < fast_within[t] / slow_all[t]
    assert fast_within[h] < 0.2 * fast_within[t]


def test_tessera_plan_prints_both_links():
    rates = Rates(1e-9, 1e-10, 1e11, 10.0, 1.0, hosts=HOSTS, inter_gbps=0.0125, inter_latency_us=80.0)
    text = format_plan(Plan(choices=(), layers=(), rates=rates, world=4, source="model"))
    assert "hosts: 2 (rank -> host [0, 0, 1, 1])" in text and "0.013 GB/s, latency 80.0 us" in text
    assert math.isclose(Rates(**rates.to_dict()).comm().inter_gbps, 0.0125)
