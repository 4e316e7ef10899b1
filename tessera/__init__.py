"""tessera: fast full-graph GNN training."""

from tessera import backends as _backends  # noqa: F401  (registers the backends and the single-process operand)
from tessera.cli.main import package_version
from tessera.errors import DatasetError, GraphError, TesseraError
from tessera.graph import Graph
from tessera.train.api import Run, fit, load_run
from tessera.train.evaluate import Evaluator

__version__ = package_version()
__all__ = ["Graph", "GraphError", "DatasetError", "TesseraError", "Run", "fit", "load_run", "Evaluator", "__version__"]
