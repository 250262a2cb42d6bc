"""Layouts, the cost model, calibration and the planner (pure Python)."""

from nereus_lightning.plan.layout import Candidate, Layout, Plan

__all__ = ["Candidate", "Layout", "Plan"]
