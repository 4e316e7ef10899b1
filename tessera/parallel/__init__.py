"""Parallel strategies, one file each, registered here (one line per strategy)."""

from tessera.comm.group import Comm
from tessera.errors import ConfigError
from tessera.parallel.base import Shard, Strategy, StrategyOptions
from tessera.parallel.hybrid import HybridStrategy
from tessera.parallel.partition import PartitionStrategy
from tessera.parallel.single import SingleStrategy
from tessera.parallel.tensor import TensorStrategy

STRATEGIES: dict[str, type[Strategy]] = {}


def register_strategy(cls: type[Strategy]) -> type[Strategy]:
    """Make ``cls`` available under ``cls.name``."""
    STRATEGIES[cls.name] = cls
    return cls


def make_strategy(name: str, comm: Comm, options: StrategyOptions) -> Strategy:
    """The registered strategy ``name`` for this process group."""
    try:
        return STRATEGIES[name](comm, options)
    except KeyError:
        raise ConfigError(f"unknown strategy {name!r}; choose from {', '.join(sorted(STRATEGIES))}") from None


register_strategy(SingleStrategy)
register_strategy(PartitionStrategy)
register_strategy(TensorStrategy)
register_strategy(HybridStrategy)

__all__ = ["STRATEGIES", "Shard", "Strategy", "StrategyOptions", "make_strategy", "register_strategy"]
