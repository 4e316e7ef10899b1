"""Partition-parallel training: per-rank plans (``tessera.graph.partition.halo``), vertex covers
(``tessera.graph.partition.cover``) and the runtime that executes them."""
