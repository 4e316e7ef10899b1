"""Random graphs with the awkward cases every kernel must handle."""

from __future__ import annotations

import os
import resource
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from tessera import Graph


def awkward_edge_index(n: int = 60, e: int = 400, seed: int = 0) -> tuple[torch.Tensor, int]:
    """COO edges over ``n + 3`` vertices: random edges, a hub holding about a third of all edges,
    self loops (one duplicated), duplicate edges, and isolated vertices ``n .. n + 2``."""
    gen = torch.Generator().manual_seed(seed)
    src = torch.randint(0, n, (e,), generator=gen)
    dst = torch.randint(0, n, (e,), generator=gen)
    hub_src = torch.randint(0, n, (e // 2,), generator=gen)
    src = torch.cat([src, hub_src, torch.tensor([5, 5, 7, 1, 1])])
    dst = torch.cat([dst, torch.full((e // 2,), 3), torch.tensor([5, 5, 7, 2, 2])])
    return torch.stack([src, dst]), n + 3


def awkward_graph(n: int = 60, e: int = 400, seed: int = 0, **data) -> Graph:
    """``awkward_edge_index`` as a :class:`Graph`."""
    ei, num = awkward_edge_index(n, e, seed)
    return Graph.from_edge_index(ei, num, **data)


def dense_adjacency(g: Graph, weight: torch.Tensor | None = None, dtype=torch.float64) -> torch.Tensor:
    """``A[i, j] = sum of weights of edges j -> i`` as a dense matrix."""
    a = torch.zeros(g.num_nodes, g.num_nodes, dtype=dtype)
    w = torch.ones(g.num_edges, dtype=dtype) if weight is None else weight.to(dtype)
    a.index_put_((g.dst_index(), g.src_index()), w, accumulate=True)
    return a


def each_dataset(datasets: list[tuple[str, str]]) -> Iterator[tuple[str, Graph]]:
    """``(name, graph)`` for each ``(name, data root or "")``, pointing TESSERA_DATA at the root first."""
    from tessera.datasets import load

    for name, root in datasets:
        if root:
            os.environ["TESSERA_DATA"] = root
        yield name, load(name)


#: torch's and tessera's switch for ranks that join a store someone else serves (torchrun's agent)
AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


@contextmanager
def bound_stores(n: int) -> Iterator[list[int]]:
    """The ports of ``n`` TCPStore servers this process binds for the block: each binds port 0, so
    the kernel picks a port nothing holds and it stays held, with no window in which another
    process can take it. Processes started inside the block inherit ``AGENT_STORE=True``, so
    their ranks (torch's ``env://`` and tessera's ``init_from_env``) join as clients of the store
    at ``MASTER_PORT``, as torchrun's workers join their agent's, instead of binding it."""
    import torch.distributed as dist

    stores = [dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) for _ in range(n)]
    before = os.environ.get(AGENT_STORE)
    os.environ[AGENT_STORE] = "True"
    try:
        yield [s.port for s in stores]
    finally:
        if before is None:
            os.environ.pop(AGENT_STORE, None)
        else:
            os.environ[AGENT_STORE] = before
        stores.clear()


#: in ``spawn_with_retry``'s arguments (or a tuple among them): a port a store is bound on first
PORT = object()


def spawn_with_retry(fn, args: tuple, nprocs: int) -> None:
    """``mp.spawn(fn, args)`` with each :data:`PORT` in ``args`` (or in a tuple among them)
    replaced by the port of a store this process binds first (:func:`bound_stores`), retried once
    if a worker dies by a signal (see ``_died_by_signal``)."""
    import torch.multiprocessing as mp

    slots = _count_ports(args)
    for attempt in range(2):
        with bound_stores(slots) as ports:
            try:
                mp.spawn(fn, args=_fill_ports(args, iter(ports)), nprocs=nprocs, join=True)
                return
            except mp.ProcessExitedException as e:
                if attempt or not _died_by_signal(e):
                    raise


def _count_ports(args: tuple) -> int:
    return sum(1 if a is PORT else _count_ports(a) if isinstance(a, tuple) else 0 for a in args)


def _fill_ports(args: tuple, ports: Iterator[int]) -> tuple:
    return tuple(next(ports) if a is PORT else _fill_ports(a, ports) if isinstance(a, tuple) else a for a in args)


def unserved_port() -> int:
    """A TCP port on 127.0.0.1 nothing listens on right now (for a rank that must find no job)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def store_socket_env(world: int) -> Iterator[list[dict[str, str]]]:
    """Environments for ``world`` ranks forked (or started with the socket passed) inside the
    block: rank 0 serves the job's store on a listening socket bound here first, as under
    ``tessera train --nprocs`` (:data:`tessera.comm.group.STORE_FD`), so no other process can
    take the port meanwhile."""
    from tessera.cli.launch import store_socket
    from tessera.comm.group import STORE_FD

    with store_socket() as sock:
        port, fd = str(sock.getsockname()[1]), str(sock.fileno())
        base = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port, "WORLD_SIZE": str(world)}
        yield [
            {
                **base,
                "RANK": str(r),
                "LOCAL_RANK": str(r),
                "LOCAL_WORLD_SIZE": str(world),
                STORE_FD: fd if r == 0 else "rank 0",
            }
            for r in range(world)
        ]


def spawn_groups(fn, worlds, args: tuple) -> None:
    """``fn(rank, world, port, *args)`` for every process group size in ``worlds``, all from one
    spawn of ``max(worlds)`` processes: ranks below P form the P-rank group, largest group first,
    so a process imports torch and tessera once for all the groups it joins. Each group's store
    is bound here before the spawn (:func:`bound_stores`): its port cannot be taken meanwhile."""
    import torch.multiprocessing as mp

    worlds = sorted(worlds, reverse=True)
    for attempt in range(2):
        with bound_stores(len(worlds)) as ports:
            try:
                mp.spawn(_in_groups, args=(fn, worlds, ports, args), nprocs=worlds[0], join=True)
                return
            except mp.ProcessExitedException as e:
                if attempt or not _died_by_signal(e):
                    raise


def _in_groups(rank: int, fn, worlds: list[int], ports: list[int], args: tuple) -> None:
    for world, port in zip(worlds, ports):
        if rank < world:
            fn(rank, world, port, *args)


def _died_by_signal(e: Exception) -> bool:
    """A worker killed by a signal: on a heavily loaded 2-core machine a gloo teardown abort
    (SIGABRT, "terminate called without an active exception") was seen once."""
    code = getattr(e, "exit_code", None)
    return code is not None and code < 0


@contextmanager
def single_thread() -> Iterator[None]:
    """torch and tessera's numba kernels on one thread inside the block, as each rank of a test's
    process group runs; the previous thread counts after it."""
    import numba

    from tessera.threads import set_num_threads

    numba.get_num_threads()  # start numba's pool first: it resets torch's count when it starts
    before = torch.get_num_threads(), numba.get_num_threads()
    set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before[0])
        numba.set_num_threads(before[1])


def compile_quantize_kernels() -> None:
    """Compile (or load) the quantized exchange's numba kernels in this process, so that ranks
    spawned next load them from numba's on-disk cache instead of each compiling them at once."""
    from tessera.comm.quantize import decode, encode

    x = torch.rand(8, 16, generator=torch.Generator().manual_seed(0))  # leaves the global generator alone
    for bits in (8, 4, 2):
        decode(encode(x, bits, 0), 16, bits, 8)


def forked_main(argv: list[str], err_path: str, env: dict[str, str] | None = None) -> None:
    """``tessera ARGV`` as ``python -m tessera`` runs it, in a fork of this process (torch imported
    already, so a launcher or a hand-started rank costs no start-up): stdout to /dev/null, stderr
    (and that of rank 0, which inherits it) to ``err_path``, no core file; exits with its status."""
    from tessera.cli.main import main

    err = open(err_path, "w", buffering=1)
    os.dup2(err.fileno(), 2)
    sys.stderr = err
    out = open(os.devnull, "w")
    os.dup2(out.fileno(), 1)
    sys.stdout = out
    resource.setrlimit(resource.RLIMIT_CORE, (0, resource.getrlimit(resource.RLIMIT_CORE)[1]))
    os.environ.update(env or {})
    os.environ["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])  # the workers import this checkout
    code = main(argv)
    err.flush()
    os._exit(code)
