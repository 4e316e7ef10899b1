"""Exact communication accounting: bytes each rank sends per layer, direction and peer (data and
quantization parameters separately) and the time spent exchanging, quantizing and computing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from tessera.comm.wire import block_bytes

FORWARD, BACKWARD = 0, 1
BYTES = ("bytes_data", "bytes_params")  # the kinds of sent bytes, in kind order
TIMES = ("exchange_s", "quantize_s", "compute_s")


@dataclass
class CommLog:
    """This rank's counters for the current epoch; :meth:`gather` collects every rank's."""

    rank: int
    world: int
    layers: int = 0
    phase: str = "train"
    _bytes: dict = field(default_factory=dict)  # (layer, dir, peer, kind) -> bytes
    _times: dict = field(default_factory=dict)  # (layer, dir, name) -> seconds

    def start_forward(self, phase: str) -> None:
        """Call before each forward pass: only ``train`` passes are counted."""
        self.phase = phase

    def record(self, layer: int, direction: int, counts: list[int], width: int, bits: int) -> None:
        """Count the blocks of ``counts[peer]`` rows sent to each peer at ``width`` and ``bits``, as
        ``tessera.comm.wire.block_bytes`` sizes them on the wire (training passes only)."""
        if self.phase != "train":
            return
        self.layers = max(self.layers, layer + 1)
        for peer, rows in enumerate(counts):
            if rows:
                for kind, b in enumerate(block_bytes(rows, width, bits)):
                    key = (layer, direction, peer, kind)
                    self._bytes[key] = self._bytes.get(key, 0) + b

    def add_time(self, layer: int, direction: int, name: str, seconds: float) -> None:
        """Accumulate time spent in exchange, quantization or local compute."""
        if self.phase == "train":
            self.layers = max(self.layers, layer + 1)  # a layer may be timed without sending a byte
            key = (layer, direction, name)
            self._times[key] = self._times.get(key, 0.0) + seconds

    def gather(self, comm) -> dict:
        """Every rank's counters for this epoch (an all-reduce; every rank must call it), then reset.
        ``bytes[kind][layer][direction][src][dst]`` with kind 0 = data, 1 = parameters;
        ``times[name][layer][direction][rank]`` in seconds."""
        L, P = max(self.layers, 1), self.world
        b = torch.zeros(2, L, 2, P, P, dtype=torch.int64)
        for (layer, d, peer, kind), v in self._bytes.items():
            b[kind, layer, d, self.rank, peer] += v
        t = torch.zeros(len(TIMES), L, 2, P, dtype=torch.float64)
        for (layer, d, name), v in self._times.items():
            t[TIMES.index(name), layer, d, self.rank] += v
        comm.all_reduce_sum(b)
        comm.all_reduce_sum(t)
        self._bytes.clear()
        self._times.clear()
        return {
            **{n: b[i].tolist() for i, n in enumerate(BYTES)},
            **{n: t[i].tolist() for i, n in enumerate(TIMES)},
        }


def add_epoch(totals: dict[str, Any], epoch: dict[str, Any]) -> None:
    """Add one epoch's :meth:`CommLog.gather` result to run totals: bytes per layer and direction,
    and the slowest rank's time per layer and direction; ``totals["epochs"]`` counts the epochs."""
    for kind in BYTES:
        per = torch.tensor(epoch[kind]).sum(dim=(2, 3))
        totals[kind] = (torch.tensor(totals[kind]) + per).tolist() if kind in totals else per.tolist()
    for name in TIMES:
        per = torch.tensor(epoch[name]).amax(dim=2)
        totals[name] = (torch.tensor(totals[name]) + per).tolist() if name in totals else per.tolist()
    totals["epochs"] = totals.get("epochs", 0) + 1


def epoch_shape(epoch: Any) -> tuple[int, int]:
    """``(layers, ranks)`` of one epoch's :meth:`CommLog.gather` result read back from a file;
    raises ``ValueError`` saying what is wrong when it is not one."""
    if not isinstance(epoch, dict) or set(epoch) != {*BYTES, *TIMES}:
        raise ValueError(f"must be a dict with exactly the keys {', '.join(BYTES + TIMES)}")
    shapes = set()
    for name in BYTES + TIMES:
        try:
            t = torch.tensor(epoch[name], dtype=torch.int64 if name in BYTES else torch.float64)
        except (TypeError, ValueError, RuntimeError, OverflowError):
            raise ValueError(f"{name} is not a rectangular array of numbers in range") from None
        shape = tuple(t.shape)
        dims = 4 if name in BYTES else 3  # layer, direction, rank (and peer, for bytes)
        if len(shape) != dims or 0 in shape or shape[1] != 2 or len(set(shape[2:])) != 1:
            want = "layers x 2 x ranks" + (" x ranks" if dims == 4 else "")
            raise ValueError(f"{name} has shape {shape}, expected {want}")
        shapes.add(shape[:3])
        if not bool((t >= 0).all()) or not bool(t.isfinite().all()):
            raise ValueError(f"{name} holds a negative or non-finite value")
        if name in BYTES and not all(type(v) is int for v in _leaves(epoch[name])):
            raise ValueError(f"{name} holds a value that is not a whole number of bytes")
    if len(shapes) > 1:
        raise ValueError(f"the counters disagree on layers x 2 x ranks: {sorted(shapes)}")
    layers, _, ranks = shapes.pop()
    return layers, ranks


def _leaves(nested: Any) -> list[Any]:
    return [x for item in nested for x in _leaves(item)] if isinstance(nested, list) else [nested]


class Timer:
    """Context manager adding elapsed wall time to a :class:`CommLog` entry."""

    def __init__(self, log: CommLog | None, layer: int, direction: int, name: str) -> None:
        self.log, self.layer, self.direction, self.name = log, layer, direction, name

    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.log is not None:
            self.log.add_time(self.layer, self.direction, self.name, time.perf_counter() - self.t0)
