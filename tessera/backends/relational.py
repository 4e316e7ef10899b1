"""``variant="auto"`` for relational aggregation: pick the RGCN variant per (graph, widths, reduce).

The rule, as :func:`tessera.backends.select.choose` does for kernels: the cost model
(:func:`tessera.sparse.relational.variant_cost`, FLOPs and bytes of a forward and backward pass)
prunes every variant modelled more than ``PRUNE_FACTOR`` (2x) slower than the best; when one
survives, or the problem is too small for a trial to pay (fewer than ``_TRIAL_MIN_FLOPS``
modelled FLOPs), the model's best is taken. Otherwise each survivor runs one forward and backward
pass on the real input (after a warm-up), alternating, and the fastest median wins. Decisions are
kept in memory per graph and on disk in the kernel cache (``kernels.json``), keyed by the graph's
fingerprint, widths, reduce and thread count, so a later run reuses them without measuring.
"""

from __future__ import annotations

import statistics
import time

import torch

from tessera.backends import select
from tessera.sparse.relation_plan import Relations, ranked_variants, variant_cost
from tessera.sparse.relational import run_variant

_TRIAL_REPS = 2
_TRIAL_MIN_FLOPS = 2e9  # below this a whole layer takes milliseconds: the model decides alone
_VERSION = 1


def decision_key(rel: Relations, fi: int, fo: int, reduce: str) -> str:
    """The cache key of one variant decision."""
    fp = rel.matrix.fingerprint()
    return f"rgcn{_VERSION}|{fp}|fi{fi}|fo{fo}|{reduce}|t{torch.get_num_threads()}"


def measure(rel: Relations, x: torch.Tensor, weight: torch.Tensor, reduce: str, names: list[str]) -> dict[str, float]:
    """Median seconds of one forward and backward pass of each variant on this input."""
    x = x.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)

    def step(name: str) -> None:
        out = run_variant(rel, name, x, w, reduce)
        out.backward(torch.ones_like(out))

    for name in names:
        step(name)
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(_TRIAL_REPS):
        for name in names:
            t0 = time.perf_counter()
            step(name)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}


def choose_variant(rel: Relations, x: torch.Tensor, weight: torch.Tensor, reduce: str) -> str:
    """The variant to run (see the module docstring for the rule)."""
    fi, fo = int(weight.shape[1]), int(weight.shape[2])
    key = decision_key(rel, fi, fo, reduce)
    stats = rel.stats()
    ranked = ranked_variants(stats, fi, fo)
    known = select.lookup(rel.matrix, key, ranked)
    if known is not None:
        return known
    if len(ranked) == 1 or variant_cost(stats, fi, fo, ranked[0])[0] < _TRIAL_MIN_FLOPS:
        select.remember(rel.matrix, key, ranked[0])
        return ranked[0]
    return select.record(rel.matrix, key, measure(rel, x, weight, reduce, ranked))
