"""Policies the simulator compares: static, always-switch, every-k-steps, Nereus(gamma), oracle.

Every policy answers the same two questions: the plan to start with, and after each step's
signals, whether to move to another plan (and how: a DAG transition or a checkpoint/restart).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from nereus_lightning.control.backend import PlanningBackend
from nereus_lightning.control.controller import Controller, ControllerConfig, workload_at
from nereus_lightning.control.decision import DecisionLog
from nereus_lightning.control.signals import StepSignals
from nereus_lightning.control.variants import follow_pool
from nereus_lightning.plan.layout import Plan
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import NereusConfigError, require
from nereus_lightning.spec.workload import Workload


@dataclass(frozen=True)
class Action:
    """A policy's move at one boundary: ``kind`` is ``none``, ``transition`` or ``restart``."""

    kind: str
    plan: Plan | None
    free: bool = False  # the oracle's transitions cost nothing


class ControllerPolicy:
    """Nereus(gamma), always-switch and every-k: the real controller with different configs."""

    def __init__(self, name: str, controller: Controller) -> None:
        self.name = name
        self.controller = controller

    def start(self, signals: StepSignals) -> Plan:
        """The controller's initial plan."""
        decision = self.controller.step(signals)
        assert decision.target is not None
        return decision.target

    def decide(self, signals: StepSignals) -> Action:
        """Ask the controller; map its decision onto an action."""
        decision = self.controller.step(signals)
        if decision.kind in ("transition", "restart"):
            return Action(decision.kind, self.controller.plan)
        return Action("none", self.controller.plan)


class StaticPolicy:
    """The paper's static baseline: the launch configuration stays; only DP follows the pool.

    Every model-stage keeps its TP/PP layout, micro-batch size and recomputation flag; when the
    pool changes, only the number of replicas is re-fitted (``follow_pool``). A static system
    cannot re-plan, so when the kept configuration stops fitting (a replica needs more GPUs than
    the pool has, or memory runs out as sequences grow) the job is checkpointed and relaunched
    with the planner's best plan for the new conditions, which is kept from then on: what an
    operator does after an OOM or a lost node.
    """

    name = "static"

    def __init__(
        self, backend: PlanningBackend, cluster: ClusterSpec, workload: Workload, calibration: Any = None
    ) -> None:
        self.backend, self.cluster, self.workload, self.calibration = backend, cluster, workload, calibration
        self.initial: Plan | None = None
        self.plan: Plan | None = None
        self._pool: int | None = None

    def start(self, signals: StepSignals) -> Plan:
        """The planner's best plan for the first step."""
        cluster = self.cluster.with_gpus(signals.num_gpus)
        self.initial = self.plan = self.backend.plan(
            cluster, workload_at(self.workload, signals), self.calibration
        )[0][0]
        self._pool = signals.num_gpus
        return self.plan

    def decide(self, signals: StepSignals) -> Action:
        """Re-fit DP when the pool changes; relaunch when the kept configuration no longer fits."""
        assert self.initial is not None and self.plan is not None
        cluster, workload = self.cluster.with_gpus(signals.num_gpus), workload_at(self.workload, signals)
        plan = self.plan
        if signals.num_gpus != self._pool:
            self._pool = signals.num_gpus
            refit = follow_pool(
                self.initial, self.workload.algorithm, signals.num_gpus, self.workload.sequences_per_step
            )
            plan = refit if refit is not None else plan
        inside = max(g for _, c in plan.items() for g in c.gpus) < signals.num_gpus
        if not inside or not self.backend.estimate(plan, cluster, workload, self.calibration).feasible:
            self.initial = self.plan = self.backend.plan(cluster, workload, self.calibration)[0][0]
            return Action("restart", self.plan)
        if plan == self.plan:
            return Action("none", plan)
        self.plan = plan
        return Action("transition", plan)


class OraclePolicy:
    """The best plan for every step under the machine's true efficiencies; transitions are free.

    It sees the step's own length (not the previous step's) and so bounds what any policy can do.
    """

    name = "oracle"

    def __init__(
        self,
        backend: PlanningBackend,
        cluster: ClusterSpec,
        workload: Workload,
        truth: Any,
        tolerance: float = 0.0,
    ) -> None:
        self.backend, self.cluster, self.workload, self.truth = backend, cluster, workload, truth
        self.tolerance = tolerance
        self.plan: Plan | None = None
        self._key: tuple | None = None

    def best(self, signals: StepSignals) -> Plan:
        """Plan for these signals with the true efficiencies.

        With ``tolerance`` > 0 (long traces), the plan is reused until the pool changes or a
        length moves by more than that fraction since it was made (an approximation that saves
        one planner call per step).
        """
        key = (signals.num_gpus, signals.response_len, signals.response_len_p95, signals.prompt_len)
        if (
            self.plan is not None
            and self._key is not None
            and self.tolerance > 0
            and key[0] == self._key[0]
            and all(
                abs(a - b) <= self.tolerance * max(b, 1.0)
                for a, b in zip(key[1:], self._key[1:], strict=False)
            )
        ):
            return self.plan
        self._key = key
        cluster = self.cluster.with_gpus(signals.num_gpus)
        return self.backend.plan(cluster, workload_at(self.workload, signals), self.truth)[0][0]

    def start(self, signals: StepSignals) -> Plan:
        """The true best plan of the first step."""
        self.plan = self.best(signals)
        return self.plan

    def decide(self, signals: StepSignals) -> Action:
        """Jump to the true best plan of this step, for free."""
        plan = self.best(signals)
        kind = "none" if plan == self.plan else "transition"
        self.plan = plan
        return Action(kind, plan, free=True)


POLICY_KINDS = ("static", "always", "every_k", "nereus", "oracle")


@dataclass(frozen=True)
class PolicySpec:
    """Which policy to run: ``kind`` in POLICY_KINDS, plus ``gamma`` (nereus) or ``k`` (every_k)."""

    kind: str
    gamma: float | None = None  # None: the controller config's gamma
    k: int = 3
    label: str = ""

    def __post_init__(self) -> None:
        require(
            self.kind in POLICY_KINDS,
            "simulate.policies",
            f"{self.kind!r} is not one of {list(POLICY_KINDS)}",
        )
        require(self.k >= 1, "simulate.k", f"must be >= 1, got {self.k}")

    @property
    def name(self) -> str:
        """A short label for tables and plots."""
        if self.label:
            return self.label
        return {
            "static": "static",
            "always": "always-switch",
            "every_k": f"every-{self.k}-steps",
            "nereus": "nereus" if self.gamma is None else f"nereus(gamma={self.gamma:g})",
            "oracle": "oracle",
        }[self.kind]

    @classmethod
    def parse(cls, text: str) -> PolicySpec:
        """Parse a policy name.

        ``static``, ``always``, ``every_k:3``, ``nereus`` (the controller's gamma), ``nereus:0.5``,
        ``oracle``.
        """
        kind, _, arg = text.partition(":")
        try:
            if kind == "nereus":
                return cls("nereus", gamma=float(arg) if arg else None)
            if kind == "every_k":
                return cls("every_k", k=int(arg) if arg else 3)
        except ValueError as exc:
            raise NereusConfigError(f"simulate.policies: cannot parse {text!r} ({exc})") from exc
        return cls(kind)


def resolve(spec: PolicySpec, controller: ControllerConfig | None) -> PolicySpec:
    """Fill in a Nereus spec's gamma from the controller config (so names show the gamma used)."""
    if spec.kind == "nereus" and spec.gamma is None:
        return PolicySpec(
            "nereus", gamma=(controller or ControllerConfig()).gamma, k=spec.k, label=spec.label
        )
    return spec


def make_policy(
    spec: PolicySpec,
    backend: PlanningBackend,
    cluster: ClusterSpec,
    workload: Workload,
    truth: Any,
    calibration_factory: Callable[[], Any],
    controller: ControllerConfig | None = None,
    log: str | None = None,
    oracle_tolerance: float = 0.0,
):
    """Instantiate ``spec`` over one backend; controller policies get a fresh calibration each."""
    base = controller or ControllerConfig()
    if spec.kind == "static":
        return StaticPolicy(backend, cluster, workload, calibration_factory())
    if spec.kind == "oracle":
        return OraclePolicy(backend, cluster, workload, truth, oracle_tolerance)
    # The baselines move to the first admitted target (the planner's best when it is reachable),
    # plan for the measured lengths, never ask for pinned-layout plans and replan only on their
    # own triggers (no quiet checks): Nereus' target choice is part of the policy being compared,
    # not of the machinery they share.
    plain = dict(selection="first", forecast_steps=0.0, pin_training=False, quiet_check_every=0, retune=False)
    if spec.kind == "always":
        cfg = _with(base, admission="any_gain", replan_every=1, **plain)
    elif spec.kind == "every_k":
        cfg = _with(
            base,
            admission="any_gain",
            replan_every=spec.k,
            drift_triggers=False,
            pool_triggers=False,
            **plain,
        )
    else:
        cfg = base if spec.gamma is None else _with(base, gamma=spec.gamma)
    ctl = Controller(
        backend,
        cluster,
        workload,
        cfg,
        calibration=calibration_factory(),
        log=DecisionLog(log) if log else None,
    )
    return ControllerPolicy(spec.name, ctl)


def _with(cfg: ControllerConfig, **changes: Any) -> ControllerConfig:
    from dataclasses import replace

    return replace(cfg, **changes)
