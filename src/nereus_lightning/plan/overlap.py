"""Which model-stages of a plan run at the same time: the one definition of colocation.

Stages (generation, inference, training) run one after another. Inside one stage, two
model-stages that share at least one GPU in the plan run one after another, in plan order
(colocated, as verl runs every role on one GPU); model-stages on disjoint GPUs run concurrently.
A stage's *groups* are the connected components of the "shares a GPU" relation among its
model-stages: members of one group run sequentially, different groups concurrently. The
planner, ``estimate_plan``, the transition DAG and the controller all ask this module.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence

from nereus_lightning.plan.layout import Plan


def stage_groups(plan: Plan, members: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """Connected components of "shares a GPU" among ``members`` (one stage's model-stages).

    Groups are ordered by their first member, members in plan order.
    """
    wanted = set(members)
    order = [n for n in plan if n in wanted]
    if len(order) < 2:  # (nothing to compare)
        return (tuple(order),) if order else ()
    every = [plan[n].gpus for n in order]
    if len(set().union(*every)) == sum(map(len, every)):  # (a candidate lists a GPU once) all disjoint
        return tuple((n,) for n in order)
    gpus = {n: frozenset(plan[n].gpus) for n in order}
    groups: list[list[str]] = []
    for n in order:  # merge n with every group it shares a GPU with (keeping the first one's place)
        touching = [g for g in groups if any(not gpus[n].isdisjoint(gpus[m]) for m in g)]
        if touching:
            first = touching[0]
            for g in touching[1:]:
                first += g
                groups.remove(g)
            first.append(n)
        else:
            groups.append([n])
    return tuple(tuple(sorted(g, key=order.index)) for g in groups)


def groups_by_stage(plan: Plan, stage_of: Mapping[str, str]) -> dict[str, tuple[tuple[str, ...], ...]]:
    """:func:`stage_groups` of every stage that has model-stages in ``plan`` (stages in plan order)."""
    stages: dict[str, list[str]] = {}
    for n in plan:
        stages.setdefault(stage_of[n], []).append(n)
    return {stage: stage_groups(plan, names) for stage, names in stages.items()}


def colocated(plan: Plan, stage_of: Mapping[str, str]) -> tuple[tuple[str, ...], ...]:
    """The groups of more than one model-stage (those that run sequentially on shared GPUs)."""
    return tuple(g for groups in groups_by_stage(plan, stage_of).values() for g in groups if len(g) > 1)


def concurrent(plan: Plan, a: str, b: str, stage_of: Mapping[str, str]) -> bool:
    """Whether ``a`` and ``b`` run at the same time: the same stage and different groups."""
    if a == b or stage_of[a] != stage_of[b]:
        return False
    names = [n for n in plan if stage_of[n] == stage_of[a]]
    return not any(a in g and b in g for g in stage_groups(plan, names))


def concurrent_pairs(plan: Plan, stage_of: Mapping[str, str]) -> frozenset[frozenset[str]]:
    """Every unordered pair of model-stages that run at the same time under ``plan``."""
    out: set[frozenset[str]] = set()
    for groups in groups_by_stage(plan, stage_of).values():
        for i, first in enumerate(groups):
            for second in groups[i + 1 :]:
                out.update(frozenset((a, b)) for a in first for b in second)
    return frozenset(out)


def partitions(members: Sequence[str]) -> Iterator[tuple[tuple[str, ...], ...]]:
    """Every way to cut ``members`` into groups (set partitions, Bell-number many), members in the
    given order; all-singletons (fully concurrent) comes first."""
    if not members:
        yield ()
        return
    first, rest = members[0], members[1:]
    for sub in partitions(rest):
        yield ((first,), *sub)
        for i in range(len(sub)):
            yield (*sub[:i], (first, *sub[i]), *sub[i + 1 :])


def describe_groups(groups: Iterable[tuple[str, ...]]) -> str:
    """Groups as text, e.g. ``actor_infer -> ref_infer | critic_infer`` (``->``: one after another)."""
    return " | ".join(" -> ".join(g) for g in groups)


def transition_peers(current: Plan, target: Plan, stage_of: Mapping[str, str]) -> dict[str, tuple[str, ...]]:
    """Per model-stage, those that run concurrently with it under both plans (in plan order).

    Only they must never share a GPU while a transition moves units: a pair that shares GPUs
    under either plan runs in turn there, so its units may meet on a GPU (memory permitting).
    """
    both = concurrent_pairs(current, stage_of) & concurrent_pairs(target, stage_of)
    return {a: tuple(b for b in current if frozenset((a, b)) in both) for a in current}
