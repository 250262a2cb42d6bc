"""The planner (Eq. 1): fastest plan under the memory cap and the stage-wise GPU budgets.

1. Per model-stage, enumerate candidates (power-of-two TP dividing the heads, power-of-two PP,
   DP from the GPUs left, micro-batch options, recompute for training) and price each with
   the cost model, placed as the planner will place it (``comm.canonical_links``).
2. Drop the ones over the memory cap and the dominated ones: the frontier keeps, per GPU count,
   only candidates faster than every candidate with fewer GPUs.
3. Stages run one after another, so the step latency is the sum of independent per-stage
   problems. In one stage the model-stages run concurrently on disjoint GPUs, so the stage
   latency is the largest chosen latency: the optimum is the smallest threshold ``lam`` such
   that the cheapest frontier points with latency ``<= lam`` fit in the pool together. We
   search ``lam`` over the frontier latencies (a dynamic programme over thresholds; exact).
4. Assign GPU ids: in the training stage by decreasing GPU count, elsewhere by decreasing
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
from typing import Any

from nereus_lightning.plan.calibration import Calibration
from nereus_lightning.plan.comm import canonical_links
from nereus_lightning.plan.cost import (
    Affine,
    StageWork,
    _offload,
    _optimizer_step,
    generation_batch,
    micro_batch_options,
    peak_memory,
    replica_sequences,
    slot_affine,
    stage_work,
    wave_affine,
)
from nereus_lightning.plan.estimate import PlanEstimate, estimate_plan
from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.plan.memory import memory_cap
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import InfeasiblePlanError
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
class Option:
    """One priced candidate shape of a model-stage (no GPU ids yet)."""

    gpus: int
    latency: float
    layout: Layout
    dp: int
    micro_batch: int
    recompute: bool
    peak_memory: float


@dataclass(frozen=True)
class PlanResult:
    """The chosen plan, its estimate, and the next-best plans (slower, usually on fewer GPUs)."""

    plan: Plan
    estimate: PlanEstimate
    alternatives: tuple[tuple[Plan, PlanEstimate], ...] = ()


def layouts_for(model: ModelSpec, max_gpus: int) -> list[Layout]:
    """Power-of-two (tp, pp) the model can be cut into, with at most ``max_gpus`` ranks."""
    out = []
    tp = 1
    while tp <= max_gpus and model.num_heads % tp == 0 and model.num_kv_heads % tp == 0:
        pp = 1
        while pp <= model.num_layers and tp * pp <= max_gpus:
            out.append(Layout(tp, pp))
            pp *= 2
        tp *= 2
    return out


def dp_options(work: StageWork, layout: Layout, max_gpus: int) -> list[int]:
    """DP degrees worth pricing: training ones keep ``dp * b * a`` fixed (powers of two, so DP
    groups align to nodes); for generation/inference, the smallest dp per distinct replica share."""
    top = max_gpus // layout.size
    if work.trains:
        return [1 << k for k in range(top.bit_length()) if replica_sequences(work, 1 << k) is not None]
    out, n, dp = [], work.sequences, 1
    while dp <= min(top, n):
        out.append(dp)
        share = -(-n // dp)
        if share == 1:
            break
        dp = -(-n // (share - 1))  # the smallest dp whose share is below this one
    return out


class _Scalars:
    """Calibrated seconds of one model-stage's cost pieces, evaluated in O(1) per candidate.

    Mirrors :func:`cost.ideal_time` term by term (so it agrees with :func:`estimate_plan` up to
    float rounding): each affine piece collapses to ``fixed + per_seq * n`` seconds.
    """

    def __init__(self, work: StageWork, cluster: ClusterSpec, calibration: Calibration | None) -> None:
        self.work, self.cluster = work, cluster
        self.eff = (calibration or Calibration()).efficiencies()

    def scalar(self, ideal: Mapping[str, float]) -> float:
        """Calibrated seconds of an ideal-time dict."""
        return sum(seconds / self.eff[name] for name, seconds in ideal.items())

    def affine(self, piece: Affine) -> tuple[float, float, float, float, float, float]:
        """(fixed, per_seq, steps/eff_decode, decode_flops, decode_fixed, decode_per_seq) in calibrated seconds."""
        fixed = sum(v / self.eff[c] for c, v in piece.fixed)
        per_seq = sum(v / self.eff[c] for c, v in piece.per_seq)
        return (
            fixed,
            per_seq,
            piece.steps / self.eff["decode"],
            piece.decode_flops,
            piece.decode_fixed,
            piece.decode_per_seq,
        )


def _at(coef: tuple[float, float, float, float, float, float], n: int) -> float:
    fixed, per_seq, steps, flops, reads, kv = coef
    value = fixed + per_seq * n
    if steps:
        value += steps * max(flops * n, reads + kv * n)
    return value


def stage_options(
    work: StageWork, cluster: ClusterSpec, calibration: Calibration | None, max_gpus: int, cap: float
) -> list[Option]:
    """Every candidate of ``work`` within ``max_gpus`` GPUs and the memory ``cap``, priced.

    For generation and inference only the smallest dp of each distinct replica share is kept
    (larger ones cost GPUs and gain nothing), and per (layout, dp) only the fastest micro-batch.
    """
    rows: list[tuple] = []  # (gpus, latency, peak, layout, dp, micro_batch, recompute)
    sc = _Scalars(work, cluster, calibration)
    mb_cache: dict[int, tuple[int, ...]] = {}
    repeats = work.epochs * work.mini_batches
    trains = work.trains
    for layout in layouts_for(work.model, max_gpus):
        one = canonical_links(layout, 1, cluster)
        offload = sc.scalar(_offload(work, layout))
        size, pp = layout.size, layout.pp
        dps = dp_options(work, layout, max_gpus)
        if work.kind == "generation":
            fit = generation_batch(work, layout, work.sequences, cap)
            if not fit:
                continue
            coef = sc.affine(wave_affine(work, layout, one, cluster))
            for dp in dps:
                share = -(-work.sequences // dp)
                batch = min(share, fit)
                full, rest = divmod(share, batch)
                lat = offload + full * _at(coef, batch) + (_at(coef, rest) if rest else 0.0)
                rows.append((dp * size, lat, None, layout, dp, batch, False))
            continue
        memo: dict[Any, float] = {}
        steps: dict[int, float] = {}
        for rc in (False, True) if trains else (False,):
            fixed, per_seq = sc.affine(slot_affine(work, layout, rc, one, cluster))[:2]
            for dp in dps:
                share = work.mini_batch_size // dp if trains else -(-work.sequences // dp)
                options = mb_cache.get(share)
                if options is None:
                    options = mb_cache[share] = micro_batch_options(work, layout, share, cap)
                step = 0.0
                if trains:
                    step = steps.get(dp, -1.0)
                    if step < 0:
                        links = canonical_links(layout, dp, cluster)
                        step = steps[dp] = sc.scalar(_optimizer_step(work, layout, dp, links, cluster))
                best_lat, best_mb, best_peak = math.inf, 0, 0.0
                for mb in options:
                    count = -(-share // mb)
                    key = (mb, rc, count if count < pp else pp) if trains else mb
                    peak = memo.get(key)
                    if peak is None:
                        peak = memo[key] = peak_memory(work, layout, dp, mb, rc)
                    if peak > cap:
                        continue
                    lat = (count + pp - 1) * (fixed + per_seq * mb)
                    if trains:
                        lat = repeats * (lat + step)
                    lat += offload
                    if lat < best_lat:
                        best_lat, best_mb, best_peak = lat, mb, peak
                if best_mb:
                    rows.append((dp * size, best_lat, best_peak, layout, dp, best_mb, rc))
    out = []
    for gpus, lat, peak, layout, dp, mb, rc in rows:
        out.append(Option(gpus, lat, layout, dp, mb, rc, peak if peak is not None else -1.0))
    return out


def frontier(options: list[Option]) -> list[Option]:
    """Non-dominated options: increasing GPU count, strictly decreasing latency."""
    best: list[Option] = []
    for opt in sorted(options, key=lambda o: (o.gpus, o.latency)):
        if not best or opt.latency < best[-1].latency:
            best.append(opt)
    return best


def _fill_peaks(work: StageWork, front: list[Option]) -> list[Option]:
    """Generation options are priced without their peak memory (the batch fits by construction)."""
    return [
        o
        if o.peak_memory >= 0
        else Option(
            o.gpus,
            o.latency,
            o.layout,
            o.dp,
            o.micro_batch,
            o.recompute,
            peak_memory(work, o.layout, o.dp, o.micro_batch, o.recompute),
        )
        for o in front
    ]


def _cheapest(front: list[Option], lam: float) -> Option | None:
    """The fewest-GPU option with latency <= lam (latencies decrease along the frontier)."""
    neg = [-o.latency for o in front]
    i = bisect.bisect_left(neg, -lam)
    return front[i] if i < len(front) else None


def _select(fronts: dict[str, list[Option]], lam: float, budget: int) -> dict[str, Option] | None:
    pick = {}
    for name, front in fronts.items():
        opt = _cheapest(front, lam)
        if opt is None:
            return None
        pick[name] = opt
    return pick if sum(o.gpus for o in pick.values()) <= budget else None


def solve_stage(fronts: dict[str, list[Option]], budget: int, count: int = 1) -> list[dict[str, Option]]:
    """The ``count`` best distinct selections of one stage (best first); [] when none fits.

    The stage latency of a selection is its largest latency; selections come from thresholds.
    """
    lams = sorted({o.latency for front in fronts.values() for o in front})
    lo, hi = 0, len(lams)
    while lo < hi:  # smallest feasible threshold (feasibility is monotone in lam)
        mid = (lo + hi) // 2
        if _select(fronts, lams[mid], budget) is None:
            lo = mid + 1
        else:
            hi = mid
    out: list[dict[str, Option]] = []
    for lam in lams[lo:]:
        pick = _select(fronts, lam, budget)
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
) -> PlanResult:
    """The fastest feasible plan for ``workload`` on ``cluster`` and up to ``alternatives`` next-best plans.

    Raises:
        InfeasiblePlanError: a model-stage fits no candidate, or a stage's model-stages cannot
            share the pool; the message names the model-stage, its memory and the GPUs it needs.
    """
    stages = workload.stages
    works = {ms.name: stage_work(ms, models, workload) for ms in stages}
    cap, budget = memory_cap(cluster), cluster.num_gpus
    fronts: dict[str, list[Option]] = {}
    shared: dict[StageWork, list[Option]] = {}  # e.g. actor and reference inference price alike
    for name, work in works.items():
        key = replace(work, name="")
        if key not in shared:
            shared[key] = _fill_peaks(work, frontier(stage_options(work, cluster, calibration, budget, cap)))
        fronts[name] = shared[key]
    failed = [diagnose_memory(works[n], cluster, budget, cap) for n, f in fronts.items() if not f]
    if failed:
        # The binding constraint is the model-stage that needs the most GPUs.
        failed.sort(key=lambda x: -(x[0] if x[0] is not None else 1 << 30))
        others = f" (also infeasible: {len(failed) - 1} more model-stages)" if len(failed) > 1 else ""
        raise InfeasiblePlanError(failed[0][1] + others)
    per_stage: list[list[dict[str, Option]]] = []
    for stage in STAGES:
        group = {ms.name: fronts[ms.name] for ms in stages if ms.stage == stage}
        if not group:
            continue
        picks = solve_stage(group, budget, alternatives + 1)
        if not picks:
            need = {n: f[0].gpus for n, f in group.items()}
            raise InfeasiblePlanError(
                f"{stage} stage: its concurrent model-stages need at least {sum(need.values())} GPUs together "
                f"({', '.join(f'{n} {g}' for n, g in need.items())}) but the pool has {budget}; "
                f"raise cluster.num_gpus to {sum(need.values())}"
            )
        per_stage.append(picks)
    stage_of = {ms.name: ms.stage for ms in stages}
    order = [ms.name for ms in stages]

    def total(combo: tuple[dict[str, Option], ...]) -> float:
        return sum(max(o.latency for o in pick.values()) for pick in combo)

    combos = sorted(itertools.product(*per_stage), key=total)[: alternatives + 1]
    results = []
    for combo in combos:
        selection = {n: o for pick in combo for n, o in pick.items()}
        plan = assign_gpus(selection, stage_of, order)
        results.append((plan, estimate_plan(plan, models, cluster, workload, calibration)))
    # On power-of-two nodes the concrete estimate equals the search's objective; elsewhere a
    # placement can cost more than its shape promised, so order by the concrete estimate.
    results.sort(key=lambda r: (not r[1].feasible, r[1].step_latency))
    best, rest = results[0], tuple(results[1:])
    return PlanResult(best[0], best[1], rest)


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
