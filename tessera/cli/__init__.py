"""The ``tessera`` command and its subcommands."""

from tessera.cli.main import main

__all__ = ["main"]
