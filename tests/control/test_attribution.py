"""Measured stage times become per-op-class calibration samples; the calibrated model predicts them back."""

from __future__ import annotations

import pytest

from nereus_lightning.control.attribution import calibrate_on_phases, op_times, phase_times_of
from nereus_lightning.plan.calibration import Calibration
from nereus_lightning.plan.estimate import estimate_plan
from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.plan.planner import job_models
from nereus_lightning.spec import Workload, cluster_preset, model_preset
from nereus_lightning.spec.workload import workflow


def _setup():
    models = job_models(model_preset("llama3_8b"))
    cluster = cluster_preset("h200x8")
    workload = Workload(
        algorithm="grpo", prompts_per_step=8, samples_per_prompt=4, prompt_len=128, response_len=512.0
    )
    plan = Plan.of({m.name: Candidate(Layout(2, 1), 4, tuple(range(8))) for m in workflow("grpo")})
    stage_of = {m.name: m.stage for m in workflow("grpo")}
    return models, cluster, workload, plan, stage_of


def test_each_phase_is_shared_among_its_op_classes_as_predicted():
    models, cluster, workload, plan, stage_of = _setup()
    est = estimate_plan(plan, models, cluster, workload)
    predicted = phase_times_of(est)
    measured = {name: 2.0 * t for name, t in predicted.items()}  # everything twice as slow
    shares = op_times(est, measured, stage_of)
    assert shares and all(abs(m - 2.0 * p) <= 1e-9 * m for p, m in shares.values())
    assert op_times(est, {}, stage_of) == {}


@pytest.mark.parametrize("gpus", [8, 1])  # TP2 x DP4 on disjoint GPUs; everything colocated on one
@pytest.mark.parametrize("factors", [(1.7, 0.6, 1.3), (2.8, 1.2, 3.5), (0.9, 2.5, 0.7)])
def test_calibrating_on_three_steps_predicts_every_measured_phase(gpus, factors):
    models, cluster, workload, plan, stage_of = _setup()
    if gpus == 1:
        cluster = cluster.with_gpus(1)
        plan = Plan.of({m.name: Candidate(Layout(1, 1), 1, (0,), 16) for m in workflow("grpo")})
    before = phase_times_of(estimate_plan(plan, models, cluster, workload))
    phases = ("gen", "infer", "update_actor")
    measured = {name: f * before[name] for name, f in zip(phases, factors, strict=True)}
    calibration = Calibration()
    for _ in range(3):
        calibrate_on_phases(
            calibration, estimate_plan(plan, models, cluster, workload, calibration), measured, stage_of
        )
    after = phase_times_of(estimate_plan(plan, models, cluster, workload, calibration))
    # Each measured stage calibrates its own stage kind's classes, so every phase is met, not just
    # their sum (a GEMM class shared by inference and training could match neither).
    for name in measured:
        assert after[name] == pytest.approx(measured[name], rel=1e-6), name
