"""The ``tessera`` command and its subcommands."""

from tessera.cli.main import main, program

__all__ = ["main", "program"]
