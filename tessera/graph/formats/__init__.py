"""Dataset file formats: Planetoid, gnn-benchmark .npz, OGB, text edge lists (plain and typed),
N-Triples, PyG conversion and torch.save'd PyG Data files."""

from tessera.graph.formats._limits import format_bytes, memory_limit
from tessera.graph.formats.edgelist import load_edgelist
from tessera.graph.formats.npz import load_npz
from tessera.graph.formats.ntriples import is_ntriples, load_ntriples
from tessera.graph.formats.ogb import is_ogb_dir, load_ogb
from tessera.graph.formats.planetoid import load_planetoid
from tessera.graph.formats.pyg import from_pyg, is_torch_file, load_pt, read_torch_file, to_pyg
from tessera.graph.formats.safe_pickle import RestrictedUnpickler, safe_load
from tessera.graph.formats.typed import is_typed_edgelist, load_typed_edgelist, write_typed_edgelist

__all__ = [
    "RestrictedUnpickler",
    "format_bytes",
    "from_pyg",
    "is_ntriples",
    "is_ogb_dir",
    "is_torch_file",
    "is_typed_edgelist",
    "load_edgelist",
    "load_npz",
    "load_ntriples",
    "load_ogb",
    "load_planetoid",
    "load_pt",
    "load_typed_edgelist",
    "memory_limit",
    "read_torch_file",
    "safe_load",
    "to_pyg",
    "write_typed_edgelist",
]
