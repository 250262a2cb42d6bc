"""What the controller needs from the planner and the transition DAG, as a small protocol.

`PlannerBackend` is the real implementation (plan/planner.py and transition/); tests may pass any
object with the same three methods. ``calibration`` is the time calibration and ``memory`` the
memory calibration (``plan.calibration.MemoryCalibration``: predicted peaks times its factors
must fit the cap); either may be None.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Protocol

from nereus_lightning.plan.layout import Plan
from nereus_lightning.plan.planner import STEP_TOLERANCE
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.workload import Workload


class Estimate(Protocol):
    """The parts of a plan estimate the controller reads."""

    @property
    def step_latency(self) -> float: ...

    @property
    def feasible(self) -> bool: ...


def op_totals(estimate: Any) -> dict[str, float]:
    """Predicted seconds per operation class, summed over model-stages.

    Reads ``op_time`` (op class -> s) or the planner's ``breakdown`` (model-stage -> op class -> s).
    Summing is safe for calibration: every term of one class scales with the same efficiency.
    """
    direct = getattr(estimate, "op_time", None)
    if direct:
        return dict(direct)
    totals: dict[str, float] = {}
    for per_class in (getattr(estimate, "breakdown", None) or {}).values():
        for op, seconds in per_class.items():
            totals[op] = totals.get(op, 0.0) + seconds
    return totals


class PlanningBackend(Protocol):
    """Planner, cost model and transition cost, as the controller calls them."""

    def plan(
        self, cluster: ClusterSpec, workload: Workload, calibration: Any, memory: Any = None
    ) -> list[tuple[Plan, Estimate]]:
        """The best plan and its next-best alternatives, best first (raises InfeasiblePlanError)."""
        ...

    def estimate(
        self, plan: Plan, cluster: ClusterSpec, workload: Workload, calibration: Any, memory: Any = None
    ) -> Estimate:
        """Predicted step latency and memory feasibility of ``plan``."""
        ...

    def transition_cost(self, current: Plan, target: Plan, cluster: ClusterSpec, workload: Workload) -> float:
        """L_tran in seconds (raises InfeasiblePlanError when no safe DAG exists)."""
        ...


class PlannerBackend:
    """The real planner (``plan.planner``) and transition DAG (``transition``) for fixed models.

    ``step_tolerance`` is the planner's lean rule (``plan_job``): the simulator compares policies on
    speed alone and plans with 0 (the fastest plan).
    """

    def __init__(
        self,
        models: Mapping[str, Any],
        alternatives: int = 4,
        transition: Callable[[Plan, Plan, ClusterSpec, Workload], float] | None = None,
        pool_key: str = "cluster.num_gpus",
        step_tolerance: float = STEP_TOLERANCE,
    ) -> None:
        self.models = models
        self.alternatives = alternatives
        self.step_tolerance = step_tolerance
        self.pool_key = pool_key  # the config key an infeasibility message tells the user to raise
        self._transition = transition

    @classmethod
    def for_models(
        cls, actor: Any, critic: Any = None, reference: Any = None, reward: Any = None, **kwargs: Any
    ) -> PlannerBackend:
        """Build the per-role model map with the planner's ``job_models``."""
        from nereus_lightning.plan.planner import job_models

        return cls(job_models(actor, critic=critic, reference=reference, reward=reward), **kwargs)

    def plan(
        self, cluster: ClusterSpec, workload: Workload, calibration: Any, memory: Any = None
    ) -> list[tuple[Plan, Estimate]]:
        """``plan_job``'s best plan, then its alternatives (each made lean: a leaner plan may be slower
        than an alternative that follows it)."""
        from nereus_lightning.plan.planner import plan_job

        result = plan_job(
            self.models,
            cluster,
            workload,
            calibration=calibration,
            alternatives=self.alternatives,
            pool_key=self.pool_key,
            memory=memory,
            step_tolerance=self.step_tolerance,
        )
        return [(result.plan, result.estimate), *result.alternatives]

    def estimate(
        self, plan: Plan, cluster: ClusterSpec, workload: Workload, calibration: Any, memory: Any = None
    ) -> Estimate:
        """``estimate_plan`` of the cost model."""
        from nereus_lightning.plan.planner import estimate_plan

        return estimate_plan(plan, self.models, cluster, workload, calibration=calibration, memory=memory)

    def transition_cost(self, current: Plan, target: Plan, cluster: ClusterSpec, workload: Workload) -> float:
        """The critical path of the global transition DAG from ``current`` to ``target``."""
        if self._transition is not None:
            return float(self._transition(current, target, cluster, workload))
        from nereus_lightning.transition import build_transition, transition_cost

        dag = build_transition(current, target, self.models, cluster, workload)
        return float(transition_cost(dag, cluster))

    def plan_pinned(
        self,
        cluster: ClusterSpec,
        workload: Workload,
        calibration: Any,
        layouts: Mapping[str, Any],
        memory: Any = None,
    ) -> list[tuple[Plan, Estimate]]:
        """Like :meth:`plan`, with the model-stages of ``layouts`` kept at those TP/PP layouts."""
        from nereus_lightning.plan.planner import plan_job

        result = plan_job(
            self.models,
            cluster,
            workload,
            calibration=calibration,
            alternatives=self.alternatives,
            pinned=layouts,
            pool_key=self.pool_key,
            memory=memory,
            step_tolerance=self.step_tolerance,
        )
        return [(result.plan, result.estimate), *result.alternatives]
