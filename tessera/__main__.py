"""``python -m tessera``."""

from tessera.cli.main import program

program()
