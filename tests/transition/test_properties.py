"""Property tests: random PPO plan pairs on 8 to 1,024 GPUs with every kind of GPU overlap."""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nereus_lightning.plan.layout import moving_shard_groups
from nereus_lightning.plan.rows import recut_stages
from nereus_lightning.spec.errors import InfeasiblePlanError
from nereus_lightning.transition import Primitive, build_transition, per_component_baseline, validate
from nereus_lightning.transition.scenarios import OVERLAP_KINDS, TransitionCase, random_case
from tests.helpers import cand, plan
from tests.transition.helpers import CLUSTER, MODELS, PPO

SIZES = (8, 16, 32, 64, 128, 256, 512, 1024)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(OVERLAP_KINDS), num_gpus=st.sampled_from(SIZES))
def test_global_dag_is_acyclic_and_safe_or_infeasible_with_reason(
    seed: int, kind: str, num_gpus: int
) -> None:
    check_case(seed, kind, num_gpus)


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("kind", OVERLAP_KINDS)
def test_large_random_cases(seed: int, kind: str) -> None:
    check_case(seed, kind, 1024)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), kind=st.sampled_from(OVERLAP_KINDS), num_gpus=st.sampled_from(SIZES))
def test_sharded_training_stages_keep_the_dag_acyclic_and_safe_or_infeasible(
    seed: int, kind: str, num_gpus: int
) -> None:
    check_case(seed, kind, num_gpus, sharded=True)


def test_sharded_cases_are_drawn_and_some_are_feasible() -> None:
    """The sharded generator gives sharded layouts on either side, and some of its cases move; some
    re-cut a training model-stage to another shard degree in place, and those that are feasible hold
    its re-cut Splits (a larger degree) and Merges (a smaller one). Every case is acyclic and
    validates, or is reported infeasible with a reason (:func:`check_transition`)."""
    shards, feasible, recut, recut_ops = set(), 0, 0, []
    for seed in range(80):
        case = random_case(random.Random(seed), OVERLAP_KINDS[seed % 3], 64, sharded=True)
        shards |= {(c.layout.shard, c.layout.zero) for p in (case.current, case.target) for _, c in p.items()}
        current, target, models, _, workload = case.args()
        role = {ms.name: ms.model for ms in workload.stages}
        recut += bool(recut_stages(current, target, {n: models[role[n]] for n in current}))
        check_transition(case, seed)
        try:
            dag = build_transition(*case.args())
        except InfeasiblePlanError:
            continue
        feasible += 1
        recut_ops += [n.op for n in dag.nodes if n.sources.layout.shard != n.targets.layout.shard]
    assert {s for s, _ in shards} == {1, 2, 4, 8} and {z for _, z in shards} == {0, 1, 2, 3}
    assert feasible >= 20
    assert recut >= 10 and set(recut_ops) == {Primitive.SPLIT, Primitive.MERGE}


def check_case(seed: int, kind: str, num_gpus: int, sharded: bool = False) -> None:
    """The global DAG of a random case is acyclic and its replay valid, or infeasible with a reason."""
    case = random_case(random.Random(seed), kind, num_gpus, sharded=sharded)
    assert kind in case.overlaps
    check_transition(case, seed)


def check_transition(case: TransitionCase, seed: int) -> None:
    """``case``'s global DAG is acyclic and its replay valid, or infeasible with a reason."""
    try:
        dag = build_transition(*case.args())
    except InfeasiblePlanError as err:
        assert "stuck:" in str(err) and " onto [" in str(err)
        current, target, models, _, workload = case.args()
        role = {ms.name: ms.model for ms in workload.stages}
        recut = recut_stages(current, target, {n: models[role[n]] for n in current})
        was, now = moving_shard_groups(current, target, recut)  # a stage that moves as its shard groups
        sharded = any(was[n] is not c or now[n] is not target[n] for n, c in current.items())
        assert ("ZeRO-sharded model-stages move as their shard groups" in str(err)) == sharded
        return
    assert all(0 <= d < n.id for n in dag.nodes for d in n.deps), "not in topological order (or cyclic)"
    report = validate(dag, random_orders=1, seed=seed)
    assert report.valid, report.problems
    assert report.peak_memory <= report.memory_cap * (1 + 1e-9)


def test_per_component_baseline_fails_in_a_measurable_share() -> None:
    """Over fixed random cases where the global DAG is safe, independent local DAGs are not always."""
    rng = random.Random(7)
    feasible = failed = 0
    for i in range(60):
        case = random_case(rng, OVERLAP_KINDS[i % 3], rng.choice((8, 16, 32, 64)), slack=(1.2, 2.0))
        try:
            build_transition(*case.args())
        except InfeasiblePlanError:
            continue
        feasible += 1
        failed += not per_component_baseline(*case.args()).ok
    assert feasible >= 20
    assert 0.1 <= failed / feasible < 1.0


@pytest.mark.parametrize("kind", OVERLAP_KINDS)
def test_random_cases_have_the_requested_overlap(kind: str) -> None:
    rng = random.Random(kind)
    for n in (8, 64, 1024):
        case = random_case(rng, kind, n)
        assert kind in case.overlaps and case.current != case.target


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    a=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (4, 2), (2, 4)]),
    b=st.sampled_from([(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4), (4, 2), (2, 4)]),
)
def test_one_model_stage_on_shuffled_gpus_is_always_safe(
    seed: int, a: tuple[int, int], b: tuple[int, int]
) -> None:
    """Any layout change onto any GPU order, with memory to spare:
    always a valid DAG that ends on the target.
    """
    rng = random.Random(seed)
    pool = list(range(16))
    cur_gpus = rng.sample(pool, rng.choice([n for n in (8, 16) if n % (a[0] * a[1]) == 0]))
    tgt_gpus = rng.sample(pool, rng.choice([n for n in (8, 16) if n % (b[0] * b[1]) == 0]))
    cur = plan(reward_infer=cand(*a, tuple(cur_gpus)))
    tgt = plan(reward_infer=cand(*b, tuple(tgt_gpus)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    report = validate(dag, random_orders=1, seed=seed)
    assert report.valid, report.problems
    moved = sum(n.bytes for n in dag.nodes)
    assert moved >= 0 and all(t.bytes > 0 for n in dag.nodes for t in n.transfers)


def test_a_sharded_stage_that_stays_keeps_its_rows_while_others_move() -> None:
    """Only a sharded model-stage whose units change moves whole: one that stays, or changes only its
    micro-batch or recompute, holds its row blocks (and their memory) while the others move, so a cluster
    too small for its whole state still moves them."""
    from dataclasses import replace

    from nereus_lightning.plan.layout import Candidate, Layout
    from nereus_lightning.plan.memory import boundary_state_bytes
    from tests.transition.helpers import with_memory

    gpus = tuple(range(8))
    train = Candidate(Layout(1, 1, shard=8, zero=3), 1, gpus)
    rows, whole = (boundary_state_bytes(MODELS["actor"], True, lay) for lay in (train.layout, Layout(1, 1)))
    cluster = with_memory(whole / 1e9 * 0.9)  # the actor's whole training state does not fit one GPU
    current = plan(actor_gen=cand(2, 1, gpus), actor_train=train)
    target = plan(actor_gen=cand(4, 1, gpus), actor_train=train)
    dag = build_transition(current, target, MODELS, cluster, PPO)
    assert validate(dag).valid and dag.nodes
    assert {n.model_stage for n in dag.nodes} == {"actor_gen"}
    assert dag.context.current_memory[:8] == pytest.approx([rows] * 8)
    relaxed = plan(actor_gen=cand(4, 1, gpus), actor_train=replace(train, micro_batch=4, recompute=True))
    dag = build_transition(current, relaxed, MODELS, cluster, PPO)
    assert validate(dag).valid and {n.model_stage for n in dag.nodes} == {"actor_gen"}
    with pytest.raises(InfeasiblePlanError, match="actor_train Z3x8 TP1xPP1 -> Z3x4 TP1xPP1"):
        moved = plan(actor_gen=cand(4, 1, gpus), actor_train=Candidate(Layout(1, 1, 4, 3), 2, gpus))
        build_transition(current, moved, MODELS, cluster, PPO)
