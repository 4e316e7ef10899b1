"""A step that runs past its time says what it is doing, once, and how long it took; a quick
step says nothing; nothing is said where no one watches (a pipe, a rank other than 0)."""

from __future__ import annotations

import io
import os
import pty
import subprocess
import sys
import time

from tessera.phases import phase


def test_a_slow_step_says_what_it_does_and_its_time():
    out = io.StringIO()
    with phase("computing the rcm vertex order", after=0.05, stream=out):
        time.sleep(0.3)
    first, last = out.getvalue().splitlines()
    assert first == "tessera: computing the rcm vertex order ..."
    assert last.startswith("tessera: computing the rcm vertex order: ") and last.endswith(" s")
    assert float(last.split(": ")[-1][:-2]) >= 0.3


def test_a_quick_step_says_nothing():
    out = io.StringIO()
    with phase("renumbering the graph", after=0.5, stream=out):
        pass
    time.sleep(0.6)  # the timer was cancelled: nothing comes later either
    assert out.getvalue() == ""


def _speaks(stderr_is_terminal: bool, rank: str) -> str:
    code = "import time\nfrom tessera.phases import phase\nwith phase('waiting', after=0.05):\n    time.sleep(0.3)\n"
    env = {**os.environ, "RANK": rank}
    if not stderr_is_terminal:
        return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True).stderr
    leader, follower = pty.openpty()
    try:
        subprocess.run([sys.executable, "-c", code], env=env, stderr=follower, check=True)
        os.close(follower)
        chunks = []
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # EIO: the terminal's other end is closed and drained
                break
            if not chunk:
                break
            chunks.append(chunk)
        return b"".join(chunks).decode()
    finally:
        os.close(leader)


def test_only_rank_0_speaks_and_only_to_a_terminal():
    assert "tessera: waiting ..." in _speaks(True, "0")
    assert _speaks(True, "1") == ""
    assert _speaks(False, "0") == ""
