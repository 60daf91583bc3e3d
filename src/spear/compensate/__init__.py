"""Error compensators: closed-form inits, CKA sensitivity, planner, calibration (the EC module is spear.layer's)."""

from spear.compensate.cka import SensitivityConfig, SensitivityTable, linear_cka, module_sensitivity
from spear.compensate.init import attach_ec, init_ec
from spear.compensate.cost import BytesCost, CostModel, LatencyCost
from spear.compensate.planner import Plan, PlannerConfig, plan_ecs
from spear.compensate.stats import InputStats, collect_input_stats
from spear.layer import ErrorCompensator

__all__ = [
    "BytesCost", "CostModel", "LatencyCost", "ErrorCompensator", "InputStats", "Plan", "PlannerConfig", "SensitivityConfig",
    "SensitivityTable", "attach_ec", "collect_input_stats", "init_ec", "linear_cka", "module_sensitivity", "plan_ecs",
]
