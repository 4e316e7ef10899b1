"""``variant="auto"`` for relational aggregation: pick the RGCN variant per (graph, widths, reduce).

The rule, as :func:`tessera.backends.select.choose` does for kernels: the cost model
(:func:`tessera.relational.variants.variant_cost`, FLOPs and bytes of a forward and backward pass)
prunes every variant modelled more than ``PRUNE_FACTOR`` (2x) slower than the best; when one
survives, or the problem is too small for a trial to pay (fewer than ``_TRIAL_MIN_FLOPS``
modelled FLOPs), the model's best is taken. Survivors whose modelled intermediates
(:func:`~tessera.relational.plan.variant_memory`) exceed ``MEMORY_FACTOR`` (2x) the leanest
survivor's are not tried either: a trial pass of a memory-hungry variant would raise the run's
peak memory even when it loses. Otherwise each survivor runs one forward and backward
pass on the real input as a warm-up (it builds the variant's structures), then the survivors
whose warm-up took at most ``WARMUP_FACTOR`` (3x) the fastest warm-up, or under ``WARMUP_FLOOR``
(1 s), run ``_TRIAL_REPS`` timed passes, alternating, and the fastest median wins. The cap bounds
what a trial costs: a variant whose first pass is far slower than the others' (a cold kernel, a
structure that takes long to build, a model that is wrong for this input) runs once, not
``1 + _TRIAL_REPS`` times, and is not chosen. Decisions are kept in memory per graph and on disk
in the kernel cache (``kernels.json``; the dropped variants' warm-up seconds under ``dropped``),
keyed by the graph's fingerprint, widths, reduce and thread count, so a later run reuses them
without measuring. After a measured choice the structures of the variants no choice on the graph
took are released (:meth:`~tessera.relational.plan.Relations.release`).
"""

from __future__ import annotations

import statistics
import time

import torch

from tessera import workspace
from tessera.backends import select
from tessera.kernels.placement import host_kernels
from tessera.relational.plan import VARIANTS, Relations, ranked_variants, variant_cost, variant_memory
from tessera.relational.variants import run_variant

_TRIAL_REPS = 2
WARMUP_FACTOR = 3.0  # a warm-up slower than this times the fastest one drops the variant ...
WARMUP_FLOOR = 1.0  # ... unless it took under this many seconds (then a trial costs nothing worth saving)
_clock = time.perf_counter
# a variant modelled to hold more than this times the leanest candidate's intermediates is not tried:
# its trial pass would raise the run's peak memory even when it loses (docs/design/rgcn-memory.md)
MEMORY_FACTOR = 2.0
_TRIAL_MIN_FLOPS = 2e9  # below this a whole layer takes milliseconds: the model decides alone
_VERSION = 2  # 2: gathered products chunked (unique_source, gtask), memory-gated trials


def decision_key(rel: Relations, fi: int, fo: int, reduce: str) -> str:
    """The cache key of one variant decision."""
    fp = rel.matrix.fingerprint()
    return f"rgcn{_VERSION}|{fp}|fi{fi}|fo{fo}|{reduce}|t{torch.get_num_threads()}"


def warm_survivors(warmups: dict[str, float]) -> list[str]:
    """The variants that go on to timed passes: warm-up within :data:`WARMUP_FACTOR` of the
    fastest one, or under :data:`WARMUP_FLOOR` seconds (in ``warmups``' order)."""
    cap = max(WARMUP_FACTOR * min(warmups.values()), WARMUP_FLOOR)
    return [name for name, t in warmups.items() if t <= cap]


def measure(
    rel: Relations, x: torch.Tensor, weight: torch.Tensor, reduce: str, names: list[str]
) -> tuple[dict[str, float], dict[str, float]]:
    """Median seconds of one forward and backward pass of each variant on this input that survives
    its warm-up (:func:`warm_survivors`), and the warm-up seconds of those dropped."""
    x = x.detach().requires_grad_(True)
    w = weight.detach().requires_grad_(True)

    def step(name: str) -> float:
        # each pass's workspace blocks (its row-sized buffers) are dropped when it ends: held, every
        # variant's would add up during the trial, and for the rest of the run (2.8 GiB on arxiv-rel8)
        with workspace.transient():
            t0 = _clock()
            out = run_variant(rel, name, x, w, reduce)
            out.backward(torch.ones_like(out))
            seconds = _clock() - t0
            del out  # its block is free before the transient ends, so dropped with the rest
            return seconds

    warmups = {name: step(name) for name in names}
    kept = warm_survivors(warmups)
    times: dict[str, list[float]] = {name: [] for name in kept}
    for _ in range(_TRIAL_REPS):
        for name in kept:
            times[name].append(step(name))
    dropped = {name: t for name, t in warmups.items() if name not in times}
    return {name: statistics.median(t) for name, t in times.items()}, dropped


def choose_variant(rel: Relations, x: torch.Tensor, weight: torch.Tensor, reduce: str) -> str:
    """The variant to run (see the module docstring for the rule)."""
    fi, fo = int(weight.shape[1]), int(weight.shape[2])
    key = decision_key(rel, fi, fo, reduce)
    stats = rel.stats()
    ranked = ranked_variants(stats, fi, fo)
    if not host_kernels(x):  # gTasks run on the CPU's kernels; the other variants in portable torch ops
        ranked = [v for v in ranked if v != "gtask"] or ["edge_wise"]
        key += f" on {x.device.type}"
    known = select.lookup(rel.matrix, key, ranked)
    if known is not None:
        return known
    if len(ranked) == 1 or variant_cost(stats, fi, fo, ranked[0])[0] < _TRIAL_MIN_FLOPS:
        select.remember(rel.matrix, key, ranked[0])
        return ranked[0]
    lean = min(variant_memory(stats, fi, fo, v) for v in ranked)
    candidates = [v for v in ranked if variant_memory(stats, fi, fo, v) <= MEMORY_FACTOR * lean]
    if len(candidates) == 1:
        select.remember(rel.matrix, key, candidates[0])
        return candidates[0]
    seconds, dropped = measure(rel, x, weight, reduce, candidates)
    choice = select.record(rel.matrix, key, seconds, dropped=dropped)
    # the losers' structures (and the backend plans made for them) go; the choices made on this
    # matrix so far (the other layers' too) keep theirs
    rel.release({v for v in select.decisions(rel.matrix) if v in VARIANTS})
    return choice
