"""A sharded training stage whose shard degree alone changes is re-cut in place: one Split (growing) or
Merge (shrinking) per replica, priced by ``recut_transfers``, acquiring the GPUs it adds after the peer
that holds them leaves, releasing the GPUs it drops; where ``lcm(d, d')`` does not divide every row
count its shard groups move whole instead."""

from __future__ import annotations

import pytest

from nereus_lightning.plan.layout import Candidate, Layout
from nereus_lightning.plan.units import Primitive
from nereus_lightning.transition import build_transition, validate
from nereus_lightning.transition.pieces import geometry, recut_transfers
from tests.helpers import cand, plan
from tests.transition.helpers import CLUSTER, MODELS, PPO

OTHERS = {  # every other stage on GPUs 0-31, each alone in its stage, the same in both plans
    "actor_gen": cand(2, 1, range(32)),
    "actor_infer": cand(2, 1, range(32)),
    "ref_infer": cand(2, 1, range(32)),
    "critic_infer": cand(2, 1, range(32)),
    "reward_infer": cand(2, 1, range(32)),
}
CRITIC_NOW, CRITIC_THEN = cand(2, 1, (4, 5, 6, 7, 12, 13, 14, 15)), cand(2, 1, range(16, 24))


def _actor(shard: int, zero: int) -> Candidate:
    """Two replicas of shard ``shard`` x TP2: on GPUs 0-3 and 8-11 at shard 2, each on a superset of
    those at a larger degree (the GPUs after them, which the critic holds now)."""
    gpus = [g for base in (0, 8) for g in range(base, base + 2 * shard)]
    return Candidate(Layout(2, 1, shard=shard, zero=zero), 2, tuple(gpus))


def _dag(shard_now: int, shard_then: int, zero: int = 1):  # noqa: ANN202
    a, b = _actor(shard_now, zero), _actor(shard_then, zero)
    # growing, the actor takes GPUs its peer (the critic) holds now; shrinking, it leaves them to it
    critic = (CRITIC_NOW, CRITIC_THEN) if shard_then > shard_now else (CRITIC_THEN, CRITIC_NOW)
    current = plan(**OTHERS, actor_train=a, critic_train=critic[0])
    target = plan(**OTHERS, actor_train=b, critic_train=critic[1])
    return build_transition(current, target, MODELS, CLUSTER, PPO), a, b


@pytest.mark.parametrize("zero", [1, 3])
def test_growing_the_shard_degree_is_one_split_per_replica_priced_by_the_row_moves(zero: int) -> None:
    dag, a, b = _dag(2, 4, zero)
    assert validate(dag, random_orders=3, seed=zero).valid
    actor = [lane for n in dag.nodes if n.model_stage == "actor_train" for lane in n.lanes()]
    assert [lane.op for lane in actor] == [Primitive.SPLIT] * 2
    geo = geometry(MODELS["actor"], True)
    mem_a, mem_b = (dag.context.memory_of("actor_train", x.layout) for x in (a, b))
    critic_leaves = {n.id: set(n.released_gpus) for n in dag.nodes if n.model_stage == "critic_train"}
    replicas = {(a.replica_gpus(r), b.replica_gpus(r)) for r in range(2)}
    assert {(lane.sources.gpus[0], lane.targets.gpus[0]) for lane in actor} == replicas
    for lane in actor:
        old, new = lane.sources.gpus[0], lane.targets.gpus[0]
        assert lane.transfers == tuple(recut_transfers(geo, a.layout, b.layout, old, new))
        added = tuple(g for g in new if g not in old)
        assert lane.acquired_gpus == added and lane.released_gpus == ()
        nets = dict(zip(lane.mem.gpus.tolist(), lane.mem.net.tolist(), strict=True))
        assert nets == {g: mem_b if g in added else mem_b - mem_a for g in new}
        # it lands on GPUs the critic holds now: only after the critic has left them
        leaving = {i for i, left in critic_leaves.items() if not left.isdisjoint(added)}
        assert leaving and leaving.issubset(_ancestors(dag, lane.id)), (lane, leaving)


def test_shrinking_the_shard_degree_is_one_merge_per_replica_releasing_the_dropped_gpus() -> None:
    dag, a, b = _dag(4, 2)
    assert validate(dag, random_orders=3, seed=1).valid
    actor = [lane for n in dag.nodes if n.model_stage == "actor_train" for lane in n.lanes()]
    assert [lane.op for lane in actor] == [Primitive.MERGE] * 2
    geo = geometry(MODELS["actor"], True)
    replicas = {(a.replica_gpus(r), b.replica_gpus(r)) for r in range(2)}
    assert {(lane.sources.gpus[0], lane.targets.gpus[0]) for lane in actor} == replicas
    for lane in actor:
        old, new = lane.sources.gpus[0], lane.targets.gpus[0]
        assert lane.transfers == tuple(recut_transfers(geo, a.layout, b.layout, old, new))
        assert lane.released_gpus == tuple(g for g in old if g not in new) and lane.acquired_gpus == ()
    # the critic lands on the GPUs the actor drops only after the actor's Merges
    merges = {n.id for n in dag.nodes if n.model_stage == "actor_train"}
    for n in dag.nodes:
        if n.model_stage == "critic_train" and set(n.acquired_gpus) & {4, 5, 6, 7, 12, 13, 14, 15}:
            assert merges.issubset(_ancestors(dag, n.id))


def test_a_degree_whose_lcm_does_not_divide_the_rows_moves_the_shard_groups_whole() -> None:
    """Shard 2 -> 3: ``lcm = 6`` divides no hidden size of 4096, so no re-cut is offered."""
    dag, _, _ = _dag(2, 3)
    actor = [n for n in dag.nodes if n.model_stage == "actor_train"]
    assert all(n.sources.layout.shard == n.targets.layout.shard == 1 for n in actor)
    assert Primitive.EXTEND in {n.op for n in actor}


def _ancestors(dag, node: int) -> set[int]:  # noqa: ANN001
    seen, todo = set(), list(dag.nodes[node].deps)
    while todo:
        d = todo.pop()
        if d not in seen:
            seen.add(d)
            todo += dag.nodes[d].deps
    return seen
