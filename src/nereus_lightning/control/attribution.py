"""Measured stage times turned into the cost model's operation classes, so calibration learns from real steps.

A training job measures each stage of a step (generation, inference, training) as a whole; the cost
model predicts, per model-stage, seconds per operation class. Each stage's measured time is shared
among its model-stages' operation classes in proportion to their predicted times, which gives one
measured time per operation class for :meth:`~nereus_lightning.plan.calibration.Calibration.observe`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol, runtime_checkable

from nereus_lightning.plan.calibration import Calibration


@runtime_checkable
class PhasedEstimate(Protocol):
    """The parts of a plan estimate the attribution reads (e.g. the planner's ``PlanEstimate``)."""

    @property
    def phase_latency(self) -> Mapping[str, float]: ...

    @property
    def breakdown(self) -> Mapping[str, Mapping[str, float]]: ...


#: A job's stage-timing names (``timing_s/<name>``) -> the workflow stages they measure.
PHASES = {"gen": "generation", "infer": "inference", "update_actor": "training"}


def phase_times_of(estimate: PhasedEstimate) -> dict[str, float]:
    """The predicted seconds of each measured phase (``gen``, ``infer``, ``update_actor``)."""
    return {name: estimate.phase_latency.get(stage, 0.0) for name, stage in PHASES.items()}


def op_times(
    estimate: PhasedEstimate, measured: Mapping[str, float], stage_of: Mapping[str, str]
) -> dict[str, tuple[float, float]]:
    """``op class -> (predicted, measured)`` seconds, each phase's measurement shared as its prediction is.

    ``stage_of`` maps each model-stage to its workflow stage; phases measured as zero or predicted
    as zero carry no information and are left out.
    """
    out: dict[str, tuple[float, float]] = {}
    for name, stage in PHASES.items():
        predicted_phase = estimate.phase_latency.get(stage, 0.0)
        seconds = measured.get(name, 0.0)
        if predicted_phase <= 0 or seconds <= 0:
            continue
        scale = seconds / predicted_phase
        for model_stage, ops in estimate.breakdown.items():
            if stage_of.get(model_stage) != stage:
                continue
            for op, t in ops.items():
                p, m = out.get(op, (0.0, 0.0))
                out[op] = (p + t, m + t * scale)
    return {op: pm for op, pm in out.items() if pm[0] > 0 and pm[1] > 0}


def calibrate_on_phases(
    calibration: Calibration,
    estimate: PhasedEstimate,
    measured: Mapping[str, float],
    stage_of: Mapping[str, str] | None = None,
) -> None:
    """Feed one step's measured phases into ``calibration``
    (``estimate`` priced at its current efficiencies).
    """
    if stage_of is None:
        from nereus_lightning.spec.algorithms import algorithm_names
        from nereus_lightning.spec.workload import workflow

        stage_of = {m.name: m.stage for algo in algorithm_names() for m in workflow(algo)}
    for op, (predicted, seconds) in op_times(estimate, measured, stage_of).items():
        calibration.observe(op, predicted, seconds)
