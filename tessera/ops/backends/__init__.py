"""Aggregation backends; importing this package registers them."""

from tessera.ops.backends import reference  # noqa: F401
