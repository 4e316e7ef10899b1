"""A link cut mid-epoch on emulated hosts: two hosts x two ranks train with ``tessera train``
under torchrun and host 1's link goes down once training is under way.

:func:`cut_link_run` returns, per rank, the exit status of its ``python -m tessera`` process (as
``tests/hosts_exit.py`` recorded it), the seconds from the cut to that exit and the
``tessera: error:`` line it printed, plus each host's torchrun status.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from hosts import EmulatedHosts

HOSTS, RANKS_PER_HOST = 2, 2
#: the host whose link is cut
CUT_HOST = 1
#: ``tessera train --timeout`` of the run
TIMEOUT_S = 10.0
#: epochs (the metrics lines) to wait for before the cut: the ranks train by then
EPOCHS_BEFORE_CUT = 3
_EXIT_WRAPPER = Path(__file__).resolve().with_name("hosts_exit.py")


@dataclass
class RankExit:
    """How one rank ended: its host, exit status, seconds after the cut, and error line."""

    host: str
    code: int
    after_cut_s: float
    line: str | None


@dataclass
class CutRun:
    """One link-cut run: each rank's :class:`RankExit` (by rank), each host's torchrun status
    (``None``: still running when the run was ended) and the cut host's name."""

    ranks: dict[int, RankExit] = field(default_factory=dict)
    torchrun: dict[str, int | None] = field(default_factory=dict)
    cut_host: str = ""
    cut_at: float | None = None
    logs: str = ""


def _error_lines(stderr: str) -> dict[int, str]:
    """Each rank's ``tessera: error: rank R: ...`` line in one host's torchrun output (two ranks
    writing at once can put one line right after the other without a newline between them)."""
    lines = {}
    for m in re.finditer(r"tessera: error: rank (\d+):.*?(?=tessera: error: |\n|$)", stderr):
        lines[int(m.group(1))] = m.group(0)
    return lines


def cut_link_run(out: Path, env: dict[str, str] | None = None, dataset: str = "synthetic:small") -> CutRun:
    """Train on :data:`HOSTS` emulated hosts into ``out``, cut host :data:`CUT_HOST`'s link once
    :data:`EPOCHS_BEFORE_CUT` epochs are written, and report how every rank ended."""
    run_dir, exits = out / "run", out / "exits"
    args = [str(_EXIT_WRAPPER), str(exits), sys.executable, "-m", "tessera", "train", "--dataset", dataset,
            "--hidden", "16", "--epochs", "100000", "--patience", "0", "--checkpoint-every", "100000",
            "--no-progress", "--timeout", f"{TIMEOUT_S:g}", "--out", str(run_dir)]  # fmt: skip
    result = CutRun()
    with EmulatedHosts(HOSTS) as hosts:
        result.cut_host = hosts.hostnames[CUT_HOST]
        started = threading.Event()

        def cut() -> None:
            metrics = run_dir / "metrics.jsonl"
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline:
                if metrics.exists() and metrics.read_text().count("\n") >= EPOCHS_BEFORE_CUT:
                    subprocess.run(["ip", "-n", hosts.namespaces[CUT_HOST], "link", "set", "eth0", "down"], check=True)
                    result.cut_at = time.time()
                    return
                if started.wait(0.05):
                    return

        cutter = threading.Thread(target=cut, daemon=True)
        cutter.start()
        # the cut host's torchrun agent cannot reach the rendezvous store on host 0 any more and
        # does not exit of itself: it is killed a few seconds after host 0's has failed
        runs = hosts.run(args, RANKS_PER_HOST, 240, env, out / "logs", grace_s=TIMEOUT_S)
        started.set()
        cutter.join()
    for r in runs:
        result.torchrun[r.host] = r.returncode
        result.logs += f"--- {r.host}: torchrun exit {r.returncode}\n{r.stderr[-4000:]}\n"
    lines = {}
    for r in runs:
        lines.update(_error_lines(r.stderr))
    for path in exits.glob("exit-rank*.json"):
        rec = json.loads(path.read_text())
        after = rec["time"] - result.cut_at if result.cut_at is not None else float("nan")
        result.ranks[rec["rank"]] = RankExit(rec["host"], rec["code"], after, lines.get(rec["rank"]))
    return result
