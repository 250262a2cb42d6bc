"""What a controller is to the training loop (:class:`PlanController`), and the simplest one.

:class:`~nereus_lightning.control.Controller` (triggers, admission, calibration) is one;
:class:`PoolFollower` is the fallback without a planner: every model-stage data-parallel over the
GPU pool, a new plan only when the pool changes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

from nereus_lightning.control.decision import Decision
from nereus_lightning.control.signals import StepSignals
from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.spec.errors import require
from nereus_lightning.spec.workload import workflow

#: Sequences per micro-batch of the fallback plan (the planner chooses its own).
FALLBACK_MICRO_BATCH = 16


@runtime_checkable
class PlanController(Protocol):
    """One step's signals in, a decision out; its current plan and state survive a checkpoint."""

    plan: Plan | None  # the plan the job runs (None before the first decision)

    def step(self, signals: StepSignals) -> Decision:
        """The decision for the boundary after ``signals.step``."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (the callback's checkpoint holds it)."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`'s output."""
        ...


def data_parallel_plan(algorithm: str, gpus: Sequence[int], micro_batch: int = FALLBACK_MICRO_BATCH) -> Plan:
    """Every model-stage as ``len(gpus)`` replicas of ``Layout(1, 1)`` (the fallback plan)."""
    gpus = tuple(gpus)
    require(len(gpus) >= 1, "pool", "no GPUs available for the plan")
    return Plan.of(
        {m.name: Candidate(Layout(1, 1), len(gpus), gpus, micro_batch) for m in workflow(algorithm)}
    )


class PlanFollower:
    """A controller that runs :meth:`target`'s plan of each step: the initial decision, a transition
    when it changes, none otherwise. Subclasses say which plan (and why, in :attr:`reason`)."""

    reason = ""

    def __init__(self) -> None:
        self.plan: Plan | None = None

    def target(self, signals: StepSignals) -> Plan:
        """The plan to run after ``signals.step``."""
        raise NotImplementedError

    def step(self, signals: StepSignals) -> Decision:
        """The decision for the boundary after ``signals.step``."""
        target = self.target(signals)
        if self.plan is not None and target == self.plan:
            return Decision(signals.step, "none")
        kind = "initial" if self.plan is None else "transition"
        decision = Decision(
            signals.step, kind, reason=self.reason, current=self.plan, target=target, signals=signals
        )
        self.plan = target
        return decision

    def state_dict(self) -> dict[str, Any]:
        """The current plan."""
        return {"plan": self.plan}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the current plan."""
        self.plan = state.get("plan")


class PoolFollower(PlanFollower):
    """The fallback controller without a planner: every model-stage data-parallel over the pool."""

    reason = "pool changed"

    def __init__(self, algorithm: str) -> None:
        super().__init__()
        self.algorithm = algorithm

    def target(self, signals: StepSignals) -> Plan:
        """Every model-stage data-parallel over this step's pool."""
        return data_parallel_plan(self.algorithm, signals.gpus)
