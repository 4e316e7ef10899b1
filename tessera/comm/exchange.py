"""The asynchronous exchange between ranks: one ``all_to_all`` of per-peer blocks of float rows,
quantized to ``bits`` below 32, counted in a :class:`~tessera.comm.accounting.CommLog`.

A block is ``rows`` rows of ``width`` values for one peer (:class:`Blocks` lists one per peer, in
rank order); each is one slice of one flat buffer, laid out on the wire as :mod:`tessera.comm.wire`
says, so every peer decodes its block alone. Partition parallelism's halo (:class:`Exchange`)
sends blocks of one width, the tensor strategy also blocks whose width differs per peer (its
column slices). An exchange runs among the members of its :class:`~tessera.comm.group.Comm`
(the whole job, or a subgroup: peers are numbered within it, and the log counts job ranks).
Below 32 bits consecutive blocks of one width are quantized by one
:func:`~tessera.comm.quantize.encode` call; a rank's block to itself is not sent, it is copied
in float32. Quantized send, receive and decoded buffers are kept per exchange and reused every
epoch instead of being allocated (and page-faulted in) per call: safe because an exchange is
finished and its decoded rows consumed before the same exchange runs again."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

from tessera.comm.accounting import FORWARD, CommLog, Timer
from tessera.comm.group import Comm
from tessera.comm.wire import check_bits, wire_bytes


@dataclass(frozen=True)
class Blocks:
    """One side of an exchange: ``rows[q]`` rows of ``widths[q]`` values for (or from) peer ``q``."""

    rows: tuple[int, ...]
    widths: tuple[int, ...]

    @classmethod
    def of(cls, rows, widths) -> Blocks:
        """Blocks of ``rows`` (one count per peer); ``widths`` is one width for all or one per peer."""
        rows = tuple(int(r) for r in rows)
        if isinstance(widths, (int, np.integer)):
            widths = (int(widths),) * len(rows)
        widths = tuple(int(w) for w in widths)
        # a block without values is not sent (below 32 bits it would still cost group parameters)
        return cls(tuple(r if w else 0 for r, w in zip(rows, widths)), widths)

    def sizes(self) -> list[int]:
        """Values per peer."""
        return [r * w for r, w in zip(self.rows, self.widths)]

    def offsets(self) -> list[int]:
        """First value of each peer's block in the flat buffer (and the total, last)."""
        return [0, *np.cumsum(self.sizes(), dtype=np.int64).tolist()]

    def nbytes(self, bits: int, skip: int | None = None) -> list[int]:
        """Wire bytes per peer at ``bits`` (0 for peer ``skip``, whose block is not sent)."""
        return [0 if q == skip else int(wire_bytes(r, w, bits)) for q, (r, w) in enumerate(zip(self.rows, self.widths))]

    def split(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each peer's block of a flat buffer laid out as these blocks, as a ``rows x width`` view."""
        o = self.offsets()
        return [flat[o[q] : o[q + 1]].view(r, w) for q, (r, w) in enumerate(zip(self.rows, self.widths))]

    def runs(self, skip: int | None = None) -> list[tuple[int, int, int]]:
        """``(first peer, end peer, width)`` of the blocks coded together: consecutive peers whose
        non-empty blocks share one width, cut at peer ``skip`` (not coded; empty blocks join any run)."""
        out, start, width = [], 0, None
        for q, (r, w) in enumerate(zip(self.rows, self.widths)):
            if q == skip:
                if q > start:
                    out.append((start, q, width or 0))
                start, width = q + 1, None
            elif r and width is not None and w != width:
                out.append((start, q, width))
                start, width = q, w
            elif r and width is None:
                width = w
        if len(self.rows) > start:
            out.append((start, len(self.rows), width or 0))
        return out


@dataclass
class Pending:
    """An exchange in flight: wait with :meth:`BlockExchange.finish_blocks`."""

    work: dist.Work | None
    out: torch.Tensor
    recv: Blocks
    own: torch.Tensor | None  # this rank's block to itself, copied rather than coded
    key: tuple
    layer: int
    direction: int
    shape: tuple[int, ...] = ()  # the rows' trailing shape, for :meth:`Exchange.finish`
    dtype: torch.dtype = torch.float32


class BlockExchange:
    """All-to-alls of per-peer blocks at one bit width per direction, counted in one log."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm
        self.widths = (32, 32)
        self.log: CommLog | None = None
        self._buffers: dict = {}

    def configure(self, bits: int | tuple[int, int], log: CommLog | None) -> None:
        """Set the bit width of every exchange (one for both directions, or ``(forward,
        backward)``) and the log that counts them."""
        fwd, bwd = (bits, bits) if isinstance(bits, int) else bits
        self.widths, self.log = (check_bits(fwd), check_bits(bwd)), log

    def bits(self, direction: int) -> int:
        """Bits per exchanged value in ``direction`` (FORWARD or BACKWARD)."""
        return self.widths[direction]

    def _buffer(self, key: tuple, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffers.get(key)
        if buf is None or tuple(buf.shape) != shape or buf.dtype != dtype:
            buf = self._buffers[key] = torch.empty(shape, dtype=dtype, device=self.comm.device)
        return buf

    def _record(self, layer: int, direction: int, send: Blocks) -> None:
        """Count the sent blocks (not the one to this rank) in the log, one call per width."""
        if self.log is None:
            return
        me, job = self.comm.rank, self.comm.job_ranks()
        for width in dict.fromkeys(send.widths):
            counts = [0] * self.log.world  # per job rank: the log counts the whole job's pairs
            for q, (r, w) in enumerate(zip(send.rows, send.widths)):
                if w == width and q != me:
                    counts[job[q]] = r
            if any(counts):
                self.log.record(layer, direction, counts, width, self.bits(direction))

    def start_blocks(
        self,
        data: torch.Tensor | list[torch.Tensor],
        send: Blocks,
        recv: Blocks,
        layer: int,
        direction: int,
        tag: int = 0,
    ) -> Pending:
        """Start sending ``data`` for ``layer`` in ``direction``: one ``rows x width`` block per peer
        (a list), or one 2-D tensor of every peer's rows in rank order when ``send`` has one width.
        ``tag`` tells apart the exchanges of one layer and direction (buffers and rounding seeds)."""
        self._record(layer, direction, send)
        key = (layer, direction, tag, send, recv)
        bits = self.bits(direction)
        if bits == 32:
            payload = torch.cat([b.reshape(-1) for b in data]) if isinstance(data, list) else data.reshape(-1)
            out = payload.new_empty(sum(recv.sizes()))
            return self._launch(
                payload.contiguous(), out, send.sizes(), recv.sizes(), recv, None, key, layer, direction
            )
        from tessera.comm.quantize import encode

        me = self.comm.rank
        skip = me if send.rows[me] else None
        send_split, recv_split = send.nbytes(bits, skip), recv.nbytes(bits, skip)
        payload = self._buffer(("send", *key), (sum(send_split),), torch.uint8)
        starts = np.cumsum([0, *send_split])
        with Timer(self.log, layer, direction, "quantize_s"):
            for a, b, width in send.runs(skip):
                rows = list(send.rows[a:b])
                x = _run_values(data, send, a, b).view(sum(rows), width).float()
                seed = quantization_seed(layer, direction, self.comm.job_rank, (tag, a))
                encode(x, bits, seed, out=payload[starts[a] : starts[b]], splits=rows)
        out = self._buffer(("recv", *key), (sum(recv_split),), torch.uint8)
        own = _run_values(data, send, me, me + 1) if skip is not None else None
        return self._launch(payload, out, send_split, recv_split, recv, own, key, layer, direction)

    def _launch(self, payload, out, send_split, recv_split, recv, own, key, layer, direction) -> Pending:
        with Timer(self.log, layer, direction, "exchange_s"):
            if self.comm.world == 1:
                out.copy_(payload)
                work = None
            else:
                work = dist.all_to_all_single(
                    out,
                    payload,
                    output_split_sizes=recv_split,
                    input_split_sizes=send_split,
                    group=self.comm.group,
                    async_op=True,
                )
        return Pending(work, out, recv, own, key, layer, direction)

    def finish_blocks(self, p: Pending) -> torch.Tensor:
        """Wait for :meth:`start_blocks`'s exchange and return the received values, flat, laid
        out as ``p.recv`` (below 32 bits float32, in a buffer reused by the next exchange of the
        same layer, direction and tag; :meth:`Blocks.split` gives each peer's block)."""
        with Timer(self.log, p.layer, p.direction, "exchange_s"):
            if p.work is not None:
                p.work.wait()
        bits = self.bits(p.direction)
        if bits == 32:
            return p.out
        from tessera.comm.quantize import decode

        me = self.comm.rank
        skip = me if p.own is not None else None
        values = self._buffer(("decoded", *p.key), (sum(p.recv.sizes()),), torch.float32)
        starts, at = np.cumsum([0, *p.recv.nbytes(bits, skip)]), p.recv.offsets()
        with Timer(self.log, p.layer, p.direction, "quantize_s"):
            for a, b, width in p.recv.runs(skip):
                rows = p.recv.rows[a:b]
                view = values[at[a] : at[b]].view(sum(rows), width)
                decode(p.out[starts[a] : starts[b]], width, bits, list(rows), out=view)
            if p.own is not None:
                values[at[me] : at[me + 1]].copy_(p.own.reshape(-1))
        return values


def _run_values(data: torch.Tensor | list[torch.Tensor], send: Blocks, a: int, b: int) -> torch.Tensor:
    """The values of peers ``a .. b - 1``'s blocks, one after the other (a view where they are
    one slice of ``data``)."""
    if isinstance(data, list):
        return data[a].reshape(-1) if b - a == 1 else torch.cat([d.reshape(-1) for d in data[a:b]])
    o = send.offsets()
    return data.reshape(-1)[o[a] : o[b]]


class Exchange(BlockExchange):
    """Rows to and from every peer: ``send_counts[q]`` rows go to rank ``q`` forward."""

    def __init__(self, comm: Comm, send_counts: Iterable[int], recv_counts: Iterable[int]) -> None:
        super().__init__(comm)
        self.send_counts, self.recv_counts = [int(c) for c in send_counts], [int(c) for c in recv_counts]

    def start(self, rows: torch.Tensor, layer: int, direction: int) -> Pending:
        """Start sending ``rows`` (peer blocks in rank order) for ``layer`` in ``direction``."""
        send, recv = (
            (self.send_counts, self.recv_counts) if direction == FORWARD else (self.recv_counts, self.send_counts)
        )
        width = int(np.prod(rows.shape[1:])) if rows.dim() > 1 else 1
        p = self.start_blocks(rows, Blocks.of(send, width), Blocks.of(recv, width), layer, direction)
        p.shape, p.dtype = tuple(rows.shape[1:]), rows.dtype
        return p

    def finish(self, p: Pending) -> torch.Tensor:
        """Wait for :meth:`start`'s exchange and return the received rows (below 32 bits, in a
        buffer reused by the next exchange of the same layer and direction)."""
        values = self.finish_blocks(p)
        return values.view(sum(p.recv.rows), *p.shape).to(p.dtype)


def quantization_seed(layer: int, direction: int, rank: int, part: tuple[int, int] = (0, 0)) -> int:
    """The stochastic-rounding seed of one exchange, hashed from torch's default generator state
    (so ``torch.manual_seed`` and checkpoints govern it) without drawing from it: quantizing does
    not shift the dropout and label-propagation draws, which then match a 32-bit or one-process run.
    ``part`` (exchange tag, first peer) tells apart the coding calls of one layer and direction;
    ``(0, 0)``, a halo exchange's only call, adds nothing to the hash."""
    state = torch.default_generator.get_state().numpy().tobytes()
    salt = np.array([layer, direction, rank, *(part if tuple(part) != (0, 0) else ())], dtype=np.int64).tobytes()
    return int.from_bytes(hashlib.blake2b(state + salt, digest_size=8).digest(), "little") >> 1
