"""`TargetSearch`: one replan's walk over candidate targets (pricing, payback, the incumbent).

The controller builds a :class:`Replan` (what this boundary knows), a
:class:`~nereus_lightning.control.candidates.CandidateSource` (the targets) and runs the search;
the verdict (transition, restart or keep) is then read off the search's incumbent and log.

Targets that do not *last* (infeasible at the lengths forecast over the horizon, see
``CandidateSource.lasting``) are priced for it: the memory check rejects them a few steps later,
so their gain counts for one step only and they pay for a second move (``TargetSearch._net``).
Outside the urgent path the lengths are those of the next step's memory check, and a target over
the cap there is not taken: the memory trigger would move away from it at the next boundary.

Targets are compared on their expected step time (``Option.expected``: the latency plus the
priced risk of running out of memory at a length jump or a forecast miss), and so is the current
plan (``Replan.current_risk``): the gain of moving to headroom is the risk it removes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from nereus_lightning.control.backend import PlanningBackend
from nereus_lightning.control.candidates import CandidateSource, Option
from nereus_lightning.control.signals import StepSignals
from nereus_lightning.control.triggers import Trigger
from nereus_lightning.plan.layout import Plan
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import InfeasiblePlanError
from nereus_lightning.spec.workload import Workload


@dataclass(frozen=True)
class Replan:
    """What one replan knows: its triggers, horizon, urgency and the current plan's standing."""

    signals: StepSignals
    triggers: tuple[Trigger, ...]
    horizon: float
    urgent: bool
    current_latency: float | None  # None: the current plan is broken (lost GPUs or out of memory)
    intact: Plan | None  # the current plan's units still readable (where a DAG starts)
    dag_cluster: ClusterSpec
    workload: Workload
    current_risk: float = 0.0  # the current plan's priced risk of running out of memory (jump, miss)
    # The current plan's predicted latencies at the lengths forecast over the horizon
    # (``LengthForecast.over_horizon``); empty: the gain is valued at the planning lengths.
    current_ahead: tuple[float, ...] = ()

    @property
    def current_expected(self) -> float | None:
        """The current plan's expected step time (None: broken)."""
        return None if self.current_latency is None else self.current_latency + self.current_risk


def horizon_gain(
    gain: float,
    current: float,
    target: float,
    current_ahead: tuple[float, ...],
    target_ahead: tuple[float, ...],
) -> float:
    """A target's mean gain over the horizon: ``gain`` (at the planning lengths, where the two
    plans predict ``current`` and ``target`` s/step) moved by how their difference changes at the
    lengths forecast over the horizon (``*_ahead``, one latency per forecast point); ``gain``
    itself without a forecast."""
    if not current_ahead:
        return gain
    ahead = sum(c - t for c, t in zip(current_ahead, target_ahead, strict=True)) / len(current_ahead)
    return gain + ahead - (current - target)


def layouts_of(plan: Plan) -> tuple:
    """Every model-stage's TP/PP layout: what a transition DAG must Split or Merge."""
    return tuple((name, cand.layout) for name, cand in plan.items())


class TargetSearch:
    """Prices targets of one replan and keeps the best admitted one (the incumbent).

    ``profitable(dL, L_tran, H)`` is the controller's payback rule; ``scale`` its calibrated
    transition-cost factor; ``first`` the selection "first" (stop at the first admitted target);
    ``latencies_ahead(plan)`` a plan's predicted latencies at the lengths forecast over the
    horizon, read where ``Replan.current_ahead`` has them: on a length trend the gain the payback
    rule weighs is the mean over the horizon (``horizon_gain``), not the gain at the lengths now.
    """

    def __init__(
        self,
        replan: Replan,
        backend: PlanningBackend,
        profitable: Callable[[float, float, float], tuple[bool, str]],
        gamma: float,
        budget: int,
        scale: float = 1.0,
        first: bool = False,
        latencies_ahead: Callable[[Plan], tuple[float, ...]] = lambda plan: (),
    ) -> None:
        self.r, self.backend, self.profitable = replan, backend, profitable
        self.latencies_ahead = latencies_ahead
        self.budget, self.scale, self.first = budget, scale, first
        # Weight of one s/step over the horizon: the payback rule's gamma * H_x; on the urgent
        # path (payback waived) the new plan runs at least one step whatever gamma is.
        h = gamma * replan.horizon
        self.weight = max(h, 1.0) if replan.urgent else h
        self.seen: list[Option] = []
        self.considered: list[dict[str, Any]] = []
        self.best: Option | None = None
        self.priced = 0
        self.ref = replan.current_expected
        self.failed: set[tuple] = set()

    def _beats(self, net: float) -> bool:
        return self.best is None or net > self.best.notes["net"]

    def _net(self, opt: Option, l_tran: float) -> float:
        """Net benefit of moving to ``opt`` at transition cost ``l_tran``: ``weight * dL - L_tran``
        against the reference latency. A target that does not last earns its gain for one step
        (the memory trigger moves away from it before it breaks; what runs after that is not
        known to beat the current plan) and pays for two moves (the one away costs about as much
        as the one in); one that does not even fit the next step also loses that step (it runs
        out of memory)."""
        assert self.ref is not None  # set by evaluate before any target is judged
        if opt.lasts:
            return self.weight * self.gain(opt) - l_tran
        lost = 0.0 if opt.runs_next else opt.latency
        return min(self.weight, 1.0) * (self.ref - opt.expected) - 2 * l_tran - lost

    def gain(self, opt: Option) -> float:
        """``opt``'s gain over the reference latency, its mean over the horizon's forecast lengths
        where there is a forecast (``horizon_gain``); priced once per target."""
        assert self.ref is not None
        if "gain" not in opt.notes:
            r = self.r
            ahead = self.latencies_ahead(opt.plan) if r.current_ahead else ()
            now = self.ref - opt.expected
            current = r.current_latency if r.current_latency is not None else self.ref
            opt.notes["gain"] = horizon_gain(now, current, opt.latency, r.current_ahead, ahead)
        return float(opt.notes["gain"])

    def evaluate(self, opt: Option) -> bool:
        """Price and judge one target; True when the search should stop (selection "first")."""
        r = self.r
        self.seen.append(opt)
        lat = opt.expected
        if self.ref is None:
            self.ref = lat  # broken current plan: rank against the first target instead
        current = r.current_expected
        d_l = math.inf if current is None else current - lat
        entry: dict[str, Any] = {
            "source": opt.source,
            "latency": round(opt.latency, 6),
            "dL": None if math.isinf(d_l) else round(d_l, 6),
        }
        if opt.risk > 0:
            entry["oom_risk_s"] = round(opt.risk, 6)  # does not hold a jump or forecast miss: priced
        if not opt.lasts:
            entry["lasts"] = False  # infeasible at the lengths forecast over the horizon
        self.considered.append(entry)
        if not opt.lasts and not r.urgent:
            entry["verdict"] = (
                "over the memory cap at the next step's forecast: the memory trigger would undo it"
            )
            return False
        bound = self._net(opt, 0.0)  # net benefit if the transition were free
        if r.intact is None:
            entry["verdict"] = "no intact replica of some model-stage: a transition cannot start"
            return False
        if not self.first and not self._beats(bound):
            assert self.best is not None
            entry["verdict"] = f"not priced: even free it cannot beat {self.best.source}"
            return False
        if not self.first and self.priced >= self.budget:
            entry["verdict"] = f"not priced: {self.budget} transition DAGs priced already (budget)"
            return False
        self.priced += 1
        try:
            l_tran = self.backend.transition_cost(r.intact, opt.plan, r.dag_cluster, r.workload) * self.scale
        except InfeasiblePlanError as exc:
            entry["verdict"] = f"transition infeasible: {exc}"
            self.failed.add(layouts_of(opt.plan))
            return False
        entry["L_tran"] = round(l_tran, 6)
        if r.urgent:
            entry["verdict"] = "reachable (urgent: profitability waived)"
        else:
            gain = self.gain(opt)
            if gain != d_l:
                entry["dL_horizon"] = round(gain, 6)  # the mean gain over the forecast lengths
            ok, why = self.profitable(gain, l_tran, r.horizon)
            entry["verdict"] = why
            if not ok:
                return False
        net = self._net(opt, l_tran)
        entry["net_benefit"] = round(net, 6)
        opt.notes.update(l_tran=l_tran, net=net, entry=entry)
        if self._beats(net):
            self.best = opt
        return self.first

    def untried_layouts_first(self, options: Iterator[Option]) -> Iterator[Option]:
        """``options`` with those sharing the layouts of a failed DAG last.

        A DAG fails mostly on a layout change (a Split that does not fit next to the co-resident
        state): targets with the layouts of a failed one are tried last.
        """
        pending = list(options)
        while pending:
            i = next((k for k, o in enumerate(pending) if layouts_of(o.plan) not in self.failed), 0)
            yield pending.pop(i)

    def run(self, source: CandidateSource, try_follow_pool: bool, pin_training: bool) -> None:
        """The regular targets; then, if the best failed, the plans that keep the training layouts."""
        regular = source.regular(self.r.signals, try_follow_pool)
        for opt in regular if self.first else self.untried_layouts_first(regular):
            if self.evaluate(opt):
                return
        best_failed = ("net" not in self.seen[0].notes) if self.seen else self.r.urgent
        if pin_training and not self.first and best_failed:
            # The best target failed: also try the best plans that keep the training layouts
            # (with a DAG budget of their own: they are the likely reachable ones). Pinned plans
            # are never faster than the planner's best, so without a faster target there is none.
            self.priced = 0
            for opt in self.untried_layouts_first(source.pinned()):
                self.evaluate(opt)

    def blocked(self) -> list[tuple[Option, dict[str, Any]]]:
        """Targets whose transition DAG was infeasible, in the order they were considered."""
        pairs = zip(self.seen, self.considered, strict=True)
        return [(o, e) for o, e in pairs if e["verdict"].startswith("transition infeasible")]
