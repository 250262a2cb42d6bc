"""Calibration learns the efficiencies of a machine from measured timings, and MemoryCalibration how far
measured peak memory exceeds the cost model's."""

from __future__ import annotations

import json

import pytest

from nereus_lightning.plan import Calibration, MemoryCalibration, estimate_plan, job_models, plan_job
from nereus_lightning.plan.calibration import DEFAULT_EFFICIENCY, OP_CLASSES
from nereus_lightning.spec import NereusConfigError, Workload, cluster_preset, model_preset

#: A "true machine" whose efficiencies differ from the conservative priors in both directions.
_VALUES = (0.8, 0.6, 0.3, 0.9, 0.85, 0.2, 0.7, 0.4, 0.95, 0.35, 0.65)
TRUE = {name: _VALUES[i % len(_VALUES)] for i, name in enumerate(OP_CLASSES)}


def test_every_class_has_a_conservative_prior():
    assert set(DEFAULT_EFFICIENCY) == set(OP_CLASSES)
    # Ideal times start conservative; the decode steps' launch cost is priced from measurements.
    assert all(0 < v <= 0.6 for c, v in DEFAULT_EFFICIENCY.items() if c != "generation.launch")
    assert DEFAULT_EFFICIENCY["generation.launch"] == 1.0
    assert Calibration().observations("training.gemm") == 0
    # Every class is a stage kind and an operation; each kind has its own GEMMs.
    assert {"generation.decode", "inference.gemm", "training.gemm", "training.optimizer"} <= set(OP_CLASSES)


def test_one_observation_recovers_the_implied_efficiency():
    cal = Calibration()
    # Predicted 2 s at efficiency 0.5 => ideal 1 s; measured 1.25 s => efficiency 0.8.
    assert cal.observe("training.gemm", 2.0, 1.25) == pytest.approx(0.8)
    # Later observations move in log space by `rate`.
    cal.observe("training.gemm", 1.0, 2.0)
    assert cal.efficiency("training.gemm") == pytest.approx((0.8 * 0.4) ** 0.5)
    assert cal.efficiency("inference.gemm") == DEFAULT_EFFICIENCY["inference.gemm"]  # another kind's


def test_an_operation_stands_for_its_class_in_every_kind():
    cal = Calibration({"gemm": 0.7, "training.gemm": 0.4})  # a class overrides its operation
    assert cal.efficiency("generation.gemm") == cal.efficiency("inference.gemm") == 0.7
    assert cal.efficiency("training.gemm") == 0.4
    # A state saved when classes were operations only loads into every kind's class.
    cal.load_state_dict({"efficiency": {"decode": 0.3}, "count": {"decode": 2}})
    assert cal.efficiency("generation.decode") == 0.3 and cal.observations("generation.decode") == 2


def test_predictions_converge_to_a_machine_with_other_efficiencies():
    models = job_models(model_preset("llama3_8b"))
    cluster = cluster_preset("paper_cluster2").with_gpus(32)
    workload = Workload(response_len=1024)
    plan = plan_job(models, cluster, workload).plan
    cal = Calibration()
    truth = estimate_plan(plan, models, cluster, workload, Calibration(TRUE))
    first = estimate_plan(plan, models, cluster, workload, cal)
    for _ in range(6):  # six RL steps of measured kernel / collective timings
        predicted = estimate_plan(plan, models, cluster, workload, cal)
        totals: dict[str, list[float]] = {}  # per class: [predicted, measured] summed over the step
        for name, per_class in predicted.breakdown.items():
            for op, seconds in per_class.items():
                pair = totals.setdefault(op, [0.0, 0.0])
                pair[0] += seconds
                pair[1] += truth.breakdown[name][op]
        for op, (pred, meas) in totals.items():
            cal.observe(op, pred, meas)
    final = estimate_plan(plan, models, cluster, workload, cal)

    def worst_error(est):
        return max(abs(est.stage_latency[n] / truth.stage_latency[n] - 1) for n in truth.stage_latency)

    assert worst_error(first) > 0.3
    assert worst_error(final) < 1e-6
    assert final.step_latency == pytest.approx(truth.step_latency, rel=1e-6)
    for op in truth.breakdown["actor_train"]:
        assert cal.efficiency(op) == pytest.approx(TRUE[op], rel=1e-6)


def test_state_dict_round_trips_through_json():
    cal = Calibration(rate=0.3)
    cal.observe("training.allreduce_inter", 1.0, 3.0)
    state = json.loads(json.dumps(cal.state_dict()))
    other = Calibration()
    other.load_state_dict(state)
    assert other.efficiencies() == cal.efficiencies()
    assert other.observations("training.allreduce_inter") == 1 and other.rate == 0.3


def test_bad_input_is_rejected():
    with pytest.raises(NereusConfigError, match="unknown op class 'matmul'"):
        Calibration().observe("matmul", 1.0, 1.0)
    with pytest.raises(NereusConfigError, match="unknown op class 'gemm'"):
        Calibration().observe("gemm", 1.0, 1.0)  # an observation is of one class
    with pytest.raises(NereusConfigError, match="unknown op class 'inference.optimizer'"):
        Calibration({"inference.optimizer": 0.5})
    with pytest.raises(NereusConfigError, match="measured_s"):
        Calibration().observe("training.gemm", 1.0, 0.0)
    with pytest.raises(NereusConfigError, match="calibration.rate"):
        Calibration(rate=0)


def test_memory_factor_jumps_up_at_once_and_never_comes_down():
    mem = MemoryCalibration()
    assert mem.factors() == {"generation": 1.0, "inference": 1.0, "training": 1.0}
    # Under the prediction: the factor stays at its floor of 1 (it never loosens the cost model).
    assert not mem.observe("training", 50e9, 40e9) and mem.factor("training") == 1.0
    assert mem.observe("training", 50e9, 65e9) and mem.factor("training") == pytest.approx(1.3)
    # Lower ratios later (this plan or another) leave it: the plan that measured 1.3 x stays priced so.
    assert not mem.observe("training", 50e9, 51e9) and mem.factor("training") == pytest.approx(1.3)
    assert mem.observations("training") == 3 and mem.factor("generation") == 1.0
    loose = MemoryCalibration(floor=0.5)  # a floor below 1 lets measurements loosen the model
    loose.observe("inference", 10e9, 8e9)
    assert loose.factor("inference") == pytest.approx(0.8)


def test_memory_calibration_round_trips_and_rejects_bad_input():
    mem = MemoryCalibration()
    mem.observe("generation", 10e9, 12e9)
    other = MemoryCalibration()
    other.load_state_dict(json.loads(json.dumps(mem.state_dict())))
    assert other.factors() == mem.factors() and other.observations("generation") == 1
    with pytest.raises(NereusConfigError, match="unknown stage 'decode'"):
        mem.factor("decode")
    with pytest.raises(NereusConfigError, match="memory_calibration.predicted"):
        mem.observe("training", 0.0, 1.0)
    with pytest.raises(NereusConfigError, match="memory_calibration.floor"):
        MemoryCalibration(floor=0)


def test_measured_memory_factor_makes_a_plan_infeasible_and_the_planner_leaner():
    """0.5B GRPO at 2K tokens on one 80 GB GPU: training measured past the cap (its GPU's headroom
    used) no longer fits with the micro-batch it ran; the planner picks a leaner one that fits with
    the factor."""
    from dataclasses import replace

    qwen = model_preset("qwen2_0_5b")
    cluster = replace(cluster_preset("h200x8"), gpu_memory=80e9).with_gpus(1)
    workload = Workload(
        "grpo",
        prompts_per_step=16,
        samples_per_prompt=4,
        prompt_len=90,
        response_len=2048,
        response_len_p95=2048,
        reward_model=False,
    )
    models = job_models(qwen)
    ran = plan_job(models, cluster, workload)
    mem = MemoryCalibration()
    predicted = ran.estimate.stage_peak["training"][0]
    factor = 1.1 * ran.estimate.memory_cap / predicted
    mem.observe("training", predicted, factor * predicted)
    again = estimate_plan(ran.plan, models, cluster, workload, memory=mem)
    assert not again.feasible and f"{factor:.2f} x the cost model's peak, as measured" in again.violations[0]
    assert again.stage_peak == ran.estimate.stage_peak  # the cost model's own peaks do not move
    lean = plan_job(models, cluster, workload, memory=mem)
    assert lean.estimate.feasible and lean.plan != ran.plan
    assert lean.estimate.stage_peak["training"][0] < predicted
    train = lean.estimate.stage_memory["actor_train"]
    assert train == pytest.approx(factor * lean.estimate.stage_peak["training"][0])
    assert train <= lean.estimate.memory_cap
