"""Aggregation backends; importing this package registers them."""

from tessera.ops.backends import csr, dense_block, reference  # noqa: F401
