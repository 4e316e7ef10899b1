"""Repeated link cuts between emulated hosts: how every rank ends after host 1's link goes down.

Each repeat trains ``synthetic:small`` on two emulated hosts x two ranks (``tests/hosts.py``)
under torchrun with ``--timeout 10``, cuts host 1's link once three epochs are written
(``tests/hosts_linkcut.py``) and prints per rank its exit status, the seconds from the cut to its
exit and its error line; the last line says whether every rank of every repeat exited 3 within
``--timeout`` + 5 s naming the host it lost. Needs root and iproute2.

    python benchmarks/bench_link_cut.py --repeats 10
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the emulated hosts are the tests' fixture

from hosts import unavailable  # noqa: E402
from hosts_linkcut import TIMEOUT_S, CutRun, cut_link_run  # noqa: E402

PEER_FAILED = 3
SLACK_S = 5.0


def good(run: CutRun) -> bool:
    """Whether every rank exited 3 within the timeout + slack with a line naming a host it lost."""
    return run.cut_at is not None and len(run.ranks) == 4 and all(
        e.code == PEER_FAILED and e.after_cut_s <= TIMEOUT_S + SLACK_S and e.line is not None and "is unreachable" in e.line
        for e in run.ranks.values()
    )  # fmt: skip


def main() -> int:
    """Run the repeats and print the table; exit status 1 if any repeat fell short."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=10)
    args = parser.parse_args()
    why = unavailable()
    if why is not None:
        print(f"bench_link_cut: {why}", file=sys.stderr)
        return 2
    ok = 0
    for i in range(args.repeats):
        with tempfile.TemporaryDirectory(prefix="linkcut-") as tmp:
            run = cut_link_run(Path(tmp))
        ok += good(run)
        print(f"repeat {i + 1}: {'ok' if good(run) else 'FAILED'}; torchrun exits {run.torchrun}", flush=True)
        for rank, e in sorted(run.ranks.items()):
            print(
                f"  rank {rank} on {e.host}: exit {e.code} at {e.after_cut_s:.2f} s after the cut: {e.line}", flush=True
            )
        if not good(run):
            print(run.logs, flush=True)
    print(
        f"{ok} of {args.repeats} repeats: every rank exited {PEER_FAILED} within {TIMEOUT_S + SLACK_S:g} s naming the host"
    )
    return 0 if ok == args.repeats else 1


if __name__ == "__main__":
    sys.exit(main())
