"""Communication volumes and projected times for P workers, from the same halo plans the
partition strategy runs (:mod:`tessera.graph.partition.halo`)."""

from tessera.graph.partition.halo import pair_rows
from tessera.planner.model import CommModel, project
from tessera.planner.volume import pair_detail, runtime_bytes, simulate_volumes

__all__ = ["CommModel", "pair_detail", "pair_rows", "project", "runtime_bytes", "simulate_volumes"]
