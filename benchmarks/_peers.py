"""One model per framework, same architecture everywhere, built from the ``_graphdata`` arrays.

Architecture (all frameworks): ``layers`` convolutions, dropout before each, ReLU between them
(ELU for GAT); GIN's MLP is Linear-ReLU-Linear of width ``hidden``; GAT's hidden width is
``heads`` heads of ``hidden // heads`` concatenated, its output layer one head with
``concat=False``, attention dropout = ``dropout``. GCN adds self loops and normalises
symmetrically; SAGE is mean aggregation with a root weight; GIN is sum with eps = 0.

Frameworks:

* ``tessera`` -- ``tessera.nn.build_model`` on a ``tessera.Graph`` (destination-major CSR).
* ``pyg-edge_index`` -- PyG layers on the ``(2, E)`` edge index (PyG's default path).
* ``pyg-csr`` -- PyG layers on a ``torch.sparse_csr`` ``adj_t`` (row = destination), PyG's
  fastest sparse path without ``torch_sparse`` / ``pyg-lib`` (no wheels for torch 2.13).
  ``GCNConv(cached=False)`` re-normalises every epoch, as on the default path. ``GATConv``
  accepts the sparse ``adj_t`` but removes/re-adds self loops and gathers its messages through
  an edge index internally, so for GAT this column is edge-index messaging plus conversions.
* ``dgl`` -- DGL layers (``GraphConv(norm='both')`` on the graph with self loops added,
  ``SAGEConv('mean')``, ``GINConv(mlp, 'sum')``, ``GATConv`` on the graph with self loops).

Imports are local to each builder: a child only imports the framework it runs.
"""

from __future__ import annotations

import hashlib
import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from _graphdata import dst_of_edges
from torch import nn

FRAMEWORKS = ("tessera", "pyg-edge_index", "pyg-csr", "dgl")
MODELS = ("gcn", "sage", "gin", "gat")

# (module, forward(module, x, train_idx) -> (logits, rows of the logits the loss reads), info)
Forward = Callable[[nn.Module, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
Built = tuple[nn.Module, Forward, dict[str, Any]]


def every_row(forward: Callable[[nn.Module, torch.Tensor], torch.Tensor]) -> Forward:
    """A framework's forward over every vertex, whose loss then picks the training rows."""
    return lambda mod, x, idx: (forward(mod, x), idx)


class Stack(nn.Module):
    """Dropout before each conv, activation between convs; ``apply(conv, x)`` runs one conv."""

    def __init__(
        self,
        convs: list[nn.Module],
        dropout: float,
        activation: str,
        apply: Callable[[nn.Module, torch.Tensor], torch.Tensor],
    ) -> None:
        super().__init__()
        self.convs = nn.ModuleList(convs)
        self.dropout = dropout
        self.act = F.elu if activation == "elu" else F.relu
        self._apply_conv = apply

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Logits for every vertex."""
        for i, conv in enumerate(self.convs):
            x = F.dropout(x, self.dropout, self.training)
            x = self._apply_conv(conv, x)
            if i < len(self.convs) - 1:
                x = self.act(x)
        return x


def _dims(in_dim: int, hidden: int, out_dim: int, layers: int) -> list[tuple[int, int, bool]]:
    dims = [in_dim] + [hidden] * (layers - 1) + [out_dim]
    return [(a, b, i == layers - 1) for i, (a, b) in enumerate(zip(dims[:-1], dims[1:]))]


def _mlp(a: int, b: int, hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(a, hidden), nn.ReLU(), nn.Linear(hidden, b))


# ---------------------------------------------------------------------------------- tessera
def build_tessera(model: str, arrays: dict[str, np.ndarray], meta: dict[str, Any], cfg: dict[str, Any]) -> Built:
    """tessera's own model on a ``tessera.Graph`` built from the CSR arrays, renumbered by
    ``cfg["reorder"]`` as ``tessera train --reorder`` does (``auto``: the measured locality order,
    if any); a renumbering permutes ``arrays``' per-vertex rows (x, y, masks) in place of the
    originals, so the caller trains on the same vertices in the new numbering."""
    from tessera.backends import available_backends
    from tessera.graph import Graph
    from tessera.nn import build_model

    g = Graph.from_csr(
        torch.from_numpy(arrays["indptr"]),
        torch.from_numpy(arrays["indices"]),
        meta["num_nodes"],
        num_classes=meta["num_classes"],
        name=meta["name"],
    )
    m = build_model(
        model,
        meta["num_features"],
        cfg["hidden"],
        meta["num_classes"],
        cfg["layers"],
        cfg["dropout"],
        heads=cfg["heads"],
        backend=cfg["backend"],
    )
    info = {
        "backend_requested": cfg["backend"],
        "backends_available": available_backends(),
        "index_dtype": str(g.indices.dtype),
        "vertex_order": "none",
    }
    setting = cfg.get("reorder", "none")
    if setting != "none":
        from tessera.backends.ordering import resolve
        from tessera.graph.order import VertexOrder

        widths = [spec.aggregate_width for spec in m.describe()]
        method = resolve(g, setting, widths, cfg["backend"])
        if method != "none":
            order = VertexOrder.of(g, method, max(widths))
            g = order.permute(g, features=False)
            perm = order.perm.numpy()
            for key in ("x", "y", "train_mask", "val_mask", "test_mask"):
                if key in arrays:
                    arrays[key] = arrays[key][perm]
            info["vertex_order"] = method
    # as ``tessera train`` steps: only the training vertices' logits (a tree from before the model
    # took ``targets`` computes every vertex's, and its loss picks the training rows)
    targeted = "targets" in inspect.signature(type(m).forward).parameters
    info["logits"] = "training rows" if targeted else "every row"
    if cfg.get("precision", "fp32") == "fp32":
        if targeted:
            return m, lambda mod, x, idx: (mod(x, g, targets=idx), None), info
        return m, every_row(lambda mod, x: mod(x, g)), info
    # ``tessera train --precision bf16``: the features stored in bfloat16 once (the float32
    # array the child loaded stays alive beside them), float32 weights
    info["precision"] = cfg["precision"]
    stored: list[torch.Tensor] = []

    def forward(mod: nn.Module, x: torch.Tensor, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not stored or stored[0] is not x:
            stored[:] = [x, x.to(torch.bfloat16)]
        if targeted:
            return mod(stored[1], g, targets=idx), None
        return mod(stored[1], g), idx

    return m, forward, info


# ---------------------------------------------------------------------------------- PyG
def build_pyg(
    model: str, arrays: dict[str, np.ndarray], meta: dict[str, Any], cfg: dict[str, Any], layout: str
) -> Built:
    """PyG layers on the edge index (``layout='edge_index'``) or a torch sparse CSR ``adj_t``."""
    import torch_geometric.nn as pyg
    from torch_geometric.utils import to_torch_csr_tensor

    n = meta["num_nodes"]
    src = torch.from_numpy(arrays["indices"])
    dst = torch.from_numpy(dst_of_edges(arrays["indptr"]))
    info: dict[str, Any] = {}
    if layout == "edge_index":
        adj: torch.Tensor = torch.stack([src, dst])
    else:
        # adj_t[i, j] != 0 for an edge j -> i: PyG's CSR of the flipped edge index.
        adj = to_torch_csr_tensor(torch.stack([dst, src]), size=(n, n))
        info["adj_layout"] = str(adj.layout)
        if model == "gat":
            info["note"] = "GATConv takes the sparse adj_t but messages via an internal edge index"
    convs: list[nn.Module] = []
    for a, b, last in _dims(meta["num_features"], cfg["hidden"], meta["num_classes"], cfg["layers"]):
        if model == "gcn":
            convs.append(pyg.GCNConv(a, b, cached=False))
        elif model == "sage":
            convs.append(pyg.SAGEConv(a, b, aggr="mean"))
        elif model == "gin":
            convs.append(pyg.GINConv(_mlp(a, b, cfg["hidden"]), train_eps=False))
        else:
            heads = 1 if last else cfg["heads"]
            out = b if last else cfg["hidden"] // cfg["heads"]
            convs.append(pyg.GATConv(a, out, heads=heads, concat=not last, dropout=cfg["dropout"]))
    net = Stack(convs, cfg["dropout"], "elu" if model == "gat" else "relu", lambda conv, x: conv(x, adj))
    return net, every_row(lambda mod, x: mod(x)), info


# ---------------------------------------------------------------------------------- DGL
class _DglGAT(nn.Module):
    """DGL's GATConv returns ``(N, H, F)``: concatenate the heads or average them (PyG ``concat``)."""

    def __init__(self, conv: nn.Module, concat: bool) -> None:
        super().__init__()
        self.conv, self.concat = conv, concat

    def forward(self, graph: Any, x: torch.Tensor) -> torch.Tensor:
        out = self.conv(graph, x)
        return out.flatten(1) if self.concat else out.mean(1)


def build_dgl(model: str, arrays: dict[str, np.ndarray], meta: dict[str, Any], cfg: dict[str, Any]) -> Built:
    """DGL layers; GCN and GAT run on the graph with self loops added (as PyG's layers do)."""
    import dgl
    import dgl.nn as dglnn

    n = meta["num_nodes"]
    src = torch.from_numpy(arrays["indices"])
    dst = torch.from_numpy(dst_of_edges(arrays["indptr"]))
    g = dgl.graph((src, dst), num_nodes=n)
    if model in ("gcn", "gat"):
        g = dgl.add_self_loop(dgl.remove_self_loop(g))
    g.create_formats_()
    convs: list[nn.Module] = []
    for a, b, last in _dims(meta["num_features"], cfg["hidden"], meta["num_classes"], cfg["layers"]):
        if model == "gcn":
            convs.append(dglnn.GraphConv(a, b, norm="both", weight=True, bias=True))
        elif model == "sage":
            convs.append(dglnn.SAGEConv(a, b, "mean"))
        elif model == "gin":
            convs.append(dglnn.GINConv(_mlp(a, b, cfg["hidden"]), "sum", init_eps=0.0, learn_eps=False))
        else:
            heads = 1 if last else cfg["heads"]
            out = b if last else cfg["hidden"] // cfg["heads"]
            conv = dglnn.GATConv(a, out, heads, feat_drop=0.0, attn_drop=cfg["dropout"], negative_slope=0.2)
            convs.append(_DglGAT(conv, concat=not last))
    net = Stack(convs, cfg["dropout"], "elu" if model == "gat" else "relu", lambda conv, x: conv(g, x))
    info = {"dgl_edges": int(g.num_edges()), "dgl_threads": _dgl_threads()}
    return net, every_row(lambda mod, x: mod(x)), info


def _dgl_threads() -> int | None:
    try:
        from dgl.utils.internal import get_num_threads

        return int(get_num_threads())
    except Exception:  # older/newer DGL without the helper
        return None


def build(
    framework: str, model: str, arrays: dict[str, np.ndarray], meta: dict[str, Any], cfg: dict[str, Any]
) -> Built:
    """``(module, forward(module, x, train_idx) -> (logits, rows), info)`` for one framework and model."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose from {', '.join(MODELS)}")
    if framework == "tessera":
        return build_tessera(model, arrays, meta, cfg)
    if framework == "pyg-edge_index":
        return build_pyg(model, arrays, meta, cfg, "edge_index")
    if framework == "pyg-csr":
        return build_pyg(model, arrays, meta, cfg, "csr")
    if framework == "dgl":
        return build_dgl(model, arrays, meta, cfg)
    raise ValueError(f"unknown framework {framework!r}; choose from {', '.join(FRAMEWORKS)}")


def _source_hash(pkg: Path) -> str:
    """SHA-1 (12 hex digits) over the package's ``.py`` files: which tessera code a child ran."""
    h = hashlib.sha1()
    for f in sorted(pkg.rglob("*.py")):
        h.update(str(f.relative_to(pkg)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:12]


def versions(framework: str) -> dict[str, str]:
    """Library versions relevant to ``framework`` (in the running interpreter)."""
    out = {"torch": torch.__version__, "numpy": np.__version__}
    if framework == "tessera":
        import numba

        import tessera

        out["numba"] = numba.__version__
        out["tessera_src_sha1"] = _source_hash(Path(tessera.__file__).parent)
    elif framework.startswith("pyg"):
        import torch_geometric

        out["torch_geometric"] = torch_geometric.__version__
        for extra in ("torch_sparse", "pyg_lib", "torch_scatter"):
            try:
                out[extra] = __import__(extra).__version__
            except Exception:
                out[extra] = "not installed"
    elif framework == "dgl":
        import dgl

        out["dgl"] = dgl.__version__
    return out


def train_loss(framework: str):
    """``loss(logits, rows, target)``: the mean cross entropy of ``logits[rows]`` (``rows`` None:
    every row) against the training labels, written as that framework's users write it:
    ``F.cross_entropy(logits[idx], y[idx])`` for PyG and DGL, ``tessera.nn.loss.cross_entropy_rows``
    (what ``tessera train`` runs) for tessera."""
    import torch.nn.functional as F

    if framework == "tessera" or framework.startswith("tessera@"):
        try:
            from tessera.nn.loss import cross_entropy_rows
        except ImportError:  # a tessera tree from before it existed
            cross_entropy_rows = None
        if cross_entropy_rows is not None:
            return lambda logits, rows, target: cross_entropy_rows(logits, rows, target) / max(target.numel(), 1)
    return lambda logits, rows, target: F.cross_entropy(logits if rows is None else logits[rows], target)
