"""Minimum vertex cover of a bipartite graph (SuperGCN §5.3): Hopcroft–Karp matching + König.

SuperGCN's Alg. 1 solves one cover per connected component of the remote graph. A minimum
cover of a disjoint union is the union of minimum covers of its components, so running König
on the whole bipartite graph at once gives the same (minimum) size; we do that.
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import breadth_first_order, maximum_bipartite_matching

from tessera.graph.csr import rows_of


def min_vertex_cover(src: np.ndarray, dst: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Minimum vertex cover of the bipartite graph with edges ``src[e] -> dst[e]`` (sides U, V):
    returns ``(cover_src_ids, cover_dst_ids)``, each sorted and unique. Duplicate edges are fine.

    The result depends only on the set of edges (not their order), so two processes holding the
    same edges in different orders agree on the cover.
    """
    src = np.asarray(src).ravel()
    dst = np.asarray(dst).ravel()
    if src.shape != dst.shape:
        raise ValueError(f"src and dst must have the same length, got {src.size} and {dst.size}")
    if src.size == 0:
        return src[:0].copy(), dst[:0].copy()
    u_ids, u = np.unique(src, return_inverse=True)
    v_ids, v = np.unique(dst, return_inverse=True)
    nu, nv = u_ids.size, v_ids.size
    # Canonical CSR (sorted, duplicates summed): the matching depends only on the edge set.
    b = sp.csr_matrix((np.ones(src.size, dtype=np.int8), (u, v)), shape=(nu, nv))
    b.sum_duplicates()
    mate_of_u = maximum_bipartite_matching(b, perm_type="column")  # column matched to each row
    # König: Z = vertices reachable from unmatched U by alternating paths (U -> V along any edge,
    # V -> its mate in U). Cover = (U \ Z) | (V & Z). Nodes: U = 0..nu-1, V = nu.., root = nu+nv.
    matched_u = np.flatnonzero(mate_of_u >= 0)
    free_u = np.flatnonzero(mate_of_u < 0)
    root = nu + nv
    rows = np.concatenate([rows_of(b.indptr), nu + mate_of_u[matched_u], np.full(free_u.size, root)])
    cols = np.concatenate([nu + b.indices, matched_u, free_u])
    g = sp.csr_matrix((np.ones(rows.size, dtype=np.int8), (rows, cols)), shape=(root + 1, root + 1))
    reached = np.zeros(root + 1, dtype=bool)
    reached[breadth_first_order(g, root, directed=True, return_predecessors=False)] = True
    return u_ids[~reached[:nu]], v_ids[reached[nu:root]]
