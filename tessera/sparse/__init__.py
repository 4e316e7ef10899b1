"""The primitives layers are written in: aggregate (and its masked S-SpMM forms), edge scores,
edge softmax, fused GAT attention and GAT's whole message passing (attend), LSTM neighbourhood
aggregation, dropout (alone or fused with an activation) and linear (alone or fused with the
activation and dropout that follow it), all over an :class:`Operand`."""

from tessera.sparse.aggregate import aggregate, inv_in_degree
from tessera.sparse.attend import attend
from tessera.sparse.attention import edge_keys, edge_score, edge_softmax
from tessera.sparse.attention_kernels import gat_attention
from tessera.sparse.dropout import act_dropout, dropout
from tessera.sparse.dropout_linear import dropout_linear
from tessera.sparse.linear import cast_like, linear, linear_add_, linear_split
from tessera.sparse.linear_act import Epilogue, linear_act
from tessera.sparse.lstm import SequencePlan, lstm_aggregate, sequence_plan
from tessera.sparse.masked import dropout_aggregate, masked_aggregate, masked_spmm_t
from tessera.sparse.operand import GraphOperand, Operand, as_operand
from tessera.sparse.sparse_features import sparse_rows
from tessera.sparse.spec import LayerSpec

__all__ = [
    "Epilogue",
    "GraphOperand",
    "LayerSpec",
    "Operand",
    "SequencePlan",
    "act_dropout",
    "aggregate",
    "as_operand",
    "attend",
    "dropout",
    "dropout_aggregate",
    "dropout_linear",
    "edge_keys",
    "edge_score",
    "edge_softmax",
    "gat_attention",
    "inv_in_degree",
    "linear",
    "linear_act",
    "linear_add_",
    "linear_split",
    "cast_like",
    "lstm_aggregate",
    "masked_aggregate",
    "masked_spmm_t",
    "sparse_rows",
    "sequence_plan",
]
