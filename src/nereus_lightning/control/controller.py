"""`Controller`: triggers, admission (feasibility + payback), urgent path and calibration loop.

One instance runs on the head rank. Feed it the monitor's `StepSignals` at every safe boundary
(`step`); it answers with a `Decision` that the body acts on. The rules follow section 4 of the
paper (section 4 of "Nereus: Adaptive Parallelism for LLM Post-Training"):

* triggers: a pool change, a predicted or measured memory violation, or a drifting signal that
  moved more than ``delta`` (relative) from its reference; references reset after every replan;
* admission: the target must be feasible (the cost model's memory check with its headroom, and a
  safe transition DAG); then it must pay back: ``dL > 0 and L_tran / dL <= gamma * H_x`` with
  H_x the smallest horizon of the firing triggers; if the best target fails, slower candidates
  with cheaper transitions are tried before the current plan is kept;
* urgent path (revocation, memory pressure that breaks the current plan): profitability is
  waived, smaller micro-batches and recomputation are considered, and checkpoint/restart is the
  last resort.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from nereus_lightning.control.backend import Estimate, PlanningBackend, op_totals
from nereus_lightning.control.decision import Decision, DecisionLog, describe_plan
from nereus_lightning.control.signals import DRIFT_SIGNALS, StepSignals
from nereus_lightning.control.state import plan_from_state, plan_to_state
from nereus_lightning.control.triggers import (
    CrossingClock,
    DriftTrigger,
    PoolTrigger,
    Trigger,
    smallest_horizon,
)
from nereus_lightning.control.variants import (
    follow_pool,
    intact_plan,
    keep_layouts,
    place_near,
    relief_variants,
)
from nereus_lightning.plan.layout import Plan
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import InfeasiblePlanError, require
from nereus_lightning.spec.workload import Workload

ADMISSION_RULES = ("payback", "any_gain")


@dataclass(frozen=True)
class ControllerConfig:
    """Knobs of the controller; the defaults are the paper's.

    ``admission="any_gain"`` admits every dL > 0 (the DynaRL-style baseline); ``replan_every=k``
    adds a replan every k steps, and with ``drift_triggers=False`` only that schedule (plus the
    urgent triggers) starts replans (the every-k-steps baseline).
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

    def __post_init__(self) -> None:
        require(self.gamma >= 0, "controller.gamma", f"must be >= 0, got {self.gamma}")
        require(self.delta_len > 0, "controller.delta_len", f"must be positive, got {self.delta_len}")
        require(self.admission in ADMISSION_RULES, "controller.admission", f"{self.admission!r} not in {ADMISSION_RULES}")
        require(self.replan_every >= 0, "controller.replan_every", f"must be >= 0, got {self.replan_every}")
        for name in self.drift_signals:
            require(name in DRIFT_SIGNALS, "controller.drift_signals", f"{name!r} is not one of {list(DRIFT_SIGNALS)}")
        require(self.restart_s > 0, "controller.restart_s", f"must be positive, got {self.restart_s}")
        require(0 < self.transition_alpha <= 1, "controller.transition_alpha", f"must be in (0, 1], got {self.transition_alpha}")
        object.__setattr__(self, "drift_signals", tuple(self.drift_signals))


@dataclass
class _Option:
    plan: Plan
    estimate: Estimate
    source: str
    notes: dict[str, Any] = field(default_factory=dict)


class Controller:
    """The adaptive-parallelism controller of one job (pure Python, one process)."""

    def __init__(
        self,
        backend: PlanningBackend,
        cluster: ClusterSpec,
        workload: Workload,
        config: ControllerConfig | None = None,
        calibration: Any = None,
        log: DecisionLog | str | None = None,
        plan: Plan | None = None,
    ) -> None:
        self.backend = backend
        self.cluster = cluster
        self.workload = workload
        self.config = config or ControllerConfig()
        self.calibration = calibration
        self.log = DecisionLog(log) if isinstance(log, str) else log
        self.plan = plan
        self.drift = {n: DriftTrigger(n, self.config.delta_len, self.config.ema_alpha) for n in self.config.drift_signals}
        self.pool = PoolTrigger(self.config.ema_alpha)
        self.memory_clock = CrossingClock(self.config.ema_alpha)
        self.transition_scale = 1.0
        self.last_replan_step: int | None = None
        self.decisions = 0
        self._pending_transition: float | None = None  # raw predicted L_tran of the last admitted transition
        self._memory_key: tuple | None = None
        self._estimate: Estimate | None = None
        self._estimate_eff: dict[str, float] = {}
        self._used: tuple[Plan, frozenset[int]] | None = None  # (plan, its GPU ids), cached per plan

    # ----------------------------------------------------------------------------- per step
    def step(self, signals: StepSignals) -> Decision:
        """Consume one step's signals; return what the body must do before the next step."""
        self._calibrate(signals)
        if self.plan is None:
            decision = self._initial(signals)
        else:
            triggers = self._triggers(signals)
            if not triggers:
                return Decision(signals.step, "none")
            decision = self._replan(signals, triggers)
            self._reset_references(signals)
        if decision.changes_plan:
            self.plan = decision.target
            self._memory_key = None
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
            triggers.append(Trigger("memory", self.memory_clock.horizon, urgent=True, detail=self._memory_detail))
        if self.last_replan_step is None:
            self.last_replan_step = step  # a plan handed in counts as planned now
        k = self.config.replan_every
        if k and step - self.last_replan_step >= k:
            triggers.append(Trigger("schedule", float(k), detail=f"every {k} steps"))
        return triggers

    def _current_fits(self, signals: StepSignals) -> bool:
        """Predicted (cost model) and measured memory of the current plan within the cap."""
        cap = self.cluster.gpu_memory
        over = [r for r, b in signals.peak_memory.items() if b > cap]
        if over:
            self._memory_detail = f"measured peak memory above the {cap / 1e9:.0f} GB cap on ranks {over[:8]}"
            return False
        est = self._current_estimate(signals)
        self._memory_detail = "predicted peak memory exceeds the cap: " + "; ".join(
            str(v) for v in getattr(est, "violations", ())
        )
        return bool(est.feasible)

    def _current_estimate(self, signals: StepSignals) -> Estimate:
        """The current plan's estimate, re-priced only when the pool or a length moved by > tolerance.

        Memory does not depend on the efficiencies, and op-class predictions are rescaled to the
        current efficiencies in :meth:`predicted_op_times`, so the cache stays valid across
        calibration updates. This keeps the per-step cost without a trigger tiny.
        """
        tol = self.config.memory_check_tolerance
        key = (
            signals.num_gpus,
            _bucket(signals.response_len, tol),
            _bucket(signals.response_len_p95, tol),
            _bucket(signals.prompt_len + 1, tol),
        )
        if key != self._memory_key or self._estimate is None:
            assert self.plan is not None
            self._estimate = self.backend.estimate(
                self.plan, self.cluster_at(signals), self.workload_at(signals), self.calibration
            )
            self._estimate_eff = _efficiencies(self.calibration)
            self._memory_key = key
        return self._estimate

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
            options = self.backend.plan(cluster, workload, self.calibration)
        except InfeasiblePlanError as exc:
            if not suspended:
                raise  # the job cannot start at all: the error names the binding constraint
            return Decision(signals.step, "wait", f"checkpointed; still no plan fits: {exc}", signals=signals)
        plan, est = options[0]
        self._reset_references(signals)
        return Decision(
            signals.step, "restart" if suspended else "initial",
            "a plan fits again: restart from the checkpoint" if suspended else "first plan for this job",
            target=plan, target_latency=est.step_latency, gamma=self.config.gamma, signals=signals,
        )

    def _replan(self, signals: StepSignals, triggers: list[Trigger]) -> Decision:
        assert self.plan is not None
        cfg = self.config
        cluster, workload = self.cluster_at(signals), self.workload_at(signals)
        horizon = smallest_horizon(triggers)
        urgent = any(t.urgent for t in triggers)
        pool = set(signals.gpus)
        # A transition may read state from draining GPUs (revocation notice); it starts from the
        # units that are still readable, priced on a cluster large enough to hold them.
        readable = pool | set(signals.draining)
        intact = intact_plan(self.plan, readable)
        dag_cluster = self.cluster.with_gpus(max(signals.num_gpus, max(readable, default=0) + 1))
        current_est = (
            self.backend.estimate(self.plan, cluster, workload, self.calibration)
            if intact_plan(self.plan, pool) == self.plan else None
        )
        current_ok = current_est is not None and bool(current_est.feasible)
        current_latency = current_est.step_latency if current_ok else None
        reasons: list[str] = []
        if not current_ok:
            urgent = True
            reasons.append("the current plan no longer fits" if current_est is not None else "GPUs of the current plan were lost")
        base = dict(
            step=signals.step, triggers=tuple(triggers), current=self.plan, current_latency=current_latency,
            horizon=horizon, gamma=cfg.gamma, urgent=urgent, signals=signals,
        )
        considered: list[dict[str, Any]] = []
        seen: list[_Option] = []
        for opt in self._candidates(cluster, workload, signals, urgent, current_latency, reasons):
            seen.append(opt)
            lat = opt.estimate.step_latency
            d_l = math.inf if current_latency is None else current_latency - lat
            entry = {"source": opt.source, "latency": round(lat, 6), "dL": None if math.isinf(d_l) else round(d_l, 6)}
            considered.append(entry)
            if intact is None:
                entry["verdict"] = "no intact replica of some model-stage: a transition cannot start"
                continue
            try:
                l_tran = self.backend.transition_cost(intact, opt.plan, dag_cluster, workload) * self.transition_scale
            except InfeasiblePlanError as exc:
                entry["verdict"] = f"transition infeasible: {exc}"
                continue
            entry["L_tran"] = round(l_tran, 6)
            if urgent:
                fastest = min(seen, key=lambda o: o.estimate.step_latency)
                slower = lat - fastest.estimate.step_latency
                if slower > 0 and cfg.admission == "payback":
                    # The reachable target is slower than the best plan, which has no safe DAG:
                    # restarting into the best plan is worth it if the restart pays back.
                    ok, why = self._profitable(slower, cfg.restart_s, horizon)
                    if ok:
                        entry["verdict"] = f"reachable, but a restart into {fastest.source} {why}"
                        return Decision(
                            kind="restart", target=fastest.plan, target_latency=fastest.estimate.step_latency,
                            transition_cost=cfg.restart_s, considered=tuple(considered),
                            reason="; ".join([*reasons, f"urgent ({_kinds(triggers)}): the reachable target is "
                                              f"{slower:.2f} s/step slower; checkpoint/restart {why}"]),
                            **base,
                        )
                entry["verdict"] = "admitted (urgent: profitability waived)"
                return Decision(
                    kind="transition", target=opt.plan, target_latency=lat, delta_latency=None if math.isinf(d_l) else d_l,
                    transition_cost=l_tran, considered=tuple(considered),
                    reason="; ".join([*reasons, f"urgent ({_kinds(triggers)}): fastest feasible target ({opt.source})"]),
                    **base,
                )
            ok, why = self._profitable(d_l, l_tran, horizon)
            entry["verdict"] = why
            if ok:
                return Decision(
                    kind="transition", target=opt.plan, target_latency=lat, delta_latency=d_l, transition_cost=l_tran,
                    considered=tuple(considered), reason=f"{_kinds(triggers)}: {why} ({opt.source})", **base,
                )
        if urgent:
            best = min(seen, key=lambda o: o.estimate.step_latency) if seen else None
            return Decision(
                kind="restart", target=None if best is None else best.plan,
                target_latency=None if best is None else best.estimate.step_latency, considered=tuple(considered),
                reason="; ".join(
                    [*reasons, "no feasible transition: checkpoint/restart"
                     + (" into the best plan" if best else "; no plan fits the pool, wait for GPUs")]
                ),
                **base,
            )
        # No DAG transition was admitted. When the best gain had no safe DAG at all, a
        # checkpoint/restart is one more way to reach it: admitted under the payback rule, with
        # L_tran = the restart's cost (the any-gain baselines do not restart voluntarily).
        blocked = [(o, e) for o, e in zip(seen, considered, strict=True) if e["verdict"].startswith("transition infeasible")]
        if blocked and current_latency is not None and cfg.admission == "payback":
            opt, entry = blocked[0]
            d_l = current_latency - opt.estimate.step_latency
            ok, why = self._profitable(d_l, cfg.restart_s, horizon)
            if ok:
                return Decision(
                    kind="restart", target=opt.plan, target_latency=opt.estimate.step_latency, delta_latency=d_l,
                    transition_cost=cfg.restart_s, considered=tuple(considered),
                    reason=f"{_kinds(triggers)}: no safe transition DAG; checkpoint/restart {why} ({opt.source})", **base,
                )
        first = considered[0] if considered else None
        why = "no faster feasible plan" if first is None else f"payback failed for every candidate (best: {first['verdict']})"
        return Decision(kind="keep", target=None, considered=tuple(considered), reason=why, **base)

    def _candidates(
        self, cluster: ClusterSpec, workload: Workload, signals: StepSignals, urgent: bool,
        current_latency: float | None, reasons: list[str],
    ) -> Iterator[_Option]:
        """Feasible targets in the order admission tries them.

        First the planner's best plan (so an admitted best target costs no extra pricing). If it
        fails, every fallback is priced and tried fastest first: the planner's alternatives;
        each planner plan placed near the current GPUs (no swap deadlocks) and with the current
        layouts kept where they fit (Extend/Destroy only), slightly slower targets with cheaper
        transitions; the current layouts with DP re-fitted to the pool; and on the urgent path
        the intact units alone and smaller micro-batches / recomputation. Outside the urgent
        path, targets not faster than the current plan are skipped.
        """
        assert self.plan is not None
        seen: set[Plan] = {self.plan}

        def priced(plan: Plan, source: str, est: Estimate | None = None) -> _Option | None:
            if plan in seen:
                return None
            seen.add(plan)
            est = est if est is not None else self.backend.estimate(plan, cluster, workload, self.calibration)
            if not est.feasible:
                return None
            if not urgent and current_latency is not None and est.step_latency >= current_latency:
                return None
            return _Option(plan, est, source)

        try:
            planned = self.backend.plan(cluster, workload, self.calibration)
        except InfeasiblePlanError as exc:
            reasons.append(f"planner: {exc}")
            planned = []
        if planned:
            best = priced(planned[0][0], "planner best", planned[0][1])
            if best is not None:
                yield best
        # The best target failed (or did not pay back): price every fallback, fastest first.
        rest: list[_Option | None] = []
        for i, (plan, est) in enumerate(planned):
            source = "planner best" if i == 0 else f"planner alternative {i}"
            if i > 0:
                rest.append(priced(plan, source, est))
            near = place_near(plan, self.plan, self.workload.algorithm)
            rest.append(priced(near, f"{source}, placed near the current GPUs"))
            rest.append(priced(keep_layouts(near, self.plan), f"{source}, current layouts kept"))
        refit = None
        if self.config.try_follow_pool:
            refit = follow_pool(self.plan, self.workload.algorithm, signals.num_gpus, self.workload.sequences_per_step)
            if refit is not None:
                refit = place_near(refit, self.plan, self.workload.algorithm)
                rest.append(priced(refit, "current layouts, DP re-fitted to the pool"))
        if urgent:
            # Drop the replicas on lost GPUs and keep the intact units (Destroy only): often
            # slower, but always reachable, and the next replan can grow back into the pool.
            survivors = intact_plan(self.plan, set(signals.gpus))
            if survivors is not None and survivors != self.plan:
                rest.append(priced(survivors, "intact units only (replicas on lost GPUs dropped)"))
            base = refit if refit is not None else self.plan
            if intact_plan(base, set(signals.gpus)) == base:
                rest += [priced(v, "smaller micro-batches / recomputation") for v in relief_variants(base)]
        yield from sorted((o for o in rest if o is not None), key=lambda o: o.estimate.step_latency)

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
        """Feed measured op-class and transition times back into the cost model after every step."""
        if signals.transition_time is not None and self._pending_transition:
            ratio = signals.transition_time / self._pending_transition
            a = self.config.transition_alpha
            self.transition_scale = a * ratio + (1 - a) * self.transition_scale
            self._pending_transition = None
        if self.calibration is None or not signals.op_time or self.plan is None:
            return
        predicted = self.predicted_op_times(signals)
        for op_class, measured in signals.op_time.items():
            if predicted.get(op_class, 0) > 0 and measured > 0:
                self.calibration.observe(op_class, predicted[op_class], measured)

    def predicted_op_times(self, signals: StepSignals) -> dict[str, float]:
        """The cost model's per-op-class times for the current plan at this step, at the current efficiencies."""
        est = self._current_estimate(signals)
        then, now = self._estimate_eff, _efficiencies(self.calibration)
        return {op: t * then.get(op, 1.0) / now.get(op, 1.0) for op, t in op_totals(est).items()}

    # -------------------------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable controller state: plan, references, H_x clocks, calibration."""
        cal = self.calibration.state_dict() if hasattr(self.calibration, "state_dict") else None
        return {
            "config": asdict(self.config),
            "plan": plan_to_state(self.plan),
            "drift": {n: d.state_dict() for n, d in self.drift.items()},
            "pool": self.pool.state_dict(),
            "memory_clock": self.memory_clock.state_dict(),
            "transition_scale": self.transition_scale,
            "last_replan_step": self.last_replan_step,
            "decisions": self.decisions,
            "calibration": cal,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (the config stays the one this controller was built with)."""
        self.plan = plan_from_state(state["plan"])
        for name, sub in state["drift"].items():
            if name in self.drift:
                self.drift[name].load_state_dict(sub)
        self.pool.load_state_dict(state["pool"])
        self.memory_clock.load_state_dict(state["memory_clock"])
        self.transition_scale = float(state["transition_scale"])
        self.last_replan_step = state["last_replan_step"]
        self.decisions = int(state["decisions"])
        if state.get("calibration") is not None and hasattr(self.calibration, "load_state_dict"):
            self.calibration.load_state_dict(state["calibration"])
        self._memory_key = None

    def __repr__(self) -> str:
        return f"Controller(gamma={self.config.gamma}, plan={describe_plan(self.plan)})"


def workload_at(workload: Workload, signals: StepSignals) -> Workload:
    """``workload`` with the response and prompt lengths measured in ``signals``."""
    return replace(
        workload,
        response_len=float(signals.response_len),
        response_len_p95=float(signals.response_len_p95),
        prompt_len=int(round(signals.prompt_len)),
    )


def _efficiencies(calibration: Any) -> dict[str, float]:
    # Efficiencies the estimate was priced with (empty when the calibration does not expose them).
    return calibration.efficiencies() if hasattr(calibration, "efficiencies") else {}


def _bucket(value: float, tol: float) -> int:
    return int(math.floor(math.log(max(value, 1e-9)) / math.log1p(tol)))


def _kinds(triggers: list[Trigger]) -> str:
    return "+".join(t.kind for t in triggers)
