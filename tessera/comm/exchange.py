"""The asynchronous row exchange between ranks: one ``all_to_all`` of row blocks, quantized to
``bits`` below 32, counted in a :class:`~tessera.comm.accounting.CommLog`.

Each peer's block is one slice of one flat buffer (:mod:`tessera.comm.wire` sizes it); a backward
exchange sends the forward's receive counts and receives its send counts. Quantized send,
receive and decoded buffers are kept per (layer, direction, width) and reused every epoch instead
of being allocated (and page-faulted in) per call: safe because an exchange is finished and its
decoded rows consumed before the same exchange runs again."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from tessera.comm.accounting import FORWARD, CommLog, Timer
from tessera.comm.group import Comm
from tessera.comm.wire import check_bits, wire_bytes
from tessera.errors import ConfigError


@dataclass
class Pending:
    """An exchange in flight: wait with :meth:`Exchange.finish`."""

    work: object | None
    out: torch.Tensor
    recv: list[int]
    shape: tuple[int, ...]
    dtype: torch.dtype
    layer: int
    direction: int


class Exchange:
    """Rows to and from every peer: ``send_counts[q]`` rows go to rank ``q`` forward."""

    def __init__(self, comm: Comm, send_counts: list[int], recv_counts: list[int]) -> None:
        self.comm = comm
        self.send_counts, self.recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]
        self.bits = 32
        self.log: CommLog | None = None
        self._buffers: dict = {}

    def configure(self, bits: int, log: CommLog | None) -> None:
        """Set the bit width of every exchange and the log that counts them."""
        self.bits, self.log = check_bits(bits), log
        if self.bits < 32 and self.comm.device.type != "cpu":
            raise ConfigError(
                "quantized exchange (--comm-bits below 32) encodes on the CPU; use --comm-bits 32 on GPUs"
            )

    def _buffer(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype:
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype, device=self.comm.device)
        return buf

    def start(self, rows: torch.Tensor, layer: int, direction: int) -> Pending:
        """Start sending ``rows`` (peer blocks in rank order) for ``layer`` in ``direction``."""
        send, recv = (
            (self.send_counts, self.recv_counts) if direction == FORWARD else (self.recv_counts, self.send_counts)
        )
        width = int(np.prod(rows.shape[1:])) if rows.dim() > 1 else 1
        out_rows = sum(recv)
        if self.log is not None:
            self.log.record(layer, direction, send, width, self.bits)
        if self.bits == 32:
            payload, out = rows.contiguous(), rows.new_empty((out_rows, *rows.shape[1:]))
            send_split, recv_split = send, recv
        else:
            from tessera.comm.quantize import encode

            send_split = [int(b) for b in wire_bytes(np.asarray(send), width, self.bits)]
            recv_split = [int(b) for b in wire_bytes(np.asarray(recv), width, self.bits)]
            seed = quantization_seed(layer, direction, self.comm.rank)
            key = (layer, direction, width)
            payload = self._buffer(("send", *key), (sum(send_split),), torch.uint8)
            with Timer(self.log, layer, direction, "quantize_s"):
                encode(rows.reshape(rows.shape[0], width).float(), self.bits, seed, out=payload, splits=send)
            out = self._buffer(("recv", *key), (sum(recv_split),), torch.uint8)
        with Timer(self.log, layer, direction, "exchange_s"):
            if self.comm.world == 1:
                out.copy_(payload)
                work = None
            else:
                work = dist.all_to_all_single(
                    out, payload, output_split_sizes=recv_split, input_split_sizes=send_split, async_op=True
                )
        return Pending(work, out, recv, tuple(rows.shape[1:]), rows.dtype, layer, direction)

    def finish(self, p: Pending) -> torch.Tensor:
        """Wait for :meth:`start`'s exchange and return the received rows as floats (below 32
        bits, in a buffer reused by the next exchange of the same layer and direction)."""
        with Timer(self.log, p.layer, p.direction, "exchange_s"):
            if p.work is not None:
                p.work.wait()
        if self.bits == 32:
            return p.out
        from tessera.comm.quantize import decode

        width = int(np.prod(p.shape)) if p.shape else 1
        rows = self._buffer(("decoded", p.layer, p.direction, width), (sum(p.recv), width), torch.float32)
        with Timer(self.log, p.layer, p.direction, "quantize_s"):
            decode(p.out, width, self.bits, p.recv, out=rows)
        return rows.view(rows.shape[0], *p.shape).to(p.dtype)


def quantization_seed(layer: int, direction: int, rank: int) -> int:
    """The stochastic-rounding seed of one exchange, hashed from torch's default generator state
    (so ``torch.manual_seed`` and checkpoints govern it) without drawing from it: quantizing does
    not shift the dropout and label-propagation draws, which then match a 32-bit or one-process run."""
    state = torch.default_generator.get_state().numpy().tobytes()
    salt = np.array([layer, direction, rank], dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(state + salt, digest_size=8).digest(), "little") >> 1


def all_to_all_flat(comm: Comm, send: torch.Tensor, send_sizes: list[int], recv_sizes: list[int]) -> torch.Tensor:
    """One synchronous ``all_to_all`` of a flat buffer: ``send_sizes[q]`` elements go to rank
    ``q`` (blocks in rank order), ``recv_sizes[p]`` come from rank ``p``; returns the received ones."""
    out = send.new_empty(sum(recv_sizes))
    if comm.world == 1:
        out.copy_(send)
    else:
        dist.all_to_all_single(out, send.contiguous(), output_split_sizes=recv_sizes, input_split_sizes=send_sizes)
    return out
