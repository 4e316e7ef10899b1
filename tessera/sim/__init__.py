"""Communication volumes and projected times for P workers, from the same plans ``dist/`` runs."""

from tessera.sim.model import CommModel, project
from tessera.sim.volume import pair_detail, pair_rows, runtime_bytes, simulate_volumes

__all__ = ["CommModel", "pair_detail", "pair_rows", "project", "runtime_bytes", "simulate_volumes"]
