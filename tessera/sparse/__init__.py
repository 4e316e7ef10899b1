"""The graph primitives layers are written in, all over an :class:`Operand`: aggregate (and its
masked S-SpMM forms), edge scores, edge softmax, fused GAT attention and GAT's whole message
passing (attend), and LSTM neighbourhood aggregation. The dense products and dropout live in
:mod:`tessera.dense`, relational sums in :mod:`tessera.relational`."""

from tessera.sparse.aggregate import aggregate, inv_in_degree
from tessera.sparse.attend import attend
from tessera.sparse.attention import edge_keys, edge_score, edge_softmax
from tessera.sparse.attention_kernels import gat_attention
from tessera.sparse.lstm import SequencePlan, lstm_aggregate, sequence_plan
from tessera.sparse.masked import dropout_aggregate, masked_aggregate, masked_spmm_t
from tessera.sparse.operand import GraphOperand, Operand, as_operand
from tessera.sparse.spec import LayerSpec

__all__ = [
    "GraphOperand",
    "LayerSpec",
    "Operand",
    "SequencePlan",
    "aggregate",
    "as_operand",
    "attend",
    "dropout_aggregate",
    "edge_keys",
    "edge_score",
    "edge_softmax",
    "gat_attention",
    "inv_in_degree",
    "lstm_aggregate",
    "masked_aggregate",
    "masked_spmm_t",
    "sequence_plan",
]
