"""Transitions from, to and between colocated plans (model-stages of one stage sharing GPUs)."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus_lightning.plan.overlap import colocated
from nereus_lightning.spec.errors import InfeasiblePlanError
from nereus_lightning.transition import Primitive, build_transition, validate
from nereus_lightning.transition.scenarios import random_colocated_case
from tests.helpers import cand, plan
from tests.transition.helpers import CLUSTER, MODELS, PPO, with_memory, without_resource_edges
from tests.transition.test_properties import check_transition

STAGE_OF = {ms.name: ms.stage for ms in PPO.stages}
ROOMY = with_memory(400)  # memory is not what these cases test
DISJOINT = plan(
    actor_infer=cand(1, 1, (0, 1)), ref_infer=cand(1, 1, (2, 3)), critic_infer=cand(1, 1, (4, 5)),
    actor_train=cand(2, 1, (0, 1, 2, 3)), critic_train=cand(2, 1, (4, 5, 6, 7)),
)  # fmt: skip
COLOCATED = plan(
    actor_infer=cand(1, 1, (0, 1)), ref_infer=cand(2, 1, (0, 1)), critic_infer=cand(1, 1, (0, 1)),
    actor_train=cand(2, 1, (0, 1, 2, 3)), critic_train=cand(4, 1, (0, 1, 2, 3)),
)  # fmt: skip
RESHUFFLED = plan(
    actor_infer=cand(1, 1, (2, 3)), ref_infer=cand(1, 1, (2, 3)), critic_infer=cand(2, 1, (4, 5)),
    actor_train=cand(4, 1, (4, 5, 6, 7)), critic_train=cand(4, 1, (4, 5, 6, 7)),
)  # fmt: skip


@pytest.mark.parametrize(
    "current, target",
    [(DISJOINT, COLOCATED), (COLOCATED, DISJOINT), (COLOCATED, RESHUFFLED), (RESHUFFLED, COLOCATED)],
    ids=["disjoint->colocated", "colocated->disjoint", "colocated->colocated", "colocated->colocated back"],
)
def test_transitions_with_colocated_plans_build_and_validate(current, target) -> None:
    assert (
        colocated(COLOCATED, STAGE_OF)
        and colocated(RESHUFFLED, STAGE_OF)
        and not colocated(DISJOINT, STAGE_OF)
    )
    dag = build_transition(current, target, MODELS, ROOMY, PPO)
    report = validate(dag, random_orders=2, seed=1)
    assert report.valid, report.problems
    assert {n.model_stage for n in dag.nodes} == {n for n in current if current[n] != target[n]}


def test_a_pair_concurrent_in_both_plans_still_waits_for_its_peer() -> None:
    """ref and critic inference run concurrently in both plans; ref lands where critic was, so it
    needs critic's release first. actor_infer, colocated with ref in the target, may share its GPUs."""
    cur = plan(actor_infer=cand(1, 1, (0,)), ref_infer=cand(1, 1, (2,)), critic_infer=cand(1, 1, (1,)))
    tgt = plan(actor_infer=cand(1, 1, (1,)), ref_infer=cand(1, 1, (1,)), critic_infer=cand(1, 1, (3,)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    assert validate(dag).valid
    gone = next(n for n in dag.nodes if n.op is Primitive.DESTROY and n.model_stage == "critic_infer")
    for name in ("ref_infer", "actor_infer"):  # actor_infer and critic_infer are peers in both plans too
        ext = next(n for n in dag.nodes if n.op is Primitive.EXTEND and n.model_stage == name)
        assert gone.id in ext.resource_deps
    assert "gpu conflict" in validate(without_resource_edges(dag)).kinds()


def test_a_pair_colocated_in_one_plan_needs_no_ordering() -> None:
    """actor and ref inference share GPU 0 now and move apart: colocated now, they run in turn,
    so neither waits for the other (no resource edge), though they are disjoint in the target."""
    cur = plan(actor_infer=cand(1, 1, (0,)), ref_infer=cand(1, 1, (0,)))
    tgt = plan(actor_infer=cand(1, 1, (1,)), ref_infer=cand(1, 1, (0,)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    assert validate(dag).valid and dag.resource_edges == 0
    # The swap that is infeasible between concurrent pairs is fine when one plan colocates them.
    swap_cur = plan(actor_infer=cand(1, 1, (0, 1)), ref_infer=cand(1, 1, (1, 2)))
    swap_tgt = plan(actor_infer=cand(1, 1, (1, 2)), ref_infer=cand(1, 1, (0, 1)))
    assert validate(build_transition(swap_cur, swap_tgt, MODELS, CLUSTER, PPO)).valid


def test_colocated_training_states_must_fit_together() -> None:
    """Two 8B training states (112 GB of weights and AdamW state each on one GPU at TP1) cannot share a
    GPU of 141 GB."""
    big = plan(actor_train=cand(1, 1, (0,)), critic_train=cand(1, 1, (0,)))
    with pytest.raises(InfeasiblePlanError, match="does not fit on GPU 0.*actor_train, critic_train"):
        build_transition(big, big, MODELS, CLUSTER, PPO)


SIZES = (8, 16, 32, 64, 128, 256, 1024)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), num_gpus=st.sampled_from(SIZES))
def test_random_colocated_cases_are_acyclic_and_safe_or_infeasible_with_reason(
    seed: int, num_gpus: int
) -> None:
    check_colocated_case(seed, num_gpus)


def check_colocated_case(seed: int, num_gpus: int) -> None:
    """The global DAG of a random colocated case is acyclic and its
    replay valid, or infeasible with a reason.
    """
    case = random_colocated_case(random.Random(seed), num_gpus)
    which = case.kind.split()[-1]
    if which in ("current", "both"):
        assert colocated(case.current, STAGE_OF)
    if which in ("target", "both"):
        assert colocated(case.target, STAGE_OF)
    check_transition(case, seed)


def test_colocated_cases_are_mostly_feasible_and_cover_every_kind() -> None:
    rng = random.Random(11)
    kinds, feasible = set(), 0
    for i in range(60):
        case = random_colocated_case(rng, (8, 16, 64, 256)[i % 4], slack=(1.2, 2.0))
        kinds.add(case.kind)
        try:
            dag = build_transition(*case.args())
        except InfeasiblePlanError:
            continue
        feasible += 1
        assert validate(dag).valid
    assert kinds == {"colocated current", "colocated target", "colocated both"}
    assert feasible >= 20
