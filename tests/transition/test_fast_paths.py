"""The shortcuts that make building and validating fast keep their answers exact."""

from __future__ import annotations

import copy
import random

from nereus_lightning.plan.layout import Layout
from nereus_lightning.transition import Primitive, build_transition, validate
from nereus_lightning.transition.dag import memory_growth
from nereus_lightning.transition.local import local_dag
from nereus_lightning.transition.pieces import geometry
from nereus_lightning.transition.scenarios import random_case
from tests.transition.helpers import CLUSTER, MODELS, PPO, cand, plan, with_memory


def test_cached_memory_growth_equals_a_fresh_sum_over_the_nodes() -> None:
    case = random_case(random.Random(1024), "cross_model_cross_stage", 1024, slack=(1.5, 2.0))
    dag = build_transition(*case.args())
    fresh = memory_growth(dag.nodes, case.cluster.num_gpus)
    assert dag.memory_growth() == fresh
    assert any(fresh), "the case should grow memory somewhere"


def test_validate_sees_memory_effects_changed_after_build() -> None:
    cur = plan(actor_gen=cand(1, 1, (0, 1)), actor_train=cand(2, 1, (2, 3)))
    tgt = plan(actor_gen=cand(1, 1, (4, 5)), actor_train=cand(2, 1, (0, 1)))
    dag = copy.deepcopy(build_transition(cur, tgt, MODELS, with_memory(85), PPO))
    assert validate(dag).valid
    grower = next(n for n in dag.nodes if n.op is Primitive.EXTEND and n.model_stage == "actor_train")
    grower.mem = tuple((g, net + 100e9, transient) for g, net, transient in grower.mem)
    report = validate(dag)
    assert not report.valid and report.kinds() & {"memory", "memory (concurrent)"}
    assert dag.memory_growth() == memory_growth(dag.nodes, CLUSTER.num_gpus)


def test_local_dag_numbers_its_nodes_from_first_id() -> None:
    current, target = cand(2, 1, range(8)), cand(1, 1, (0, 1, 2, 3, 8, 9, 10, 11))
    geo = geometry(MODELS["actor"], True)
    zero = local_dag("actor_train", geo, lambda layout: 1e9, current, target, CLUSTER)
    shifted = local_dag("actor_train", geo, lambda layout: 1e9, current, target, CLUSTER, first_id=10)
    assert [n.id for n in shifted] == [n.id + 10 for n in zero]
    assert [n.deps for n in shifted] == [[d + 10 for d in n.deps] for n in zero]
    assert [(n.op, n.sources, n.targets, n.mem, n.transfers) for n in shifted] == [
        (n.op, n.sources, n.targets, n.mem, n.transfers) for n in zero
    ]


def test_dp_doubling_keeps_every_unit_and_only_extends() -> None:
    """Units already on a target slot are reused in place (no Split, Merge or Destroy)."""
    cur = plan(actor_train=cand(2, 1, range(64)), critic_train=cand(2, 1, range(64, 128)))
    tgt = plan(
        actor_train=cand(2, 1, range(64)), critic_train=cand(2, 1, (*range(64, 128), *range(128, 192)))
    )
    big = CLUSTER.with_gpus(256)
    dag = build_transition(cur, tgt, MODELS, big, PPO)
    assert {n.op for n in dag.nodes} == {Primitive.EXTEND} and len(dag.nodes) == 32
    assert all(n.sources[0].layout == Layout(2, 1) for n in dag.nodes)
    assert validate(dag).valid
