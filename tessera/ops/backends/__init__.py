"""Aggregation backends; importing this package registers them."""

from tessera.ops.backends import csr, reference  # noqa: F401
