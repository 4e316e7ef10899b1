"""The dense side of a layer: linear maps (alone, split, accumulated, fused with the activation
and dropout after them or the dropout before them), dropout keyed by global ids, products over a
feature matrix's non-zeros, and the library path (MKL or oneDNN, row chunks) that runs them."""

from tessera.dense.act_dropout import act_dropout
from tessera.dense.dropout_linear import dropout_linear
from tessera.dense.linear import cast_like, linear, linear_add_, linear_split
from tessera.dense.linear_act import Epilogue, linear_act
from tessera.dense.sparse_features import feature_nonzeros
from tessera.kernels.dropout import dropout, dropout_mask, dropout_with_mask

__all__ = [
    "Epilogue",
    "act_dropout",
    "cast_like",
    "dropout",
    "dropout_linear",
    "dropout_mask",
    "dropout_with_mask",
    "feature_nonzeros",
    "linear",
    "linear_act",
    "linear_add_",
    "linear_split",
]
