"""Executing a plan change on the units: the transition brain's DAG, or per-model-stage relayout.

The brain (:func:`nereus_lightning.transition.build_transition`) builds the DAG of ``current ->
target`` on the strategy's cluster and workload, and the EMU executor runs it on every rank.
The DAG the controller priced is not reused: the controller runs on rank 0 and keeps only the
price, and its decision reaches every rank as a plan. Every rank must execute one DAG, so each
builds it again from the same inputs (the build is deterministic), starting from the units' live
plan rather than the controller's intact one, for the role models the units hold. The record
prices the DAG executed (``predicted_s``), so its prediction is compared with what it measured.

Plans the brain does not model (model-stages of one stage sharing GPUs, as in the
all-data-parallel fallback) move each model-stage with :func:`nereus_lightning.emu.sync.relayout`
(the same transfer plans).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from nereus_lightning import emu, transition
from nereus_lightning.emu.executor import ops_of
from nereus_lightning.emu.sync import relayout
from nereus_lightning.models.groups import prepare_groups
from nereus_lightning.plan.layout import Plan
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import InfeasiblePlanError, NereusConfigError
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.spec.workload import Workload

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransitionRun:
    """What executing one plan change did.

    ``record``: mode (``"dag"``, ``"relayout"`` or ``"kept"``), bytes moved, seconds and, for a
    DAG, its node counts, prediction and per-node observations; ``report``: the DAG's reduced
    :class:`~nereus_lightning.emu.ExecutionReport` (None otherwise); ``moved``: False when the
    brain found no safe transition (nothing moved).
    """

    record: dict[str, Any] = field(default_factory=dict)
    report: Any = None
    moved: bool = True


def dag_rank_sets(dag: Any) -> list[tuple[int, ...]]:
    """Every rank set the executor's primitives will communicate over (same list on every rank)."""
    reg = emu.registry()
    out: list[tuple[int, ...]] = []
    for op in (op for node in dag.nodes for op in ops_of(node)):  # a batched node: one op per lane
        if isinstance(op, emu.Extend):
            for i, sender in enumerate(op.source.gpus):
                out.append((sender, *(u.gpus[i] for u in op.targets)))
        elif isinstance(op, (emu.Split, emu.Merge)):
            name = op.model_stage
            out.append(emu.reshard_plan(op, reg.schema(name), reg.trains[name]).ranks())
    return out


def run_transition(
    current: Plan, target: Plan, specs: Mapping[str, ModelSpec], cluster: ClusterSpec, workload: Workload
) -> TransitionRun:
    """Move every model-stage from ``current`` to ``target`` (collective; device tensors).

    The brain's DAG for the role models ``specs``; per-model-stage relayout for plans the brain
    does not model (``NereusConfigError``); nothing when it finds no safe transition
    (``InfeasiblePlanError``: ``moved`` is False).
    """
    start = time.perf_counter()
    try:
        dag = transition.build_transition(current, target, specs, cluster, workload)
    except InfeasiblePlanError as exc:
        log.warning("transition to the new plan is infeasible (%s); keeping the current plan", exc)
        return TransitionRun({"mode": "kept", "reason": str(exc), "bytes": 0}, moved=False)
    except NereusConfigError as exc:
        log.info("transition outside the brain's model (%s): per-model-stage relayout", exc)
        record = {"mode": "relayout", "reason": str(exc), "bytes": _relayout(current, target)}
        return TransitionRun({**record, "seconds": time.perf_counter() - start})
    prepare_groups(dag_rank_sets(dag))
    report = emu.execute_dag(dag).reduce()
    observations = report.node_observations()
    record = {
        "mode": "dag",
        "counts": {k: int(v) for k, v in dag.counts().items()},
        "bytes": sum(o.measured_bytes for o in observations),
        "predicted_bytes": sum(o.predicted_bytes for o in observations),
        "observations": observations,
        "predicted_s": float(dag.cost),
    }
    return TransitionRun({**record, "seconds": time.perf_counter() - start}, report)


def _relayout(current: Plan, target: Plan) -> int:
    """Relayout every model-stage whose units changed; the bytes received over all ranks."""
    moved = 0
    for name in target:
        if not current[name].same_units(target[name]):
            traffic, _ = relayout(name, emu.replica_units(target[name]))
            moved += traffic.payload_received
    box = torch.tensor([moved], dtype=torch.int64)
    dist.all_reduce(box)
    return int(box.item())


__all__ = ["TransitionRun", "dag_rank_sets", "run_transition"]
