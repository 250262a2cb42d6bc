"""`Controller`: triggers, admission (feasibility + payback), urgent path and calibration loop.

One instance runs on the head rank. Feed it the monitor's `StepSignals` at every safe boundary
(`step`); it answers with a `Decision` that the body acts on. The rules follow section 4 of the
paper (section 4 of "Nereus: Adaptive Parallelism for LLM Post-Training"):

* triggers: a pool change, a predicted or measured memory violation, or a drifting signal that
  moved more than ``delta`` (relative) from its reference; references reset after every
  triggered replan; a faster target refused there is rechecked once the gain given up has cost
  as much as its transition (``triggers.Recheck``); after ``quiet_check_every`` steps without a
  replan, a ``quiet`` check looks for a plan that became faster under the thresholds;
* admission: the target must be feasible (the cost model's memory check with its headroom, and a
  safe transition DAG); then it must pay back: ``dL > 0 and L_tran / dL <= gamma * H_x`` with
  H_x the smallest horizon of the firing triggers (a due recheck keeps its own) and, while the
  lengths follow a trend, dL the mean gain at the lengths forecast over H_x
  (:meth:`Controller.horizon_workloads`); if the best target fails, slower candidates with
  cheaper transitions are tried before the current plan is kept;
* urgent path (revocation, memory pressure that breaks the current plan): profitability is
  waived, smaller micro-batches and recomputation are considered, and checkpoint/restart is the
  last resort;
* headroom for unannounced length jumps: once the length forecast has been surprised
  (``LengthForecast.surprise``), plans are compared on expected step time, their latency plus
  the priced risk of running out of memory at a jump like the largest seen
  (``candidates.Surprise``), and so, once the next step has come in above its forecast, at a miss
  like the earlier ones (``candidates.Shortfall``); a ``headroom`` trigger fires when the current
  plan stops holding either;
* calibration: measured op-class times correct the time model (``calibration``), and measured
  per-stage peak memory the memory model (``memory_calibration``, a
  :class:`~nereus_lightning.plan.calibration.MemoryCalibration`): every plan, the current one
  included, is then judged on its predicted peaks times the stage's measured factor.

Where to move (``ControllerConfig.selection``, documented there) is Nereus' own policy on top of
the paper's admission rule: among the targets that pass, the one with the largest net benefit
``gamma * H_x * dL - L_tran``; optionally, plans are chosen for the lengths forecast one step
ahead (``control.forecast``); when the best target fails, the planner is also asked for the best plans
that keep the training layouts (``CandidateSource.pinned``); and a restart is judged over
``max(H_x, H_pool)`` (:meth:`Controller.restart_horizon`). Every considered target appears in the
decision log with its latency, ``L_tran``, net benefit and verdict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace
from functools import partial
from typing import Any

from nereus_lightning.control.attribution import PHASES, PhasedEstimate, op_times
from nereus_lightning.control.backend import Estimate, PlanningBackend, op_totals
from nereus_lightning.control.candidates import CandidateSource, Shortfall, Surprise
from nereus_lightning.control.decision import Decision, DecisionLog, describe_plan
from nereus_lightning.control.forecast import LengthForecast
from nereus_lightning.control.search import Replan, TargetSearch
from nereus_lightning.control.signals import DRIFT_SIGNALS, StepSignals
from nereus_lightning.control.state import plan_from_state, plan_to_state
from nereus_lightning.control.triggers import (
    NON_CROSSING_KINDS,
    CrossingClock,
    DriftTrigger,
    PoolTrigger,
    Recheck,
    Trigger,
    bounded,
    smallest_horizon,
)
from nereus_lightning.control.variants import intact_plan
from nereus_lightning.plan.calibration import MemoryCalibration
from nereus_lightning.plan.layout import Plan
from nereus_lightning.plan.memory import full_memory
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import InfeasiblePlanError, require
from nereus_lightning.spec.workload import Workload

ADMISSION_RULES = ("payback", "any_gain")
SELECTIONS = ("net_benefit", "first")


@dataclass(frozen=True)
class ControllerConfig:
    """Knobs of the controller; the defaults are the paper's.

    ``admission="any_gain"`` admits every dL > 0 (the DynaRL-style baseline); ``replan_every=k``
    adds a replan every k steps, and with ``drift_triggers=False`` only that schedule (plus the
    urgent triggers) starts replans (the every-k-steps baseline).

    Target choice (the admission rule decides *whether* to move; these decide *where*):

    * ``selection="net_benefit"``: among the targets that pass feasibility and payback, take the
      one with the largest net benefit over the horizon, ``gamma * H_x * dL - L_tran`` (on the
      urgent path, where payback is waived, the smallest ``w * L_step + L_tran`` with
      ``w = max(gamma * H_x, 1)``: the new plan runs at least one step). ``"first"`` takes the
      first admitted target in latency order (the planner's best when it passes).
    * ``forecast_steps``: plan for (and check memory against) the length signals extrapolated
      this many steps ahead along their recent trend (see ``control.forecast``); 0 (default)
      plans for the last measured lengths. Off by default: it moves memory-driven replans one
      step earlier, which is safer on a machine that fails at the planner's headroom but cost
      time on the simulated one (it runs plans up to the full GPU memory) and gained nothing
      elsewhere (see the ablation in benchmarks/results/controller.json).
    * ``quiet_check_every``: after this many steps without a replan, look for a faster plan anyway
      (a ``quiet`` trigger): drifts under ``delta_len`` and calibration updates can make another
      plan faster without any trigger firing. Its target must pay back within ``gamma`` times the
      steps to the next such check (its H_x), and it leaves the drift references where they are;
      0 turns it off.
    * ``pin_training``: if the best target fails, also ask the planner for the best plans that
      keep every training model-stage's current TP/PP layout and ZeRO stage (no Split/Merge of
      optimizer state: cheap, and safe when a Split would not fit next to the co-resident state);
      a ZeRO-sharded replica may change its shard degree, its rows re-cut in place.
    * ``retune``: at every boundary where no trigger fires, take the planner's micro-batches and
      recomputation for the current layouts and GPUs when they are faster at the lengths now
      (nothing moves, so the gain pays back at once): micro-batches follow the lengths up and
      down between replans.
    * ``dag_budget_gpus``: per round of targets (the regular ones, then the pinned ones) at most
      ``max(2, dag_budget_gpus // pool size)`` transition DAGs are priced (4 at 1,024 GPUs, 64 at
      64): DAG pricing grows with the pool, so this bounds the replan time where it matters;
      targets that cannot beat the chosen one are never priced, and targets with the same
      layouts as one whose DAG failed are priced last (the failure is usually a layout change).
    """

    gamma: float = 0.5
    delta_len: float = 0.3
    drift_signals: tuple[str, ...] = ("response_len", "response_len_p95", "prompt_len")
    ema_alpha: float = 0.5
    admission: str = "payback"
    replan_every: int = 0
    drift_triggers: bool = True
    pool_triggers: bool = True
    try_follow_pool: bool = True
    transition_alpha: float = 0.5
    memory_check_tolerance: float = 0.01
    restart_s: float = 300.0  # expected seconds of a checkpoint/restart (save, relaunch, load)
    selection: str = "net_benefit"
    forecast_steps: float = 0.0
    forecast_window: int = 3
    quiet_check_every: int = 4
    pin_training: bool = True
    dag_budget_gpus: int = 4096
    retune: bool = True

    def __post_init__(self) -> None:
        require(self.gamma >= 0, "controller.gamma", f"must be >= 0, got {self.gamma}")
        require(self.delta_len > 0, "controller.delta_len", f"must be positive, got {self.delta_len}")
        require(
            self.admission in ADMISSION_RULES,
            "controller.admission",
            f"{self.admission!r} not in {ADMISSION_RULES}",
        )
        require(self.replan_every >= 0, "controller.replan_every", f"must be >= 0, got {self.replan_every}")
        require(
            self.quiet_check_every >= 0,
            "controller.quiet_check_every",
            f"must be >= 0, got {self.quiet_check_every}",
        )
        for name in self.drift_signals:
            require(
                name in DRIFT_SIGNALS,
                "controller.drift_signals",
                f"{name!r} is not one of {list(DRIFT_SIGNALS)}",
            )
        require(self.restart_s > 0, "controller.restart_s", f"must be positive, got {self.restart_s}")
        require(
            0 < self.transition_alpha <= 1,
            "controller.transition_alpha",
            f"must be in (0, 1], got {self.transition_alpha}",
        )
        require(
            self.selection in SELECTIONS, "controller.selection", f"{self.selection!r} not in {SELECTIONS}"
        )
        require(
            self.forecast_steps >= 0, "controller.forecast_steps", f"must be >= 0, got {self.forecast_steps}"
        )
        require(
            self.forecast_window >= 2,
            "controller.forecast_window",
            f"must be >= 2, got {self.forecast_window}",
        )
        require(
            self.dag_budget_gpus >= 1,
            "controller.dag_budget_gpus",
            f"must be >= 1, got {self.dag_budget_gpus}",
        )
        object.__setattr__(self, "drift_signals", tuple(self.drift_signals))


class Controller:
    """The adaptive-parallelism controller of one job (pure Python, one process).

    ``calibration`` (time; None: the cost model's priors) and ``memory_calibration`` (peak memory;
    None: a fresh :class:`~nereus_lightning.plan.calibration.MemoryCalibration`) learn from every
    step's measurements and are part of :meth:`state_dict`.
    """

    def __init__(
        self,
        backend: PlanningBackend,
        cluster: ClusterSpec,
        workload: Workload,
        config: ControllerConfig | None = None,
        calibration: Any = None,
        log: DecisionLog | str | None = None,
        plan: Plan | None = None,
        memory_calibration: MemoryCalibration | None = None,
        max_steps: int | None = None,
    ) -> None:
        self.backend = backend
        self.cluster = cluster
        self.workload = workload
        self.config = config or ControllerConfig()
        self.calibration = calibration
        self.memory_calibration = memory_calibration or MemoryCalibration()
        self.log = DecisionLog(log) if isinstance(log, str) else log
        self.plan = plan
        self.drift = {
            n: DriftTrigger(n, self.config.delta_len, self.config.ema_alpha)
            for n in self.config.drift_signals
        }
        self.pool = PoolTrigger(self.config.ema_alpha, cluster.num_nodes * cluster.gpus_per_node)
        self.memory_clock = CrossingClock(self.config.ema_alpha)
        self.recheck = Recheck()
        self.transition_scale = 1.0
        self.last_replan_step: int | None = None
        self.decisions = 0
        self._pending_transition: float | None = None  # raw predicted L_tran of the last admitted transition
        # The current plan's estimates by (pool, length buckets): at the measured lengths (the
        # calibration loop) and at the forecast (the memory trigger); cleared when the plan changes.
        self._estimates: dict[tuple, tuple[Estimate, dict[str, float]]] = {}
        self.forecast = LengthForecast(self.config.forecast_window, self.config.delta_len)
        self._used: tuple[Plan, frozenset[int]] | None = None  # (plan, its GPU ids), cached per plan
        # The run's step limit (None: unbounded): no horizon reaches past it.
        self.max_steps = max_steps
        self._relaunched = False  # state restored: the next pool trigger's pool is the launch's
        self._headroom_checked: tuple[Plan, bool] | None = None  # (plan, whether it held a jump)
        self._retuned: tuple | None = None  # what the last retune looked at (plan, pool, lengths)

    # ----------------------------------------------------------------------------- per step
    def step(self, signals: StepSignals) -> Decision:
        """Consume one step's signals; return what the body must do before the next step."""
        self.forecast.observe(signals)
        for clock in (self.pool.clock, *(d.clock for d in self.drift.values())):
            clock.start(signals.step)
        self._calibrate(signals)
        if self.plan is None:
            decision = self._initial(signals)
        else:
            triggers = self._triggers(signals)
            relaunch = self._relaunch(signals, triggers) if self._relaunched else None
            self._relaunched = False
            if relaunch is None and not triggers:
                decision = self._retune(signals)
                if decision.kind == "none":
                    return decision
            else:
                decision = relaunch or self._replan(signals, triggers)
                if relaunch is not None or any(t.kind not in NON_CROSSING_KINDS for t in triggers):
                    self._reset_references(signals)  # neither is a crossing: references stay
                    self.recheck.settle(signals.step)
                self.recheck.refuse(
                    signals.step, None if relaunch else refused_payback(decision), self.config.gamma
                )
        if decision.changes_plan:
            self.plan = decision.target
            self._estimates.clear()
            self._pending_transition = (
                decision.transition_cost / self.transition_scale
                if decision.kind == "transition" and decision.transition_cost
                else None
            )
        if self.log is not None:
            self.log.append(decision)
        self.decisions += 1
        return decision

    def workload_at(self, signals: StepSignals) -> Workload:
        """The job's workload with the measured lengths of ``signals``."""
        return workload_at(self.workload, signals)

    def planning_workload(self, signals: StepSignals) -> Workload:
        """The workload plans are chosen for: the lengths forecast ``forecast_steps`` ahead.

        The measured lengths lag the step a new plan will run by one step; with a steady drift
        the forecast is where the next step will be (``control.forecast``). Falls back to the
        measured lengths when the forecast is off or has fewer than two measurements.
        """
        ahead = self.forecast.ahead(self.config.forecast_steps) if self.config.forecast_steps > 0 else None
        if ahead is None:
            return self.workload_at(signals)
        return at_lengths(self.workload, ahead)

    def next_step_workload(self, signals: StepSignals) -> Workload:
        """The lengths the next step is checked for: the planning lengths, or the next step's
        forecast on the safe side (``LengthForecast.next_step``) where it is longer (the step a
        plan runs is one past the last measurement)."""
        base = self.planning_workload(signals)
        ahead = self.forecast.next_step()
        if ahead is None or ahead["response_len_p95"] <= base.response_len_p95:
            return base
        return replace(
            base,
            response_len=max(base.response_len, ahead["response_len"]),
            response_len_p95=ahead["response_len_p95"],
        )

    def surprise(self, signals: StepSignals) -> Surprise | None:
        """The length jumps no forecast announced so far (``LengthForecast.surprise``) as a
        :class:`~nereus_lightning.control.candidates.Surprise`: the lengths planned for times the
        largest of them, and how often they came; None while there was none."""
        seen = self.forecast.surprise()
        if seen is None:
            return None
        rate, ratio = seen
        base = self.planning_workload(signals)
        jump = replace(
            base,
            response_len=base.response_len * ratio,
            response_len_p95=base.response_len_p95 * ratio,
        )
        return Surprise(jump, rate)

    def shortfall(self, signals: StepSignals) -> Shortfall | None:
        """How far above their forecast earlier steps came in (``LengthForecast.misses``), as a
        :class:`~nereus_lightning.control.candidates.Shortfall` around the next step's forecast;
        None while none did."""
        if not self.forecast.misses:
            return None
        ratios = tuple(sorted(self.forecast.misses))
        return Shortfall(self.next_step_workload(signals), ratios, self.forecast.scored)

    def cluster_at(self, signals: StepSignals) -> ClusterSpec:
        """The cluster restricted to the pool of ``signals``."""
        return self.cluster.with_gpus(signals.num_gpus)

    # ------------------------------------------------------------------------------ triggers
    def _triggers(self, signals: StepSignals) -> list[Trigger]:
        step = signals.step
        triggers: list[Trigger] = []
        assert self.plan is not None
        if self._used is None or self._used[0] is not self.plan:
            self._used = (self.plan, frozenset(g for _, c in self.plan.items() for g in c.gpus))
        used = self._used[1]
        pool_trigger = self.pool.check(step, signals.gpus, used)
        if pool_trigger is not None and (pool_trigger.urgent or self.config.pool_triggers):
            triggers.append(pool_trigger)
        if self.config.drift_triggers:
            for name, drift in self.drift.items():
                fired = drift.check(step, signals.value(name))
                if fired is not None:
                    triggers.append(fired)
        if (pool_trigger is None or not pool_trigger.urgent) and not self._current_fits(signals):
            self.memory_clock.cross(step)
            triggers.append(
                Trigger("memory", self.memory_clock.horizon, urgent=True, detail=self._memory_detail)
            )
        headroom = self._headroom_trigger(signals)
        if headroom is not None:
            triggers.append(headroom)
        if self.last_replan_step is None:
            self.last_replan_step = step  # a plan handed in counts as planned now
        k = self.config.replan_every
        if k and step - self.last_replan_step >= k:
            triggers.append(Trigger("schedule", float(k), detail=f"every {k} steps"))
        quiet = self.config.quiet_check_every
        if quiet and step - self.last_replan_step >= quiet:
            triggers.append(Trigger("quiet", float(quiet), detail=f"no replan for {quiet} steps"))
            self.last_replan_step = step  # the next check comes `quiet` steps on
        recheck = self.recheck.check(step)
        if recheck is not None:
            triggers.append(recheck)
        left = None if self.max_steps is None else max(self.max_steps - step, 0)
        return [bounded(t, left, self._relaunched) for t in triggers]

    def _current_fits(self, signals: StepSignals) -> bool:
        """Predicted (cost model) and measured memory of the current plan within the cap."""
        cap = self.cluster.gpu_memory
        over = [r for r, b in signals.peak_memory.items() if b > cap]
        if over:
            self._memory_detail = f"measured peak memory above the {cap / 1e9:.0f} GB cap on ranks {over[:8]}"
            return False
        est = self._current_estimate(signals, self.next_step_workload(signals))
        self._memory_detail = "predicted peak memory at the next step's forecast exceeds the cap: " + (
            "; ".join(str(v) for v in getattr(est, "violations", ()))
        )
        return bool(est.feasible)

    def _headroom_trigger(self, signals: StepSignals) -> Trigger | None:
        """A replan when the current plan would run out of memory at a length jump like the largest
        unannounced one or at a miss of the length forecast like the worst so far: its priced risk
        (``Surprise``, ``Shortfall``) is then weighed against the plans that hold them. It fires
        when a plan is first seen not to hold them (as the lengths grow, a plan chosen for its
        headroom may lose it, and with it the reason it was chosen); its horizon is the p95
        length's drift clock (the headroom is worth as much as the plan runs, until the next
        crossing of the length the jumps and misses are measured on)."""
        if self.plan is None or not self.config.drift_triggers:
            return None
        short = self._short_of_headroom(signals)
        if short is None:
            return None
        seen, self._headroom_checked = self._headroom_checked, (self.plan, not short)
        if not short or seen == (self.plan, False):
            return None
        p95 = self.drift.get("response_len_p95")
        horizon = p95.clock.horizon if p95 is not None else 1.0
        detail = "the current plan runs out of memory at " + " and ".join(short)
        return Trigger("headroom", horizon, detail=detail)

    def _short_of_headroom(self, signals: StepSignals) -> list[str] | None:
        """What the current plan does not hold of the jumps and forecast misses seen so far; None
        while there were none."""
        surprise, shortfall = self.surprise(signals), self.shortfall(signals)
        if surprise is None and shortfall is None:
            return None
        short = []
        if surprise is not None and not self._holds(signals, surprise.workload):
            rate, ratio = self.forecast.surprise() or (0.0, 0.0)
            short.append(
                f"a length jump like the largest unannounced one (x{ratio:.2f}, {rate:.0%} of steps)"
            )
        if shortfall is not None and not self._holds(signals, shortfall.worst):
            short.append(
                f"a miss of the length forecast like the worst so far (x{shortfall.ratios[-1]:.2f}; "
                f"{len(shortfall.ratios) / shortfall.scored:.0%} of steps came in above their forecast)"
            )
        return short

    def _holds(self, signals: StepSignals, workload: Workload) -> bool:
        """Whether the current plan fits ``workload`` in the whole GPU memory (``full_memory``)."""
        return bool(self._cached_estimate(signals, workload, whole_memory=True)[0].feasible)

    def _current_risk(self, signals: StepSignals, latency: float) -> float:
        """The current plan's priced risk of running out of memory at a length jump or a forecast
        miss like those seen (``Surprise.risk``, ``Shortfall.rate``), in s/step."""
        risk = 0.0
        surprise, shortfall = self.surprise(signals), self.shortfall(signals)
        if surprise is not None:
            at_jump = self._cached_estimate(signals, surprise.workload, whole_memory=True)[0]
            risk += surprise.risk(at_jump, latency)
        if shortfall is not None and not self._holds(signals, shortfall.worst):
            risk += shortfall.rate(partial(self._holds, signals)) * latency
        return risk

    def _current_estimate(self, signals: StepSignals, workload: Workload | None = None) -> Estimate:
        """The current plan's estimate at ``workload`` (default: the measured lengths), re-priced
        only when the pool or a length moved by more than the tolerance.

        Memory does not depend on the efficiencies, and op-class predictions are rescaled to the
        current efficiencies in :meth:`predicted_op_times`, so the cache stays valid across
        calibration updates; a memory factor that rises clears it (:meth:`_calibrate_memory`).
        This keeps the per-step cost without a trigger tiny.
        """
        return self._cached_estimate(signals, workload or self.workload_at(signals))[0]

    def _cached_estimate(
        self, signals: StepSignals, workload: Workload, whole_memory: bool = False
    ) -> tuple[Estimate, dict[str, float]]:
        tol = self.config.memory_check_tolerance
        # whole_memory: judged against the whole GPU memory (``full_memory``), not the cap
        key = (signals.num_gpus, *_length_buckets(workload, tol), whole_memory)
        hit = self._estimates.get(key)
        if hit is None:
            assert self.plan is not None
            if len(self._estimates) >= 8:
                self._estimates.clear()
            cluster, memory = self.cluster_at(signals), self.memory_calibration
            if whole_memory:
                cluster = full_memory(cluster)
            est = self.backend.estimate(self.plan, cluster, workload, self.calibration, memory=memory)
            hit = self._estimates[key] = (est, _efficiencies(self.calibration))
        return hit

    def _reset_references(self, signals: StepSignals) -> None:
        # Every replan, admitted or rejected, moves every reference to the current value.
        for name, drift in self.drift.items():
            drift.reset(signals.value(name))
        self.pool.reset(signals.gpus)
        self.last_replan_step = signals.step

    # ------------------------------------------------------------------------------ planning
    def _initial(self, signals: StepSignals) -> Decision:
        cluster, workload = self.cluster_at(signals), self.workload_at(signals)
        suspended = self.decisions > 0  # a restart with no plan left the job checkpointed, waiting
        try:
            options = self.backend.plan(cluster, workload, self.calibration, memory=self.memory_calibration)
        except InfeasiblePlanError as exc:
            if not suspended:
                raise  # the job cannot start at all: the error names the binding constraint
            return Decision(signals.step, "wait", f"checkpointed; still no plan fits: {exc}", signals=signals)
        plan, est = options[0]
        self._reset_references(signals)
        return Decision(
            signals.step,
            "restart" if suspended else "initial",
            "a plan fits again: restart from the checkpoint" if suspended else "first plan for this job",
            target=plan,
            target_latency=est.step_latency,
            gamma=self.config.gamma,
            signals=signals,
        )

    def _relaunch(self, signals: StepSignals, triggers: list[Trigger]) -> Decision | None:
        """The first decision after a relaunch: the planner's best plan for the launch's pool.

        The body rebuilds every unit from the layout-independent checkpoint (Lightning restores
        it before the first step), so reaching any plan costs the same load: no transition is
        run, L_tran = 0, and a faster plan pays back at once over the steps left. None (the
        regular replan decides) when no plan fits the pool, none is faster than the restored
        one, or gamma = 0.
        """
        assert self.plan is not None
        cluster, workload = self.cluster_at(signals), self.planning_workload(signals)
        memory = self.memory_calibration
        try:
            best, est = self.backend.plan(cluster, workload, self.calibration, memory=memory)[0]
        except InfeasiblePlanError:
            return None
        current = None
        if intact_plan(self.plan, set(signals.gpus)) == self.plan:
            own = self.backend.estimate(self.plan, cluster, workload, self.calibration, memory=memory)
            current = own.step_latency if own.feasible else None
        left = None if self.max_steps is None else max(self.max_steps - signals.step, 1)
        horizon = float(left) if left is not None else smallest_horizon(triggers) if triggers else 1.0
        d_l = math.inf if current is None else current - est.step_latency
        ok, why = self._profitable(d_l, 0.0, horizon)
        if best == self.plan or not ok:
            return None
        span = f"the {left} steps left" if left is not None else "H_x"
        return Decision(
            signals.step,
            "transition",
            triggers=tuple(triggers),
            current=self.plan,
            current_latency=current,
            target=best,
            target_latency=est.step_latency,
            delta_latency=None if current is None else d_l,
            transition_cost=0.0,
            horizon=horizon,
            gamma=self.config.gamma,
            signals=signals,
            considered=(
                {
                    "source": "planner best",
                    "latency": est.step_latency,
                    "L_tran": 0.0,
                    "verdict": f"admitted: {why}",
                },
            ),
            reason=f"relaunched on {signals.num_gpus} GPUs: the checkpoint loads into any plan, so "
            f"the planner's best costs no transition (L_tran = 0) and {why} ({span})",
        )

    def _replan(self, signals: StepSignals, triggers: list[Trigger]) -> Decision:
        assert self.plan is not None
        cfg = self.config
        r, reasons = self._replan_context(signals, triggers)
        latencies_ahead = partial(self.latencies_at, self.horizon_workloads(r), self.cluster_at(signals))
        r = replace(r, current_ahead=latencies_ahead(self.plan))
        decision = self._decision(r)
        first = cfg.selection == "first"
        source = self._candidates(r)
        budget = max(2, cfg.dag_budget_gpus // max(r.dag_cluster.num_gpus, 1))
        search = TargetSearch(
            r,
            self.backend,
            self._profitable,
            cfg.gamma,
            budget,
            self.transition_scale,
            first,
            latencies_ahead,
        )
        search.run(source, cfg.try_follow_pool, cfg.pin_training)
        reasons += source.reasons
        if search.best is not None:
            return self._admit(r, search, reasons, decision)
        if r.urgent:
            best = min(search.seen, key=lambda o: o.latency) if search.seen else None
            return decision(
                kind="restart",
                target=None if best is None else best.plan,
                target_latency=None if best is None else best.latency,
                considered=tuple(search.considered),
                reason="; ".join(
                    [
                        *reasons,
                        "no feasible transition: checkpoint/restart"
                        + (" into the best plan" if best else "; no plan fits the pool, wait for GPUs"),
                    ]
                ),
            )
        return self._keep_or_restart(r, search, decision)

    def _candidates(self, r: Replan) -> CandidateSource:
        """The targets of replan ``r``, priced on its pool and lengths."""
        assert self.plan is not None
        signals = r.signals
        return CandidateSource(
            self.backend,
            self.calibration,
            self.plan,
            self.workload.algorithm,
            self.workload.sequences_per_step,
            self.cluster_at(signals),
            r.workload,
            r.urgent,
            r.current_expected,
            safe_first=self.config.selection != "first",
            memory=self.memory_calibration,
            lasting=self.lasting_workload(signals, r) if r.urgent else self.next_step_workload(signals),
            next_step=self.next_step_workload(signals),
            surprise=self.surprise(signals),
            shortfall=self.shortfall(signals),
        )

    def _retune(self, signals: StepSignals) -> Decision:
        """At a boundary without triggers: the current layouts and GPUs with the planner's
        micro-batches and recomputation for the lengths now (``CandidateSource.retuned``), taken
        when faster. Nothing moves, so any gain pays back at once; the drift references and the
        replan clock stay where they are."""
        none = Decision(signals.step, "none")
        if not self.config.retune or self.plan is None:
            return none
        # One pinned planner call per look: looked at again once the plan, the pool or a length
        # (in buckets of ``memory_check_tolerance``) has changed.
        work, tol = self.planning_workload(signals), self.config.memory_check_tolerance
        key = (self.plan, signals.num_gpus, *_length_buckets(work, tol))
        if key == self._retuned:
            return none
        self._retuned = key
        trigger = Trigger("retune", 1.0, detail="micro-batches and recomputation retuned to the lengths")
        r, _ = self._replan_context(signals, [trigger])
        if r.urgent:  # (also when the current plan is broken: lost GPUs or over memory)
            return none
        opt = self._candidates(r).retuned()  # the same units: no DAG to price
        if opt is None or not opt.lasts:
            return none
        assert r.current_expected is not None  # not urgent: the current plan runs
        d_l = r.current_expected - opt.expected
        return self._decision(r)(
            kind="transition",
            reason=f"retune: {opt.source}, {d_l:.3f} s/step faster with no state moved",
            target=opt.plan,
            target_latency=opt.latency,
            delta_latency=d_l,
            transition_cost=0.0,
        )

    def _decision(self, r: Replan) -> partial[Decision]:
        """A verdict of replan ``r``: ``Decision`` with the fields every verdict of its step carries."""
        return partial(
            Decision,
            step=r.signals.step,
            triggers=r.triggers,
            current=self.plan,
            current_latency=r.current_latency,
            horizon=r.horizon,
            gamma=self.config.gamma,
            urgent=r.urgent,
            signals=r.signals,
        )

    def _replan_context(self, signals: StepSignals, triggers: list[Trigger]) -> tuple[Replan, list[str]]:
        """What this replan knows: horizon, urgency, the current plan's latency, the intact units."""
        assert self.plan is not None
        cluster, workload = self.cluster_at(signals), self.planning_workload(signals)
        pool = set(signals.gpus)
        # A transition may read state from draining GPUs (revocation notice); it starts from the
        # units that are still readable, priced on a cluster large enough to hold them.
        readable = pool | set(signals.draining)
        memory = self.memory_calibration
        current_est = (
            self.backend.estimate(self.plan, cluster, workload, self.calibration, memory=memory)
            if intact_plan(self.plan, pool) == self.plan
            else None
        )
        current_latency = (
            current_est.step_latency if current_est is not None and current_est.feasible else None
        )
        urgent = any(t.urgent for t in triggers)
        reasons: list[str] = []
        if current_latency is None:
            urgent = True
            lost = current_est is None
            reasons.append(
                "GPUs of the current plan were lost" if lost else "the current plan no longer fits"
            )
        risk = 0.0 if current_latency is None else self._current_risk(signals, current_latency)
        if risk > 0:
            reasons.append(
                f"the current plan may run out of memory at a length jump or a forecast miss like "
                f"those seen: priced at {risk:.2f} s/step"
            )
        replan = Replan(
            signals,
            tuple(triggers),
            smallest_horizon(triggers),
            urgent,
            current_latency,
            intact_plan(self.plan, readable),
            self.cluster.with_gpus(max(signals.num_gpus, max(readable, default=0) + 1)),
            workload,
            risk,
        )
        return replan, reasons

    def lasting_workload(self, signals: StepSignals, replan: Replan) -> Workload | None:
        """The lengths a target must still fit: the forecast over the horizon, never below the
        lengths planned for nor the next step's memory check (``next_step_workload``).

        The forecast moves at most ``delta_len`` from the last measurement (its clamp): a
        larger move fires a drift trigger and a replan anyway, so a target need not fit beyond
        it. None (no check) before the forecast has two measurements.
        """
        ahead = self.forecast.ahead(max(1.0, replan.horizon))
        if ahead is None:
            return None
        base = self.next_step_workload(replan.signals)
        mean = max(base.response_len, ahead["response_len"])
        return replace(
            base,
            response_len=mean,
            response_len_p95=max(base.response_len_p95, ahead["response_len_p95"], mean),
            prompt_len=max(base.prompt_len, int(round(ahead["prompt_len"]))),
        )

    def horizon_workloads(self, replan: Replan) -> tuple[Workload, ...]:
        """The lengths forecast over the horizon (``LengthForecast.over_horizon``), where the payback
        rule values a target's gain (``search.horizon_gain``): on a steady rise the gain of a plan
        that scales better grows over the steps it will run. Empty while the forecast has no trend
        (the gain at the planning lengths, the paper's rule), on the urgent path (no payback) and
        under the any-gain rule (any gain now is admitted)."""
        if replan.urgent or replan.current_latency is None or self.config.admission != "payback":
            return ()
        return tuple(
            at_lengths(replan.workload, ahead) for ahead in self.forecast.over_horizon(replan.horizon)
        )

    def latencies_at(
        self, workloads: tuple[Workload, ...], cluster: ClusterSpec, plan: Plan
    ) -> tuple[float, ...]:
        """``plan``'s predicted step latency at each of ``workloads`` on ``cluster``."""
        return tuple(
            self.backend.estimate(
                plan, cluster, w, self.calibration, memory=self.memory_calibration
            ).step_latency
            for w in workloads
        )

    def _admit(self, r: Replan, search: TargetSearch, reasons: list[str], decision: Any) -> Decision:
        """The verdict when a target was admitted (on the urgent path: possibly a restart instead)."""
        cfg = self.config
        chosen = search.best
        assert chosen is not None
        entry, l_tran = chosen.notes["entry"], chosen.notes["l_tran"]
        how = "first admitted target" if search.first else "largest net benefit gamma*H_x*dL - L_tran"
        if not chosen.lasts:
            how += (
                "; it does not last the forecast over the horizon (priced: its gain for one step, two moves)"
            )
        considered = tuple(search.considered)
        if r.urgent:
            fastest = min(search.seen, key=lambda o: o.latency)
            slower = chosen.latency - fastest.latency
            if slower > 0 and cfg.admission == "payback":
                # The reachable target is slower than the best plan, which has no safe DAG:
                # restarting into the best plan is worth it if the restart pays back.
                ok, why = self._profitable(
                    slower, max(cfg.restart_s - l_tran, 0.0), self.restart_horizon(r.horizon, r.signals.step)
                )
                if ok:
                    entry["verdict"] = f"reachable, but a restart into {fastest.source} {why}"
                    return decision(
                        kind="restart",
                        target=fastest.plan,
                        target_latency=fastest.latency,
                        transition_cost=cfg.restart_s,
                        considered=considered,
                        reason="; ".join(
                            [
                                *reasons,
                                f"urgent ({_kinds(r.triggers)}): the reachable target is "
                                f"{slower:.2f} s/step slower; checkpoint/restart {why}",
                            ]
                        ),
                    )
            entry["verdict"] = "admitted (urgent: profitability waived)"
            d_l = None if r.current_latency is None else r.current_latency - chosen.latency
            return decision(
                kind="transition",
                target=chosen.plan,
                target_latency=chosen.latency,
                delta_latency=d_l,
                transition_cost=l_tran,
                considered=considered,
                reason="; ".join(
                    [
                        *reasons,
                        f"urgent ({_kinds(r.triggers)}): {how} among feasible targets ({chosen.source})",
                    ]
                ),
            )
        entry["verdict"] = "admitted: " + entry["verdict"]
        assert r.current_latency is not None
        return decision(
            kind="transition",
            target=chosen.plan,
            target_latency=chosen.latency,
            delta_latency=r.current_latency - chosen.latency,
            transition_cost=l_tran,
            considered=considered,
            reason=f"{_kinds(r.triggers)}: {entry['verdict'].removeprefix('admitted: ')}; {how} "
            f"({chosen.source}){_headroom_note(r.current_risk, chosen.risk)}",
        )

    def _keep_or_restart(self, r: Replan, search: TargetSearch, decision: Any) -> Decision:
        """No DAG transition was admitted: restart into a target without a safe DAG, or keep."""
        # When the best gain had no safe DAG at all, a checkpoint/restart is one more way to
        # reach it: admitted under the payback rule, with L_tran = the restart's cost (the
        # any-gain baselines do not restart voluntarily).
        cfg = self.config
        blocked = search.blocked()
        considered = tuple(search.considered)
        if blocked and r.current_latency is not None and cfg.admission == "payback":
            opt, _ = blocked[0]
            d_l = r.current_latency - opt.latency
            ok, why = self._profitable(d_l, cfg.restart_s, self.restart_horizon(r.horizon, r.signals.step))
            if ok:
                return decision(
                    kind="restart",
                    target=opt.plan,
                    target_latency=opt.latency,
                    delta_latency=d_l,
                    transition_cost=cfg.restart_s,
                    considered=considered,
                    reason=f"{_kinds(r.triggers)}: no safe transition DAG; checkpoint/restart {why} "
                    f"({opt.source})",
                )
        top = considered[0] if considered else None
        why = (
            "no faster feasible plan"
            if top is None
            else f"payback failed for every candidate (best: {top['verdict']})"
        )
        return decision(kind="keep", target=None, considered=considered, reason=why)

    def restart_horizon(self, horizon: float, step: int | None = None) -> float:
        """The horizon a checkpoint/restart is judged over: ``max(H_x, H_pool)``, never past the
        run's last step (the steps left after ``step``, as every trigger's horizon).

        A restart is considered only when the better plan has no safe transition DAG from the
        current one (the current layouts are a trap: e.g. a deep pipeline whose Split does not
        fit next to the co-resident state). Every later drift or memory replan meets the same
        infeasible DAG, so the deficit of staying lasts until the pool changes (only new GPUs
        can open a safe path), not just until the firing signal's next crossing: the pool's
        crossing clock bounds it from below when it is longer.
        """
        longest = max(horizon, self.pool.clock.horizon)
        if self.max_steps is None or step is None:
            return longest
        return min(longest, float(max(self.max_steps - step, 1)))

    def _profitable(self, d_l: float, l_tran: float, horizon: float) -> tuple[bool, str]:
        cfg = self.config
        if d_l <= 0:
            return False, f"not faster (dL={d_l:.3f} s)"
        if cfg.admission == "any_gain":
            return True, f"dL={d_l:.3f} s > 0 (any gain admitted)"
        if cfg.gamma <= 0:
            return False, "gamma=0 admits only urgent transitions"
        payback = l_tran / d_l
        if payback <= cfg.gamma * horizon:
            return True, f"pays back in {payback:.2f} steps <= gamma*H_x = {cfg.gamma:g}*{horizon:.2f}"
        return False, f"pays back in {payback:.2f} steps > gamma*H_x = {cfg.gamma:g}*{horizon:.2f}"

    # ---------------------------------------------------------------------------- calibration
    def _calibrate(self, signals: StepSignals) -> None:
        """Feed measured op-class and transition times and stage peaks back into the cost model after
        every step."""
        if signals.transition_time is not None and self._pending_transition:
            ratio = signals.transition_time / self._pending_transition
            a = self.config.transition_alpha
            self.transition_scale = a * ratio + (1 - a) * self.transition_scale
            self._pending_transition = None
        self._calibrate_memory(signals)
        if self.calibration is None or self.plan is None:
            return
        measured = signals.op_time or self._op_time_from_phases(signals)
        if not measured:
            return
        predicted = self.predicted_op_times(signals)
        for op_class, seconds in measured.items():
            if predicted.get(op_class, 0) > 0 and seconds > 0:
                self.calibration.observe(op_class, predicted[op_class], seconds)

    def _calibrate_memory(self, signals: StepSignals) -> None:
        """Feed each stage's measured peak into the memory calibration: on the GPU where measured /
        predicted is largest, against the plan that ran, priced at the lengths it ran."""
        if self.plan is None or not signals.stage_peak_memory:
            return
        est, _ = self._cached_estimate(signals, self.workload_at(signals))
        predicted = getattr(est, "stage_peak", None) or {}
        rose = False
        for stage, measured in signals.stage_peak_memory.items():
            pairs = [(measured[g], p) for g, p in predicted.get(stage, {}).items() if p > 0 and g in measured]
            if pairs:
                worst, p = max(pairs, key=lambda mp: mp[0] / mp[1])
                rose |= self.memory_calibration.observe(stage, p, worst)
        if rose:  # every estimate priced before judged memory with the old factors
            self._estimates.clear()

    def _op_time_from_phases(self, signals: StepSignals) -> dict[str, float]:
        """A training job's measured stages (``gen``, ``infer``, ``update_actor``) shared among op classes."""
        if not any(name in signals.stage_time for name in PHASES):
            return {}
        est, _ = self._cached_estimate(signals, self.workload_at(signals))
        if not isinstance(est, PhasedEstimate):  # (an estimate without phases: nothing to share)
            return {}
        stage_of = {m.name: m.stage for m in self.workload.stages}
        return {op: seconds for op, (_, seconds) in op_times(est, signals.stage_time, stage_of).items()}

    def predicted_op_times(self, signals: StepSignals) -> dict[str, float]:
        """The cost model's per-op-class times for the current plan at
        this step, at the current efficiencies.
        """
        est, then = self._cached_estimate(signals, self.workload_at(signals))
        now = _efficiencies(self.calibration)
        return {op: t * then.get(op, 1.0) / now.get(op, 1.0) for op, t in op_totals(est).items()}

    # -------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable controller state: plan, references, H_x clocks, calibrations."""
        cal = self.calibration.state_dict() if hasattr(self.calibration, "state_dict") else None
        return {
            "config": asdict(self.config),
            "plan": plan_to_state(self.plan),
            "drift": {n: d.state_dict() for n, d in self.drift.items()},
            "pool": self.pool.state_dict(),
            "memory_clock": self.memory_clock.state_dict(),
            "recheck": self.recheck.state_dict(),
            "forecast": self.forecast.state_dict(),
            "transition_scale": self.transition_scale,
            "last_replan_step": self.last_replan_step,
            "decisions": self.decisions,
            "calibration": cal,
            "memory_calibration": self.memory_calibration.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the config stays the one this controller was built with)."""
        self.plan = plan_from_state(state["plan"])
        for name, sub in state["drift"].items():
            if name in self.drift:
                self.drift[name].load_state_dict(sub)
        self.pool.load_state_dict(state["pool"])
        self.memory_clock.load_state_dict(state["memory_clock"])
        if state.get("recheck") is not None:  # absent in checkpoints of older versions
            self.recheck.load_state_dict(state["recheck"])
        if state.get("forecast") is not None:  # absent in checkpoints of older versions
            self.forecast.load_state_dict(state["forecast"])
        self.transition_scale = float(state["transition_scale"])
        self.last_replan_step = state["last_replan_step"]
        self.decisions = int(state["decisions"])
        if state.get("calibration") is not None and hasattr(self.calibration, "load_state_dict"):
            self.calibration.load_state_dict(state["calibration"])
        if state.get("memory_calibration") is not None:  # absent in checkpoints of older versions
            self.memory_calibration.load_state_dict(state["memory_calibration"])
        self._estimates.clear()
        self._relaunched = True

    def __repr__(self) -> str:
        return f"Controller(gamma={self.config.gamma}, plan={describe_plan(self.plan)})"


def at_lengths(workload: Workload, lengths: Mapping[str, float]) -> Workload:
    """``workload`` at a forecast's ``lengths`` (``response_len``, ``response_len_p95``, ``prompt_len``)."""
    return replace(
        workload,
        response_len=float(lengths["response_len"]),
        response_len_p95=float(lengths["response_len_p95"]),
        prompt_len=int(round(lengths["prompt_len"])),
    )


def workload_at(workload: Workload, signals: StepSignals) -> Workload:
    """``workload`` with the response and prompt lengths measured in ``signals``."""
    return replace(
        workload,
        response_len=float(signals.response_len),
        response_len_p95=float(signals.response_len_p95),
        prompt_len=int(round(signals.prompt_len)),
    )


def refused_payback(decision: Decision) -> float | None:
    """The payback in steps (``L_tran / dL``) of the fastest-paying target that ``decision`` left
    out, against the plan that runs next; None when no priced target is faster than it."""
    runs = decision.target_latency if decision.kind == "transition" else decision.current_latency
    if decision.kind not in ("transition", "keep") or runs is None:
        return None
    paybacks = [
        c["L_tran"] / (runs - c["latency"])
        for c in decision.considered
        if "L_tran" in c and c["latency"] < runs
    ]
    return min(paybacks, default=None)


def _headroom_note(current_risk: float, target_risk: float) -> str:
    """What moving does to the priced risk of running out of memory (if any)."""
    if current_risk <= target_risk:
        return ""
    return (
        f"; expected step times include the risk of running out of memory at a length jump or a "
        f"forecast miss ({current_risk:.2f} s/step for the current plan, {target_risk:.2f} for the target)"
    )


def _efficiencies(calibration: Any) -> dict[str, float]:
    # Efficiencies the estimate was priced with (empty when the calibration does not expose them).
    return calibration.efficiencies() if hasattr(calibration, "efficiencies") else {}


def _length_buckets(workload: Workload, tol: float) -> tuple[int, int, int]:
    """The lengths a plan is priced at (mean and p95 response, prompt + 1: never zero), each in
    relative buckets of ``tol``: a cache key that changes once a length has moved by ``tol``."""
    mean, p95, prompt = workload.response_len, workload.response_len_p95, workload.prompt_len + 1
    return _bucket(mean, tol), _bucket(p95, tol), _bucket(prompt, tol)


def _bucket(value: float, tol: float) -> int:
    return int(math.floor(math.log(max(value, 1e-9)) / math.log1p(tol)))


def _kinds(triggers: list[Trigger] | tuple[Trigger, ...]) -> str:
    return "+".join(t.kind for t in triggers)
