"""Graph convolution layers with PyG-identical semantics."""

from tessera.nn.conv.gat import GATConv
from tessera.nn.conv.gcn import GCNConv
from tessera.nn.conv.gin import GINConv
from tessera.nn.conv.rgcn import RGCNConv
from tessera.nn.conv.sage import SAGEConv
from tessera.nn.conv.sage_lstm import SAGELSTMConv

__all__ = ["GATConv", "GCNConv", "GINConv", "RGCNConv", "SAGEConv", "SAGELSTMConv"]
