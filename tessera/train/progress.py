"""Training progress on stderr: a redrawn bar on a terminal; on anything else (a log file, a
pipe) whole lines, few enough to read: the first epoch, then at most one line per
:data:`INTERVAL_S` seconds, and the last epoch. ``TQDM_DISABLE=1`` in the environment hides both,
as it hides tqdm's bars elsewhere."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import Any, Protocol, TextIO

from tqdm import tqdm

#: the least time between two progress lines written to a log
INTERVAL_S = 5.0


class Progress(Protocol):
    """What the training loop calls on its progress display (tqdm's names)."""

    def set_postfix(self, **values: Any) -> None: ...

    def update(self, n: int = 1) -> None: ...

    def close(self) -> None: ...


class LineProgress:
    """Progress as complete lines (``desc: epoch n/total k=v ... [elapsed]``): one for the first
    epoch, then one when ``interval`` seconds have passed since the last, and one for the last
    epoch, so a log gets no carriage returns and a few lines a minute."""

    def __init__(
        self,
        total: int,
        initial: int = 0,
        desc: str = "train",
        stream: TextIO | None = None,
        interval: float = INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total, self.n, self.desc = total, initial, desc
        self.stream = sys.stderr if stream is None else stream
        self.interval, self.clock = interval, clock
        self.start = clock()
        self.last: float | None = None  # when the last line was written
        self.written = initial  # the epoch the last line showed
        self.postfix: dict[str, Any] = {}

    def set_postfix(self, **values: Any) -> None:
        """The ``key=value`` pairs of the next line."""
        self.postfix = values

    def update(self, n: int = 1) -> None:
        """Count ``n`` more epochs; write a line if one is due."""
        self.n += n
        now = self.clock()
        if self.last is None or now - self.last >= self.interval or self.n >= self.total:
            self._write(now)

    def close(self) -> None:
        """Write the last epoch's line if it has not been written (a run stopped early)."""
        if self.n != self.written:
            self._write(self.clock())

    def _write(self, now: float) -> None:
        values = "".join(f" {k}={v}" for k, v in self.postfix.items())
        self.stream.write(f"{self.desc}: epoch {self.n}/{self.total}{values} [{now - self.start:.1f}s]\n")
        self.stream.flush()
        self.last, self.written = now, self.n


def disabled_by_env() -> bool:
    """Whether ``TQDM_DISABLE`` asks for no progress display (set, and not 0, false, no or off)."""
    return os.environ.get("TQDM_DISABLE", "").strip().lower() not in ("", "0", "false", "no", "off")


def progress(total: int, initial: int = 0, enabled: bool = True, desc: str = "train") -> Progress:
    """The progress display of a run of ``total`` epochs starting after ``initial``: tqdm's bar when
    stderr is a terminal, :class:`LineProgress` otherwise, nothing shown unless ``enabled`` and
    ``TQDM_DISABLE`` is unset."""
    # tqdm reads TQDM_DISABLE only for arguments its caller leaves out, and disable is given here
    enabled = enabled and not disabled_by_env()
    if enabled and not sys.stderr.isatty():
        return LineProgress(total, initial, desc)
    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, unit="ep", leave=True, mininterval=0.5)
