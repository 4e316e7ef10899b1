"""Exception types: every user-facing problem is a ``TesseraError`` with a message that names it."""


class TesseraError(Exception):
    """Base class for errors caused by input the user can fix (the CLI prints one line, exits 2)."""


class GraphError(TesseraError, ValueError):
    """A graph's structure, features, labels or masks are inconsistent."""


class DatasetError(TesseraError):
    """A dataset spec, file or directory could not be read."""


class UnsafePickleError(DatasetError):
    """A pickle tried to load a type outside the allow-list."""


class ConfigError(TesseraError):
    """A command-line flag or config-file value is invalid."""


class DistributedError(TesseraError):
    """A distributed job lost a rank or timed out in a collective (the CLI exits 3, not 2: the
    input may be fine). Bad partition files are a :class:`DatasetError`."""
