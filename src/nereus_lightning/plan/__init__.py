"""Layouts, the cost model, calibration and the planner (pure Python)."""

from nereus_lightning.plan.calibration import OP_CLASSES, Calibration, MemoryCalibration
from nereus_lightning.plan.estimate import PlanEstimate, estimate_plan
from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.plan.planner import PlanResult, job_models, plan_job

__all__ = [
    "OP_CLASSES",
    "Calibration",
    "Candidate",
    "Layout",
    "MemoryCalibration",
    "Plan",
    "PlanEstimate",
    "PlanResult",
    "estimate_plan",
    "job_models",
    "plan_job",
]
