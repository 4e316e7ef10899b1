"""Random graphs with the awkward cases every kernel must handle."""

from __future__ import annotations

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


def spawn_with_retry(fn, args: tuple, nprocs: int) -> None:
    """``mp.spawn(fn, args)`` where ``args = (world, port, ...)``, retried once on a fresh port if a
    worker dies by a signal: on a heavily loaded 2-core machine a gloo teardown abort (SIGABRT,
    "terminate called without an active exception") was seen once; a second failure is real."""
    import torch.multiprocessing as mp

    from tessera.cli.launch import free_port

    try:
        mp.spawn(fn, args=args, nprocs=nprocs, join=True)
    except mp.ProcessExitedException as e:
        if e.exit_code is None or e.exit_code >= 0:
            raise
        mp.spawn(fn, args=(args[0], free_port(), *args[2:]), nprocs=nprocs, join=True)
