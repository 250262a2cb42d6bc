"""The controller feeds measured per-stage peaks back: a plan that measured over its cap is never chosen
again as feasible; one that measured under keeps running."""

from __future__ import annotations

import json
from dataclasses import replace

from nereus_lightning.control import Controller, PlannerBackend, StepSignals
from nereus_lightning.plan import job_models
from nereus_lightning.spec import Workload, cluster_preset, model_preset

#: The 0.5B GRPO job at 2K tokens on one 80 GB GPU (reference/gpu-facts.md).
CLUSTER = replace(cluster_preset("h200x8"), gpu_memory=80e9).with_gpus(1)
WORKLOAD = Workload(
    "grpo",
    prompts_per_step=16,
    samples_per_prompt=4,
    prompt_len=90,
    response_len=2048,
    response_len_p95=2048,
    reward_model=False,
)


def _signals(step: int, stage_peak_memory=None) -> StepSignals:
    return StepSignals(step, 2048, 2048, 90, (0,), stage_peak_memory=stage_peak_memory or {})


def _started() -> tuple[Controller, PlannerBackend]:
    backend = PlannerBackend(job_models(model_preset("qwen2_0_5b")))
    ctl = Controller(backend, CLUSTER, WORKLOAD)
    assert ctl.step(_signals(0)).kind == "initial"
    return ctl, backend


def _measured(ctl: Controller, backend: PlannerBackend, training: float) -> dict:
    """Per-stage peaks on GPU 0: the cost model's, training's times ``training``."""
    predicted = backend.estimate(ctl.plan, CLUSTER, WORKLOAD, None).stage_peak
    scale = {"training": training}
    return {stage: {0: peaks[0] * scale.get(stage, 1.0)} for stage, peaks in predicted.items()}


def test_a_plan_that_measured_over_its_cap_is_not_chosen_again():
    ctl, backend = _started()
    ran = ctl.plan
    before = backend.estimate(ran, CLUSTER, WORKLOAD, None)
    factor = 1.1 * before.memory_cap / before.stage_peak["training"][0]  # measured past the cap
    measured = _measured(ctl, backend, factor)
    assert measured["training"][0] > before.memory_cap
    decision = ctl.step(_signals(1, measured))
    assert ctl.memory_calibration.factor("training") > 0.99 * factor
    # The memory trigger fires at once (urgent) and the controller moves to a plan that fits at that factor.
    assert decision.urgent and any(t.kind == "memory" for t in decision.triggers)
    assert decision.changes_plan and decision.target != ran
    after = backend.estimate(decision.target, CLUSTER, WORKLOAD, None)
    assert after.stage_peak["training"][0] < before.stage_peak["training"][0]
    assert not backend.estimate(ran, CLUSTER, WORKLOAD, None, memory=ctl.memory_calibration).feasible
    # Neither the planner nor a later replan offers it as feasible again, even after leaner steps.
    for step in range(2, 5):
        ctl.step(_signals(step, _measured(ctl, backend, 0.9)))
        assert ctl.plan != ran
    planned = backend.plan(CLUSTER, WORKLOAD, None, memory=ctl.memory_calibration)
    assert all(plan != ran for plan, _ in planned)


def test_a_plan_that_measured_under_its_prediction_keeps_running():
    ctl, backend = _started()
    ran = ctl.plan
    for step in range(1, 4):
        assert ctl.step(_signals(step, _measured(ctl, backend, 0.9))).kind == "none"
    assert ctl.plan == ran and ctl.memory_calibration.factors()["training"] == 1.0
    assert ctl.memory_calibration.observations("training") == 3
    assert backend.plan(CLUSTER, WORKLOAD, None, memory=ctl.memory_calibration)[0][0] == ran


def test_the_memory_factors_survive_a_checkpoint_and_old_checkpoints_load():
    ctl, backend = _started()
    ctl.step(_signals(1, _measured(ctl, backend, 1.3)))
    state = json.loads(json.dumps(ctl.state_dict()))
    resumed = Controller(backend, CLUSTER, WORKLOAD)
    resumed.load_state_dict(state)
    assert resumed.memory_calibration.factors() == ctl.memory_calibration.factors()
    old = {k: v for k, v in state.items() if k != "memory_calibration"}  # saved before memory factors
    older = Controller(backend, CLUSTER, WORKLOAD)
    older.load_state_dict(old)
    assert older.plan == ctl.plan and older.memory_calibration.factors()["training"] == 1.0
