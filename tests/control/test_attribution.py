"""Measured stage times become per-op-class calibration samples; the calibrated model predicts them back."""

from __future__ import annotations

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


def test_calibrating_on_three_steps_predicts_the_measured_phases():
    models, cluster, workload, plan, stage_of = _setup()
    before = phase_times_of(estimate_plan(plan, models, cluster, workload))
    measured = {
        "gen": 1.7 * before["gen"],
        "infer": 0.6 * before["infer"],
        "update_actor": 1.3 * before["update_actor"],
    }
    calibration = Calibration()
    for _ in range(3):
        calibrate_on_phases(
            calibration, estimate_plan(plan, models, cluster, workload, calibration), measured, stage_of
        )
    after = phase_times_of(estimate_plan(plan, models, cluster, workload, calibration))
    error = {k: abs(after[k] - measured[k]) / measured[k] for k in measured}
    assert error["gen"] < 0.05 and max(error.values()) < 0.5, error
    assert max(error.values()) < max(abs(before[k] - measured[k]) / measured[k] for k in measured)
