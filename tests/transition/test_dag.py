"""Local and global transition DAGs on hand-built plans: structure, resource edges, errors, cost."""

from __future__ import annotations

import dataclasses

import pytest

from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import InfeasiblePlanError, NereusConfigError
from nereus_lightning.transition import (
    Primitive,
    build_transition,
    clear_cache,
    per_component_baseline,
    schedule,
    transition_cost,
    validate,
)
from nereus_lightning.transition.dag import Memory, Units
from nereus_lightning.transition.pieces import geometry, shard_bytes
from tests.helpers import cand, plan
from tests.transition.helpers import (
    CLUSTER,
    MODELS,
    PPO,
    lanes,
    with_memory,
    with_nodes,
    without_resource_edges,
)


def ops(dag) -> list[str]:
    return [n.op.value for n in lanes(dag)]


def test_unchanged_plan_needs_no_nodes() -> None:
    p = plan(actor_train=cand(2, 1, range(8)))
    dag = build_transition(p, p, MODELS, CLUSTER, PPO)
    assert dag.nodes == () and dag.cost == 0.0 and validate(dag).valid


def test_dp_doubling_is_extend_only_and_rank_aligned() -> None:
    cur = plan(actor_train=cand(2, 1, range(0, 4)))
    tgt = plan(actor_train=cand(2, 1, (0, 1, 2, 3, 4, 5, 6, 7)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    assert ops(dag) == ["extend", "extend"]
    geo = geometry(MODELS["actor"], True)
    for n in lanes(dag):
        src, dst = n.sources[0].gpus, n.targets[0].gpus
        assert [(t.src_gpu, t.dst_gpu) for t in n.transfers] == list(zip(src, dst, strict=True))
        assert all(t.bytes == shard_bytes(geo, n.targets[0].layout, 0) for t in n.transfers)
    assert validate(dag).valid


def test_the_critic_moves_the_state_of_the_value_model_the_body_builds() -> None:
    """The default role mapping gives the critic a one-output ``score`` head, not the actor's LM head:
    a DP doubling of ``critic_train`` moves the value model's shards."""
    cur = plan(critic_train=cand(2, 1, range(0, 4)))
    tgt = plan(critic_train=cand(2, 1, range(8)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    value, causal = (geometry(m, True) for m in (MODELS["actor"].as_value_model(), MODELS["actor"]))
    moved = {t.bytes for n in lanes(dag) for t in n.transfers}
    assert moved == {shard_bytes(value, Layout(2, 1), 0)}
    assert shard_bytes(value, Layout(2, 1), 0) < shard_bytes(causal, Layout(2, 1), 0)


def test_tp_merge_in_place_copies_nothing() -> None:
    cur = plan(reward_infer=cand(1, 1, range(4)))
    tgt = plan(reward_infer=cand(2, 1, range(4)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    assert ops(dag) == ["merge", "merge"] and dag.total_bytes == 0


def test_tp_split_in_place_is_one_split() -> None:
    cur = plan(reward_infer=cand(4, 1, range(4)))
    tgt = plan(reward_infer=cand(2, 1, range(4)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    assert ops(dag) == ["split"]
    assert {u.gpus for u in dag.nodes[0].targets} == {(0, 1), (2, 3)}
    assert validate(dag).valid


def test_paper_example_reshards_through_tsub() -> None:
    """Reward inference TP4 x PP8 -> TP8 x PP2 goes through T_sub = TP4 x PP2."""
    cur = plan(reward_infer=cand(4, 8, range(32)))
    tgt = plan(reward_infer=cand(8, 2, range(32)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    assert {u.layout for n in dag.nodes for u in (*n.sources, *n.targets)} >= {cur["reward_infer"].layout}
    assert all(
        u.layout.tp in (4, 8) and u.layout.pp in (2, 8) for n in dag.nodes for u in (*n.sources, *n.targets)
    )
    assert ops(dag).count("merge") == 2 and validate(dag).valid


def test_moving_the_only_copy_extends_before_destroying() -> None:
    cur = plan(critic_train=cand(2, 1, (0, 1)))
    tgt = plan(critic_train=cand(2, 1, (8, 9)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    assert ops(dag) == ["extend", "destroy"]
    assert dag.nodes[1].deps == (0,)
    assert validate(dag).valid


def test_same_stage_handover_gets_a_resource_edge() -> None:
    """ref_infer takes critic_infer's GPUs while critic_infer moves away: release before acquire."""
    cur = plan(ref_infer=cand(1, 1, (0,)), critic_infer=cand(1, 1, (1,)))
    tgt = plan(ref_infer=cand(1, 1, (1,)), critic_infer=cand(1, 1, (2,)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    ext_ref = next(n for n in dag.nodes if n.op is Primitive.EXTEND and n.model_stage == "ref_infer")
    gone = next(n for n in dag.nodes if n.op is Primitive.DESTROY and n.model_stage == "critic_infer")
    assert gone.id in ext_ref.resource_deps
    assert validate(dag).valid and dag.resource_edges >= 1
    base = per_component_baseline(cur, tgt, MODELS, CLUSTER, PPO)
    assert base.outcome == "conflict" and "gpu conflict" in base.report.kinds()


def test_same_stage_swap_is_infeasible_and_names_the_acquisition() -> None:
    cur = plan(ref_infer=cand(1, 1, (0,)), critic_infer=cand(1, 1, (1,)))
    tgt = plan(ref_infer=cand(1, 1, (1,)), critic_infer=cand(1, 1, (0,)))
    with pytest.raises(InfeasiblePlanError, match=r"extend of (ref|critic)_infer onto \[[01]\]"):
        build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    assert per_component_baseline(cur, tgt, MODELS, CLUSTER, PPO).outcome == "wait cycle"


def test_idle_generation_weights_do_not_block_training_state() -> None:
    """actor_train lands where actor_gen is now: generation weights live on the host between steps
    (plan.memory.boundary_state_bytes, the planner's rule), so no memory edge is needed."""
    cur = plan(actor_gen=cand(1, 1, (0, 1)), actor_train=cand(2, 1, (2, 3)))
    tgt = plan(actor_gen=cand(1, 1, (4, 5)), actor_train=cand(2, 1, (0, 1)))
    cluster = with_memory(85)  # 76.5 GB cap: 64 GB training state fits; 16 GB gen weights are offloaded
    dag = build_transition(cur, tgt, MODELS, cluster, PPO)
    ext = next(n for n in dag.nodes if n.op is Primitive.EXTEND and n.model_stage == "actor_train")
    assert not ext.resource_deps
    assert validate(dag, random_orders=3).valid


def test_training_state_beyond_the_cap_is_refused() -> None:
    """Resident training state alone over the cap makes the target infeasible, naming the GPU."""
    cur = plan(actor_gen=cand(1, 1, (0, 1)), actor_train=cand(2, 1, (2, 3)))
    tgt = plan(actor_gen=cand(1, 1, (4, 5)), actor_train=cand(1, 1, (0,)))
    with pytest.raises(InfeasiblePlanError, match="GPU 0"):
        build_transition(cur, tgt, MODELS, with_memory(85), PPO)


def test_bad_plans_are_rejected_with_the_field() -> None:
    cur = plan(ref_infer=cand(1, 1, (0,)), critic_infer=cand(1, 1, (64,)))
    with pytest.raises(NereusConfigError, match="critic_infer uses GPU 64, outside the pool 0..63"):
        build_transition(cur, cur, MODELS, CLUSTER, PPO)
    with pytest.raises(NereusConfigError, match="differ from the current plan"):
        build_transition(
            plan(ref_infer=cand(1, 1, (0,))), plan(critic_infer=cand(1, 1, (0,))), MODELS, CLUSTER, PPO
        )
    with pytest.raises(NereusConfigError, match="no ModelSpec for role 'reward'"):
        p = plan(reward_infer=cand(1, 1, (0,)))
        build_transition(p, p, {"actor": MODELS["actor"]}, CLUSTER, PPO)
    big = plan(actor_train=cand(1, 1, (0,)), critic_train=cand(1, 1, (0,)))  # 2 x 8B x 14 B > 127 GB cap
    with pytest.raises(InfeasiblePlanError, match="does not fit on GPU 0"):
        build_transition(big, big, MODELS, CLUSTER, PPO)


def test_plans_are_cached_per_pair_until_the_cache_is_cleared() -> None:
    cur = plan(actor_train=cand(2, 1, range(0, 4)))
    tgt = plan(actor_train=cand(2, 1, range(0, 8)))
    first = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    assert build_transition(cur, tgt, dict(MODELS), CLUSTER, PPO) is first
    clear_cache()
    again = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    assert again is not first and again.nodes == first.nodes


def test_a_built_dag_is_immutable() -> None:
    cur = plan(critic_train=cand(2, 1, (0, 1)))
    tgt = plan(critic_train=cand(2, 1, (8, 9)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    node = dag.nodes[1]
    with pytest.raises(AttributeError):
        node.id = 5  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        dag.nodes = ()  # type: ignore[misc]
    assert isinstance(dag.nodes, tuple) and isinstance(node.deps, tuple)
    for part in (node.sources, node.mem):
        with pytest.raises(AttributeError):
            part.gpus = ()  # type: ignore[misc]


def test_cost_of_one_intra_node_extend() -> None:
    cur = plan(actor_train=cand(2, 1, (0, 1)))
    tgt = plan(actor_train=cand(2, 1, (0, 1, 2, 3)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    shard = dag.nodes[0].transfers[0].bytes
    expected = CLUSTER.comm_setup + shard / CLUSTER.intra_bw + CLUSTER.intra_latency
    assert transition_cost(dag) == pytest.approx(expected)


def test_cost_shares_a_nic() -> None:
    """Two model-stages extending across the same pair of nodes share one NIC: the time of both
    model-stages' bytes (the critic's a little fewer than the actor's: a value head for the LM head)."""
    one = plan(actor_train=cand(2, 1, (0, 1)), critic_train=cand(2, 1, (2, 3)))
    cur_a = plan(actor_train=cand(2, 1, (0, 1)), critic_train=cand(2, 1, (2, 3)))
    tgt_a = plan(actor_train=cand(2, 1, (0, 1, 8, 9)), critic_train=cand(2, 1, (2, 3)))
    tgt_b = plan(actor_train=cand(2, 1, (0, 1, 8, 9)), critic_train=cand(2, 1, (2, 3, 10, 11)))
    single = build_transition(cur_a, tgt_a, MODELS, CLUSTER, PPO)
    double = build_transition(one, tgt_b, MODELS, CLUSTER, PPO)
    nic = 2 * single.nodes[0].transfers[0].bytes / CLUSTER.inter_bw
    critic = sum(t.bytes for n in lanes(double) if n.model_stage == "critic_train" for t in n.transfers)
    assert 0 < critic < 2 * single.nodes[0].transfers[0].bytes
    assert single.cost == pytest.approx(CLUSTER.comm_setup + nic + CLUSTER.inter_latency)
    assert double.cost == pytest.approx(
        CLUSTER.comm_setup + nic + critic / CLUSTER.inter_bw + CLUSTER.inter_latency
    )
    sched = schedule(double)
    assert sched.makespan == double.cost and len(sched.critical_path) >= 1


def test_validation_catches_a_missing_resource_edge() -> None:
    cur = plan(ref_infer=cand(1, 1, (0,)), critic_infer=cand(1, 1, (1,)))
    tgt = plan(ref_infer=cand(1, 1, (1,)), critic_infer=cand(1, 1, (2,)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    broken = without_resource_edges(dag)
    report = validate(broken)
    assert not report.valid and "gpu conflict" in report.kinds()


def test_validation_catches_destroying_the_last_copy_first() -> None:
    cur = plan(critic_train=cand(2, 1, (0, 1)))
    tgt = plan(critic_train=cand(2, 1, (8, 9)))
    extend, destroy = build_transition(cur, tgt, MODELS, CLUSTER, PPO).nodes
    dag = with_nodes(
        build_transition(cur, tgt, MODELS, CLUSTER, PPO),
        destroy._replace(id=0, deps=()),
        extend._replace(id=1),
    )
    report = validate(dag)
    assert not report.valid and {"last copy", "structure"} <= report.kinds()


def test_validation_catches_memory_overflow() -> None:
    cur = plan(actor_gen=cand(1, 1, (0, 1)), actor_train=cand(2, 1, (2, 3)))
    tgt = plan(actor_gen=cand(1, 1, (4, 5)), actor_train=cand(2, 1, (0, 1)))
    dag = build_transition(cur, tgt, MODELS, with_memory(85), PPO)
    assert validate(dag).valid
    # 20 GB more already resident on GPUs 0-1: the 64 GB of training state landing there overflows.
    base = dag.context.current_memory
    extra = tuple(m + (20e9 if g in (0, 1) else 0.0) for g, m in enumerate(base))
    report = validate(
        dataclasses.replace(dag, context=dataclasses.replace(dag.context, current_memory=extra))
    )
    assert not report.valid and report.kinds() & {"memory", "memory (concurrent)"}


def test_validation_sees_memory_effects_changed_after_build() -> None:
    cur = plan(actor_gen=cand(1, 1, (0, 1)), actor_train=cand(2, 1, (2, 3)))
    tgt = plan(actor_gen=cand(1, 1, (4, 5)), actor_train=cand(2, 1, (0, 1)))
    dag = build_transition(cur, tgt, MODELS, with_memory(85), PPO)
    assert validate(dag).valid
    grower = next(n for n in dag.nodes if n.op is Primitive.EXTEND and n.model_stage == "actor_train")
    heavier = grower._replace(mem=Memory(grower.mem.gpus, grower.mem.net + 100e9, grower.mem.transient))
    report = validate(with_nodes(dag, *(heavier if n is grower else n for n in dag.nodes)))
    assert not report.valid and report.kinds() >= {"memory", "memory (concurrent)"}


def test_validation_names_a_unit_made_twice_or_where_one_is() -> None:
    cur = plan(actor_train=cand(2, 1, range(4)), critic_train=cand(2, 1, range(8, 12)))
    tgt = plan(actor_train=cand(2, 1, range(8)), critic_train=cand(2, 1, range(8, 12)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    grower = next(n for n in dag.nodes if n.op is Primitive.EXTEND)
    for targets in (Units(grower.targets.layout, grower.targets.gpus * 2), grower.sources[:1]):
        broken = with_nodes(dag, *(n._replace(targets=targets) if n is grower else n for n in dag.nodes))
        report = validate(broken)
        assert not report.valid and "where a unit already is" in report.problems[0]
