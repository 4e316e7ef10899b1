"""Seeded synthetic graphs shaped like the usual benchmarks (degree-corrected stochastic block model),
plain, typed (``<preset>-rel[R]``: R relations whose homophily differs, see :func:`generate_typed`)
or multi-label (``<preset>-multilabel``: binary tasks that follow the communities, see
:func:`generate_multilabel`)."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tessera.errors import DatasetError
from tessera.graph.graph import Graph, stratified_split

_CHUNK = 1 << 16
_MAX_ROUNDS = 6


@dataclass(frozen=True)
class SyntheticSpec:
    """Parameters of a degree-corrected SBM graph whose communities are the classes.

    ``homophily`` is the exact share of undirected edges inside a community; degree propensities are
    Pareto with density exponent ``exponent``, capped so no expected degree exceeds ``max_degree``.
    Features are ``feature_signal * centroid[class] + feature_noise * N(0, I)``. The split is
    ``per_class = (train, val)`` vertices per class (rest test) when given, else ``split`` fractions.
    """

    num_nodes: int
    num_undirected_edges: int
    num_features: int
    num_classes: int
    exponent: float = 2.3
    max_degree: int = 1000
    homophily: float = 0.7
    feature_signal: float = 0.2
    feature_noise: float = 1.0
    size_spread: float = 0.3
    split: tuple[float, float, float] = (0.54, 0.18, 0.28)
    per_class: tuple[int, int] | None = None
    name: str = "custom"


# Positional fields: vertices, undirected edges, features, classes, degree exponent, max degree,
# homophily, feature signal.
PRESETS: dict[str, SyntheticSpec] = {
    "tiny": SyntheticSpec(200, 800, 16, 4, 2.5, 40, 0.8, 0.3, per_class=(10, 10), name="tiny"),
    "small": SyntheticSpec(10_000, 50_000, 64, 8, 2.3, 500, 0.75, 0.2, per_class=(50, 100), name="small"),
    "arxiv": SyntheticSpec(169_343, 1_157_799, 128, 40, 2.2, 3000, 0.65, 0.17, name="arxiv"),
    "products": SyntheticSpec(
        500_000, 12_000_000, 100, 47, 2.3, 8000, 0.8, 0.24, split=(0.08, 0.02, 0.90), name="products"
    ),
    "reddit": SyntheticSpec(
        100_000, 10_000_000, 602, 41, 2.5, 2000, 0.75, 0.09, split=(0.66, 0.10, 0.24), name="reddit"
    ),
}


def _resolve(preset: str | SyntheticSpec) -> SyntheticSpec:
    if isinstance(preset, SyntheticSpec):
        spec = preset
    elif preset in PRESETS:
        spec = PRESETS[preset]
    else:
        raise DatasetError(f"unknown synthetic preset {preset!r}; choose one of: {', '.join(PRESETS)}")
    n, c = spec.num_nodes, spec.num_classes
    if n < 2 or not 1 <= c <= n:
        raise DatasetError(f"synthetic spec needs num_nodes >= 2 and 1 <= num_classes <= num_nodes, got {n}, {c}")
    if not 0 <= spec.num_undirected_edges <= n * (n - 1) // 4:
        raise DatasetError(f"{spec.num_undirected_edges} undirected edges is too dense for {n} vertices")
    if not 0.0 <= spec.homophily <= 1.0 or spec.exponent <= 1.0 or spec.max_degree < 1 or spec.num_features < 1:
        raise DatasetError("synthetic spec needs 0 <= homophily <= 1, exponent > 1, max_degree >= 1, num_features >= 1")
    if spec.per_class is None and (min(spec.split) < 0 or spec.split[0] <= 0 or sum(spec.split) > 1 + 1e-9):
        raise DatasetError(f"split fractions {spec.split} must be non-negative, sum to <= 1, with a non-empty train")
    return spec


def _community_sizes(spec: SyntheticSpec, rng: np.random.Generator) -> np.ndarray:
    c, n = spec.num_classes, spec.num_nodes
    p = rng.lognormal(0.0, spec.size_spread, c)
    p = np.maximum(p / p.sum(), 0.5 / c)
    sizes = np.maximum(np.floor(p / p.sum() * n).astype(np.int64), 1)
    while sizes.sum() != n:  # hand out (or take back) the rounding remainder one vertex at a time
        i = int(np.argmin(sizes) if sizes.sum() < n else np.argmax(sizes))
        sizes[i] += 1 if sizes.sum() < n else -1
    return sizes


def _propensities(spec: SyntheticSpec, rng: np.random.Generator) -> np.ndarray:
    mean_deg = 2.0 * spec.num_undirected_edges / spec.num_nodes
    theta = (1.0 - rng.random(spec.num_nodes)) ** (-1.0 / (spec.exponent - 1.0))
    cap = max(spec.max_degree / max(mean_deg, 1e-12), 1.0)
    for _ in range(8):  # expected degree is mean_deg * theta once theta has mean 1
        theta /= theta.mean()
        if theta.max() <= cap * 1.001:
            break
        np.minimum(theta, cap, out=theta)
    return theta


def _sorted_unique(a: np.ndarray) -> np.ndarray:
    """``np.unique`` for int64 keys by an in-place sort (numpy's hash-based unique is far slower)."""
    a.sort()
    keep = np.empty(a.size, dtype=bool)
    keep[:1] = True
    np.not_equal(a[1:], a[:-1], out=keep[1:])
    return a[keep]


def _sample_pool(
    draw: Callable[[int], tuple[np.ndarray, np.ndarray]], target: int, n: int, rng: np.random.Generator
) -> np.ndarray:
    """Exactly ``target`` distinct canonical keys ``min * n + max`` (fewer if the pool saturates)."""
    keys = np.empty(0, dtype=np.int64)
    k = int(target * 1.03) + 16
    for _ in range(_MAX_ROUNDS):
        if target == 0 or keys.size >= target:
            break
        a, b = draw(k)
        lo, hi = np.minimum(a, b), np.maximum(a, b)
        new = (lo * n + hi)[lo != hi]
        before = keys.size
        keys = _sorted_unique(np.concatenate([keys, new]))
        gain = (keys.size - before) / k
        if gain < 0.01:  # the pool is saturated; more rounds would not help
            break
        k = min(int((target - keys.size) / gain * 1.1) + 16, 4 * target)
    if keys.size > target:
        keys = np.delete(keys, rng.choice(keys.size, keys.size - target, replace=False))
    return keys


def _edges(spec: SyntheticSpec, sizes: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Canonical undirected keys over community-sorted vertex ids (communities are id ranges here).

    Endpoints are drawn by exact multinomial counts over the propensities (then shuffled where the
    pairing must be random), which is several times faster than inverse-CDF searchsorted."""
    n = spec.num_nodes
    theta = _propensities(spec, rng)
    p = theta / theta.sum()
    ends = np.cumsum(sizes)
    starts = ends - sizes
    ids = np.arange(n, dtype=np.int64)
    comm = np.repeat(np.arange(sizes.size), sizes)
    p_in = [theta[s:e] / theta[s:e].sum() for s, e in zip(starts, ends, strict=True)]

    def by_theta(k: int, shuffle: bool) -> np.ndarray:
        v = np.repeat(ids, rng.multinomial(k, p))
        if shuffle:
            rng.shuffle(v)
        return v

    def intra(k: int) -> tuple[np.ndarray, np.ndarray]:
        src = by_theta(k, shuffle=False)  # sorted, so sources of community c form one block
        per_comm = np.bincount(comm[src], minlength=sizes.size)
        dst = np.empty(k, dtype=np.int64)
        pos = 0
        for c, kc in enumerate(per_comm.tolist()):
            blk = dst[pos : pos + kc]
            blk[:] = np.repeat(ids[starts[c] : ends[c]], rng.multinomial(kc, p_in[c]))
            rng.shuffle(blk)
            pos += kc
        return src, dst

    def inter(k: int) -> tuple[np.ndarray, np.ndarray]:
        src, dst = by_theta(k, shuffle=False), by_theta(k, shuffle=True)
        keep = comm[src] != comm[dst]
        return src[keep], dst[keep]

    m = spec.num_undirected_edges
    m_in = m if sizes.size == 1 else int(round(spec.homophily * m))
    keys = np.concatenate([_sample_pool(intra, m_in, n, rng), _sample_pool(inter, m - m_in, n, rng)])
    if keys.size < 0.97 * m:
        raise DatasetError(
            f"synthetic spec is too dense: placed only {keys.size} of {m} distinct undirected edges; "
            "lower num_undirected_edges, homophily or max_degree, or use fewer classes"
        )
    return keys


def _features(spec: SyntheticSpec, y: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    centroids = (rng.standard_normal((spec.num_classes, spec.num_features)) * spec.feature_signal).astype(np.float32)
    x = rng.standard_normal((spec.num_nodes, spec.num_features), dtype=np.float32)
    for s in range(0, spec.num_nodes, _CHUNK):
        blk = x[s : s + _CHUNK]
        blk *= np.float32(spec.feature_noise)
        blk += centroids[y[s : s + _CHUNK]]
    return x


def _split(spec: SyntheticSpec, y: np.ndarray, rng: np.random.Generator) -> tuple[torch.Tensor, ...]:
    n = spec.num_nodes
    if spec.per_class is not None:
        seed = int(rng.integers(2**31))
        return stratified_split(torch.from_numpy(y), spec.num_classes, spec.per_class[0], spec.per_class[1], seed)
    order = rng.permutation(n)
    n_train = max(1, int(round(spec.split[0] * n)))
    n_val = min(int(round(spec.split[1] * n)), n - n_train)
    n_test = min(int(round(spec.split[2] * n)), n - n_train - n_val)
    masks = []
    for lo, hi in ((0, n_train), (n_train, n_train + n_val), (n_train + n_val, n_train + n_val + n_test)):
        m = np.zeros(n, dtype=bool)
        m[order[lo:hi]] = True
        masks.append(torch.from_numpy(m))
    return tuple(masks)


def generate(preset: str | SyntheticSpec, seed: int = 0) -> Graph:
    """Generate the named preset (or a custom spec) as a symmetric graph; same seed, same graph.
    Names ``<preset>-rel[R]`` give typed graphs (:func:`generate_typed`)."""
    if isinstance(preset, str) and preset not in PRESETS and _TYPED.match(preset):
        return generate_typed(preset, seed)
    if isinstance(preset, str) and preset not in PRESETS and _MULTILABEL.match(preset):
        return generate_multilabel(preset, seed)
    spec = _resolve(preset)
    rng_struct, rng_feat, rng_split = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(3))
    n = spec.num_nodes
    sizes = _community_sizes(spec, rng_struct)
    keys = _edges(spec, sizes, rng_struct)
    perm = rng_struct.permutation(n)  # community-sorted id -> public id, so classes are not id ranges
    y = np.empty(n, dtype=np.int64)
    y[perm] = np.repeat(np.arange(spec.num_classes, dtype=np.int64), sizes)
    a, b = perm[keys // n], perm[keys % n]
    del keys
    dst = np.concatenate([a, b])
    del a
    stored = dst * n
    stored[: b.size] += b
    stored[b.size :] += dst[: b.size]
    del b
    indptr = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.bincount(dst, minlength=n), out=indptr[1:])
    del dst
    stored.sort()
    stored %= n
    return Graph.from_csr(indptr, stored, n, **_node_data(spec, y, rng_feat, rng_split, f"synthetic:{spec.name}"))


def _node_data(
    spec: SyntheticSpec, y: np.ndarray, rng_feat: np.random.Generator, rng_split: np.random.Generator, name: str
) -> dict:
    train, val, test = _split(spec, y, rng_split)
    return {
        "x": torch.from_numpy(_features(spec, y, rng_feat)),
        "y": torch.from_numpy(y),
        "train_mask": train,
        "val_mask": val,
        "test_mask": test,
        "num_classes": spec.num_classes,
        "name": name,
    }


# ---------------------------------------------------------------------------------------- typed graphs
_TYPED = re.compile(r"^(?P<base>[a-z]+)-rel(?P<r>\d+)?$")
DEFAULT_RELATIONS = 8
RELATION_RANGE = (1, 64)
#: typed presets listed beside the plain ones; any ``<preset>-rel<R>`` with R in RELATION_RANGE works
TYPED_PRESETS = ("small-rel", "arxiv-rel", "arxiv-rel8", "arxiv-rel32")


@dataclass(frozen=True)
class RelationKinds:
    """How each relation of a typed synthetic graph connects classes: ``kind[r]`` is ``same``
    (class c to class c), ``mapped`` (class c to ``partner[r, c]``, a pairing of the classes, so
    the relation is symmetric) or ``noise`` (any vertex); ``purity[r]`` is the share of the
    relation's edges that follow its rule (the rest go to a random vertex); ``share[r]`` its share
    of the edges."""

    kind: tuple[str, ...]
    partner: np.ndarray
    purity: np.ndarray
    share: np.ndarray


def is_preset(name: str) -> bool:
    """Whether ``name`` is a plain preset, a typed ``<preset>-rel[R]`` or a ``<preset>-multilabel`` one."""
    m = _TYPED.match(name) or _MULTILABEL.match(name)
    return name in PRESETS or (m is not None and m["base"] in PRESETS)


def _typed_preset(name: str) -> tuple[SyntheticSpec, int]:
    m = _TYPED.match(name)
    if m is None or m["base"] not in PRESETS:
        raise DatasetError(f"unknown synthetic preset {name!r}; choose one of: {', '.join([*PRESETS, *TYPED_PRESETS])}")
    r = int(m["r"]) if m["r"] else DEFAULT_RELATIONS
    lo, hi = RELATION_RANGE
    if not lo <= r <= hi:
        raise DatasetError(
            f"synthetic preset {name!r} asks for {r} relations; use {lo} to {hi} (e.g. {m['base']}-rel32)"
        )
    return PRESETS[m["base"]], r


def relation_kinds(num_relations: int, num_classes: int, rng: np.random.Generator) -> RelationKinds:
    """Draw the rule of every relation: an eighth ``same``, a quarter ``noise`` (at least one of
    each when there are three or more relations), the rest ``mapped``, in a seeded order."""
    r = num_relations
    n_same = max(1, r // 8)
    n_noise = max(1, r // 4) if r >= 3 else 0
    kinds = ["same"] * n_same + ["noise"] * n_noise + ["mapped"] * (r - n_same - n_noise)
    kind = tuple(kinds[i] for i in rng.permutation(r))
    partner = np.tile(np.arange(num_classes, dtype=np.int64), (r, 1))
    for i in range(r):
        if kind[i] == "mapped":  # pair the classes up at random (an involution: symmetric edges)
            order = rng.permutation(num_classes)
            a, b = order[0 : num_classes - 1 : 2], order[1::2]
            partner[i, a], partner[i, b] = b, a
    purity = np.where(np.array(kind) == "noise", 0.0, rng.uniform(0.6, 0.95, r))
    share = rng.lognormal(0.0, 0.5, r)
    return RelationKinds(kind, partner, purity, share / share.sum())


def _typed_edges(
    spec: SyntheticSpec, sizes: np.ndarray, rules: RelationKinds, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """Distinct undirected ``(key, relation)`` pairs over community-sorted ids (key ``min * n + max``)."""
    n, r = spec.num_nodes, rules.share.size
    theta = _propensities(spec, rng)
    ends = np.cumsum(sizes)
    starts = ends - sizes
    comm = np.repeat(np.arange(sizes.size), sizes)
    ids = np.arange(n, dtype=np.int64)
    m = spec.num_undirected_edges
    k = int(m * 1.08) + 16
    rel = rng.choice(r, k, p=rules.share)
    src = np.repeat(ids, rng.multinomial(k, theta / theta.sum()))
    rng.shuffle(src)
    follows = rng.random(k) < rules.purity[rel]
    target = rules.partner[rel, comm[src]]
    dst = np.repeat(ids, rng.multinomial(k, theta / theta.sum()))  # the random targets
    rng.shuffle(dst)
    ruled = np.flatnonzero(follows)
    by_class = ruled[np.argsort(target[ruled], kind="stable")]
    counts = np.bincount(target[ruled], minlength=sizes.size)
    pos = 0
    for c, kc in enumerate(counts.tolist()):
        s, e = starts[c], ends[c]
        picks = np.repeat(ids[s:e], rng.multinomial(kc, theta[s:e] / theta[s:e].sum()))
        rng.shuffle(picks)
        dst[by_class[pos : pos + kc]] = picks
        pos += kc
    keep = src != dst
    lo, hi, rel = np.minimum(src, dst)[keep], np.maximum(src, dst)[keep], rel[keep]
    key = _sorted_unique((lo * n + hi) * r + rel)
    if key.size > m:
        key = np.sort(rng.choice(key, m, replace=False))
    return key // r, key % r


def generate_typed(preset: str, seed: int = 0) -> Graph:
    """The typed preset ``<base>-rel[R]``: the plain preset's vertices, classes, features and split,
    with edges drawn per relation by :func:`relation_kinds`' rules (symmetric, each undirected edge
    stored both ways with one relation). Same seed, same graph."""
    spec, r = _typed_preset(preset)
    spec = _resolve(spec)
    rng_struct, rng_feat, rng_split, rng_rel = (np.random.default_rng(s) for s in np.random.SeedSequence(seed).spawn(4))
    n = spec.num_nodes
    sizes = _community_sizes(spec, rng_struct)
    rules = relation_kinds(r, spec.num_classes, rng_rel)
    keys, rel = _typed_edges(spec, sizes, rules, rng_struct)
    perm = rng_struct.permutation(n)
    y = np.empty(n, dtype=np.int64)
    y[perm] = np.repeat(np.arange(spec.num_classes, dtype=np.int64), sizes)
    a, b = perm[keys // n], perm[keys % n]
    return Graph.from_edge_index(
        torch.from_numpy(np.stack([np.concatenate([a, b]), np.concatenate([b, a])])),
        n,
        edge_type=torch.from_numpy(np.concatenate([rel, rel])),
        num_relations=r,
        **_node_data(spec, y, rng_feat, rng_split, f"synthetic:{preset}"),
    )


# ---------------------------------------------------------------------------------- multi-label graphs
_MULTILABEL = re.compile(r"^(?P<base>[a-z]+)-multilabel$")
#: multi-label presets listed beside the plain ones; any ``<preset>-multilabel`` works
MULTILABEL_PRESETS = ("tiny-multilabel", "small-multilabel")
#: tasks of a multi-label preset per community of its base preset
TASKS_PER_CLASS = 2
#: the share of vertices positive in each task
POSITIVE_RATE = 0.25


def generate_multilabel(preset: str, seed: int = 0) -> Graph:
    """The multi-label preset ``<base>-multilabel``: the plain preset's vertices, edges, features and
    split, with ``TASKS_PER_CLASS`` binary tasks per community instead of the class. A vertex is
    positive in task t when its community's seeded affinity to t plus Gaussian noise is among the
    top :data:`POSITIVE_RATE` of the task's scores, so a model that recognises communities (from
    features and neighbours) predicts the tasks well, never perfectly. Same seed, same graph."""
    m = _MULTILABEL.match(preset)
    if m is None or m["base"] not in PRESETS:
        raise DatasetError(
            f"unknown synthetic preset {preset!r}; choose one of: {', '.join([*PRESETS, *MULTILABEL_PRESETS])}"
        )
    base = generate(m["base"], seed)
    assert base.y is not None and base.num_classes is not None  # every plain preset has its classes
    rng = np.random.default_rng(np.random.SeedSequence(seed).spawn(4)[3])  # the plain preset uses the first 3
    communities, tasks = base.num_classes, TASKS_PER_CLASS * base.num_classes
    affinity = rng.standard_normal((communities, tasks)) * 1.5
    score = affinity[base.y.numpy()] + rng.standard_normal((base.num_nodes, tasks))
    y = (score > np.quantile(score, 1.0 - POSITIVE_RATE, axis=0)).astype(np.int64)
    return base.replace(y=torch.from_numpy(y), num_classes=tasks, name=f"synthetic:{preset}")
