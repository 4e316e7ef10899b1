"""Layers and models written against ``tessera.sparse``."""

from tessera.nn.conv import GATConv, GCNConv, GINConv, RGCNConv, SAGEConv, SAGELSTMConv
from tessera.nn.models import GNN, MODELS, build_model

__all__ = ["GATConv", "GCNConv", "GINConv", "RGCNConv", "SAGEConv", "SAGELSTMConv", "GNN", "MODELS", "build_model"]
