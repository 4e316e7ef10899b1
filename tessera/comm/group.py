"""The process group: started from torchrun's standard environment or tessera's own launcher.

A group carries the device its tensors live on, and the collective backend follows it: gloo for
CPU tensors, NCCL for CUDA ones. Training runs where its tensors are, so a GPU node training on
CPU tensors uses gloo, and asking for a CUDA device the node lacks is refused with a clear error."""

from __future__ import annotations

import contextlib
import datetime
import errno
import os
import socket
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tessera.errors import ConfigError, DistributedError

#: exit status of a rank that could not join its job in time (the CLI's PEER_FAILED)
_PEER_FAILED = 3
#: seconds past ``--timeout`` after which a rank still joining ends itself: torch bounds connecting
#: by the timeout, but a client connected to a port something else holds can wait for its answer forever
_RENDEZVOUS_SLACK_S = 3.0
#: seconds a rank whose collective broke waits for each peer's beacon to answer a connection
PROBE_S = 1.0


@dataclass
class Comm:
    """This process's place in a group of the job's ranks (the whole job unless made by
    :func:`subgroup`): rank and size within it, device, and the collectives it runs over it."""

    rank: int
    world: int
    device: torch.device
    group: Any = None  # the torch.distributed process group; None: the whole job
    members: tuple[int, ...] | None = None  # the job rank of each member; None: the whole job in order
    job_world: int | None = None  # ranks in the job (None: this group is the job)

    @property
    def job_rank(self) -> int:
        """This process's rank in the whole job."""
        return self.rank if self.members is None else self.members[self.rank]

    @property
    def job_size(self) -> int:
        """Ranks in the whole job."""
        return self.world if self.job_world is None else self.job_world

    def job_ranks(self) -> list[int]:
        """The job rank of each member, in group order."""
        return list(range(self.world)) if self.members is None else list(self.members)

    @property
    def backend(self) -> str:
        """The collective backend for this group's tensors."""
        return backend_for(self.device)

    def _collective(self, t: torch.Tensor, run: Callable[[torch.Tensor], object]) -> torch.Tensor:
        """``run`` (an in-place collective) on ``t``, through a copy on this group's device when
        ``t`` lives elsewhere (NCCL takes CUDA tensors only); returns ``t``."""
        if self.world == 1:
            return t
        on = t if t.device == self.device else t.to(self.device)
        run(on)
        if on is not t:
            t.copy_(on)
        return t

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over all ranks (no-op for one rank); returns ``t``."""
        return self._collective(t, lambda x: dist.all_reduce(x, op=dist.ReduceOp.SUM, group=self.group))

    def all_reduce_max(self, t: torch.Tensor) -> torch.Tensor:
        """In-place maximum over all ranks (no-op for one rank); returns ``t``."""
        return self._collective(t, lambda x: dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group))

    def broadcast(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        """In-place broadcast from member ``src``; returns ``t``."""
        return self._collective(t, lambda x: dist.broadcast(x, self.job_ranks()[src], group=self.group))

    def host_indices(self) -> list[int]:
        """Each member's host, numbered by first appearance in member order (a collective): ranks
        on one host share its memory and its links."""
        if self.world == 1:
            return [0]
        names: list[Any] = [None] * self.world
        dist.all_gather_object(names, socket.gethostname(), group=self.group)
        number: dict[str, int] = {}
        return [number.setdefault(str(n), len(number)) for n in names]

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every member's ``t`` (rows of the same width and dtype, any number per member) stacked in
        member order, on every member (``t`` itself for one rank): the row counts are exchanged
        first, each member's rows padded to the largest count for ``all_gather``, then trimmed."""
        if self.world == 1:
            return t
        on = t.to(self.device).contiguous()
        sizes = torch.zeros(self.world, dtype=torch.int64, device=self.device)
        sizes[self.rank] = on.shape[0]
        counts = self.all_reduce_sum(sizes).tolist()
        most = max(counts)
        padded = on.new_zeros((most, *on.shape[1:]))
        padded[: on.shape[0]] = on
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded, group=self.group)
        out = torch.cat([p[:c] for p, c in zip(parts, counts, strict=True)])
        return out if out.device == t.device else out.to(t.device)

    def barrier(self) -> None:
        """Wait for every member."""
        if self.world > 1:
            dist.barrier(group=self.group)


def subgroup(comm: Comm, groups: list[list[int]]) -> Comm:
    """This rank's group among ``groups`` (lists of job ranks, each rank in exactly one): every
    rank creates every group of more than one rank, in the given order, as
    ``torch.distributed.new_group`` requires, so all ranks must pass the same ``groups``."""
    mine = None
    for members in groups:
        handle = dist.new_group(list(members)) if len(members) > 1 else None
        if comm.job_rank in members:
            mine = Comm(
                list(members).index(comm.job_rank), len(members), comm.device, handle, tuple(members), comm.job_size
            )
    if mine is None:
        raise ValueError(f"rank {comm.job_rank} is in none of the groups {groups}")
    return mine


def env_world_size() -> int:
    """``WORLD_SIZE`` from the environment (1 when not launched as a distributed job)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def backend_for(device: torch.device) -> str:
    """``nccl`` for CUDA tensors, ``gloo`` for everything else."""
    return "nccl" if device.type == "cuda" else "gloo"


def single_process(device: torch.device | str = "cpu") -> Comm:
    """The group of a run that is not distributed."""
    return Comm(0, 1, torch.device(device))


def init_from_env(timeout_s: float, device: torch.device | str = "cpu") -> Comm:
    """Join the job described by ``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT``
    (torchrun's variables) for tensors on ``device`` (``cuda`` means this rank's ``LOCAL_RANK``
    GPU). Collectives that wait longer than ``timeout_s`` raise instead of hanging."""
    rank, world = int(os.environ["RANK"]), env_world_size()
    device = torch.device(device)
    if device.type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        if not torch.cuda.is_available() or torch.cuda.device_count() <= local_rank:
            raise ConfigError(
                f"rank {rank} asks for CUDA device {local_rank} but this node has "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}; train on cpu or start fewer ranks per node"
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        timeout = datetime.timedelta(seconds=timeout_s)
        where = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
        fix = (
            "start every rank with the same MASTER_ADDR and MASTER_PORT, rank 0 on a port nothing else "
            "uses, and all of them within --timeout"
        )
        with _rendezvous_deadline(f"rank {rank} of {world}", where, timeout_s, fix):
            try:
                dist.init_process_group(
                    backend_for(device),
                    rank=rank,
                    world_size=world,
                    timeout=timeout,
                    store=_job_store(rank, world, timeout),
                )
            except RuntimeError as e:  # torch's DistNetworkError, DistStoreError: no group to leave
                first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
                raise DistributedError(
                    f"rank {rank} of {world} could not join the job at {where} within --timeout {timeout_s:g} s "
                    f"({first}); {fix}"
                ) from None
        if world > 1:
            _join_peer_table(rank, world)
    return Comm(rank, world, device)


@dataclass(frozen=True)
class Peer:
    """Where one rank of the job runs: its host name and the address and port of its beacon (a
    listening socket it holds while it lives; port 0: it has none)."""

    rank: int
    host: str
    addr: str
    port: int


#: every rank's :class:`Peer`, in rank order, once this process has joined a job
_peers: list[Peer] = []
#: this rank's beacon: peers that can connect to it know this process is alive and reachable
_beacon: socket.socket | None = None


def _own_address() -> str:
    """The address this host sends from towards ``MASTER_ADDR`` (no packet is sent), which is the
    address its peers reach it at; ``127.0.0.1`` when that cannot be told."""
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, int(os.environ.get("MASTER_PORT", "9"))))
            return str(s.getsockname()[0])
    except (OSError, ValueError):
        return "127.0.0.1"


def _join_peer_table(rank: int, world: int) -> None:
    """Open this rank's beacon and all-gather every rank's host name and beacon address, so that
    a rank whose collective breaks can name the peer it lost (:func:`lost_peers`)."""
    global _beacon
    addr, port = _own_address(), 0
    if _beacon is not None:
        _beacon.close()
        _beacon = None
    try:
        _beacon = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        _beacon.bind((addr, 0))
        _beacon.listen(socket.SOMAXCONN)  # the kernel completes probes' connections: nothing accepts
        port = int(_beacon.getsockname()[1])
    except OSError:
        if _beacon is not None:
            _beacon.close()
        _beacon = None
    table: list[Any] = [None] * world
    dist.all_gather_object(table, (socket.gethostname(), addr, port))
    _peers[:] = [Peer(r, str(h), str(a), int(p)) for r, (h, a, p) in enumerate(table)]


def _probe(peer: Peer, timeout_s: float) -> str:
    """``alive``, ``exited`` (its host refused: nothing holds the beacon) or ``unreachable`` (no
    answer within ``timeout_s``, or no route to its host)."""
    try:
        with socket.create_connection((peer.addr, peer.port), timeout=timeout_s):
            return "alive"
    except ConnectionRefusedError:
        return "exited"
    except OSError as e:
        return "exited" if e.errno == errno.ECONNRESET else "unreachable"


def _ranks(peers: Sequence[Peer]) -> str:
    return ("rank " if len(peers) == 1 else "ranks ") + ", ".join(str(p.rank) for p in peers)


def lost_peers(rank: int, timeout_s: float = PROBE_S) -> str | None:
    """Which peers ``rank`` lost, in words, from probing every other rank's beacon at once (at
    most ``timeout_s``): the hosts that did not answer (a cut link, a host gone) and their ranks,
    else the ranks that exited; ``None`` when every peer answered or no table was made."""
    others = [p for p in _peers if p.rank != rank and p.port > 0]
    if not others:
        return None
    states: dict[int, str] = {}
    threads = [
        threading.Thread(target=lambda p=p: states.__setitem__(p.rank, _probe(p, timeout_s)), daemon=True)
        for p in others
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s + 1.0)
    here = _peers[rank].host if rank < len(_peers) else socket.gethostname()
    unreachable = [p for p in others if states.get(p.rank, "unreachable") == "unreachable"]
    if unreachable:
        hosts: dict[str, list[Peer]] = {}
        for p in unreachable:
            hosts.setdefault(p.host, []).append(p)
        said = "; ".join(
            f"host {h} is unreachable ({_ranks(ps)} at {', '.join(sorted({p.addr for p in ps}))} "
            f"gave no answer within {timeout_s:g} s)"
            for h, ps in hosts.items()
        )
        return f"{said}; this rank is on host {here}"
    exited = [p for p in others if states.get(p.rank) == "exited"]
    if exited:
        return "; ".join(f"{_ranks([p])} on host {p.host} has exited" for p in exited)
    return None


@contextlib.contextmanager
def _rendezvous_deadline(who: str, where: str, timeout_s: float, fix: str) -> Iterator[None]:
    """Joining a job, bounded: a rank still inside after ``timeout_s`` + a few seconds says so in
    one line (unless tessera's launcher, which names it, started it) and ends with status 3.
    torch's own messages about failed connection attempts (C++ log lines with stack traces on
    stderr) are held back while joining and shown only if the rank joined after all."""
    done = threading.Event()

    def watch() -> None:
        if done.wait(timeout_s + _RENDEZVOUS_SLACK_S):
            return
        if not os.environ.get("TESSERA_LAUNCHER_PID"):
            line = (
                f"tessera: error: {who} could not join the job at {where} within --timeout {timeout_s:g} s "
                f"(no answer from the store there); {fix}\n"
            )
            os.write(real_stderr, line.encode())
        os._exit(_PEER_FAILED)

    with _stderr_held() as real_stderr:
        threading.Thread(target=watch, daemon=True, name="tessera-rendezvous").start()
        try:
            yield
        finally:
            done.set()


@contextlib.contextmanager
def _stderr_held() -> Iterator[int]:
    """File descriptor 2 goes to a temporary file while inside, and what was written there is
    copied to the real stderr on leaving without an error (dropped after one: the error's line says
    it); yields a descriptor of the real stderr."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        sys.stderr.flush()
    real = os.dup(2)
    held = tempfile.TemporaryFile()
    os.dup2(held.fileno(), 2)
    ok = False
    try:
        yield real
        ok = True
    finally:
        with contextlib.suppress(AttributeError, ValueError, OSError):
            sys.stderr.flush()
        os.dup2(real, 2)
        os.close(real)
        if ok:
            held.seek(0)
            text = held.read()
            while text:
                text = text[os.write(2, text) :]
        held.close()


#: set in every rank of a job whose rank 0 inherited a listening socket for the store: its file
#: descriptor in rank 0, any value in the others
STORE_FD = "TESSERA_STORE_FD"


def _job_store(rank: int, world: int, timeout: datetime.timedelta) -> dist.Store | None:
    """The job's store, or ``None`` for torch's ``env://``.

    Under ``tessera train --nprocs``, the launcher bound a listening socket before starting any
    worker and passed it to rank 0 (:data:`STORE_FD`): rank 0 serves the store on it, so the port
    was never free for another process to take, and the others join it as clients.

    Under torchrun, a store private to this restart attempt: torchrun's agent hosts one store for
    the whole job, so after a worker dies and the group is restarted the previous attempt's peer
    addresses are still in it, and a restarted rank can read a dead peer's address before the
    live one overwrites it and fail with "connection refused". Prefixing every key with the
    attempt number makes each attempt start from an empty namespace."""
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        base = dist.TCPStore(addr, port, is_master=False, timeout=timeout)
        return dist.PrefixStore(f"tessera/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", base)
    fd = os.environ.get(STORE_FD)
    if fd is None:
        return None
    if rank == 0:
        return dist.TCPStore(addr, port, world, True, timeout, wait_for_workers=False, master_listen_fd=int(fd))
    return dist.TCPStore(addr, port, world, False, timeout)


def shutdown(clean: bool = True) -> None:
    """Leave the process group if one was joined. After a clean run every rank first meets the
    others, so none tears gloo down while a peer still talks to it (a torchrun worker can abort
    in teardown otherwise); restarted workers pass this barrier because each attempt has its own
    store prefix (``_job_store``)."""
    global _beacon
    if _beacon is not None:
        _beacon.close()
        _beacon = None
    if dist.is_initialized():
        if clean:
            try:
                dist.barrier()
            except RuntimeError:
                pass  # a peer is already gone: still leave the group
        dist.destroy_process_group()
