"""`StepSignals`: what the monitor measures at the end of one RL step (the controller's input)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from nereus_lightning.spec.errors import require
from nereus_lightning.spec.workload import STAGES

EMPTY: Mapping[Any, float] = MappingProxyType({})
NO_STAGES: Mapping[str, Mapping[int, float]] = MappingProxyType({})
#: The body's stage names in its peak-memory metrics (``perf/max_memory_allocated_gb/<name>``) ->
#: the workflow stages they measure.
PEAK_STAGES = {"gen": "generation", "infer": "inference", "train": "training"}


def as_pool(gpus: int | tuple[int, ...] | list[int] | range) -> tuple[int, ...]:
    """Normalise a GPU pool given as a count or as GPU ids into sorted, unique GPU ids."""
    if isinstance(gpus, int):
        require(gpus >= 0, "signals.gpus", f"a GPU count must be >= 0, got {gpus}")
        return tuple(range(gpus))
    pool = tuple(sorted(set(map(int, gpus))))  # C-level loops: ~50 us for 1,024 ids
    require(not pool or pool[0] >= 0, "signals.gpus", f"GPU ids must be >= 0, got {pool[:4]}...")
    return pool


@dataclass(frozen=True)
class StepSignals:
    """Signals of one finished RL step, as the monitor reports them.

    Lengths are in tokens, memory in bytes, times in seconds. ``stage_time`` maps a stage or a
    model-stage name to its measured time; ``op_time`` maps an operation class (the
    calibration's classes, e.g. ``"training.gemm"``) to its measured time; ``transition_time`` is the
    measured duration of the transition executed just before this step (``None`` if none ran).
    ``draining`` lists GPUs that are being revoked but can still be read until the transition
    ends (a spot two-minute notice): a transition may copy state off them.

    ``peak_memory`` maps a rank to its peak GPU memory over the step; ``stage_peak_memory`` maps a
    workflow stage (``generation``, ``inference``, ``training``) to each rank's peak during that
    stage (the allocator's peak, reset between stages), which the memory calibration reads.
    """

    step: int
    response_len: float
    response_len_p95: float
    prompt_len: float
    gpus: tuple[int, ...]
    peak_memory: Mapping[int, float] = field(default_factory=lambda: EMPTY)
    stage_peak_memory: Mapping[str, Mapping[int, float]] = field(default_factory=lambda: NO_STAGES)
    stage_time: Mapping[str, float] = field(default_factory=lambda: EMPTY)
    op_time: Mapping[str, float] = field(default_factory=lambda: EMPTY)
    transition_time: float | None = None
    draining: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        require(self.step >= 0, "signals.step", f"must be >= 0, got {self.step}")
        require(self.response_len > 0, "signals.response_len", f"must be positive, got {self.response_len}")
        require(
            self.response_len_p95 >= self.response_len,
            "signals.response_len_p95",
            f"{self.response_len_p95} is below the mean response_len={self.response_len}",
        )
        require(self.prompt_len >= 0, "signals.prompt_len", f"must be >= 0, got {self.prompt_len}")
        unknown = sorted(set(self.stage_peak_memory) - set(STAGES))
        require(not unknown, "signals.stage_peak_memory", f"unknown stages {unknown}; one of {list(STAGES)}")
        object.__setattr__(self, "gpus", as_pool(self.gpus))
        if self.draining:
            pool = set(self.gpus)
            object.__setattr__(self, "draining", tuple(g for g in as_pool(self.draining) if g not in pool))

    @property
    def num_gpus(self) -> int:
        """Size of the GPU pool."""
        return len(self.gpus)

    def value(self, name: str) -> float:
        """The drifting signal called ``name`` (``response_len``, ``response_len_p95``, ``prompt_len``)."""
        require(
            name in DRIFT_SIGNALS, "controller.drift_signals", f"{name!r} is not one of {list(DRIFT_SIGNALS)}"
        )
        return float(getattr(self, name))

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable summary (the GPU pool as ranges, memory as the per-rank maximum)."""
        return {
            "step": self.step,
            "response_len": self.response_len,
            "response_len_p95": self.response_len_p95,
            "prompt_len": self.prompt_len,
            "num_gpus": self.num_gpus,
            "gpus": gpu_ranges(self.gpus),
            "max_peak_memory": max(self.peak_memory.values(), default=None),
            "max_stage_peak_memory": {
                stage: max(peaks.values(), default=None) for stage, peaks in self.stage_peak_memory.items()
            },
            "stage_time": dict(self.stage_time),
        }


DRIFT_SIGNALS = ("response_len", "response_len_p95", "prompt_len")


def gpu_ranges(gpus: tuple[int, ...] | list[int]) -> str:
    """Compact text for a set of GPU ids, e.g. ``"0-7,16-23"``."""
    ids = sorted(gpus)
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)
