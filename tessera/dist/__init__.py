"""Partition-parallel training: per-rank plans (``tessera.dist.plan``), vertex covers
(``tessera.dist.cover``) and the runtime that executes them."""
