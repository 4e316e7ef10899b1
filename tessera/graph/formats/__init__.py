"""Dataset file formats: Planetoid, gnn-benchmark .npz, OGB, text edge lists, PyG conversion."""

from tessera.graph.formats._limits import format_bytes, memory_limit
from tessera.graph.formats.edgelist import load_edgelist
from tessera.graph.formats.npz import load_npz
from tessera.graph.formats.ogb import is_ogb_dir, load_ogb
from tessera.graph.formats.planetoid import load_planetoid
from tessera.graph.formats.pyg import from_pyg, to_pyg
from tessera.graph.formats.safe_pickle import RestrictedUnpickler, safe_load

__all__ = [
    "RestrictedUnpickler",
    "format_bytes",
    "from_pyg",
    "is_ogb_dir",
    "load_edgelist",
    "load_npz",
    "load_ogb",
    "load_planetoid",
    "memory_limit",
    "safe_load",
    "to_pyg",
]
