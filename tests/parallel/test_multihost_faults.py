"""A link cut mid-epoch between emulated hosts (``tests/hosts_linkcut.py``): every rank on every
host ends within ``--timeout`` + 5 s with exit status 3 and a line naming the unreachable host.

``TESSERA_LINK_CUTS=N`` repeats the cut N times (default once); ``benchmarks/bench_link_cut.py``
prints each repeat's exit statuses and seconds."""

from __future__ import annotations

import os
import sys

import pytest

from hosts_linkcut import CUT_HOST, HOSTS, RANKS_PER_HOST, TIMEOUT_S, cut_link_run

pytestmark = [pytest.mark.distributed, pytest.mark.multihost]  # starts torchrun on emulated hosts

PEER_FAILED = 3
#: seconds past --timeout within which every rank must have ended after the cut
SLACK_S = 5.0
REPEATS = int(os.environ.get("TESSERA_LINK_CUTS", "1"))


@pytest.mark.parametrize("repeat", range(REPEATS))
def test_a_cut_link_ends_every_rank_in_time_naming_the_unreachable_host(hosts_ready, tmp_path, repeat):
    run = cut_link_run(tmp_path)
    assert run.cut_at is not None, f"training never got under way\n{run.logs}"
    assert sorted(run.ranks) == list(range(HOSTS * RANKS_PER_HOST)), run.logs
    cut_host = f"h{CUT_HOST}"
    for rank, end in run.ranks.items():
        assert end.code == PEER_FAILED, f"rank {rank}: {end}\n{run.logs}"
        assert end.after_cut_s <= TIMEOUT_S + SLACK_S, f"rank {rank}: {end}"
        assert end.line is not None, f"rank {rank} printed no error line\n{run.logs}"
        # each side names the other: the hosts it can no longer reach and their ranks
        lost = cut_host if end.host != cut_host else "h0"
        lost_ranks = [r for r, e in run.ranks.items() if e.host == lost]
        assert f"host {lost} is unreachable" in end.line, end.line
        assert f"ranks {', '.join(map(str, sorted(lost_ranks)))} at " in end.line, end.line


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
