"""Graph structure, formats, synthetic generators."""

from tessera.graph.graph import Graph, stratified_split

__all__ = ["Graph", "stratified_split"]
