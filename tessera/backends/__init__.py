"""Aggregation backends: one file each, registered here (one line per backend), and the
single-process operand that runs on them."""

import importlib.util

from tessera.backends.base import Backend, available_backends, get_backend, register_backend
from tessera.backends.cpu_csr import CSRBackend
from tessera.backends.cpu_dense_block import DenseBlockBackend
from tessera.backends.local import LocalOperand, local_operand
from tessera.backends.reference import ReferenceBackend
from tessera.backends.torch_native import TorchBackend
from tessera.backends.triton_csr import TritonBackend
from tessera.sparse.operand import register_local

register_backend(ReferenceBackend())
register_backend(CSRBackend())
register_backend(DenseBlockBackend(remainder=get_backend("csr"), small=get_backend("reference")))
register_backend(TorchBackend())
if importlib.util.find_spec("triton") is not None:  # its kernels load on the first product
    register_backend(TritonBackend())
register_local(local_operand)

__all__ = ["Backend", "LocalOperand", "available_backends", "get_backend", "local_operand", "register_backend"]
