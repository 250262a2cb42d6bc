"""Which rank does what in one RL step: partitions of the global batch per model-stage, and the
collectives that move per-sample results between stages with different DP layouts.

A model-stage with ``dp`` replicas splits the global batch into ``dp`` contiguous blocks of
global sample indices (replica ``r`` gets block ``r`` of :func:`~nereus_lightning.rl.batch.dp_slice`,
or of :func:`~nereus_lightning.rl.batch.balanced_slice` where the samples' tokens are known).
The split depends only on the batch and ``dp``, never on which ranks hold the
replicas, so results are identical under any placement. Each replica's "leader" (its first GPU)
reports the replica's results; every rank then holds the whole batch again in global order, which
is how a batch moves from one stage's DP layout to the next one's.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from nereus_lightning.plan.layout import Candidate, Plan
from nereus_lightning.rl.batch import balanced_slice, dp_slice
from nereus_lightning.spec.errors import NereusConfigError, require
from nereus_lightning.spec.workload import workflow

T = TypeVar("T")


def role_of(model_stage: str, algorithm: str) -> str:
    """The role model (``actor``, ``critic``, ``reference``, ``reward``) ``model_stage`` runs."""
    for ms in workflow(algorithm):
        if ms.name == model_stage:
            return ms.model
    raise NereusConfigError(
        f"model_stage: {model_stage!r} is not a model-stage of {algorithm!r} "
        f"({', '.join(m.name for m in workflow(algorithm))})"
    )


@dataclass(frozen=True)
class StageSlot:
    """This rank's place in one model-stage: its replica (or None) and that replica's sample range."""

    stage: str
    candidate: Candidate
    replica: int | None
    position: int | None  # index inside the (compute) replica (pp_rank * tp + tp_rank)
    start: int = 0
    stop: int = 0

    @property
    def active(self) -> bool:
        """Whether this rank holds a unit of the model-stage."""
        return self.replica is not None

    @property
    def is_leader(self) -> bool:
        """Whether this rank reports its replica's results (the replica's first GPU)."""
        return self.position == 0

    @property
    def indices(self) -> range:
        """Global sample indices this rank's replica processes."""
        return range(self.start, self.stop)


def slot_of(
    plan: Plan, stage: str, rank: int, num_samples: int, tokens: Sequence[int] | None = None
) -> StageSlot:
    """This rank's slot in ``stage`` of ``plan`` for a batch of ``num_samples`` samples.

    With ``tokens`` (each sample's), replicas get contiguous blocks of near-equal tokens
    (:func:`~nereus_lightning.rl.batch.balanced_slice`); else of near-equal sample counts. Each shard
    rank of a sharded replica is a replica here (:meth:`Candidate.shard_groups`), with its own rows.
    """
    cand = plan[stage].shard_groups()
    if rank not in cand.gpus:
        return StageSlot(stage, cand, None, None)
    index = cand.gpus.index(rank)
    replica, position = divmod(index, cand.layout.size)
    if tokens is None:
        rows = dp_slice(num_samples, cand.dp, replica)
    else:
        require(len(tokens) == num_samples, "tokens", f"{len(tokens)} counts for {num_samples} samples")
        rows = balanced_slice(tokens, cand.dp, replica)
    return StageSlot(stage, cand, replica, position, rows.start, rows.stop)


def _assemble(payloads: Sequence[Any], num_samples: int, stage: str = "") -> list[Any]:
    """Every sample's result in global order from ``(start, items)`` payloads (None: nothing reported)."""
    out: list[Any] = [None] * num_samples
    seen = 0
    for part in payloads:
        if part is None:
            continue
        begin, items = part
        out[begin : begin + len(items)] = items
        seen += len(items)
    require(
        seen == num_samples,
        "stage results",
        f"{stage + ': ' if stage else ''}{seen} sample results reported for a batch of {num_samples}",
    )
    return out


def _all_gather(payload: Any) -> list[Any]:
    if not dist.is_initialized():
        return [payload]
    parts: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(parts, payload)
    return parts


def gather_samples(local: Sequence[T] | None, start: int, num_samples: int) -> list[T]:
    """All ranks: every sample's result in global order; ``local`` is this rank's results from ``start``.

    Ranks that report nothing pass ``None``. Every index must be reported exactly once.
    """
    payload = None if local is None else (start, list(local))
    return _assemble(_all_gather(payload), num_samples)


def run_stages(
    plan: Plan,
    jobs: Mapping[str, Callable[[StageSlot], Sequence[T]]],
    rank: int,
    num_samples: int,
) -> dict[str, list[T]]:
    """Run several model-stages of one stage (model-stage -> ``fn(slot)``), then exchange their results once.

    Each rank runs, in the given order, only the model-stages it holds a unit of, so model-stages
    on disjoint ranks compute at the same time; every rank gets every sample's result per stage.
    """
    payloads: dict[str, Any] = {}
    for stage, fn in jobs.items():
        slot = slot_of(plan, stage, rank, num_samples)
        if slot.active:
            local = fn(slot) if slot.stop > slot.start else []
            if slot.is_leader:
                payloads[stage] = (slot.start, list(local))
    parts = _all_gather(payloads)
    return {stage: _assemble([p.get(stage) for p in parts], num_samples, stage) for stage in jobs}


@dataclass(frozen=True)
class RowsJob:
    """One model-stage of :func:`run_stages_rows`: ``fn(slot)`` returns this replica's rows ``[b, width]``."""

    stage: str
    width: int
    fn: Callable[[StageSlot], torch.Tensor]


def run_stages_rows(
    plan: Plan,
    jobs: Sequence[RowsJob],
    rank: int,
    num_samples: int,
    device: torch.device,
    tokens: Sequence[int] | None = None,
) -> dict[str, torch.Tensor]:
    """Run several model-stages of one stage (e.g. every inference model-stage) and exchange their rows once.

    Each rank runs, in the given order, only the model-stages it holds a unit of; model-stages on
    disjoint ranks therefore compute at the same time, and no rank waits for a model-stage it is
    not part of until the single exchange at the end. Every rank gets ``[n, width]`` per stage.
    ``tokens``: each sample's, to balance replicas by tokens (:func:`slot_of`).
    The rows travel as one float32 buffer summed over the world (each row is reported by one
    leader, the others add zeros, so the sum is exact); tensors stay on their device.
    """
    columns = [job.width + 1 for job in jobs]  # + one "reported" column per stage
    buffer = torch.zeros(num_samples, sum(columns), dtype=torch.float32, device=device)
    offset = 0
    for job, cols in zip(jobs, columns, strict=True):
        slot = slot_of(plan, job.stage, rank, num_samples, tokens)
        if slot.active and slot.stop > slot.start:
            rows = job.fn(slot)
            if slot.is_leader:
                buffer[slot.start : slot.stop, offset : offset + job.width] = rows.to(torch.float32)
                buffer[slot.start : slot.stop, offset + job.width] = 1.0
        offset += cols
    if dist.is_initialized():
        dist.all_reduce(buffer)
    out, offset = {}, 0
    for job, cols in zip(jobs, columns, strict=True):
        reported = buffer[:, offset + job.width]
        require(
            bool((reported == 1).all()),
            "stage results",
            f"{job.stage}: rows reported {reported.tolist()} times, expected once each",
        )
        out[job.stage] = buffer[:, offset : offset + job.width]
        offset += cols
    return out


def micro_slices(rows: int, micro_batch: int) -> list[slice]:
    """A replica's ``rows`` cut into micro-batches of at most ``micro_batch`` sequences (the plan's)."""
    return [slice(lo, min(lo + micro_batch, rows)) for lo in range(0, rows, max(micro_batch, 1))]
