"""Exact communication accounting: bytes each rank sends per layer, direction and peer (data and
quantization parameters separately) and the time spent exchanging, quantizing and computing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tessera.comm.wire import block_bytes

FORWARD, BACKWARD = 0, 1
_TIMES = ("exchange_s", "quantize_s", "compute_s")


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
        t = torch.zeros(len(_TIMES), L, 2, P, dtype=torch.float64)
        for (layer, d, name), v in self._times.items():
            t[_TIMES.index(name), layer, d, self.rank] += v
        comm.all_reduce_sum(b)
        comm.all_reduce_sum(t)
        self._bytes.clear()
        self._times.clear()
        return {
            "bytes_data": b[0].tolist(),
            "bytes_params": b[1].tolist(),
            **{n: t[i].tolist() for i, n in enumerate(_TIMES)},
        }


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
