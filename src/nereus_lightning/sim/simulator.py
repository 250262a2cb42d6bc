"""Replay a drift trace through a policy on the simulated machine, and summarise the runs."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from nereus_lightning.control.backend import PlanningBackend
from nereus_lightning.control.controller import ControllerConfig, workload_at
from nereus_lightning.control.decision import describe_plan
from nereus_lightning.control.signals import StepSignals
from nereus_lightning.control.variants import intact_plan
from nereus_lightning.plan.layout import Plan
from nereus_lightning.sim.machine import TrueMachine
from nereus_lightning.sim.policies import PolicySpec, make_policy, resolve
from nereus_lightning.sim.trace import DriftTrace
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import InfeasiblePlanError
from nereus_lightning.spec.workload import Workload


@dataclass(frozen=True)
class StepRecord:
    """One simulated step of one policy (a row of the per-step CSV)."""

    policy: str
    step: int
    num_gpus: int
    response_len: float
    step_s: float  # true step latency; an infeasible step adds the restart its OOM forces
    transition_s: float  # time spent moving to this step's plan (0 if none)
    action: str  # "initial", "none", "transition", "restart"
    feasible: bool
    plan: str


@dataclass(frozen=True)
class Summary:
    """One row of the policy table."""

    policy: str
    mean_step_s: float  # (steps + transitions) / steps
    transitions: int
    transition_s: float
    transition_share: float  # of total run time
    gap_to_oracle: float | None  # mean over steps of (step + transition) / oracle step - 1
    infeasible_steps: int
    restarts: int
    total_s: float


def simulate(
    policy: Any,
    trace: DriftTrace,
    machine: TrueMachine,
    backend: PlanningBackend,
    cluster: ClusterSpec,
    workload: Workload,
    notice: bool = True,
) -> list[StepRecord]:
    """Run ``policy`` over every step of ``trace``.

    At the boundary before step ``s`` the policy sees the pool of step ``s`` and the lengths and
    timings measured in step ``s-1`` (the oracle alone sees step ``s``'s own lengths). With
    ``notice`` a shrinking pool is announced before the GPUs go (as spot instances' two-minute
    warning does): the transition may still read state from them.
    """
    records: list[StepRecord] = []
    name = policy.name
    controller = getattr(policy, "controller", None)
    if controller is not None and getattr(controller, "max_steps", 0) is None:
        controller.max_steps = len(trace)  # the trainer's max_steps: the run ends with the trace
    plan: Plan | None = None
    last = None
    last_transition: float | None = None
    oracle = name == "oracle"
    for s in range(len(trace)):
        pool = trace.num_gpus[s]
        cluster_s = cluster.with_gpus(pool)
        truth_sig = trace.signals(s)
        transition_s, action = 0.0, "initial"
        if plan is None:
            plan = policy.start(truth_sig)
        else:
            seen = s if oracle else s - 1
            prev = trace.num_gpus[s - 1]
            draining = tuple(range(pool, prev)) if notice else ()
            sig = StepSignals(
                s,
                trace.response_len[seen],
                trace.response_len_p95[seen],
                trace.prompt_len[seen],
                tuple(range(pool)),
                op_time=last.op_time if last else {},
                stage_time=last.stage_time if last else {},
                transition_time=last_transition,
                draining=draining,
            )
            act = policy.decide(sig)
            action = act.kind
            if act.kind == "transition" and not act.free:
                transition_s, action = _transition_time(
                    machine,
                    backend,
                    s,
                    plan,
                    act.plan,
                    cluster.with_gpus(max(pool, prev) if draining else pool),
                    workload_at(workload, sig),
                )
            elif act.kind == "restart":
                transition_s = machine.restart_s
            if act.plan is not None:
                plan = act.plan
        last_transition = transition_s if action in ("transition", "restart") and transition_s > 0 else None
        ok = plan is not None and max(g for _, c in plan.items() for g in c.gpus) < pool
        if ok:
            last = machine.run_step(s, plan, cluster_s, workload_at(workload, truth_sig))
            ok = last.feasible
            # A step over a GPU's memory runs out of it: the job dies and restarts from its checkpoint.
            step_s = last.latency if ok else last.latency + machine.restart_s
        else:
            step_s, last = math.nan, None
        records.append(
            StepRecord(
                name, s, pool, trace.response_len[s], step_s, transition_s, action, ok, describe_plan(plan)
            )
        )
    return records


def _transition_time(
    machine: TrueMachine,
    backend: PlanningBackend,
    step: int,
    current: Plan,
    target: Plan | None,
    cluster: ClusterSpec,
    workload: Workload,
) -> tuple[float, str]:
    """Real duration and kind of a move: the DAG from the intact units, priced by the cost model
    and scaled by the machine; a move with no safe DAG is a checkpoint/restart."""
    start = None if target is None else intact_plan(current, frozenset(range(cluster.num_gpus)))
    if target is None or start is None:
        return machine.restart_s, "restart"
    try:
        return machine.transition_time(
            step, backend.transition_cost(start, target, cluster, workload)
        ), "transition"
    except InfeasiblePlanError:
        return machine.restart_s, "restart"


def summarise(records: Sequence[StepRecord], oracle: Sequence[StepRecord] | None = None) -> Summary:
    """The policy-table row of one run."""
    steps = [r.step_s for r in records]
    finite = [x for x in steps if math.isfinite(x)]
    tran = sum(r.transition_s for r in records)
    total = sum(finite) + tran
    gap = None
    if oracle is not None:
        gaps = [
            (r.step_s + r.transition_s) / o.step_s - 1
            for r, o in zip(records, oracle, strict=False)
            if math.isfinite(r.step_s) and o.step_s > 0
        ]
        gap = sum(gaps) / len(gaps) if gaps else None
    return Summary(
        policy=records[0].policy,
        mean_step_s=total / max(len(records), 1),
        transitions=sum(1 for r in records if r.action in ("transition", "restart")),
        transition_s=tran,
        transition_share=tran / total if total > 0 else 0.0,
        gap_to_oracle=gap,
        infeasible_steps=sum(1 for r in records if not r.feasible),
        restarts=sum(1 for r in records if r.action == "restart"),
        total_s=total,
    )


@dataclass
class Comparison:
    """All runs of one trace: per-step records and the summary table, oracle included."""

    trace: DriftTrace
    records: dict[str, list[StepRecord]]
    summaries: dict[str, Summary]

    def table(self) -> list[dict[str, Any]]:
        """The summary rows as dicts (for printing and JSON)."""
        return [asdict(s) for s in self.summaries.values()]


def compare(
    trace: DriftTrace,
    specs: Sequence[PolicySpec],
    backend: PlanningBackend,
    cluster: ClusterSpec,
    workload: Workload,
    machine: TrueMachine,
    calibration_factory: Callable[[], Any],
    controller: ControllerConfig | None = None,
    log_dir: str | None = None,
    notice: bool = True,
    oracle_tolerance: float = 0.0,
) -> Comparison:
    """Run every policy of ``specs`` (the oracle always runs, first, for the gap column)."""
    specs = [resolve(s, controller) for s in specs]
    if not any(s.kind == "oracle" for s in specs):
        specs.insert(0, PolicySpec("oracle"))
    specs.sort(key=lambda s: s.kind != "oracle")
    records: dict[str, list[StepRecord]] = {}
    for spec in specs:
        log = (
            None
            if log_dir is None or spec.kind in ("static", "oracle")
            else f"{log_dir}/decisions_{_slug(spec.name)}.jsonl"
        )
        if log is not None and os.path.exists(log):
            os.remove(log)  # one simulation per file (the controller itself appends, for resumed jobs)
        policy = make_policy(
            spec,
            backend,
            cluster,
            workload,
            machine.truth,
            calibration_factory,
            controller,
            log,
            oracle_tolerance,
        )
        records[spec.name] = simulate(policy, trace, machine, backend, cluster, workload, notice)
    oracle = records["oracle"]
    summaries = {n: summarise(r, None if n == "oracle" else oracle) for n, r in records.items()}
    return Comparison(trace, records, summaries)


def _slug(name: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in name).strip("_")


def gamma_sweep(
    trace: DriftTrace,
    gammas: Sequence[float],
    backend: PlanningBackend,
    cluster: ClusterSpec,
    workload: Workload,
    machine: TrueMachine,
    calibration_factory: Callable[[], Any],
    controller: ControllerConfig | None = None,
    oracle: Sequence[StepRecord] | None = None,
    notice: bool = True,
) -> list[dict[str, Any]]:
    """Nereus(gamma) for every gamma of ``gammas``: one summary row each (gap against the oracle)."""
    if oracle is None:
        policy = make_policy(
            PolicySpec("oracle"), backend, cluster, workload, machine.truth, calibration_factory
        )
        oracle = simulate(policy, trace, machine, backend, cluster, workload, notice)
    rows = []
    for gamma in gammas:
        spec = PolicySpec("nereus", gamma=float(gamma))
        policy = make_policy(spec, backend, cluster, workload, machine.truth, calibration_factory, controller)
        summary = summarise(simulate(policy, trace, machine, backend, cluster, workload, notice), oracle)
        rows.append({"gamma": float(gamma), **asdict(summary)})
    return rows
