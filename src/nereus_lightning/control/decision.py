"""`Decision`: the controller's answer for one step, and the JSON-lines decision log."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from nereus_lightning.control.signals import StepSignals, gpu_ranges
from nereus_lightning.control.triggers import Trigger
from nereus_lightning.plan.layout import Plan

# What the body does: nothing ("none": no trigger; "keep": replanned, current plan kept),
# execute the transition DAG to `target` ("transition"), or checkpoint and restart into
# `target` ("restart"; `target` None = checkpoint and wait until a plan fits again; then
# "wait" at every step while none does).
DECISION_KINDS = ("none", "initial", "keep", "transition", "restart", "wait")


@dataclass(frozen=True)
class Decision:
    """The controller's verdict after one step's signals."""

    step: int
    kind: str
    reason: str = ""
    triggers: tuple[Trigger, ...] = ()
    current: Plan | None = None
    target: Plan | None = None
    current_latency: float | None = None  # predicted s/step of the current plan (None: broken)
    target_latency: float | None = None
    delta_latency: float | None = None  # dL = L_step(current) - L_step(target)
    transition_cost: float | None = None  # L_tran in seconds
    horizon: float | None = None  # H_x in steps (smallest over the triggers)
    gamma: float | None = None
    urgent: bool = False
    signals: StepSignals | None = None
    considered: tuple[dict[str, Any], ...] = field(default=())

    @property
    def changes_plan(self) -> bool:
        """Whether the body must act (transition or restart)."""
        return self.kind in ("initial", "transition", "restart")

    def to_json(self) -> dict[str, Any]:
        """One decision-log record (JSON-serialisable; infinities become None)."""
        return {
            "step": self.step,
            "decision": self.kind,
            "reason": self.reason,
            "trigger": [t.to_json() for t in self.triggers],
            "urgent": self.urgent,
            "signals": None if self.signals is None else self.signals.to_json(),
            "current_plan": plan_to_json(self.current),
            "target_plan": plan_to_json(self.target),
            "current_latency": _finite(self.current_latency),
            "target_latency": _finite(self.target_latency),
            "dL": _finite(self.delta_latency),
            "L_tran": _finite(self.transition_cost),
            "H_x": _finite(self.horizon),
            "gamma": self.gamma,
            "considered": list(self.considered),
        }


def _finite(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(x) else round(float(x), 6)


def plan_to_json(plan: Plan | None) -> dict[str, Any] | None:
    """A compact JSON form of a plan: per model-stage dp/tp/pp/ZeRO shard and stage/micro-batch/recompute
    and GPU ranges."""
    if plan is None:
        return None
    return {
        name: {
            "dp": c.dp,
            "tp": c.layout.tp,
            "pp": c.layout.pp,
            "shard": c.layout.shard,
            "zero": c.layout.zero,
            "micro_batch": c.micro_batch,
            "recompute": c.recompute,
            "gpus": gpu_ranges(c.gpus),
        }
        for name, c in plan.items()
    }


def describe_plan(plan: Plan | None) -> str:
    """One line per plan: ``actor_gen=dp4 TP2xPP1 mb1, ...``."""
    if plan is None:
        return "-"
    return ", ".join(f"{n}={c.describe()}" for n, c in plan.items())


class DecisionLog:
    """Appends every replan decision to a JSON-lines file (one object per line)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        parent = os.path.dirname(self.path)
        if parent:
            os.makedirs(parent, exist_ok=True)

    def append(self, decision: Decision) -> None:
        """Write one decision as a line."""
        with open(self.path, "a") as f:
            f.write(json.dumps(decision.to_json(), sort_keys=True) + "\n")

    def read(self) -> list[dict[str, Any]]:
        """All records written so far."""
        if not os.path.exists(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]
