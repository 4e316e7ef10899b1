"""A run's ``--aggregate-on`` setting made into its model: the device alone, or MixGCN's mixture of
accelerators (aggregation on the host's CPU, update on the device), chosen once at set-up."""

from __future__ import annotations

import logging

import torch

from tessera.nn.mixture import MixtureGNN
from tessera.nn.models import GNN
from tessera.planner.accelerators import Choice, LayerShape, choose, measure_rates
from tessera.sparse import Operand, as_operand
from tessera.sparse.mixture import mixture_plan
from tessera.train.config import TrainConfig

log = logging.getLogger("tessera")


def _shapes(model: GNN, operand: Operand) -> list[LayerShape]:
    edges = int(as_operand(operand).in_degree().sum())
    rows = as_operand(operand).num_rows
    return [
        LayerShape(edges + rows, rows, s.in_width, s.in_width, s.out_width) for s in model.describe()
    ]  # the self loops GCN and GIN's root term add, counted as edges


def choose_side(cfg: TrainConfig, model: GNN, operand: Operand, device: torch.device) -> Choice | None:
    """``auto``'s choice from rates measured here (None where the device is the CPU: there is no
    second kind of processor to mix with, and the run aggregates on its device)."""
    if device.type == "cpu":
        return None
    width = max(s.in_width for s in model.describe())
    host = as_operand(operand, cfg.backend)  # the backend the layers aggregate with on the host
    rates = measure_rates(host, as_operand(operand, "auto"), width, device)
    return choose(_shapes(model, operand), rates, cfg.mixture_stages)


def placed_model(cfg: TrainConfig, model: GNN, operand: Operand, device: torch.device) -> GNN | MixtureGNN:
    """``model`` as the run executes it: itself (aggregating on ``device``), or wrapped to
    aggregate on the host with updates on ``device`` (``--aggregate-on cpu``, or ``auto`` where
    the model says it is faster); logged when ``auto`` decides."""
    side = cfg.aggregate_on
    if side == "auto":
        choice = choose_side(cfg, model, operand, device)
        side = "device" if choice is None else choice.aggregate_on
        if choice is not None:
            log.info(
                "aggregating on the %s: modelled step %.4f s on the device alone, %.4f s with the CPU's "
                "aggregation (%d stages)",
                "CPU" if side == "cpu" else "device", choice.device_s, choice.mixture_s, choice.stages,
            )  # fmt: skip
    if side == "device":
        return model
    rows = as_operand(operand).num_rows
    return MixtureGNN(model, mixture_plan(rows, cfg.mixture_stages, device))
