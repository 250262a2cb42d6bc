"""`estimate_plan`: price any concrete plan (the planner's choice, the running plan after drift, ...)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import lru_cache

from nereus_lightning.plan.calibration import Calibration, MemoryCalibration
from nereus_lightning.plan.comm import links_of
from nereus_lightning.plan.cost import StageWork, ideal_time, rank_peak_memory, replica_sequences, stage_work
from nereus_lightning.plan.layout import Candidate, Plan
from nereus_lightning.plan.memory import memory_cap, resident_rank_bytes
from nereus_lightning.plan.overlap import groups_by_stage
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.spec.workload import STAGES, Workload


@dataclass(frozen=True)
class PlanEstimate:
    """Predicted step latency and per-GPU peak memory of a plan.

    Attributes:
        step_latency: seconds per RL step: the sum over stages of the stage's slowest group, a
            group's time being the sum of its colocated model-stages' (``plan.overlap``).
        stage_latency: seconds per model-stage (key: model-stage name).
        peak_memory: peak bytes per GPU id over the step (GPUs no model-stage uses are absent):
            the largest of each unit's own peak plus the training state other model-stages keep
            resident on it (colocated training model-stages keep their states side by side),
            times its stage's memory factor (``MemoryCalibration``; 1 without one).
        memory_cap: allocator bytes allowed per GPU (:func:`~nereus_lightning.plan.memory.memory_cap`).
        feasible: no violation.
        violations: human-readable reasons the plan cannot run as priced.
        phase_latency: seconds per stage (generation, inference, training).
        breakdown: predicted seconds per operation class, per model-stage (for calibration).
        stage_memory: peak bytes on the most-loaded GPU of each model-stage, including the
            training state other model-stages keep resident on the same GPU, times its stage's
            memory factor.
        stage_peak: the cost model's own peak (no memory factor) per workflow stage and GPU: the
            largest of the stage's model-stages on that GPU (they run in turn) plus the training
            state resident beside it. What a measured stage peak is compared with.
    """

    step_latency: float
    stage_latency: dict[str, float]
    peak_memory: dict[int, float]
    memory_cap: float
    feasible: bool
    violations: tuple[str, ...] = ()
    phase_latency: dict[str, float] = field(default_factory=dict)
    breakdown: dict[str, dict[str, float]] = field(default_factory=dict)
    stage_memory: dict[str, float] = field(default_factory=dict)
    stage_peak: dict[str, dict[int, float]] = field(default_factory=dict)

    def peak_of(self, gpus: tuple[int, ...]) -> float:
        """The largest peak memory among ``gpus``."""
        return max((self.peak_memory.get(g, 0.0) for g in gpus), default=0.0)


def _per_gpu(ranks: list[float] | tuple[float, ...], cand: Candidate) -> list[float]:
    """Per-pipeline-rank values spread over the candidate's GPUs (replica, shard, pp, tp order)."""
    tp = cand.layout.tp
    return [ranks[p] for _ in range(cand.data_parallel) for p in range(cand.layout.pp) for _ in range(tp)]


@lru_cache(maxsize=64)  # one plan_job's plans share most candidates; per-GPU lists can be long
def _candidate_cost(
    work: StageWork, cand: Candidate, cluster: ClusterSpec
) -> tuple[dict[str, float], list[float]]:
    """Ideal seconds per class and own peak bytes per GPU of one placed candidate (memoised: the
    planner estimates several plans that share most candidates)."""
    links = links_of(cand.gpus, cand.layout, cand.dp, cluster)
    ideal = ideal_time(work, cand.layout, cand.dp, cand.micro_batch, cand.recompute, links, cluster)
    ranks = rank_peak_memory(work, cand.layout, cand.dp, cand.micro_batch, cand.recompute)
    return ideal, _per_gpu(ranks, cand)


def estimate_plan(
    plan: Plan,
    models: Mapping[str, ModelSpec],
    cluster: ClusterSpec,
    workload: Workload,
    calibration: Calibration | None = None,
    memory: MemoryCalibration | None = None,
) -> PlanEstimate:
    """Price ``plan`` on its concrete GPUs; infeasibilities are reported, not raised.

    ``memory`` scales each stage's predicted peaks by its measured factor before the cap check.

    Raises:
        NereusConfigError: the plan misses a model-stage of the workload, names an unknown one,
            or uses a TP/PP degree the model cannot be cut into.
    """
    stages = workload.stages
    names = [ms.name for ms in stages]
    missing = [n for n in names if n not in plan]
    extra = [n for n in plan if n not in names]
    if missing or extra:
        raise NereusConfigError(
            f"plan: model-stages must be exactly {names}; missing {missing}, unknown {extra}"
        )
    cap = memory_cap(cluster)
    violations: list[str] = []
    stage_latency: dict[str, float] = {}
    breakdown: dict[str, dict[str, float]] = {}
    peak: dict[int, float] = {}
    stage_memory: dict[str, float] = {}
    stage_peak: dict[str, dict[int, float]] = {}
    cal = calibration or Calibration()
    factors = (memory or MemoryCalibration()).factors()
    # Training state stays on its GPUs all step (colocated training model-stages keep theirs side
    # by side); generation and inference run next to all of it, a training unit next to the others'.
    resident: dict[int, float] = {}
    own: dict[str, list[float]] = {}
    for ms in stages:
        if (
            ms.trains
            and replica_sequences(stage_work(ms, models, workload), plan[ms.name].data_parallel) is not None
        ):
            cand, model = plan[ms.name], models[ms.model]
            per_rank = [resident_rank_bytes(model, cand.layout, p) for p in range(cand.layout.pp)]
            own[ms.name] = _per_gpu(per_rank, cand)
            for g, value in zip(cand.gpus, own[ms.name], strict=True):
                resident[g] = resident.get(g, 0.0) + value
    for ms in stages:
        work, cand = stage_work(ms, models, workload, cluster.gpu_memory), plan[ms.name]
        work.model.validate_tp(cand.layout.tp)
        work.model.validate_pp(cand.layout.pp)
        if cand.layout.shard > 1 and not work.trains:
            raise NereusConfigError(
                f"plan.{ms.name}.layout.shard: {cand.layout.shard}, but only training model-stages shard "
                "their state (ZeRO)"
            )
        outside = [g for g in cand.gpus if not 0 <= g < cluster.num_gpus]
        if outside:
            violations.append(f"{ms.name}: GPUs {outside} are outside the pool of {cluster.num_gpus}")
        if replica_sequences(work, cand.data_parallel) is None:
            violations.append(
                f"{ms.name}: dp={cand.dp} x shard={cand.layout.shard} cannot split the batch of "
                f"{work.sequences} sequences"
            )
            stage_latency[ms.name] = float("inf")
            continue
        ideal, per_gpu = _candidate_cost(work, cand, cluster)
        breakdown[ms.name] = {c: s / cal.efficiency(c) for c, s in ideal.items()}
        stage_latency[ms.name] = sum(breakdown[ms.name].values())
        mine = own.get(ms.name, [0.0] * len(cand.gpus))  # its own state is in its peak already
        factor, raw = factors[ms.stage], stage_peak.setdefault(ms.stage, {})
        worst, worst_gpu, worst_beside = 0.0, -1, 0.0
        for g, value, state in zip(cand.gpus, per_gpu, mine, strict=True):
            beside = resident.get(g, 0.0) - state
            value += beside
            raw[g] = max(raw.get(g, 0.0), value)
            value *= factor
            if value > worst:
                worst, worst_gpu, worst_beside = value, g, beside
            if value > peak.get(g, 0.0):
                peak[g] = value
        stage_memory[ms.name] = worst
        if worst > cap:
            others = "other model-stages' " if work.trains else ""
            held = (
                f", {worst_beside / 1e9:.1f} GB of it {others}resident training state"
                if worst_beside > 0
                else ""
            )
            measured = f" ({factor:.2f} x the cost model's peak, as measured)" if factor != 1 else ""
            violations.append(
                f"{ms.name}: GPU {worst_gpu} needs {worst / 1e9:.1f} GB{held}{measured}, over the cap "
                f"{cap / 1e9:.1f} GB ({cand.describe()})"
            )
    phase: dict[str, float] = {}
    for stage, groups in groups_by_stage(plan, {ms.name: ms.stage for ms in stages}).items():
        # Colocated model-stages run one after another; groups on disjoint GPUs run concurrently.
        phase[stage] = max(sum(stage_latency[n] for n in group) for group in groups)
    phase = {stage: phase[stage] for stage in STAGES if stage in phase}
    return PlanEstimate(
        step_latency=sum(phase.values()),
        stage_latency=stage_latency,
        peak_memory=dict(sorted(peak.items())),
        memory_cap=cap,
        feasible=not violations,
        violations=tuple(violations),
        phase_latency=phase,
        breakdown=breakdown,
        stage_memory=stage_memory,
        stage_peak=stage_peak,
    )
