"""Colocated model-stages: the overlap definition, their estimate, and the planner's choice."""

from __future__ import annotations

import pytest

from nereus_lightning.plan import Candidate, Layout, Plan, estimate_plan, job_models, plan_job
from nereus_lightning.plan.memory import boundary_state_bytes
from nereus_lightning.plan.overlap import (
    colocated,
    concurrent,
    concurrent_pairs,
    describe_groups,
    partitions,
    stage_groups,
)
from nereus_lightning.spec import ClusterSpec, Workload, cluster_preset, model_preset

TINY, L8 = model_preset("tiny_llama"), model_preset("llama3_8b")
PPO_STAGES = {ms.name: ms.stage for ms in Workload("ppo").stages}


def _c(*gpus: int) -> Candidate:
    return Candidate(Layout(1, 1), len(gpus), gpus)


def _ppo(**gpus: tuple[int, ...]) -> Plan:
    """A PPO plan with one-GPU replicas; model-stages not given sit on GPU 0."""
    return Plan.of({n: _c(*gpus.get(n, (0,))) for n in PPO_STAGES})


def test_groups_are_connected_components_of_sharing_a_gpu():
    plan = _ppo(
        actor_infer=(0, 1),
        ref_infer=(1, 2),
        critic_infer=(3,),
        reward_infer=(2,),
        actor_train=(0,),
        critic_train=(1,),
    )
    infer = ["actor_infer", "ref_infer", "critic_infer", "reward_infer"]
    # ref shares GPU 1 with actor and GPU 2 with reward: one group, in plan order; critic alone.
    assert stage_groups(plan, infer) == (("actor_infer", "ref_infer", "reward_infer"), ("critic_infer",))
    assert concurrent(plan, "actor_infer", "critic_infer", PPO_STAGES)
    assert not concurrent(plan, "actor_infer", "reward_infer", PPO_STAGES)  # transitively colocated
    assert not concurrent(plan, "actor_infer", "actor_train", PPO_STAGES)  # other stage: in turn anyway
    assert concurrent(plan, "actor_train", "critic_train", PPO_STAGES)
    assert frozenset(("actor_train", "critic_train")) in concurrent_pairs(plan, PPO_STAGES)
    assert colocated(plan, PPO_STAGES) == (("actor_infer", "ref_infer", "reward_infer"),)
    assert (
        describe_groups(stage_groups(plan, infer))
        == "actor_infer -> ref_infer -> reward_infer | critic_infer"
    )


@pytest.mark.parametrize("n, bell", [(1, 1), (2, 2), (3, 5), (4, 15)])
def test_partitions_are_every_grouping_once_all_concurrent_first(n, bell):
    names = "abcd"[:n]
    parts = list(partitions(names))
    assert len(parts) == bell == len({frozenset(map(frozenset, p)) for p in parts})
    assert parts[0] == tuple((x,) for x in names)
    assert all(sorted(x for g in p for x in g) == list(names) for p in parts)


def test_estimate_sums_colocated_members_and_maxes_concurrent_groups():
    models, cluster, workload = job_models(TINY), cluster_preset("h200x8"), Workload("ppo")
    plan = _ppo(
        actor_gen=(0, 1),
        actor_infer=(0,),
        ref_infer=(0,),
        critic_infer=(1,),
        reward_infer=(1,),
        critic_train=(1,),
    )
    est = estimate_plan(plan, models, cluster, workload)
    assert est.feasible, est.violations
    lat = est.stage_latency
    assert est.phase_latency["inference"] == pytest.approx(
        max(lat["actor_infer"] + lat["ref_infer"], lat["critic_infer"] + lat["reward_infer"])
    )
    assert est.phase_latency["training"] == pytest.approx(max(lat["actor_train"], lat["critic_train"]))
    assert est.step_latency == pytest.approx(sum(est.phase_latency.values()))


def test_colocated_training_states_stay_side_by_side_in_the_estimate():
    models, workload = job_models(L8), Workload("ppo")
    cluster = cluster_preset("h200x8")
    state = boundary_state_bytes(L8, True, Layout(1, 2))  # what a training unit keeps beside the other's pass
    two = Candidate(Layout(1, 2), 1, (0, 1))
    apart = Plan.of(
        {n: (two if n != "critic_train" else Candidate(Layout(1, 2), 1, (2, 3))) for n in PPO_STAGES}
    )
    together = Plan.of({n: two for n in PPO_STAGES})
    est_apart = estimate_plan(apart, models, cluster, workload)
    est_together = estimate_plan(together, models, cluster, workload)
    # Apart, each training unit holds only its own state; together each one's peak sits next to the other's.
    delta = est_together.stage_memory["actor_train"] - est_apart.stage_memory["actor_train"]
    assert delta == pytest.approx(state, rel=1e-3)  # (the other pipeline rank's state, a hair smaller)
    assert not est_together.feasible
    assert any(
        "actor_train" in v and "other model-stages' resident training state" in v
        for v in est_together.violations
    )
    # Inference on GPU 0 sits next to both states.
    assert est_together.stage_memory["actor_infer"] >= 2 * state


@pytest.mark.parametrize("algorithm", ["ppo", "grpo", "remax"])
@pytest.mark.parametrize("gpus", [1, 2, 3])
def test_every_algorithm_plans_on_one_two_and_three_gpus(algorithm, gpus):
    workload = Workload(algorithm)
    stage_of = {ms.name: ms.stage for ms in workload.stages}
    result = plan_job(job_models(TINY), cluster_preset("h200x8").with_gpus(gpus), workload)
    assert result.estimate.feasible, result.estimate.violations
    assert all(g < gpus for _, c in result.plan.items() for g in c.gpus)
    concurrent_need = max(sum(1 for s in stage_of.values() if s == stage) for stage in set(stage_of.values()))
    if gpus < concurrent_need:  # too small for every stage's model-stages on GPUs of their own
        assert colocated(result.plan, stage_of)
    # The prediction of a stage is its slowest group, a group's the sum of its members'.
    lat = result.estimate.stage_latency
    for stage, phase in result.estimate.phase_latency.items():
        groups = stage_groups(result.plan, [n for n, s in stage_of.items() if s == stage])
        assert phase == pytest.approx(max(sum(lat[n] for n in g) for g in groups), rel=1e-12)


def test_one_gpu_runs_every_stage_in_turn_and_predicts_the_sum():
    workload = Workload("ppo")
    result = plan_job(job_models(TINY), cluster_preset("h200x8").with_gpus(1), workload)
    lat, phase = result.estimate.stage_latency, result.estimate.phase_latency
    assert phase["inference"] == pytest.approx(
        lat["actor_infer"] + lat["ref_infer"] + lat["critic_infer"] + lat["reward_infer"]
    )
    assert phase["training"] == pytest.approx(lat["actor_train"] + lat["critic_train"])


def test_a_large_pool_keeps_model_stages_concurrent_when_that_is_faster():
    models, cluster, workload = job_models(L8), cluster_preset("h200x8").with_gpus(64), Workload("ppo")
    result = plan_job(models, cluster, workload)
    assert colocated(result.plan, PPO_STAGES) == ()
    # Colocating reference inference with actor inference (same GPUs, in turn) is slower.
    shared = result.plan.replace("ref_infer", result.plan["actor_infer"])
    est = estimate_plan(shared, models, cluster, workload)
    assert colocated(shared, PPO_STAGES) == (("actor_infer", "ref_infer"),)
    assert est.step_latency > result.estimate.step_latency


def test_training_states_that_do_not_fit_together_are_placed_apart():
    """PPO-8B on 4 H200s with training pinned to TP1xPP2: each training unit keeps 66 GB of state
    per GPU, two of them on one GPU pass the 126.9 GB cap, so actor and critic training run apart."""
    pinned = {"actor_train": Layout(1, 2), "critic_train": Layout(1, 2)}
    result = plan_job(job_models(L8), cluster_preset("h200x8").with_gpus(4), Workload("ppo"), pinned=pinned)
    assert result.estimate.feasible
    assert concurrent(result.plan, "actor_train", "critic_train", PPO_STAGES)
    assert all(est.feasible for _plan, est in result.alternatives)
    # Pinned to PP4, which halves the state per GPU, both fit side by side on the same 4 GPUs.
    pp4 = {"actor_train": Layout(1, 4), "critic_train": Layout(1, 4)}
    free = plan_job(job_models(L8), cluster_preset("h200x8").with_gpus(4), Workload("ppo"), pinned=pp4)
    assert ("actor_train", "critic_train") in colocated(free.plan, PPO_STAGES)
    assert max(free.estimate.peak_memory.values()) <= free.estimate.memory_cap


def test_small_training_states_are_colocated_when_memory_allows():
    """On one GPU the two training states of a tiny model fit side by side (their sum is the
    level the other stages are budgeted against)."""
    cluster = ClusterSpec("one", 1, 1, 8e9, 312e12, 1.6e12, 300e9, 25e9)
    result = plan_job(job_models(TINY), cluster, Workload("ppo"))
    assert ("actor_train", "critic_train") in colocated(result.plan, PPO_STAGES)
    assert max(result.estimate.peak_memory.values()) <= result.estimate.memory_cap
