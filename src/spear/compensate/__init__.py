"""Error compensators: the EC module, closed-form inits, CKA sensitivity, planner, calibration."""

from spear.compensate.ec import ErrorCompensator

__all__ = ["ErrorCompensator"]
