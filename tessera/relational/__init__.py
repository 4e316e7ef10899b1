"""Relational aggregation ``sum_r A_r x W_r`` (RGCN): the operands that offer it, the five ways
of computing it and their cost model, and WiseGraph's gTasks with their batched kernels."""

from tessera.relational.operand import RelationalOperand, relational
from tessera.relational.plan import GTASK_RESTRICTIONS, VARIANTS, Relations, split_variant
from tessera.relational.variants import relational_aggregate, relational_sum

__all__ = [
    "GTASK_RESTRICTIONS",
    "VARIANTS",
    "RelationalOperand",
    "Relations",
    "relational",
    "relational_aggregate",
    "relational_sum",
    "split_variant",
]
