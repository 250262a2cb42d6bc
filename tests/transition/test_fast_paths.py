"""The shortcuts that make building and validating fast keep their answers exact."""

from __future__ import annotations

import copy
import random

from nereus_lightning.plan.layout import Layout
from nereus_lightning.transition import Primitive, build_transition, validate
from nereus_lightning.transition.dag import memory_growth
from nereus_lightning.transition.local import _remote_picks, local_dag
from nereus_lightning.transition.pieces import geometry
from nereus_lightning.transition.scenarios import random_case
from tests.transition.helpers import CLUSTER, MODELS, PPO, cand, lanes, plan, with_memory


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
        key = lambda n: (n.op, n.sources, n.targets, n.mem, n.transfers)  # noqa: E731
        assert sorted(map(key, split)) == sorted(map(key, one))
        assert len(many) < len(one) or len(one) <= 1
        owner = {}  # per-replica node id -> batched node id, matched by what it does
        lookup = {key(n): n.id for n in many for n in n.lanes()}
        for n in one:
            owner[n.id] = lookup[key(n)]
        for n in one:
            assert all(owner[d] in many[owner[n.id]].deps for d in n.deps)
        assert all(0 <= d < n.id for n in many for d in n.deps)


def test_model_stages_a_same_stage_peer_blocks_stay_per_replica() -> None:
    cur = plan(ref_infer=cand(1, 1, (0, 4)), critic_infer=cand(1, 1, (1, 5)))
    tgt = plan(ref_infer=cand(1, 1, (1, 5)), critic_infer=cand(1, 1, (2, 6)))
    dag = build_transition(cur, tgt, MODELS, CLUSTER, PPO)
    assert all(n.width == 1 for n in dag.nodes if n.model_stage == "ref_infer")
    assert any(n.width == 2 for n in dag.nodes if n.model_stage == "critic_infer")
    assert validate(dag).valid and dag.resource_edges >= 2


def test_same_layout_shortcut_gives_the_general_paths_lanes(monkeypatch) -> None:
    """Random plan pairs (every overlap kind, 8 to 256 GPUs): each model-stage's local DAG is the
    same with and without the same-layout shortcut."""
    from nereus_lightning.transition import local
    from nereus_lightning.transition.build import make_context
    from nereus_lightning.transition.scenarios import OVERLAP_KINDS

    def lanes_of(ctx, shortcut: bool) -> list:
        monkeypatch.setattr(local, "SAME_LAYOUT_SHORTCUT", shortcut)
        out = []
        for name, cur in ctx.current.items():
            ms = ctx.stages[name]
            geo = geometry(ctx.models[ms.model], ms.trains)
            nodes = local.local_dag(
                name, geo, lambda lay, _n=name: ctx.memory_of(_n, lay), cur, ctx.target[name], ctx.cluster
            )
            out.append([(n.op, n.sources, n.targets, n.mem, n.deps, n.transfers) for n in nodes])
        return out

    rng = random.Random(7)
    used = 0
    for i in range(24):
        case = random_case(rng, OVERLAP_KINDS[i % len(OVERLAP_KINDS)], (8, 32, 64, 256)[i % 4])
        ctx = make_context(*case.args())
        used += sum(ctx.current[n].layout == ctx.target[n].layout for n in ctx.current)
        assert lanes_of(ctx, True) == lanes_of(ctx, False), case
    assert used > 0, "no case kept a layout"
    # And by hand: grow, shrink, move away, partly onto old GPUs (no shortcut), across machines.
    geo = geometry(MODELS["actor"], True)
    pairs = [
        (cand(2, 1, range(8)), cand(2, 1, range(16))),
        (cand(2, 1, range(16)), cand(2, 1, range(8))),
        (cand(2, 2, range(8)), cand(2, 2, range(16, 32))),
        (cand(1, 1, (0, 1, 2, 3)), cand(1, 1, (2, 3, 4, 5, 8, 9))),
        (cand(2, 1, (0, 1, 2, 3)), cand(2, 1, (1, 2, 8, 9))),
        (cand(4, 1, range(0, 64, 2)), cand(4, 1, range(64))),
    ]
    for current, target in pairs:
        got = []
        for shortcut in (True, False):
            monkeypatch.setattr(local, "SAME_LAYOUT_SHORTCUT", shortcut)
            nodes = local.local_dag("actor_train", geo, lambda layout: 1e9, current, target, CLUSTER)
            got.append([(n.op, n.sources, n.targets, n.mem, n.deps, n.transfers) for n in nodes])
        assert got[0] == got[1] and got[0], (current, target)


def _local_lanes_with(monkeypatch, flag: str, value: bool, current, target, cluster=CLUSTER) -> list:
    from nereus_lightning.transition import local

    monkeypatch.setattr(local, flag, value)
    geo = geometry(MODELS["actor"], True)
    nodes = local.local_dag("actor_train", geo, lambda layout: 1e9 * layout.size, current, target, cluster)
    return [(n.op, n.sources, n.targets, n.mem, n.deps, n.transfers) for n in nodes]


def test_bulk_shortcuts_give_the_general_paths_lanes(monkeypatch) -> None:
    """Regular plans (every unit decided alike) built in bulk give the per-unit path's lanes, and
    irregular ones (where the bulk checks must fail) too."""
    from nereus_lightning.transition import local
    from nereus_lightning.transition.build import make_context
    from nereus_lightning.transition.scenarios import OVERLAP_KINDS

    big = CLUSTER.with_gpus(256)
    pairs = [
        (cand(2, 1, range(64)), cand(1, 1, range(64))),  # full split in place
        (cand(4, 1, range(64)), cand(2, 1, range(64))),  # split into strided TP2 slots
        (cand(2, 2, range(64)), cand(1, 2, range(64))),  # TP split with PP
        (cand(4, 2, range(64)), cand(4, 1, range(64))),  # PP split
        (cand(2, 1, range(64)), cand(4, 1, range(64))),  # pairwise merge of consecutive units
        (cand(1, 2, range(64)), cand(1, 4, range(64))),  # PP merge
        (cand(2, 1, range(64)), cand(8, 1, range(64))),  # merge of four
        (cand(1, 1, range(64)), cand(2, 1, range(64))),  # merge of strided slots
        (cand(2, 1, range(64)), cand(4, 1, range(128))),  # merge and extend
        (cand(2, 1, range(64)), cand(1, 1, range(32, 160))),  # split, move, extend
        (cand(2, 1, (*range(0, 64, 2), *range(1, 64, 2))), cand(4, 1, range(64))),  # irregular
        (cand(4, 1, range(64)), cand(2, 1, (*range(0, 64, 2), *range(1, 64, 2)))),  # irregular
        (cand(2, 2, range(64)), cand(4, 1, range(128))),  # reshard through T_sub
        (cand(2, 1, range(64)), cand(2, 1, range(128))),  # DP grows after the current GPUs
        (cand(1, 1, range(0, 64, 2)), cand(1, 1, (*range(0, 64, 2), *range(64, 128)))),  # chained Extends
    ]
    for current, target in pairs:
        fast = _local_lanes_with(monkeypatch, "BULK_SHORTCUTS", True, current, target, big)
        slow = _local_lanes_with(monkeypatch, "BULK_SHORTCUTS", False, current, target, big)
        assert fast == slow and fast, (current, target)
    rng = random.Random(11)
    for i in range(24):
        case = random_case(rng, OVERLAP_KINDS[i % len(OVERLAP_KINDS)], (8, 32, 64, 256)[i % 4])
        ctx = make_context(*case.args())
        got = []
        for bulk in (True, False):
            monkeypatch.setattr(local, "BULK_SHORTCUTS", bulk)
            got.append(
                [
                    [(n.op, n.sources, n.targets, n.mem, n.deps, n.transfers) for n in lanes]
                    for lanes in (
                        local.local_dag(
                            name,
                            geometry(ctx.models[ctx.stages[name].model], ctx.stages[name].trains),
                            lambda lay, _n=name, _c=ctx: _c.memory_of(_n, lay),
                            cur,
                            ctx.target[name],
                            ctx.cluster,
                        )
                        for name, cur in ctx.current.items()
                    )
                ]
            )
        assert got[0] == got[1], case


def test_early_memory_infeasibility_agrees_with_the_replay(monkeypatch) -> None:
    """The up-front 'can never fit' check only raises where the ordered replay would also fail."""
    from nereus_lightning.spec.errors import InfeasiblePlanError
    from nereus_lightning.transition import build
    from nereus_lightning.transition.scenarios import OVERLAP_KINDS

    def outcome(case, early: bool) -> str:
        monkeypatch.setattr(build, "_never_fits", build._never_fits if early else lambda *a: None)
        build._build.cache_clear()
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
    build._build.cache_clear()


def test_validate_names_a_unit_made_twice_or_where_one_is() -> None:
    cur = plan(actor_train=cand(2, 1, range(4)), critic_train=cand(2, 1, range(8, 12)))
    tgt = plan(actor_train=cand(2, 1, range(8)), critic_train=cand(2, 1, range(8, 12)))
    for twice in (True, False):
        dag = copy.deepcopy(build_transition(cur, tgt, MODELS, CLUSTER, PPO))
        grower = next(n for n in dag.nodes if n.op is Primitive.EXTEND)
        grower.targets = grower.targets * 2 if twice else (grower.sources[0],)
        report = validate(dag)
        assert not report.valid and "where a unit already is" in report.problems[0]


def _heap_free_reference(pools: list[list[int]], fresh: list[bool], count: int) -> list[int]:
    """The Extend loop's remote choice by brute force: least-sent node, then least-loaded source,
    reused (not fresh) first, then the lower index; only these picks load sources."""
    node_of = {k: i for i, pool in enumerate(pools) for k in pool}
    sent, load, out = [0] * len(pools), dict.fromkeys(node_of, 0), []
    for _ in range(count):
        k = min(node_of, key=lambda k: (sent[node_of[k]], load[k], fresh[k], k))
        sent[node_of[k]] += 1
        load[k] += 1
        out.append(k)
    return out


def test_remote_picks_in_rounds_equal_the_brute_force_choice() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n_cand = rng.randint(1, 24)
        fresh = sorted(rng.random() < 0.4 for _ in range(n_cand))  # non-decreasing, as required
        nodes = [rng.randrange(max(1, n_cand // 3)) for _ in range(n_cand)]
        pools = [[k for k in range(n_cand) if nodes[k] == nd] for nd in dict.fromkeys(nodes)]
        count = rng.randint(1, 3 * n_cand)
        assert list(_remote_picks(pools, fresh, count)) == _heap_free_reference(pools, fresh, count)


def test_peer_resource_edges_equal_the_per_gpu_brute_force() -> None:
    """Random plan pairs (every overlap kind, several stages sharing GPUs): each Extend's resource
    edges are exactly the releases by which a same-stage peer left one of its GPUs (less its local
    deps), and every 'still held' reason names the first peer holding one of its GPUs."""
    from nereus_lightning.spec.errors import InfeasiblePlanError
    from nereus_lightning.transition.build import _tight
    from nereus_lightning.transition.scenarios import OVERLAP_KINDS

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
