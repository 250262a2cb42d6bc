"""The planner (Eq. 1): fastest plan under the memory cap and the stage-wise GPU budgets.

1. Per model-stage, enumerate candidates (power-of-two TP dividing the heads, power-of-two PP,
   DP from the GPUs left, micro-batch options, recompute and ZeRO variants for training) and price
   each with the cost model, placed as the planner will place it (``comm.canonical_links``); see
   ``options.py``.
2. Drop the ones over the memory cap (each stage's predicted peaks times its measured memory
   factor, ``calibration.MemoryCalibration``: the cap divided by it), choose per GPU count the
   leanest candidate within 2% of the fastest (``options.leanest_within``), and drop the
   dominated ones: the frontier keeps only GPU counts faster than every smaller one. "Fastest"
   below means fastest over these choices (the search is exact for them).
3. Stages run one after another, so for a fixed memory budget the step latency is a sum of
   independent per-stage problems. In one stage, model-stages on disjoint GPUs run concurrently
   and model-stages that share GPUs run one after another (``overlap.py``). For every partition
   of the stage's model-stages into groups (Bell-number many; a stage has at most four) each
   group of several becomes one item placed from one first GPU: its time at ``g`` GPUs is the
   sum of its members' fastest frontier latencies with at most ``g`` GPUs each. Groups run
   concurrently on disjoint GPUs, so the stage latency is the largest chosen group latency: the
   optimum is the smallest threshold ``lam`` such that the cheapest group points with latency
   ``<= lam`` fit in the pool together (a dynamic programme over thresholds; exact). The best
   partition wins; a partition whose groups cannot beat the best one found even with the whole
   pool each is skipped. So a pool too small for concurrent model-stages gets a colocated plan,
   and a large pool keeps them concurrent when that is faster.
4. Co-resident state couples the stages: training state stays on its GPUs all step, and a
   generation or inference unit may land on any of them (transitions move units), so it must
   fit next to the largest per-GPU training state ``rho`` of the plan. We solve step 3 for each
   level ``rho`` of training state (training candidates with state ``<= rho``; the other stages
   with ``cap - rho`` per GPU) and keep the best; levels are tried from the unconstrained
   training optimum downwards (each solve jumps to the state the training choice really keeps)
   and the search stops once training alone plus the other stages' unconstrained optimum cannot
   beat the best plan found (exact). Colocated training model-stages keep their states side by
   side: a group's state is the sum of its members' (a level ``rho`` may be such a sum), and each
   member's peak must fit next to the other members' states; the group's points come from every
   combination of its members' state levels (exact).
5. Lean: the plan's micro-batches and recompute are made leaner while its step stays within 5% of
   the fastest (``STEP_TOLERANCE``, ``lean_slots``): the model-stage with the largest peak per GPU
   takes its next leaner choice on the same layout and GPUs, until that would pass the 5%.
   Predictions are not exact to a few percent, and the memory left free is headroom for responses
   that grow, for the allocator's fragmentation and for the model-stages a transition brings.
6. Assign GPU ids: in the training stage by decreasing GPU count, elsewhere by decreasing
   replica size, each group from the lowest free id (a group's members all from its first id).
   With power-of-two sizes and nodes this keeps every replica aligned (TP groups inside nodes)
   and every training candidate that fits in a node inside one node, which is exactly how step 1
   priced it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, replace

from nereus_lightning.plan.calibration import Calibration, MemoryCalibration
from nereus_lightning.plan.cost import (
    StageWork,
    micro_batch_options,
    peak_memory,
    replica_sequences,
    stage_work,
)
from nereus_lightning.plan.estimate import PlanEstimate, estimate_plan
from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.plan.memory import memory_cap
from nereus_lightning.plan.options import (  # noqa: F401  (re-exported for callers of the first API)
    CandidateTable,
    Option,
    dp_options,
    fastest_sharded,
    frontier,
    frontier_of_rows,
    layouts_for,
    shard_options,
    stage_options,
)
from nereus_lightning.plan.overlap import partitions
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import InfeasiblePlanError, NereusConfigError, require
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.spec.workload import STAGES, Workload

ROLES = ("actor", "critic", "reference", "reward")
#: How much slower than the fastest plan's step the planner lets a plan become to need less memory
#: per GPU (step 5 of the module docstring, :func:`lean_slots`).
STEP_TOLERANCE = 0.05


def job_models(
    actor: ModelSpec,
    critic: ModelSpec | None = None,
    reference: ModelSpec | None = None,
    reward: ModelSpec | None = None,
) -> dict[str, ModelSpec]:
    """The role -> model mapping of an RL job, as the body builds it (``lightning.roles``): missing roles
    use the actor's architecture, and the critic and the reward model are the value models of theirs."""
    return {
        "actor": actor,
        "critic": _value_model(critic or actor),
        "reference": reference or actor,
        "reward": _value_model(reward or actor),
    }


def _value_model(model: ModelSpec) -> ModelSpec:
    """``model`` as a value model: a causal LM's :meth:`~ModelSpec.as_value_model`, a value model itself."""
    return model if model.num_labels else model.as_value_model()


@dataclass(frozen=True)
class PlanResult:
    """The chosen plan, its estimate, and up to ``alternatives`` other feasible plans, fastest first.

    Alternatives are the next-best plans at the chosen level of resident training state and (up
    to half of them) the best plans that keep less training state resident per GPU, so the
    admission rule has slower but leaner targets to fall back to.
    """

    plan: Plan
    estimate: PlanEstimate
    alternatives: tuple[tuple[Plan, PlanEstimate], ...] = ()


@dataclass(frozen=True)
class Group:
    """Model-stages of one stage placed from one first GPU and run one after another (a stage's
    concurrent item; a model-stage on its own GPUs is a group of one).

    ``gpus`` is its largest member's GPU count, ``latency`` the sum of its members' (they run in
    turn) and ``resident`` the sum of their per-GPU training states (they stay side by side).
    """

    members: tuple[tuple[str, Option], ...]
    gpus: int
    latency: float
    resident: float


Pick = dict[tuple[str, ...], Group]  # one stage's selection: group members -> the group's choice


def _single(name: str, front: list[Option]) -> list[Group]:
    return [Group(((name, o),), o.gpus, o.latency, o.resident) for o in front]


def _sum_front(block: tuple[str, ...], fronts: list[list[Option]]) -> list[Group]:
    """Frontier of ``block`` run in turn from one first GPU: at ``g`` GPUs every member takes its
    fastest frontier point with at most ``g`` GPUs."""
    lowest = max(f[0].gpus for f in fronts)
    at = [0] * len(fronts)
    out: list[Group] = []
    for g in sorted({o.gpus for f in fronts for o in f if o.gpus >= lowest}):
        for i, f in enumerate(fronts):
            while at[i] + 1 < len(f) and f[at[i] + 1].gpus <= g:
                at[i] += 1
        picks = [f[i] for f, i in zip(fronts, at, strict=True)]
        lat = sum(o.latency for o in picks)
        if not out or lat < out[-1].latency:
            out.append(Group(tuple(zip(block, picks, strict=True)), g, lat, sum(o.resident for o in picks)))
    return out


def _select(
    fronts: Mapping[tuple[str, ...], list[Group]],
    keys: dict[tuple[str, ...], list[float]],
    lam: float,
    budget: int,
) -> Pick | None:
    """Per group the fewest-GPU frontier point with latency <= lam, if they fit together."""
    pick = {}
    for name, front in fronts.items():
        i = bisect.bisect_left(keys[name], -lam)  # latencies decrease along the frontier
        if i == len(front):
            return None
        pick[name] = front[i]
    return pick if sum(o.gpus for o in pick.values()) <= budget else None


def solve_stage(fronts: Mapping[tuple[str, ...], list[Group]], budget: int, count: int = 1) -> list[Pick]:
    """The ``count`` best distinct selections of concurrent groups (best first); [] when none fits.

    The stage latency of a selection is its largest latency; selections come from thresholds.
    """
    keys = {name: [-o.latency for o in front] for name, front in fronts.items()}
    lams = sorted({o.latency for front in fronts.values() for o in front})
    lo, hi = 0, len(lams)
    while lo < hi:  # smallest feasible threshold (feasibility is monotone in lam)
        mid = (lo + hi) // 2
        if _select(fronts, keys, lams[mid], budget) is None:
            lo = mid + 1
        else:
            hi = mid
    out: list[Pick] = []
    for lam in lams[lo:]:
        pick = _select(fronts, keys, lam, budget)
        if pick is not None and pick not in out:
            out.append(pick)
            if len(out) >= count:
                break
    return out


def assign_gpus(
    selection: Mapping[tuple[str, ...], Group], stage_of: Mapping[str, str], order: list[str]
) -> Plan:
    """Concrete GPU ids for a selection: groups of one stage get disjoint ids, a group's members
    all start at the group's first id (they share GPUs and run in turn)."""
    cands: dict[str, Candidate] = {}
    for stage in STAGES:
        groups = [grp for block, grp in selection.items() if stage_of[block[0]] == stage]
        if stage == "training":
            groups.sort(key=lambda grp: -grp.gpus)
        else:
            groups.sort(key=lambda grp: (-max(o.layout.size for _, o in grp.members), -grp.gpus))
        offset = 0
        for grp in groups:
            for n, o in grp.members:
                cands[n] = Candidate(
                    o.layout, o.dp, tuple(range(offset, offset + o.gpus)), o.micro_batch, o.recompute
                )
            offset += grp.gpus
    return Plan.of({n: cands[n] for n in order})


def plan_job(
    models: Mapping[str, ModelSpec],
    cluster: ClusterSpec,
    workload: Workload,
    calibration: Calibration | None = None,
    alternatives: int = 4,
    pinned: Mapping[str, Layout | Collection[Layout]] | None = None,
    pool_key: str = "cluster.num_gpus",
    memory: MemoryCalibration | None = None,
    step_tolerance: float = STEP_TOLERANCE,
) -> PlanResult:
    """The fastest feasible plan for ``workload`` on ``cluster``, made lean, and up to ``alternatives``
    next-best plans.

    Lean: its micro-batches and recompute are made leaner while its step stays within
    ``step_tolerance`` of the fastest (:func:`lean_slots`; 0: leaner only as fast).

    ``memory`` holds the measured memory factor of each stage: a stage's predicted peaks times its
    factor must fit the cap.

    ``pinned`` restricts model-stages to one layout each, or to a set of layouts (their DP degree,
    micro-batch and recomputation stay free): the controller asks for plans that keep the training
    layouts it runs, whose transitions need no Split/Merge of optimizer state. ``pool_key`` is the caller's
    config key for the pool size, which infeasibility messages tell the user to raise
    (``nereus-train`` passes ``trainer.devices``).

    Raises:
        InfeasiblePlanError: a model-stage fits no candidate, or a stage's model-stages cannot
            share the pool; the message names the model-stage, its memory and the GPUs it needs.
    """
    require(step_tolerance >= 0, "plan_job.step_tolerance", f"must be >= 0, got {step_tolerance}")
    stages = workload.stages
    works = {ms.name: stage_work(ms, models, workload, cluster.gpu_memory) for ms in stages}
    cap, budget = memory_cap(cluster), cluster.num_gpus
    factors = (memory or MemoryCalibration()).factors()
    unknown = set(pinned or {}) - set(works)
    if unknown:
        raise NereusConfigError(
            f"plan_job.pinned: unknown model-stages {sorted(unknown)}; known: {sorted(works)}"
        )
    empty = [n for n, v in (pinned or {}).items() if not isinstance(v, Layout) and not v]
    if empty:
        raise NereusConfigError(
            f"plan_job.pinned: no layout given for {sorted(empty)}; give one or more, or unpin them"
        )
    stage_of = {ms.name: ms.stage for ms in stages}
    search = _Search(works, stage_of, cluster, calibration, budget, cap, factors, pinned, pool_key)
    stuck = [n for n in search.pinned if not search.fronts(n, search.cap(n))]
    if stuck:
        pins = sorted(str(layout) for layout in search.pinned[stuck[0]])
        which = "that layout" if len(pins) == 1 else "those layouts"
        raise InfeasiblePlanError(
            f"{stuck[0]} pinned to {' or '.join(pins)}: no candidate of {which} fits {budget} GPUs under "
            f"the cap of {cap / 1e9:.1f} GB per GPU; pin fewer model-stages or another layout"
        )
    failed = [
        diagnose_memory(works[n], cluster, budget, cap, pool_key, factors[stage_of[n]])
        for n in works
        if not search.fronts(n, search.cap(n))
    ]
    if failed:
        # The binding constraint is the model-stage that needs the most GPUs.
        failed.sort(key=lambda x: -(x[0] if x[0] is not None else 1 << 30))
        others = f" (also infeasible: {len(failed) - 1} more model-stages)" if len(failed) > 1 else ""
        raise InfeasiblePlanError(failed[0][1] + others)
    rho = search.best_level()
    # Alternatives: the next-best plans at the best level, plus the best plans that keep less
    # training state resident (leaner per-GPU memory: the admission rule's "slightly slower
    # candidates with cheaper transitions" often need that room).
    leaner = search.leaner_levels(rho, alternatives // 2)
    per_stage = [search.solve(stage, rho, alternatives + 1 - len(leaner)) for stage in search.stages]

    order = [ms.name for ms in stages]
    combos = sorted(itertools.product(*per_stage), key=_step)[: alternatives + 1 - len(leaner)]
    for level in leaner:
        combos.append(tuple(search.solve(stage, level)[0] for stage in search.stages))

    def placed(combo: tuple[Pick, ...]) -> tuple[Plan, PlanEstimate]:
        groups = {block: grp for pick in combo for block, grp in pick.items()}
        plan = assign_gpus(groups, search.stage_of, order)
        return plan, estimate_plan(plan, models, cluster, workload, calibration, memory)

    fast: list[tuple[tuple[Pick, ...], Plan, PlanEstimate]] = []
    for combo in combos:
        plan, est = placed(combo)
        if all(plan != seen for _, seen, _ in fast):
            fast.append((combo, plan, est))
    # On power-of-two nodes the concrete estimate equals the search's objective; elsewhere a
    # placement can cost more than its shape promised, so order by the concrete estimate. Then
    # each plan is made lean (step 5), keeping that order.
    fast.sort(key=lambda r: (not r[2].feasible, r[2].step_latency))
    results: list[tuple[Plan, PlanEstimate]] = []
    for combo, plan, est in fast:
        lean = lean_slots(combo, search.tables, step_tolerance)
        plan, est = (plan, est) if lean == combo else placed(lean)
        if all(plan != seen for seen, _ in results):
            results.append((plan, est))
    return PlanResult(results[0][0], results[0][1], tuple(results[1:]))


def sharded_alternatives(
    models: Mapping[str, ModelSpec],
    cluster: ClusterSpec,
    workload: Workload,
    plan: Plan,
    calibration: Calibration | None = None,
) -> dict[str, tuple[Option, bool]]:
    """Each training model-stage of ``plan`` -> its fastest ZeRO-sharded candidate on as many GPUs (alone
    under the cap) and whether the planner offers it (:func:`~options.fastest_sharded`), where that is
    another layout than the plan's."""
    cap, out = memory_cap(cluster), {}
    for ms in workload.stages:
        cand = plan[ms.name]
        if ms.stage != "training":
            continue
        work = stage_work(ms, models, workload, cluster.gpu_memory)
        found = fastest_sharded(CandidateTable(work, cluster, calibration, cand.num_gpus, cap), cand.num_gpus)
        if found is not None and (found[0].layout, found[0].dp) != (cand.layout, cand.dp):
            out[ms.name] = found
    return out


def lean_slots(
    combo: tuple[Pick, ...], tables: Mapping[str, CandidateTable], tolerance: float
) -> tuple[Pick, ...]:
    """``combo`` (one pick per stage) with leaner micro-batch / recompute choices while its step stays
    within ``tolerance`` of its own (step 5): in rounds, every member at the largest per-GPU peak takes
    the next leaner choice of its layout and dp, until a round cannot (the round is then undone).

    Layouts, DP degrees and so GPU counts and resident states stay as they are.
    """
    picks = [dict(pick) for pick in combo]
    limit = _step(picks) * (1 + tolerance)
    while True:
        rho = max((g.resident for p in picks for g in p.values()), default=0.0)
        peaks = {
            (i, block, k): _member_peak(grp, k, rho)
            for i, pick in enumerate(picks)
            for block, grp in pick.items()
            for k in range(len(grp.members))
        }
        top = max(peaks.values())
        trial = [dict(pick) for pick in picks]
        for (i, block, k), peak in peaks.items():
            if peak < top:
                continue
            grp = trial[i][block]
            name, option = grp.members[k]
            leaner = tables[name].next_leaner(option)
            if leaner is None:
                return tuple(picks)
            members = grp.members[:k] + ((name, leaner),) + grp.members[k + 1 :]
            latency = grp.latency - option.latency + leaner.latency
            trial[i][block] = replace(grp, members=members, latency=latency)
        if _step(trial) > limit:
            return tuple(picks)
        picks = trial


def _step(picks: Sequence[Pick]) -> float:
    """The step latency of one pick per stage: stages in turn, each as slow as its slowest group."""
    return sum(max(grp.latency for grp in pick.values()) for pick in picks)


def _member_peak(grp: Group, k: int, rho: float) -> float:
    """Member ``k``'s peak per GPU as the cap bounds it: a training member's next to its group's other
    states, any other one's next to the plan's training state ``rho``."""
    option = grp.members[k][1]
    if option.resident:
        return option.peak_memory + grp.resident - option.resident
    return option.peak_memory + rho


class _Search:
    """Frontiers per (model-stage, memory budget, resident level), stage solves over every
    grouping (step 3), and the search over levels of co-resident training state (step 4).

    ``factors`` is each stage's measured memory factor: the cost model's peaks of a stage fit
    within ``cap / factor`` (:meth:`cap`).
    """

    def __init__(
        self,
        works: Mapping[str, StageWork],
        stage_of: Mapping[str, str],
        cluster: ClusterSpec,
        calibration: Calibration | None,
        budget: int,
        cap: float,
        factors: Mapping[str, float],
        pinned: Mapping[str, Layout | Collection[Layout]] | None = None,
        pool_key: str = "cluster.num_gpus",
    ) -> None:
        self.works, self.stage_of, self.budget = works, dict(stage_of), budget
        self.factors = {stage: factors.get(stage, 1.0) for stage in STAGES}
        self.caps = {stage: cap / factor for stage, factor in self.factors.items()}
        self.memory_cap = cap
        # Each pinned model-stage -> the layouts it may take.
        self.pinned = {n: frozenset((v,) if isinstance(v, Layout) else v) for n, v in (pinned or {}).items()}
        self.pool_key = pool_key
        self.stages = [s for s in STAGES if any(v == s for v in stage_of.values())]
        self.members = {s: tuple(n for n, v in stage_of.items() if v == s) for s in self.stages}
        self.partitions = {s: list(partitions(m)) for s, m in self.members.items()}
        self.tables: dict[str, CandidateTable] = {}
        shared: dict[StageWork, CandidateTable] = {}  # e.g. actor and reference inference price alike
        for name, work in works.items():
            key = replace(work, name="")
            if key not in shared:
                shared[key] = CandidateTable(work, cluster, calibration, budget, self.cap(name))
            self.tables[name] = shared[key]
        self._fronts: dict[tuple, list[Option]] = {}
        self._fastest: dict[tuple, float] = {}
        self._groups: dict[tuple, list[Group]] = {}
        self._solved: dict[tuple, list[Pick]] = {}

    def cap(self, name: str) -> float:
        """The memory cap of model-stage ``name``'s stage (over its measured memory factor)."""
        return self.caps[self.stage_of[name]]

    def fronts(
        self, name: str, memory: float, resident: float = math.inf, least: float = -math.inf
    ) -> list[Option]:
        """The frontier of ``name`` within ``memory`` bytes per GPU and ``least`` to ``resident`` bytes of
        state.
        """
        table = self.tables[name]
        allowed = self.pinned.get(name)
        trains = self.works[name].trains
        key = (id(table), memory, resident if trains else math.inf, least if trains else -math.inf, allowed)
        if key not in self._fronts:
            rows = table.rows_within(memory, resident, least)
            if allowed is not None:
                rows = [row for row in rows if row[4] in allowed]
            self._fronts[key] = frontier_of_rows(rows)
        return self._fronts[key]

    def fastest(self, name: str, resident: float, least: float = -math.inf) -> float:
        """The latency of the fastest candidate of ``name`` (a training model-stage) keeping ``least`` to
        ``resident`` bytes of state, under the cap (inf: none).

        A bound on what ``name`` takes from any narrower band of state (:meth:`fronts` of a band picks
        per GPU count with :func:`~options.leanest_within`, which on a narrower band can be faster).
        """
        key = (name, resident, least)
        if key not in self._fastest:
            allowed = self.pinned.get(name)
            rows = self.tables[name].rows_within(self.cap(name), resident, least)
            self._fastest[key] = min(
                (r[1] for r in rows if allowed is None or r[4] in allowed), default=math.inf
            )
        return self._fastest[key]

    def _member_front(self, name: str, rho: float) -> list[Option]:
        """``name``'s frontier at training-state level ``rho``, on GPUs of its own."""
        if self.stage_of[name] == "training":
            return self.fronts(name, self.cap(name), rho)
        return self.fronts(name, self.cap(name) - rho)

    def group_front(self, block: tuple[str, ...], rho: float, limit: float = math.inf) -> list[Group]:
        """The frontier of ``block`` (one stage's model-stages run in turn on shared GPUs) at level
        ``rho``; colocated training model-stages keep only points faster than ``limit``."""
        training = self.stage_of[block[0]] == "training"
        key = (
            block,
            rho if training else self.cap(block[0]) - rho,
            limit if training and len(block) > 1 else math.inf,
        )
        if key not in self._groups:
            if len(block) == 1:
                self._groups[key] = _single(block[0], self._member_front(block[0], rho))
            elif training:
                self._groups[key] = self._coresident_front(block, rho, limit)
            else:
                fronts = [self._member_front(n, rho) for n in block]
                self._groups[key] = _sum_front(block, fronts) if all(fronts) else []
        return self._groups[key]

    def _levels(self, name: str) -> list[float]:
        """The per-GPU states ``name`` (a training model-stage) can keep, ascending (its pinned layout's, if
        pinned).
        """
        allowed = self.pinned.get(name)
        return sorted({row[3] for row in self.tables[name].rows if allowed is None or row[1] in allowed})

    def _coresident_front(self, block: tuple[str, ...], rho: float, limit: float) -> list[Group]:
        """Training model-stages side by side: their states sum to at most ``rho`` and each
        member's peak fits next to the others' states (every combination of state levels).

        A combination takes each member's candidates of exactly its level (one keeping less is
        in the combination of its own level, where the others have more room). Points at least
        as slow as ``limit`` are left out (the caller has a selection that fast), and so is every
        combination whose members, each at its level's fastest candidate, cannot beat it.
        """
        points: list[Group] = []
        for states in itertools.product(*(self._levels(n) for n in block)):
            total = sum(states)
            if total > rho or sum(self.fastest(n, s, s) for n, s in zip(block, states, strict=True)) >= limit:
                continue
            fronts = [
                self.fronts(n, self.cap(n) - (total - s), s, s) for n, s in zip(block, states, strict=True)
            ]
            if all(fronts):
                points += [grp for grp in _sum_front(block, fronts) if grp.latency < limit]
        return frontier(points)

    def _bound(self, block: tuple[str, ...], rho: float) -> float:
        """A lower bound on ``block``'s latency: each member alone with the whole pool (colocated
        training model-stages: each member's fastest candidate, as each picks within its own level)."""
        if len(block) > 1 and self.stage_of[block[0]] == "training":
            return sum(self.fastest(n, rho) for n in block)
        fronts = [self._member_front(n, rho) for n in block]
        return sum(f[-1].latency for f in fronts) if all(fronts) else math.inf

    def solve(self, stage: str, rho: float, count: int = 1) -> list[Pick]:
        """The ``count`` best selections of ``stage`` at level ``rho``
        over every grouping ([] if none fits).
        """
        key = (stage, rho, count)
        if key in self._solved:
            return self._solved[key]
        found: list[tuple[float, Pick]] = []
        for blocks in self.partitions[stage]:  # all-concurrent first
            worst = found[-1][0] if len(found) >= count else math.inf
            if max(self._bound(block, rho) for block in blocks) >= worst:
                continue  # even with the whole pool per group it cannot beat those found
            fronts = {block: self.group_front(block, rho, worst) for block in blocks}
            if not all(fronts.values()):
                continue
            for pick in solve_stage(fronts, self.budget, count):
                found.append((max(grp.latency for grp in pick.values()), pick))
            found.sort(key=lambda x: x[0])  # stable: on a tie the earlier (more concurrent) grouping
            del found[count:]
        self._solved[key] = [pick for _, pick in found]
        return self._solved[key]

    def _latency(self, stage: str, rho: float) -> float:
        picks = self.solve(stage, rho)
        return max(grp.latency for grp in picks[0].values()) if picks else math.inf

    def _resident(self, rho: float) -> float:
        """The per-GPU training state the fastest training selection at level ``rho`` keeps."""
        return max(grp.resident for grp in self.solve("training", rho)[0].values())

    def _training_levels(self) -> list[float]:
        """Every per-GPU training state a training group can keep (a member's, or colocated
        members' summed), largest first."""
        names = self.members.get("training", ())
        levels = {lvl for n in names for lvl in self._levels(n)}
        for blocks in self.partitions.get("training", []):
            for block in (b for b in blocks if len(b) > 1):
                levels.update(sum(c) for c in itertools.product(*(self._levels(n) for n in block)))
        return sorted(levels, reverse=True)

    def best_level(self) -> float:
        """The training-state level ``rho`` of the fastest plan (raises when no level works)."""
        others = [s for s in self.stages if s != "training"]
        if "training" not in self.stages:
            self._require(others, 0.0)
            return 0.0
        self._require(others, 0.0)  # the other stages on their own (no co-resident state)
        self._require(["training"], math.inf)
        levels = self._training_levels()
        ascending = levels[::-1]
        bound = sum(self._latency(s, 0.0) for s in others)
        best, best_rho = math.inf, None
        rho = self._resident(math.inf)
        while True:
            train = self._latency("training", rho)
            if train == math.inf or train + bound >= best:
                break  # smaller levels only slow training down further
            # Every level from here down to the state this choice keeps picks the same training
            # latency, and the other stages fit best next to that state: price it there.
            rho = self._resident(rho)
            step = train + sum(self._latency(s, rho) for s in others)
            if step < best:
                best, best_rho = step, rho
            below = bisect.bisect_left(ascending, rho)
            if below == 0:
                break
            rho = ascending[below - 1]
        if best_rho is None:
            raise InfeasiblePlanError(self._coresidency_message(levels[-1] if levels else 0.0))
        return best_rho

    def leaner_levels(self, rho: float, count: int) -> list[float]:
        """Up to ``count`` training-state levels below ``rho`` at which a whole plan still fits."""
        # Below the smallest state some training model-stage can keep (its pinned layout's, if
        # pinned) no plan fits: skip those levels without solving them.
        floor = max(
            (min(self._levels(n), default=math.inf) for n in self.members.get("training", ())), default=0.0
        )
        out: list[float] = []
        for level in (lvl for lvl in self._training_levels() if floor <= lvl < rho):
            if len(out) >= count:
                break
            if all(self.solve(stage, level) for stage in self.stages):
                out.append(level)
        return out

    def _require(self, stages: list[str], rho: float) -> None:
        for stage in stages:
            if self.solve(stage, rho):
                continue
            names = self.members[stage]
            fronts = {n: self._member_front(n, rho) for n in names}
            need = {n: f[0].gpus for n, f in fronts.items() if f}
            # Only co-resident training state can keep model-stages that each fit from sharing GPUs.
            raise InfeasiblePlanError(
                f"{stage} stage: its model-stages fit neither side by side on shared GPUs (their training "
                f"states together pass the cap of {self.caps[stage] / 1e9:.1f} GB per GPU) nor on disjoint "
                "GPUs, "
                f"where they need at least {sum(need.values())} GPUs together "
                f"({', '.join(f'{n} {g}' for n, g in need.items())}) but the pool has {self.budget}; "
                f"raise {self.pool_key} to {sum(need.values())}"
            )

    def _coresidency_message(self, leanest: float) -> str:
        for stage in self.stages:
            if stage == "training":
                continue
            for name in self.members[stage]:
                if not self._member_front(name, leanest):
                    factor = self.factors[stage]
                    _, text = diagnose_memory(
                        self.works[name],
                        self.cluster_of(),
                        self.budget,
                        self.memory_cap - factor * leanest,
                        self.pool_key,
                        factor,
                    )
                    return f"next to {leanest / 1e9:.1f} GB of resident training state per GPU, {text}"
        return (
            f"no plan fits: the generation and inference model-stages need more GPUs than the pool of "
            f"{self.budget} once {leanest / 1e9:.1f} GB per GPU of training state stays resident; "
            f"raise {self.pool_key}"
        )

    def cluster_of(self) -> ClusterSpec:
        """The cluster the tables were priced for."""
        return next(iter(self.tables.values())).cluster


def _least_memory(work: StageWork, layout: Layout) -> float:
    """Peak bytes of one replica of ``layout`` at its leanest: smallest micro-batch, recompute on."""
    if replica_sequences(work, layout.shard) is None:
        return float("inf")
    share = replica_sequences(work, layout.shard) or 1
    if work.kind == "generation":
        return peak_memory(work, layout, 1, 1, False)
    options = micro_batch_options(work, layout, share, float("inf"))
    return peak_memory(work, layout, 1, options[0], work.trains) if options else float("inf")


def _replica_layouts(work: StageWork, gpus: int, gpus_per_node: int) -> list[Layout]:
    """Every layout one replica of ``work`` may take on at most ``gpus`` GPUs (a training one sharded
    over all of them too, as far as its mini-batch splits)."""
    out = []
    for lay in layouts_for(work.model, gpus):
        width = min(gpus // lay.size, work.mini_batch_size if work.trains else 1)
        out += shard_options(lay, 1 << (width.bit_length() - 1), gpus_per_node) if work.trains else [lay]
    return out


def diagnose_memory(
    work: StageWork,
    cluster: ClusterSpec,
    budget: int,
    cap: float,
    pool_key: str = "cluster.num_gpus",
    factor: float = 1.0,
) -> tuple[int | None, str]:
    """Why ``work`` fits no candidate: (GPUs that would fit it or None, a message naming its
    least memory within the pool, the cap, and the GPU count to ask for).

    ``factor`` is the stage's measured memory factor: the cost model's peaks times it must fit.
    """
    gpn = cluster.gpus_per_node
    inside = [(factor * _least_memory(work, lay), lay) for lay in _replica_layouts(work, budget, gpn)]
    best = min(inside, key=lambda x: x[0], default=None)
    fits = next(
        (
            lay
            for lay in sorted(_replica_layouts(work, 1 << 20, gpn), key=lambda lay: lay.size)
            if factor * _least_memory(work, lay) <= cap
        ),
        None,
    )
    measured = f", {factor:.2f} x the cost model's as measured" if factor != 1 else ""
    need = (
        f"{best[0] / 1e9:.1f} GB per GPU at its best layout {best[1]}{measured}"
        if best
        else "more GPUs than the pool has"
    )
    hint = (
        f"it would fit on {fits.size} GPUs ({fits}); raise {pool_key} to at least {fits.size}"
        if fits
        else "it does not fit at any layout; use GPUs with more memory or shorter sequences"
    )
    if work.reserved:
        hint += (
            f"; or lower algorithm.vllm.gpu_memory_utilization ({work.engine.gpu_memory_utilization}: "
            "the share of each GPU a vLLM engine takes)"
        )
    message = (
        f"{work.name} ({work.model.name}, {work.kind}) cannot fit: it needs {need}, "
        f"over the cap of {cap / 1e9:.1f} GB ({_cap_terms(cluster)}) "
        f"with {budget} GPUs; {hint}"
    )
    return (fits.size if fits else None), message


def _cap_terms(cluster: ClusterSpec) -> str:
    """How the memory cap comes from the GPU's memory, for messages."""
    outside = cluster.reserved_memory / 1e9
    reserved = f" and {outside:.1f} GB outside the allocator" if outside else ""
    return f"{cluster.gpu_memory / 1e9:.0f} GB less 10% headroom{reserved}"
