"""The planner (Eq. 1): fastest plan under the memory cap and the stage-wise GPU budgets.

1. Per model-stage, enumerate candidates (power-of-two TP dividing the heads, power-of-two PP,
   DP from the GPUs left, micro-batch options, recompute for training) and price each with
   the cost model, placed as the planner will place it (``comm.canonical_links``); see
   ``options.py``.
2. Drop the ones over the memory cap and the dominated ones: the frontier keeps, per GPU count,
   only candidates faster than every candidate with fewer GPUs.
3. Stages run one after another, so for a fixed memory budget the step latency is a sum of
   independent per-stage problems. In one stage the model-stages run concurrently on disjoint
   GPUs, so the stage latency is the largest chosen latency: the optimum is the smallest
   threshold ``lam`` such that the cheapest frontier points with latency ``<= lam`` fit in the
   pool together (a dynamic programme over thresholds; exact).
4. Co-resident state couples the stages: training state stays on its GPUs all step, and a
   generation or inference unit may land on any of them (transitions move units), so it must
   fit next to the largest per-GPU training state ``rho`` of the plan. We solve step 3 for each
   level ``rho`` of training state (training candidates with state ``<= rho``; the other stages
   with ``cap - rho`` per GPU) and keep the best; levels are tried from the unconstrained
   training optimum downwards and the search stops once training alone plus the other stages'
   unconstrained optimum cannot beat the best plan found (exact).
5. Assign GPU ids: in the training stage by decreasing GPU count, elsewhere by decreasing
   replica size, each from the lowest free id. With power-of-two sizes and nodes this keeps
   every replica aligned (TP groups inside nodes) and every training candidate that fits in a
   node inside one node, which is exactly how step 1 priced it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from nereus_lightning.plan.calibration import Calibration
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
    fill_peaks,
    frontier,
    frontier_of_rows,
    layouts_for,
    stage_options,
)
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import InfeasiblePlanError, NereusConfigError
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.spec.workload import STAGES, Workload

ROLES = ("actor", "critic", "reference", "reward")


def job_models(
    actor: ModelSpec,
    critic: ModelSpec | None = None,
    reference: ModelSpec | None = None,
    reward: ModelSpec | None = None,
) -> dict[str, ModelSpec]:
    """The role -> model mapping of an RL job; missing roles use the actor's architecture."""
    return {
        "actor": actor,
        "critic": critic or actor,
        "reference": reference or actor,
        "reward": reward or actor,
    }


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


def _select(
    fronts: dict[str, list[Option]], keys: dict[str, list[float]], lam: float, budget: int
) -> dict[str, Option] | None:
    """Per model-stage the fewest-GPU frontier point with latency <= lam, if they fit together."""
    pick = {}
    for name, front in fronts.items():
        i = bisect.bisect_left(keys[name], -lam)  # latencies decrease along the frontier
        if i == len(front):
            return None
        pick[name] = front[i]
    return pick if sum(o.gpus for o in pick.values()) <= budget else None


def solve_stage(fronts: dict[str, list[Option]], budget: int, count: int = 1) -> list[dict[str, Option]]:
    """The ``count`` best distinct selections of one stage (best first); [] when none fits.

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
    out: list[dict[str, Option]] = []
    for lam in lams[lo:]:
        pick = _select(fronts, keys, lam, budget)
        if pick is not None and pick not in out:
            out.append(pick)
            if len(out) >= count:
                break
    return out


def assign_gpus(selection: Mapping[str, Option], stage_of: Mapping[str, str], order: list[str]) -> Plan:
    """Concrete GPU ids for a selection; model-stages of one stage get disjoint ids."""
    cands: dict[str, Candidate] = {}
    for stage in STAGES:
        members = [n for n in order if stage_of[n] == stage]
        if stage == "training":
            members.sort(key=lambda n: -selection[n].gpus)
        else:
            members.sort(key=lambda n: (-selection[n].layout.size, -selection[n].gpus))
        offset = 0
        for n in members:
            o = selection[n]
            cands[n] = Candidate(
                o.layout, o.dp, tuple(range(offset, offset + o.gpus)), o.micro_batch, o.recompute
            )
            offset += o.gpus
    return Plan.of({n: cands[n] for n in order})


def plan_job(
    models: Mapping[str, ModelSpec],
    cluster: ClusterSpec,
    workload: Workload,
    calibration: Calibration | None = None,
    alternatives: int = 4,
    pinned: Mapping[str, Layout] | None = None,
) -> PlanResult:
    """The fastest feasible plan for ``workload`` on ``cluster`` and up to ``alternatives`` next-best plans.

    ``pinned`` restricts model-stages to one layout each (their DP degree, micro-batch and
    recomputation stay free): the controller asks for plans that keep the training layouts it
    runs, whose transitions need no Split/Merge of optimizer state.

    Raises:
        InfeasiblePlanError: a model-stage fits no candidate, or a stage's model-stages cannot
            share the pool; the message names the model-stage, its memory and the GPUs it needs.
    """
    stages = workload.stages
    works = {ms.name: stage_work(ms, models, workload) for ms in stages}
    cap, budget = memory_cap(cluster), cluster.num_gpus
    unknown = set(pinned or {}) - set(works)
    if unknown:
        raise NereusConfigError(
            f"plan_job.pinned: unknown model-stages {sorted(unknown)}; known: {sorted(works)}"
        )
    search = _Search(works, {ms.name: ms.stage for ms in stages}, cluster, calibration, budget, cap, pinned)
    stuck = [n for n in (pinned or {}) if not search.fronts(n, cap)]
    if stuck:
        raise InfeasiblePlanError(
            f"{stuck[0]} pinned to {pinned[stuck[0]]}: no candidate of that layout fits {budget} GPUs under "
            f"the cap of {cap / 1e9:.1f} GB per GPU; pin fewer model-stages or another layout"
        )
    failed = [diagnose_memory(works[n], cluster, budget, cap) for n in works if not search.fronts(n, cap)]
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

    def total(combo: tuple[dict[str, Option], ...]) -> float:
        return sum(max(o.latency for o in pick.values()) for pick in combo)

    order = [ms.name for ms in stages]
    combos = sorted(itertools.product(*per_stage), key=total)[: alternatives + 1 - len(leaner)]
    for level in leaner:
        combos.append(tuple(search.solve(stage, level)[0] for stage in search.stages))
    results = []
    for combo in combos:
        selection = {n: o for pick in combo for n, o in pick.items()}
        for n in selection:
            if selection[n].peak_memory < 0:
                selection[n] = fill_peaks(works[n], [selection[n]])[0]
        plan = assign_gpus(selection, search.stage_of, order)
        if all(plan != seen for seen, _ in results):
            results.append((plan, estimate_plan(plan, models, cluster, workload, calibration)))
    # On power-of-two nodes the concrete estimate equals the search's objective; elsewhere a
    # placement can cost more than its shape promised, so order by the concrete estimate.
    results.sort(key=lambda r: (not r[1].feasible, r[1].step_latency))
    return PlanResult(results[0][0], results[0][1], tuple(results[1:]))


class _Search:
    """Frontiers per (model-stage, memory budget, resident level), stage solves, and the search
    over levels of co-resident training state (step 4 of the module docstring)."""

    def __init__(
        self,
        works: Mapping[str, StageWork],
        stage_of: Mapping[str, str],
        cluster: ClusterSpec,
        calibration: Calibration | None,
        budget: int,
        cap: float,
        pinned: Mapping[str, Layout] | None = None,
    ) -> None:
        self.works, self.stage_of, self.budget, self.cap = works, dict(stage_of), budget, cap
        self.pinned = dict(pinned or {})
        self.stages = [s for s in STAGES if any(v == s for v in stage_of.values())]
        self.tables: dict[str, CandidateTable] = {}
        shared: dict[StageWork, CandidateTable] = {}  # e.g. actor and reference inference price alike
        for name, work in works.items():
            key = replace(work, name="")
            if key not in shared:
                shared[key] = CandidateTable(work, cluster, calibration, budget, cap)
            self.tables[name] = shared[key]
        self._fronts: dict[tuple, list[Option]] = {}

    def fronts(self, name: str, memory: float, resident: float = math.inf) -> list[Option]:
        """The frontier of ``name`` within ``memory`` bytes per GPU and ``resident`` bytes of state."""
        table = self.tables[name]
        layout = self.pinned.get(name)
        key = (id(table), memory, resident if self.works[name].trains else math.inf, layout)
        if key not in self._fronts:
            rows = table.rows_within(memory, resident)
            if layout is not None:
                rows = [row for row in rows if row[4] == layout]
            self._fronts[key] = frontier_of_rows(rows)
        return self._fronts[key]

    def stage_fronts(self, stage: str, rho: float) -> dict[str, list[Option]]:
        """Frontiers of a stage's model-stages at training-state level ``rho``."""
        names = [n for n, s in self.stage_of.items() if s == stage]
        if stage == "training":
            return {n: self.fronts(n, self.cap, rho) for n in names}
        return {n: self.fronts(n, self.cap - rho) for n in names}

    def solve(self, stage: str, rho: float, count: int = 1) -> list[dict[str, Option]]:
        """The ``count`` best selections of ``stage`` at level ``rho`` ([] if none fits)."""
        fronts = self.stage_fronts(stage, rho)
        if any(not f for f in fronts.values()):
            return []
        return solve_stage(fronts, self.budget, count)

    def _latency(self, stage: str, rho: float) -> float:
        picks = self.solve(stage, rho)
        return max(o.latency for o in picks[0].values()) if picks else math.inf

    def _training_levels(self) -> list[float]:
        """Every resident training-state level some training model-stage can keep, largest first."""
        return sorted(
            {
                lvl
                for n, s in self.stage_of.items()
                if s == "training"
                for lvl in self.tables[n].resident_levels()
            },
            reverse=True,
        )

    def best_level(self) -> float:
        """The training-state level ``rho`` of the fastest plan (raises when no level works)."""
        others = [s for s in self.stages if s != "training"]
        if "training" not in self.stages:
            self._require(others, 0.0)
            return 0.0
        self._require(others, 0.0)  # the other stages on their own (no co-resident state)
        self._require(["training"], math.inf)
        top = max(o.resident for o in self.solve("training", math.inf)[0].values())
        levels = self._training_levels()
        bound = sum(self._latency(s, 0.0) for s in others)
        best, best_rho = math.inf, None
        for rho in (lvl for lvl in levels if lvl <= top):
            train = self._latency("training", rho)
            if train == math.inf or train + bound >= best:
                break  # smaller levels only slow training down further
            step = train + sum(self._latency(s, rho) for s in others)
            if step < best:
                best, best_rho = step, rho
        if best_rho is None:
            raise InfeasiblePlanError(self._coresidency_message(levels[-1] if levels else 0.0))
        return best_rho

    def leaner_levels(self, rho: float, count: int) -> list[float]:
        """Up to ``count`` training-state levels below ``rho`` at which a whole plan still fits."""
        levels = self._training_levels()
        # Below the smallest state some training model-stage can keep (its pinned layout's, if
        # pinned) no plan fits: skip those levels without solving them.
        floor = max(
            (
                min(
                    (row[3] for row in self.tables[n].rows if self.pinned.get(n) in (None, row[1])),
                    default=math.inf,
                )
                for n, s in self.stage_of.items()
                if s == "training"
            ),
            default=0.0,
        )
        out: list[float] = []
        for level in (lvl for lvl in levels if floor <= lvl < rho):
            if len(out) >= count:
                break
            if all(self.solve(stage, level) for stage in self.stages):
                out.append(level)
        return out

    def _require(self, stages: list[str], rho: float) -> None:
        for stage in stages:
            if self.solve(stage, rho):
                continue
            fronts = self.stage_fronts(stage, rho)
            need = {n: f[0].gpus for n, f in fronts.items() if f}
            raise InfeasiblePlanError(
                f"{stage} stage: its concurrent model-stages need at least {sum(need.values())} GPUs together "
                f"({', '.join(f'{n} {g}' for n, g in need.items())}) but the pool has {self.budget}; "
                f"raise cluster.num_gpus to {sum(need.values())}"
            )

    def _coresidency_message(self, leanest: float) -> str:
        for stage in self.stages:
            if stage == "training":
                continue
            for name, front in self.stage_fronts(stage, leanest).items():
                if not front:
                    _, text = diagnose_memory(
                        self.works[name], self.cluster_of(), self.budget, self.cap - leanest
                    )
                    return f"next to {leanest / 1e9:.1f} GB of resident training state per GPU, {text}"
        return (
            f"no plan fits: the generation and inference model-stages need more GPUs than the pool of "
            f"{self.budget} once {leanest / 1e9:.1f} GB per GPU of training state stays resident; raise cluster.num_gpus"
        )

    def cluster_of(self) -> ClusterSpec:
        """The cluster the tables were priced for."""
        return next(iter(self.tables.values())).cluster


def _least_memory(work: StageWork, layout: Layout) -> float:
    """Peak bytes of one replica of ``layout`` at its leanest: smallest micro-batch, recompute on."""
    share = replica_sequences(work, 1) or 1
    if work.kind == "generation":
        return peak_memory(work, layout, 1, 1, False)
    options = micro_batch_options(work, layout, share, float("inf"))
    return peak_memory(work, layout, 1, options[0], work.trains) if options else float("inf")


def diagnose_memory(work: StageWork, cluster: ClusterSpec, budget: int, cap: float) -> tuple[int | None, str]:
    """Why ``work`` fits no candidate: (GPUs that would fit it or None, a message naming its
    least memory within the pool, the cap, and the GPU count to ask for)."""
    inside = [(_least_memory(work, lay), lay) for lay in layouts_for(work.model, budget)]
    best = min(inside, key=lambda x: x[0], default=None)
    fits = next(
        (
            lay
            for lay in sorted(layouts_for(work.model, 1 << 20), key=lambda lay: lay.size)
            if _least_memory(work, lay) <= cap
        ),
        None,
    )
    need = (
        f"{best[0] / 1e9:.1f} GB per GPU at its best layout {best[1]}"
        if best
        else "more GPUs than the pool has"
    )
    hint = (
        f"it would fit on {fits.size} GPUs ({fits}); raise cluster.num_gpus to at least {fits.size}"
        if fits
        else "it does not fit at any layout; use GPUs with more memory or shorter sequences"
    )
    message = (
        f"{work.name} ({work.model.name}, {work.kind}) cannot fit: it needs {need}, "
        f"over the cap of {cap / 1e9:.1f} GB ({cluster.gpu_memory / 1e9:.0f} GB less 10% headroom) "
        f"with {budget} GPUs; {hint}"
    )
    return (fits.size if fits else None), message
