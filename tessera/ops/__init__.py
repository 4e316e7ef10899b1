"""The primitives layers are written in: aggregate (and its masked S-SpMM forms), edge scores,
edge softmax, dropout."""

from tessera.ops import backends as _backends  # noqa: F401  (registers the backends)
from tessera.ops.aggregate import aggregate, inv_in_degree
from tessera.ops.attention import edge_score, edge_softmax
from tessera.ops.attention_kernels import gat_attention
from tessera.ops.dense import linear
from tessera.ops.dropout import dropout
from tessera.ops.masked import dropout_aggregate, masked_aggregate, masked_spmm_t
from tessera.ops.registry import available_backends, get_backend, register_backend
from tessera.ops.threads import set_num_threads

__all__ = [
    "aggregate",
    "available_backends",
    "dropout",
    "dropout_aggregate",
    "edge_score",
    "edge_softmax",
    "gat_attention",
    "get_backend",
    "inv_in_degree",
    "linear",
    "masked_aggregate",
    "masked_spmm_t",
    "register_backend",
    "set_num_threads",
]
