"""A scripted planning backend (latencies, feasibility and transition costs chosen by the test) and a
controller over it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from nereus_lightning.control import Controller, ControllerConfig, StepSignals
from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.spec import CLUSTER_PRESETS, Workload
from nereus_lightning.spec.errors import InfeasiblePlanError

CLUSTER = CLUSTER_PRESETS["paper_cluster2"]


def gen_plan(tp: int, dp: int, micro_batch: int = 1, recompute: bool = False) -> Plan:
    """A one-model-stage plan on GPUs 0 .. tp*dp-1."""
    return Plan.of({"actor_gen": Candidate(Layout(tp, 1), dp, tuple(range(tp * dp)), micro_batch, recompute)})


START = gen_plan(1, 4)  # where a scripted controller starts unless told


@dataclass
class FakeEstimate:
    step_latency: float
    feasible: bool = True
    violations: tuple = ()
    op_time: dict = field(default_factory=dict)


class FakeBackend:
    """``latency[plan]`` (s/step, or a function of the workload) and ``feasible[plan]`` (default
    True); ``candidates`` is what the planner returns."""

    def __init__(self, candidates, latency, tran=None, feasible=None, op_time=None):
        self.candidates = candidates
        self.latency = latency
        self.tran = tran or {}
        self.feasible = feasible or {}
        self.op_time = op_time or {}
        self.calls = {"plan": 0, "estimate": 0, "transition_cost": 0}

    def _est(self, plan, workload):
        if plan not in self.latency:  # plans the test did not script do not fit
            return FakeEstimate(float("inf"), False)
        latency = self.latency[plan]
        latency = latency(workload) if callable(latency) else latency
        return FakeEstimate(latency, self.feasible.get(plan, True), op_time=dict(self.op_time))

    def plan(self, cluster, workload, calibration, memory=None):
        self.calls["plan"] += 1
        cands = self.candidates(cluster, workload) if callable(self.candidates) else self.candidates
        opts = [(p, self._est(p, workload)) for p in cands if self.feasible.get(p, True)]
        if not opts:
            raise InfeasiblePlanError("nothing fits")
        return sorted(opts, key=lambda pe: pe[1].step_latency)

    def estimate(self, plan, cluster, workload, calibration, memory=None):
        self.calls["estimate"] += 1
        return self._est(plan, workload)

    def transition_cost(self, current, target, cluster, workload):
        self.calls["transition_cost"] += 1
        cost = self.tran.get(target, 1.0)
        if cost is None:
            raise InfeasiblePlanError("no safe DAG")
        return cost


def controller(
    backend: FakeBackend, plan: Plan | None = START, *, calibration: Any = None, log: Any = None, **cfg: Any
) -> Controller:
    """A controller over ``backend`` on paper_cluster2 at ``plan``; ``cfg``: ``ControllerConfig`` fields.

    It only weighs the backend's plans (``try_follow_pool`` off unless given) and replans only
    on the paper's triggers (``quiet_check_every`` and ``retune`` off unless given).
    """
    cfg.setdefault("try_follow_pool", False)
    cfg.setdefault("quiet_check_every", 0)
    cfg.setdefault("retune", False)
    max_steps = cfg.pop("max_steps", None)
    return Controller(
        backend,
        CLUSTER,
        Workload(),
        ControllerConfig(**cfg),
        calibration=calibration,
        log=log,
        plan=plan,
        max_steps=max_steps,
    )


def sig(step: int, length: float = 1000.0, gpus: int = 8, p95: float | None = None, **kw) -> StepSignals:
    """Signals with p95 = 1.1 x mean unless given."""
    return StepSignals(step, length, p95 if p95 is not None else 1.1 * length, 256, tuple(range(gpus)), **kw)
