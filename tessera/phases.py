"""Steps that keep a watching user waiting say so: a step still running after :data:`AFTER_S`
seconds writes ``tessera: <what> ...`` on stderr, and its time when it ends.

Only where someone watches (stderr is a terminal) and on rank 0: a log or a pipe gets no line
whose presence depends on the machine's speed or the caches' state, and every error stays one line.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TextIO

#: seconds a step runs before it says what it is doing
AFTER_S = 2.0


def _watched() -> TextIO | None:
    if os.environ.get("RANK", "0") != "0" or not sys.stderr.isatty():
        return None
    return sys.stderr


@contextmanager
def phase(what: str, after: float = AFTER_S, stream: TextIO | None = None) -> Iterator[None]:
    """Run the block; if it still runs after ``after`` seconds, write ``what`` to ``stream``
    (default: stderr where it is a terminal, on rank 0 only), and its duration when it ends."""
    out = stream if stream is not None else _watched()
    if out is None:
        yield
        return
    start = time.perf_counter()
    said = threading.Event()
    lock = threading.Lock()

    def say() -> None:
        with lock:
            if not done:
                said.set()
                print(f"tessera: {what} ...", file=out, flush=True)

    done = False
    timer = threading.Timer(after, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            done = True
        timer.cancel()
        if said.is_set():
            print(f"tessera: {what}: {time.perf_counter() - start:.1f} s", file=out, flush=True)
