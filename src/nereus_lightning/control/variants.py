"""Cheap plan variants: the same layouts re-fitted to a pool, or with smaller batches / recompute.

These are the "slightly slower candidates with cheaper transitions" the admission rule tries when
the planner's best target fails, and the memory relief the urgent path considers.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import replace

from nereus_lightning.plan.layout import Candidate, Plan
from nereus_lightning.plan.overlap import groups_by_stage
from nereus_lightning.spec.workload import ModelStage, workflow


def relief_variants(plan: Plan, stages: Collection[str]) -> list[Plan]:
    """``plan`` with the model-stages ``stages`` relieved: activation recomputation on, halved
    micro-batches, and both. The other model-stages stay as they are: relief costs time (halved
    generation micro-batches double the decode steps) and buys nothing where memory fits."""

    def relieved(recompute: bool, halve: bool) -> Plan:
        return Plan(
            tuple(
                (
                    n,
                    replace(
                        c,
                        recompute=c.recompute or recompute,
                        micro_batch=max(1, c.micro_batch // 2) if halve else c.micro_batch,
                    )
                    if n in stages
                    else c,
                )
                for n, c in plan.items()
            )
        )

    out: list[Plan] = []
    for variant in (relieved(True, False), relieved(False, True), relieved(True, True)):
        if variant != plan and variant not in out:
            out.append(variant)
    return out


def _dp_ok(ms: ModelStage, dp: int, batch: int) -> bool:
    # Training keeps the global batch dp * b * a fixed, so its DP degree must divide the batch.
    return not ms.trains or batch % dp == 0


def follow_pool(plan: Plan, algorithm: str, num_gpus: int, batch: int) -> Plan | None:
    """Keep every model-stage's TP/PP layout and re-fit only its DP degree to ``num_gpus`` GPUs.

    The groups of one stage (``plan.overlap``: colocated model-stages share a group's GPUs and
    run in turn) share the stage's GPUs; each model-stage keeps at least one replica and the
    spare GPUs go, one replica at a time, to the model-stage with the most work per replica
    (work = its replica count in ``plan``). GPUs are handed out in contiguous blocks, one per
    group (its members all from its first GPU), largest layouts first, so power-of-two TP groups
    stay node-aligned. Returns None if even one replica per model-stage does not fit.
    """
    stages = {ms.name: ms for ms in workflow(algorithm)}
    stage_of = {n: stages[n].stage for n in plan}
    chosen: dict[str, Candidate] = {}
    for groups in groups_by_stage(plan, stage_of).values():
        names = [n for g in groups for n in g]
        group_of = {n: g for g in groups for n in g}
        dp = {n: 1 for n in names}

        def size(group: tuple[str, ...], dp: dict[str, int] = dp) -> int:
            return max(dp[n] * plan[n].layout.size for n in group)

        used = sum(size(g) for g in groups)
        if used > num_gpus:
            return None
        # Keep the GPU shares the plan gave each model-stage (its share of the work).
        work = {n: float(plan[n].num_gpus) for n in names}
        while True:
            options = []
            for n in names:
                nxt = _next_dp(stages[n], dp[n], batch)
                if nxt is None:
                    continue
                group = group_of[n]
                grown = max(size(group), nxt * plan[n].layout.size)
                if used + grown - size(group) <= num_gpus:
                    options.append((n, nxt, grown - size(group)))
            if not options:
                break
            n, nxt, extra = max(
                options, key=lambda o: (work[o[0]] / (dp[o[0]] * plan[o[0]].layout.size), -names.index(o[0]))
            )
            used += extra
            dp[n] = nxt
        start = 0
        for group in sorted(groups, key=lambda g: -max(plan[m].layout.size for m in g)):
            for n in group:
                chosen[n] = replace(
                    plan[n], dp=dp[n], gpus=tuple(range(start, start + dp[n] * plan[n].layout.size))
                )
            start += size(group)
    return Plan(tuple((n, chosen[n]) for n, _ in plan.items()))


def _next_dp(ms: ModelStage, dp: int, batch: int) -> int | None:
    # The next admissible DP degree above dp (training: the next divisor of the batch).
    for cand in range(dp + 1, batch + 1):
        if _dp_ok(ms, cand, batch):
            return cand
    return None


def intact_plan(plan: Plan, pool: set[int] | frozenset[int]) -> Plan | None:
    """The replicas of ``plan`` whose GPUs all survive in ``pool``.

    A transition after a revocation starts from these intact units. None if some model-stage
    lost every replica (its state must come from a checkpoint).
    """
    out = []
    for name, cand in plan.items():
        keep = [r for r in range(cand.dp) if set(cand.replica_gpus(r)) <= pool]
        if not keep:
            return None
        if len(keep) == cand.dp:
            out.append((name, cand))
        else:
            gpus = tuple(g for r in keep for g in cand.replica_gpus(r))
            out.append((name, replace(cand, dp=len(keep), gpus=gpus)))
    return Plan(tuple(out))


def place_near(plan: Plan, current: Plan, algorithm: str) -> Plan:
    """``plan`` with each stage's GPU blocks reordered to follow where ``current`` has them.

    The planner hands out contiguous blocks in a canonical order; when two model-stages of one
    stage swap places between plans, neither can move first (each waits for GPUs the other
    holds). Keeping every group's block (``plan.overlap``: colocated model-stages share one) near
    its current GPUs avoids such swaps and moves less state. Sizes, layouts and each member's
    first GPU inside its group's block are unchanged (each member gets a contiguous run); callers
    re-price the result, since a reordering can break node alignment.
    """
    stages = {ms.name: ms.stage for ms in workflow(algorithm)}
    chosen: dict[str, Candidate] = {}
    for groups in groups_by_stage(plan, {n: stages[n] for n in plan}).values():
        names = [n for g in groups for n in g]
        first = {g: min(min(plan[n].gpus) for n in g) for g in groups}
        where = {g: min((min(current[n].gpus) for n in g if n in current), default=0) for g in groups}
        start = min(first.values())
        for group in sorted(groups, key=lambda g: (where[g], names.index(g[0]))):
            ends = []
            for n in group:
                lo = start + min(plan[n].gpus) - first[group]
                chosen[n] = replace(plan[n], gpus=tuple(range(lo, lo + plan[n].num_gpus)))
                ends.append(lo + plan[n].num_gpus)
            start = max(ends)
    return Plan(tuple((n, chosen[n]) for n, _ in plan.items()))


def keep_layouts(plan: Plan, current: Plan) -> Plan:
    """``plan``'s GPU blocks, but every model-stage keeps its current layout where it fits the block.

    A model-stage whose block holds a whole number of current replicas needs no Split or Merge,
    only Extend/Destroy: a slightly slower target with a much cheaper (and more often feasible)
    transition. Callers re-price the result (DP degrees may not split the batch).
    """
    out = []
    for name, cand in plan.items():
        cur = current[name] if name in current else None
        if cur is not None and cur.layout != cand.layout and cand.num_gpus % cur.layout.size == 0:
            cand = Candidate(
                cur.layout, cand.num_gpus // cur.layout.size, cand.gpus, cur.micro_batch, cur.recompute
            )
        out.append((name, cand))
    return Plan(tuple(out))
