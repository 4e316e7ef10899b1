"""A torchrun worker that records when and how its program ended: ``python hosts_exit.py OUT PROGRAM...``.

Runs ``PROGRAM...`` (e.g. ``python -m tessera train ...``) as a child, forwards SIGTERM and SIGINT
to it, and once it has exited writes ``OUT/exit-rank<RANK>.json``: the host name, the rank, the
child's exit status (negative: the signal that killed it) and ``time.time()`` at its exit, then
exits with the same status (128 + the signal's number for a signal).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


def main(out: Path, argv: list[str]) -> int:
    """Run ``argv``, record its end in ``out`` and return the status to exit with."""
    child = subprocess.Popen(argv)
    for s in (signal.SIGTERM, signal.SIGINT):
        signal.signal(s, lambda signum, frame: child.send_signal(signum))
    code = child.wait()
    ended = time.time()
    rank = os.environ.get("RANK", "?")
    record = {"host": socket.gethostname(), "rank": int(rank), "code": code, "time": ended}
    out.mkdir(parents=True, exist_ok=True)
    (out / f"exit-rank{rank}.json").write_text(json.dumps(record))
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
