"""Layers and models written against ``tessera.sparse``."""

from tessera.nn.conv import GATConv, GCNConv, GINConv, SAGEConv
from tessera.nn.models import GNN, MODELS, build_model

__all__ = ["GATConv", "GCNConv", "GINConv", "SAGEConv", "GNN", "MODELS", "build_model"]
