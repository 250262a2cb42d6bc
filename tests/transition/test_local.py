"""The local planner: its phases, its batching and the Extend source choice, checked by the validator."""

from __future__ import annotations

import random
from collections import Counter

import pytest

from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import InfeasiblePlanError
from nereus_lightning.transition import Primitive, build_transition, clear_cache, validate
from nereus_lightning.transition.dag import memory_growth
from nereus_lightning.transition.local import local_dag, plan_extends
from nereus_lightning.transition.pieces import geometry
from nereus_lightning.transition.scenarios import OVERLAP_KINDS, random_case
from tests.helpers import cand, plan
from tests.transition.helpers import CLUSTER, MODELS, PPO, lanes, with_memory

BIG = with_memory(400).with_gpus(256)  # memory is not what the layout cases test


def test_local_dag_numbers_its_nodes_from_first_id() -> None:
    current, target = cand(2, 1, range(8)), cand(1, 1, (0, 1, 2, 3, 8, 9, 10, 11))
    geo = geometry(MODELS["actor"], True)
    zero = local_dag("actor_train", geo, lambda layout: 1e9, current, target, CLUSTER)
    shifted = local_dag("actor_train", geo, lambda layout: 1e9, current, target, CLUSTER, first_id=10)
    assert [n.id for n in shifted] == [n.id + 10 for n in zero]
    assert [n.deps for n in shifted] == [tuple(d + 10 for d in n.deps) for n in zero]
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
    assert {n.op for n in dag.nodes} == {Primitive.EXTEND} and len(lanes(dag)) == 32
    assert all(u.layout == Layout(2, 1) for n in dag.nodes for u in n.sources)
    assert validate(dag).valid
    # One node per chain depth (first copy onto each new machine, then inside it), not per replica.
    assert len(dag.nodes) == 4 and all(n.width == 8 for n in dag.nodes)


def test_batched_local_dag_carries_exactly_the_per_replica_nodes() -> None:
    """A batched local DAG's lanes are the per-replica nodes (units, memory, transfers), and its
    deps cover theirs: every lane's dep lies in a dep of its node."""
    cases = [
        (cand(2, 1, range(8)), cand(1, 1, (0, 1, 2, 3, 8, 9, 10, 11))),  # split, destroy, extend
        (cand(1, 1, range(16)), cand(2, 1, range(16))),  # merge in place
        (cand(2, 1, range(16)), cand(4, 1, (*range(8), *range(24, 32)))),  # move + merge
        (cand(2, 2, range(16)), cand(4, 1, range(32))),  # reshard through T_sub + extend chains
    ]
    geo = geometry(MODELS["actor"], True)
    for current, target in cases:
        one = local_dag("actor_train", geo, lambda layout: 1e9, current, target, CLUSTER)
        many = local_dag("actor_train", geo, lambda layout: 1e9, current, target, CLUSTER, batch=True)
        split = [lane for n in many for lane in n.lanes()]
        key = lambda n: (n.op, tuple(n.sources), tuple(n.targets), tuple(n.mem), tuple(n.transfers))  # noqa: E731
        assert sorted(map(key, split)) == sorted(map(key, one))
        assert len(many) < len(one) or len(one) <= 1
        owner = {}  # per-replica node id -> batched node id, matched by what it does
        lookup = {key(n): n.id for n in many for n in n.lanes()}
        for n in one:
            owner[n.id] = lookup[key(n)]
        for n in one:
            assert all(owner[d] in many[owner[n.id]].deps for d in n.deps)
        assert all(0 <= d < n.id for n in many for d in n.deps)


def test_lanes_a_peer_blocks_wait_for_its_release_and_go_together_when_they_wait_for_the_same_one() -> None:
    """ref_infer moves onto GPUs critic_infer holds now: its Extends wait for critic_infer's
    Destroy node, and since both wait for that one node they share a node; critic_infer, which no
    peer blocks, is batched per step."""
    cur = plan(ref_infer=cand(1, 1, (0, 4)), critic_infer=cand(1, 1, (1, 5)))
    tgt = plan(ref_infer=cand(1, 1, (1, 5)), critic_infer=cand(1, 1, (2, 6)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    extend = next(n for n in dag.nodes if n.model_stage == "ref_infer" and n.op is Primitive.EXTEND)
    release = next(n for n in dag.nodes if n.model_stage == "critic_infer" and n.op is Primitive.DESTROY)
    assert extend.width == 2 and extend.resource_deps == (release.id,)
    assert all(n.width == 2 for n in dag.nodes if n.model_stage == "critic_infer")
    assert validate(dag).valid


def test_lanes_waiting_for_different_releases_stay_apart() -> None:
    """Two ref_infer Extends onto GPUs critic_infer releases at different times (one unit it
    drops at once, one it reads first) are carried by separate nodes."""
    cur = plan(ref_infer=cand(1, 1, (0, 4)), critic_infer=cand(1, 1, (1, 5)))
    tgt = plan(ref_infer=cand(1, 1, (1, 5)), critic_infer=cand(1, 1, (2,)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    extends = [n for n in dag.nodes if n.model_stage == "ref_infer" and n.op is Primitive.EXTEND]
    assert sorted(n.width for n in extends) == [1, 1]
    assert extends[0].resource_deps != extends[1].resource_deps
    assert validate(dag).valid


# (current, target, the replica-level primitives expected): each path of the local planner.
LAYOUT_CHANGES = [
    (cand(2, 1, range(64)), cand(1, 1, range(64)), {"split": 32}),  # full split in place
    (cand(4, 1, range(64)), cand(2, 1, range(64)), {"split": 16}),  # split into strided TP2 slots
    (cand(2, 2, range(64)), cand(1, 2, range(64)), {"split": 16}),  # TP split with PP
    (cand(4, 2, range(64)), cand(4, 1, range(64)), {"split": 8}),  # PP split
    (cand(2, 1, range(64)), cand(4, 1, range(64)), {"merge": 16}),  # pairwise merge of consecutive units
    (cand(1, 2, range(64)), cand(1, 4, range(64)), {"merge": 16}),  # PP merge
    (cand(2, 1, range(64)), cand(8, 1, range(64)), {"merge": 8}),  # merge of four
    (cand(1, 1, range(64)), cand(2, 1, range(64)), {"merge": 32}),  # merge of strided slots
    (cand(2, 1, range(64)), cand(4, 1, range(128)), {"merge": 32, "extend": 32}),  # merge and extend
    (cand(2, 1, range(64)), cand(2, 1, range(128)), {"extend": 32}),  # DP grows after the current GPUs
    (cand(2, 1, range(16)), cand(2, 1, range(8)), {"destroy": 4}),  # shrink
    (cand(2, 2, range(8)), cand(2, 2, range(16, 32)), {"extend": 4, "destroy": 2}),  # move away
]


@pytest.mark.parametrize("current, target, expected", LAYOUT_CHANGES)
def test_each_layout_change_takes_the_fewest_primitives_and_validates(current, target, expected) -> None:
    dag = build_transition(plan(actor_train=current), plan(actor_train=target), MODELS, BIG, PPO)
    assert Counter(n.op.value for n in lanes(dag)) == expected
    report = validate(dag, random_orders=2, seed=1)
    assert report.valid, report.problems


def test_a_kept_layout_is_only_extended_and_destroyed_where_new_units_avoid_held_gpus() -> None:
    """Random plan pairs (every overlap kind, 8 to 256 GPUs): a model-stage that keeps its layout,
    and whose new units touch none of the GPUs it holds, keeps every unit it can and neither
    splits nor merges; every DAG validates."""
    rng = random.Random(7)
    checked = 0
    for i in range(24):
        case = random_case(
            rng, OVERLAP_KINDS[i % len(OVERLAP_KINDS)], (8, 32, 64, 256)[i % 4], slack=(2.0, 3.0)
        )
        try:
            dag = build_transition(*case.args())
        except InfeasiblePlanError:
            continue
        assert validate(dag).valid
        for name, cur in case.current.items():
            tgt = case.target[name]
            new = set(tgt.gpus) - set(cur.gpus)
            if cur.layout != tgt.layout or not new or len(tgt.gpus) % cur.layout.size:
                continue
            units = {cur.gpus[i : i + cur.layout.size] for i in range(0, len(cur.gpus), cur.layout.size)}
            moved = [tgt.gpus[i : i + tgt.layout.size] for i in range(0, len(tgt.gpus), tgt.layout.size)]
            if any(set(u) & set(cur.gpus) for u in moved if u not in units):
                continue
            ops = {lane.op for n in dag.nodes if n.model_stage == name for lane in n.lanes()}
            assert ops <= {Primitive.EXTEND, Primitive.DESTROY}, (name, ops)
            checked += 1
    assert checked, "no case kept a layout"


def test_early_memory_infeasibility_agrees_with_the_replay(monkeypatch) -> None:
    """The up-front 'can never fit' check only raises where the ordered replay would also fail."""
    from nereus_lightning.transition import build

    def outcome(case, early: bool) -> str:
        monkeypatch.setattr(build, "_never_fits", build._never_fits if early else lambda *a: None)
        clear_cache()
        try:
            build_transition(*case.args())
        except InfeasiblePlanError as e:
            return "cannot fit" if "cannot fit" in str(e) else "infeasible"
        return "ok"

    rng = random.Random(3)
    cases = [random_case(rng, OVERLAP_KINDS[i % 3], (8, 16, 32, 64)[i % 4]) for i in range(60)]
    early = [outcome(c, True) for c in cases]
    late = [outcome(c, False) for c in cases]
    assert [e != "ok" for e in early] == [x != "ok" for x in late]
    assert "cannot fit" in early, "no case exercised the early check"
    clear_cache()


def _brute_force_sources(candidates, reused, missing, gpn) -> list:
    """``plan_extends``'s rule by brute force: on a node with candidates (or slots made there),
    the least-loaded of them, reused first; else the first slot of a node takes the candidate of
    the least-sent node, least loaded, reused first, lower index; later slots there chain."""
    n_cand = len(candidates)
    fresh = [t not in reused for t in candidates] + [True] * len(missing)
    load, sent, tail, out = [0] * len(fresh), Counter(), {}, []
    node_of = [t[0] // gpn for t in candidates]
    made_on: dict[int, list[int]] = {}
    for j, slot in enumerate(missing):
        node = slot[0] // gpn
        local = [k for k in range(n_cand) if node_of[k] == node] + made_on.get(node, [])
        if node in tail:
            si = tail[node]
        elif local:
            si = min(local, key=lambda k: (load[k], fresh[k]))
            made_on.setdefault(node, []).append(n_cand + j)
            load[si] += 1
        else:
            si = min(range(n_cand), key=lambda k: (sent[node_of[k]], load[k], fresh[k], k))
            sent[node_of[si]] += 1
            load[si] += 1
        if node in tail or not local:
            tail[node] = n_cand + j
        out.append(candidates[si] if si < n_cand else missing[si - n_cand])
    return out


def test_extend_sources_follow_the_documented_rule() -> None:
    rng = random.Random(7)
    for _ in range(300):
        gpn = rng.choice((2, 4, 8))
        gpus = rng.sample(range(16 * gpn), rng.randint(2, 12 * gpn))
        cut = rng.randint(1, len(gpus) - 1)
        candidates = [(g,) for g in gpus[:cut]]
        missing = [(g,) for g in gpus[cut:]]
        reused = {t for t in candidates if rng.random() < 0.4}
        got = plan_extends(candidates, reused, missing, gpn).sources
        assert got == _brute_force_sources(candidates, reused, missing, gpn)


def test_peer_resource_edges_equal_the_per_gpu_brute_force() -> None:
    """Random plan pairs (every overlap kind, several stages sharing GPUs): each Extend's resource
    edges are exactly the releases by which a same-stage peer left one of its GPUs (less its local
    deps), and every 'still held' reason names the first peer holding one of its GPUs."""
    from nereus_lightning.transition.build import _tight

    rng = random.Random(5)
    checked = held = 0
    for i in range(60):
        case = random_case(rng, OVERLAP_KINDS[i % len(OVERLAP_KINDS)], (8, 16, 32, 64)[i % 4])
        try:
            dag = build_transition(*case.args())
        except InfeasiblePlanError as e:
            held += "still held by" in str(e)
            continue
        if _tight(dag.context, dag.memory_growth()):
            continue  # memory edges too
        stage = {name: dag.context.stages[name].stage for name in dag.context.current}
        for n in dag.nodes:
            if n.op is not Primitive.EXTEND:
                continue
            acquired = set(n.acquired_gpus)
            expected = {
                m.id
                for m in dag.nodes
                if m.model_stage != n.model_stage
                and stage[m.model_stage] == stage[n.model_stage]
                and not acquired.isdisjoint(m.released_gpus)
            }
            local = set(n.deps) - set(n.resource_deps)
            assert set(n.resource_deps) == expected - local, (case, n)
            checked += bool(n.resource_deps)
    assert checked and held, "no case exercised peer edges or a peer-held block"


def test_growth_bounds_every_replay() -> None:
    """Resident memory plus ``memory_growth`` bounds what the validator's replays reach."""
    case = random_case(random.Random(1024), "cross_model_cross_stage", 1024, slack=(1.5, 2.0))
    dag = build_transition(*case.args())
    growth = memory_growth(dag.nodes, case.cluster.num_gpus)
    assert any(growth), "the case should grow memory somewhere"
    bound = max(base + grow for base, grow in zip(dag.context.current_memory, growth, strict=True))
    assert validate(dag, random_orders=2).peak_memory <= bound * (1 + 1e-12)


def test_an_extend_onto_another_node_copies_a_reused_piece_first() -> None:
    """TP2 x PP2 on GPUs 4-7 -> TP1 on 6-9: the pieces on 6 and 7 stay, those on 4 and 5 go. The
    copy onto the other node (8, then chained to 9) reads a piece that stays, so the unused ones
    are destroyed at once. (Before the rewrite the candidates' heap was never heapified and the
    first candidate, GPU 4, was read instead: 9 of 1,500 random cases built such a DAG, none of
    the golden ones.)"""
    dag = build_transition(
        plan(actor_train=cand(2, 2, (4, 5, 6, 7))),
        plan(actor_train=cand(1, 1, (6, 7, 8, 9))),
        MODELS,
        BIG,
        PPO,
    )
    extends = [n for n in lanes(dag) if n.op is Primitive.EXTEND]
    assert [(n.sources[0].gpus, n.targets[0].gpus) for n in extends] == [((6,), (8,)), ((8,), (9,))]
    dropped = [n.sources[0].gpus for n in lanes(dag) if n.op is Primitive.DESTROY]
    assert sorted(dropped) == [(4,), (5,)] and validate(dag, random_orders=2).valid
