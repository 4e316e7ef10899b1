"""Vertex partitions: the partition vector and its cache, statistics, part files, METIS, and the
per-rank halo plans (with the vertex covers behind them) that partition parallelism executes."""

from tessera.graph.partition.assign import (
    METHODS,
    format_partition_report,
    load_meta,
    load_part,
    partition,
    partition_stats,
    write_parts,
)

__all__ = [
    "METHODS",
    "format_partition_report",
    "load_meta",
    "load_part",
    "partition",
    "partition_stats",
    "write_parts",
]
