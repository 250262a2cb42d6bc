"""The targets a replan considers, in the order admission tries them.

`CandidateSource` prices plans once each (the cost model's estimate at the planning workload)
and drops infeasible ones; outside the urgent path it also drops targets that are not faster
than the current plan. :meth:`CandidateSource.regular` yields the planner's best plan first (so an
admitted best target costs no extra pricing), then every fallback fastest first;
:meth:`CandidateSource.pinned` yields the planner's best plans that keep the current training
layouts (asked for only when the best target failed: one more planner call). Both also yield each
target that does not last with its over-cap model-stages relieved (:meth:`CandidateSource.relieved`).

Once the run has shown length jumps that no forecast announced (:class:`Surprise`), every target
is also judged at the lengths planned for times the largest such jump: one that runs out of memory
there is charged the expected cost of that (:attr:`Option.risk`), and its relieved variants, which
hold the jump, compete with it on expected step time (:attr:`Option.expected`). Smaller misses
of the forecast are priced the same way (:class:`Shortfall`): a target that would run out of
memory if the next step came in above its forecast as far as earlier steps did is charged the
share of steps that did.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from nereus_lightning.control.backend import Estimate, PlanningBackend
from nereus_lightning.control.signals import StepSignals
from nereus_lightning.control.variants import (
    follow_pool,
    intact_plan,
    keep_layouts,
    place_near,
    relief_variants,
)
from nereus_lightning.plan.layout import Layout, Plan
from nereus_lightning.plan.memory import full_memory
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import InfeasiblePlanError, require
from nereus_lightning.spec.workload import Workload, workflow


@dataclass(frozen=True)
class Surprise:
    """The length jumps no forecast announced, as seen so far in the run (``LengthForecast.surprise``).

    ``workload``: the lengths planned for times the largest such jump; ``rate``: the share of
    steps that brought one.
    """

    workload: Workload
    rate: float

    def risk(self, at_jump: Estimate, latency: float) -> float:
        """Expected seconds per step that running out of memory at a jump adds to a plan: none
        where the plan holds the jump (``at_jump`` feasible), else ``rate`` times the step it
        loses (the step is run again after the urgent replan)."""
        return 0.0 if at_jump.feasible else self.rate * latency


@dataclass(frozen=True)
class Shortfall:
    """How far above their forecast the lengths of past steps came in (``LengthForecast.misses``).

    ``next_step``: the next step's forecast lengths; ``ratios``: ascending, each a step's p95 over
    the forecast made for it, where it came in above it (by less than a ``Surprise``);
    ``scored``: how many steps were compared with their forecast.
    """

    next_step: Workload
    ratios: tuple[float, ...]
    scored: int

    def __post_init__(self) -> None:
        require(
            bool(self.ratios) and list(self.ratios) == sorted(self.ratios) and self.ratios[0] > 1,
            "shortfall.ratios",
            f"must be ascending misses above 1, got {self.ratios}",
        )
        require(
            self.scored >= len(self.ratios),
            "shortfall.scored",
            f"{self.scored} steps scored cannot hold {len(self.ratios)} misses",
        )

    def at(self, ratio: float) -> Workload:
        """The next step's forecast lengths times ``ratio``."""
        w = self.next_step
        return replace(w, response_len=w.response_len * ratio, response_len_p95=w.response_len_p95 * ratio)

    @property
    def worst(self) -> Workload:
        """The next step's lengths if it misses its forecast as far as the worst miss so far."""
        return self.at(self.ratios[-1])

    def rate(self, holds: Callable[[Workload], bool]) -> float:
        """The share of scored steps that came in above what a plan holds, for a plan that does
        not hold :attr:`worst`: a bisection over the misses with ``holds`` (the plan fits there)."""
        lo, hi = -1, len(self.ratios) - 1  # holds at ratios[lo] (-1: none known), not at ratios[hi]
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if holds(self.at(self.ratios[mid])):
                lo = mid
            else:
                hi = mid
        return (len(self.ratios) - hi) / self.scored


@dataclass
class Option:
    """One priced target: its plan, estimate, where it came from, and admission notes."""

    plan: Plan
    estimate: Estimate
    source: str
    notes: dict[str, Any] = field(default_factory=dict)
    lasts: bool = True  # still feasible at the lengths forecast over the horizon
    runs_next: bool = True  # feasible at the next step's lengths (the memory check's)
    at_lasting: Estimate | None = None  # its estimate at those lengths (None: not checked)
    risk: float = 0.0  # expected s/step lost to running out of memory (Surprise, Shortfall)
    at_jump: Estimate | None = None  # its estimate at the jump's lengths (None: not checked)
    at_shortfall: Estimate | None = None  # its estimate at Shortfall.worst (None: not checked)

    @property
    def latency(self) -> float:
        """Predicted step latency of the target."""
        return self.estimate.step_latency

    @property
    def expected(self) -> float:
        """Expected step time: the latency plus the priced risk of running out of memory."""
        return self.latency + self.risk


class CandidateSource:
    """Prices candidate targets of one replan, each plan at most once."""

    def __init__(
        self,
        backend: PlanningBackend,
        calibration: Any,
        current: Plan,
        algorithm: str,
        sequences_per_step: int,
        cluster: ClusterSpec,
        workload: Workload,
        urgent: bool,
        current_latency: float | None,
        safe_first: bool = True,
        memory: Any = None,
        lasting: Workload | None = None,
        surprise: Surprise | None = None,
        next_step: Workload | None = None,
        shortfall: Shortfall | None = None,
    ) -> None:
        self.backend, self.calibration, self.current = backend, calibration, current
        self.memory = memory  # the memory calibration every plan is priced with
        self.algorithm, self.sequences_per_step = algorithm, sequences_per_step
        self.cluster, self.workload = cluster, workload
        # current_latency: the current plan's expected step time (``Option.expected``'s terms)
        self.urgent, self.current_latency = urgent, current_latency
        self.safe_first = safe_first
        self.surprise, self.shortfall = surprise, shortfall
        # The lengths forecast over the horizon (outside the urgent path: the next step's): a
        # target infeasible there does not last. No second pricing where they are the planned ones.
        self.lasting = None if lasting == workload else lasting
        # The next step's lengths (never above the lasting ones): where a target that does not
        # last is checked again, for whether it runs one step at all (None: not checked).
        self.next_step = next_step
        self.seen: set[Plan] = {current}
        self.reasons: list[str] = []
        # Faster than the current plan but for their jump risk: not targets, yet their relieved
        # variants may be (taken up by the next ``relieved``).
        self._risky: list[Option] = []

    def price(self, plan: Plan, source: str, est: Estimate | None = None) -> Option | None:
        """``plan`` as an option, or None if already seen, infeasible, or (not urgent) not faster."""
        if plan in self.seen:
            return None
        self.seen.add(plan)
        if est is None:
            est = self.backend.estimate(
                plan, self.cluster, self.workload, self.calibration, memory=self.memory
            )
        if not est.feasible:
            return None
        opt = Option(plan, est, source)
        if self.surprise is not None:
            opt.at_jump = self.at_whole_memory(plan, self.surprise.workload)
            opt.risk = self.surprise.risk(opt.at_jump, est.step_latency)
        if self.shortfall is not None:
            opt.at_shortfall = self.at_whole_memory(plan, self.shortfall.worst)
            if not opt.at_shortfall.feasible:
                rate = self.shortfall.rate(lambda w: bool(self.at_whole_memory(plan, w).feasible))
                opt.risk += rate * est.step_latency
        if not self.urgent and self.current_latency is not None and opt.expected >= self.current_latency:
            if opt.latency < self.current_latency:
                self._risky.append(opt)
            return None
        if self.lasting is not None:
            opt.at_lasting = self.estimate(plan, self.lasting)
            opt.lasts = bool(opt.at_lasting.feasible)
            opt.runs_next = opt.lasts or self.runs_next(plan)
        return opt

    def runs_next(self, plan: Plan) -> bool:
        """Whether ``plan`` (feasible at the planned lengths) runs the next step without running
        out of memory: at the next step's lengths, against the whole GPU memory (``full_memory``:
        the planner's headroom is for prediction errors, not part of what runs out)."""
        if self.next_step is None or self.next_step == self.workload:
            return True
        est = self.backend.estimate(
            plan, full_memory(self.cluster), self.next_step, self.calibration, memory=self.memory
        )
        return bool(est.feasible)

    def estimate(self, plan: Plan, workload: Workload) -> Estimate:
        """``plan`` priced at ``workload`` on this replan's pool."""
        return self.backend.estimate(plan, self.cluster, workload, self.calibration, memory=self.memory)

    def at_whole_memory(self, plan: Plan, workload: Workload) -> Estimate:
        """``plan`` priced at a length jump or a forecast miss, its memory against the whole GPU
        memory (``full_memory``): the planner's headroom absorbs prediction errors at the lengths
        planned for, and these lengths are already the worst ones seen."""
        return self.backend.estimate(
            plan, full_memory(self.cluster), workload, self.calibration, memory=self.memory
        )

    def relieved(self, options: list[Option | None]) -> list[Option | None]:
        """Each of ``options`` that does not last or does not hold a length jump or the worst
        forecast miss, with the model-stages that pass the cap there relieved (``short_of``,
        ``relief_variants``): a little slower, and it lasts (the layouts, and so the transition,
        stay the same). Also the plans priced since the last call that were faster than the
        current plan but for their priced risk: relieved, they may be faster still."""
        risky, self._risky = self._risky, []
        out = [
            self.price(v, f"{o.source}, relieved")
            for o in (*options, *risky)
            if o is not None
            for v in relief_variants(o.plan, short_of(o))
        ]
        self._risky = []  # (a variant still short of the jump is not relieved twice)
        return out

    def headroom_relief(self) -> list[Option | None]:
        """The current plan relieved where it does not hold a length jump or the worst forecast
        miss (its layouts kept: the cheapest move to headroom); empty where it holds both. (The
        other targets that do not are relieved in :meth:`relieved`.)"""
        worst = []
        if self.surprise is not None:
            worst.append(self.surprise.workload)
        if self.shortfall is not None:
            worst.append(self.shortfall.worst)
        short: set[str] = set()
        for workload in worst:
            est = self.at_whole_memory(self.current, workload)
            if not est.feasible:
                short |= over_cap(est, self.current)
        variants = relief_variants(self.current, short)
        return [self.price(v, "current plan relieved for headroom") for v in variants]

    def regular(self, signals: StepSignals, try_follow_pool: bool) -> Iterator[Option]:
        """The planner's best plan, then every fallback fastest first.

        Fallbacks: the planner's alternatives; each planner plan placed near the current GPUs
        (no swap deadlocks) and with the current layouts kept where they fit (Extend/Destroy
        only), slightly slower targets with cheaper transitions; the current layouts with DP
        re-fitted to the pool; on the urgent path the intact units alone and the current plan
        relieved (smaller micro-batches / recomputation where it runs out of memory); and every
        target that does not last, relieved (:meth:`relieved`).
        """
        try:
            planned = self.backend.plan(self.cluster, self.workload, self.calibration, memory=self.memory)
        except InfeasiblePlanError as exc:
            self.reasons.append(f"planner: {exc}")
            planned = []
        best = self.price(planned[0][0], "planner best", planned[0][1]) if planned else None
        if best is not None:
            yield best
        rest: list[Option | None] = []
        for i, (plan, est) in enumerate(planned):
            source = "planner best" if i == 0 else f"planner alternative {i}"
            if i > 0:
                rest.append(self.price(plan, source, est))
            near = place_near(plan, self.current, self.algorithm)
            rest.append(self.price(near, f"{source}, placed near the current GPUs"))
            rest.append(self.price(keep_layouts(near, self.current), f"{source}, current layouts kept"))
        refit = None
        if try_follow_pool:
            refit = follow_pool(self.current, self.algorithm, signals.num_gpus, self.sequences_per_step)
            if refit is not None:
                refit = place_near(refit, self.current, self.algorithm)
                rest.append(self.price(refit, "current layouts, DP re-fitted to the pool"))
        if self.urgent:
            # Drop the replicas on lost GPUs and keep the intact units (Destroy only): often
            # slower, but always reachable, and the next replan can grow back into the pool.
            survivors = intact_plan(self.current, set(signals.gpus))
            if survivors is not None and survivors != self.current:
                rest.append(self.price(survivors, "intact units only (replicas on lost GPUs dropped)"))
            base = refit if refit is not None else self.current
            if intact_plan(base, set(signals.gpus)) == base:
                est = self.backend.estimate(
                    base, self.cluster, self.lasting or self.workload, self.calibration, memory=self.memory
                )
                rest += [
                    self.price(v, "smaller micro-batches / recomputation")
                    for v in relief_variants(base, over_cap(est, base))
                ]
        rest += self.headroom_relief()
        rest += self.relieved([best, *rest])
        yield from self._safe_first(o for o in rest if o is not None)

    def _safe_first(self, options: Iterator[Option]) -> Iterator[Option]:
        """``options`` fastest first, except that the fastest of those that change the fewest
        layouts comes first: its transition is the cheapest and most likely safe, so pricing it
        early gives the net-benefit search a strong incumbent (pruning the rest) and keeps a
        reachable target inside the DAG budget when the layout changes all fail. With
        ``safe_first`` off (selection "first"), plain latency order."""
        ranked = sorted(options, key=lambda o: o.expected)
        if not ranked or not self.safe_first:
            yield from ranked
            return
        safe = min(ranked, key=lambda o: (layout_changes(o.plan, self.current), o.expected))
        yield safe
        yield from (o for o in ranked if o is not safe)

    def retuned(self) -> Option | None:
        """The current plan with the planner's micro-batches and recomputation for this replan's
        lengths, where it keeps a model-stage's layout and replica count (the planner asked with
        every layout pinned): nothing moves, so a faster one pays back at once. None where nothing
        changes, it is not faster, or the backend cannot pin layouts."""
        plan_pinned = getattr(self.backend, "plan_pinned", None)
        if plan_pinned is None:
            return None
        layouts = {n: c.layout for n, c in self.current.items()}
        try:
            planned = plan_pinned(self.cluster, self.workload, self.calibration, layouts, memory=self.memory)
        except InfeasiblePlanError:
            return None
        best = planned[0][0]
        tuned = Plan(
            tuple(
                (n, replace(c, micro_batch=best[n].micro_batch, recompute=best[n].recompute))
                if n in best and (best[n].layout, best[n].dp) == (c.layout, c.dp)
                else (n, c)
                for n, c in self.current.items()
            )
        )
        return self.price(tuned, "current layouts and GPUs, micro-batches retuned")

    def pinned(self) -> Iterator[Option]:
        """The planner's best plans with every training model-stage kept at its current TP x PP cut
        and ZeRO stage (:func:`same_cut`: a sharded one may change its shard degree).

        Their transitions move no training state between model cuts (Extend/Destroy, or rows
        re-cut in place), so they are cheap and stay safe where a Split would not fit next to
        co-resident state. Needs a backend with ``plan_pinned``; yields nothing otherwise or when
        nothing fits.
        """
        plan_pinned = getattr(self.backend, "plan_pinned", None)
        if plan_pinned is None:
            return
        trains = {ms.name for ms in workflow(self.algorithm) if ms.trains}
        gpus = self.cluster.num_gpus
        layouts = {n: same_cut(c.layout, gpus) for n, c in self.current.items() if n in trains}
        if not layouts:
            return
        try:
            planned = plan_pinned(self.cluster, self.workload, self.calibration, layouts, memory=self.memory)
        except InfeasiblePlanError as exc:
            self.reasons.append(f"planner with the training layouts kept: {exc}")
            return
        found: list[Option | None] = []
        for i, (plan, est) in enumerate(planned):
            source = "training layouts kept: planner " + ("best" if i == 0 else f"alternative {i}")
            found.append(self.price(plan, source, est))
            found.append(
                self.price(
                    place_near(plan, self.current, self.algorithm), f"{source}, placed near the current GPUs"
                )
            )
        found += self.relieved(found)
        yield from self._safe_first(o for o in found if o is not None)


def same_cut(layout: Layout, gpus: int) -> frozenset[Layout]:
    """``layout`` and, where it is ZeRO-sharded, every other shard degree of its TP x PP cut and
    ZeRO stage that fits ``gpus``: a replica that loses or gains GPUs keeps its model cut and
    re-cuts its rows (``plan.rows.recut_in_place``) instead of moving its whole state."""
    if layout.shard == 1:
        return frozenset((layout,))
    most = gpus // layout.model_size
    return frozenset(replace(layout, shard=s) for s in range(2, max(most, layout.shard) + 1))


def layout_changes(plan: Plan, current: Plan) -> int:
    """How many model-stages of ``plan`` run another TP/PP layout than in ``current`` (Split/Merge needed)."""
    return sum(1 for name, cand in plan.items() if name not in current or current[name].layout != cand.layout)


def short_of(opt: Option) -> set[str]:
    """The model-stages of ``opt`` that pass the cap at the lengths forecast over the horizon (if
    it does not last), at a length jump or at the worst forecast miss (if it does not hold them);
    empty where it does all three."""
    out: set[str] = set()
    if opt.at_lasting is not None and not opt.lasts:
        out |= over_cap(opt.at_lasting, opt.plan)
    for est in (opt.at_jump, opt.at_shortfall):
        if est is not None and not est.feasible:
            out |= over_cap(est, opt.plan)
    return out


def over_cap(est: Estimate, plan: Plan) -> set[str]:
    """The model-stages whose peak in ``est`` passes the memory cap; every model-stage of ``plan``
    where it names none (a measured overflow the model did not predict, or an estimate without
    per-stage memory)."""
    cap = getattr(est, "memory_cap", math.inf)
    over = {n for n, peak in (getattr(est, "stage_memory", None) or {}).items() if peak > cap}
    return over or set(plan)
