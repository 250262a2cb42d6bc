"""The simulated "true" machine: the cost model with hidden efficiencies plus per-step noise.

The planner starts from conservative priors; this machine runs every operation class at its own
(different) efficiency, so a controller that calibrates from measured timings predicts better
than one that does not. Noise is drawn once per step and shared by every policy (common random
numbers), so policies are compared on the same luck.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from nereus_lightning.control.backend import PlanningBackend, op_totals
from nereus_lightning.plan.layout import Plan
from nereus_lightning.plan.memory import full_memory
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import require
from nereus_lightning.spec.workload import Workload

#: Hidden efficiencies of the simulated machine by operation, every stage kind alike (the planner's
#: priors are lower: see plan/calibration.py).
TRUE_EFFICIENCY: dict[str, float] = {
    "gemm": 0.72,
    "attention": 0.55,
    "decode": 0.62,
    "launch": 0.86,  # a decode step's fixed cost, priced against measured (README "One GPU")
    "optimizer": 0.62,
    "offload": 0.8,
    "allreduce_intra": 0.78,
    "allgather_intra": 0.75,
    "p2p_intra": 0.8,
    "allreduce_inter": 0.62,
    "allgather_inter": 0.6,
    "p2p_inter": 0.7,
}


@dataclass(frozen=True)
class StepOutcome:
    """What running one step on the true machine produced."""

    latency: float
    feasible: bool
    op_time: dict[str, float]
    stage_time: dict[str, float]


class TrueMachine:
    """Runs plans on the cost model with hidden efficiencies ``truth`` and seeded noise.

    Args:
        backend: the planning backend whose cost model is reused (``estimate`` with ``truth``).
        truth: a calibration object holding the machine's real efficiencies.
        noise: relative standard deviation (log-normal) of per-step time noise.
        transition_factor: how much slower real transitions are than the DAG's prediction.
        restart_s: seconds a checkpoint/restart costs (save, relaunch, load).
        seed: seed of the noise stream.
    """

    def __init__(
        self,
        backend: PlanningBackend,
        truth: Any,
        noise: float = 0.03,
        transition_factor: float = 1.25,
        restart_s: float = 300.0,
        seed: int = 0,
    ) -> None:
        require(noise >= 0, "machine.noise", f"must be >= 0, got {noise}")
        require(
            transition_factor > 0, "machine.transition_factor", f"must be positive, got {transition_factor}"
        )
        require(restart_s >= 0, "machine.restart_s", f"must be >= 0, got {restart_s}")
        self.backend = backend
        self.truth = truth
        self.noise = noise
        self.transition_factor = transition_factor
        self.restart_s = restart_s
        self.seed = seed
        self._cache: dict[tuple, Any] = {}

    def noise_at(self, step: int, salt: int = 0) -> float:
        """The multiplicative noise of ``step`` (identical for every policy)."""
        if self.noise == 0:
            return 1.0
        rng = random.Random((self.seed * 1_000_003 + step) * 31 + salt)
        return math.exp(rng.gauss(0.0, self.noise))

    def run_step(self, step: int, plan: Plan, cluster: ClusterSpec, workload: Workload) -> StepOutcome:
        """Time one RL step of ``plan``; op-class and stage timings carry the same noise."""
        key = (plan, cluster.num_gpus, workload)
        est = self._cache.get(key)
        if est is None:
            est = self.backend.estimate(plan, full_memory(cluster), workload, self.truth)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[key] = est
        f = self.noise_at(step)
        ops = {k: v * f for k, v in op_totals(est).items()}
        stages = {k: v * f for k, v in (getattr(est, "stage_latency", None) or {}).items()}
        return StepOutcome(est.step_latency * f, bool(est.feasible), ops, stages)

    def transition_time(self, step: int, predicted_raw: float) -> float:
        """The real duration of a transition the DAG priced at ``predicted_raw`` seconds."""
        return predicted_raw * self.transition_factor * self.noise_at(step, salt=1)
