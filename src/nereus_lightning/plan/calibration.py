"""`Calibration`: one learned efficiency per operation class (a stage kind and an operation);
`MemoryCalibration`: one measured / predicted peak-memory factor per workflow stage.

The cost model prices every operation at its *ideal* time (peak FLOP/s, peak HBM bandwidth,
nominal link bandwidth and latency) and divides it by the efficiency of its class. A measured
time therefore implies an efficiency: ``implied = current * predicted / measured``. We average
implied efficiencies in log space (an exponential moving average), so over- and
under-predictions by the same factor pull equally hard and efficiencies stay positive.

Memory is corrected the other way round: the planner's feasibility multiplies a stage's
predicted peak by the factor its measured peaks have shown (:class:`MemoryCalibration`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from nereus_lightning.spec.errors import NereusConfigError, require

LINKS = ("intra", "inter")
COLLECTIVES = ("allreduce", "allgather", "p2p")
_COMM = tuple(f"{c}_{link}" for c in COLLECTIVES for link in LINKS)

#: The operations each stage kind runs. An operation class is a kind and an operation, e.g.
#: ``training.gemm``: a training step's GEMMs (forward, backward, autograd) run at another
#: efficiency than a forward-only pass's, and each measured stage then calibrates its own classes.
OPERATIONS: dict[str, tuple[str, ...]] = {
    "generation": ("gemm", "attention", "decode", "launch", "offload", *_COMM),
    "inference": ("gemm", "attention", "offload", *_COMM),
    "training": ("gemm", "attention", "optimizer", *_COMM),
}

#: Every operation class the cost model emits, e.g. ``training.allreduce_inter``.
OP_CLASSES: tuple[str, ...] = tuple(f"{kind}.{op}" for kind, ops in OPERATIONS.items() for op in ops)

#: Priors per operation, for classes never observed: deliberately conservative (well below what
#: tuned kernels reach), so an uncalibrated plan over-estimates time rather than promising too much.
#: ``launch`` is priced from measurements already, so its prior is 1.
DEFAULT_OP_EFFICIENCY: dict[str, float] = {
    "gemm": 0.5,
    "attention": 0.35,
    "decode": 0.5,
    # Not an ideal: the decode steps' fixed kernel cost is priced from measured steps (cost.py).
    "launch": 1.0,
    "optimizer": 0.5,
    "offload": 0.5,
    **{f"{c}_intra": 0.6 for c in COLLECTIVES},
    **{f"{c}_inter": 0.5 for c in COLLECTIVES},
}

#: The priors of every operation class.
DEFAULT_EFFICIENCY: dict[str, float] = {c: DEFAULT_OP_EFFICIENCY[c.split(".")[1]] for c in OP_CLASSES}


_KNOWN = "; ".join(f"{kind}: {', '.join(ops)}" for kind, ops in OPERATIONS.items())


def op_class(collective: str, inter_node: bool) -> str:
    """The operation name of a collective on the link it spans, e.g. ``allreduce_inter``."""
    return f"{collective}_{'inter' if inter_node else 'intra'}"


def classes_of(name: str) -> tuple[str, ...]:
    """The operation classes ``name`` stands for: itself, or an operation's class in every kind.

    ``"gemm"`` stands for ``generation.gemm``, ``inference.gemm`` and ``training.gemm`` (a setting
    or an old checkpoint that knows operations only); an unknown name is an error.
    """
    if name in DEFAULT_EFFICIENCY:
        return (name,)
    classes = tuple(c for c in OP_CLASSES if c.split(".")[1] == name)
    if not classes:
        raise NereusConfigError(
            f"calibration: unknown op class {name!r}; give <kind>.<operation>, or an operation for "
            f"every kind ({_KNOWN})"
        )
    return classes


def qualified(kind: str, ideal: Mapping[str, float]) -> dict[str, float]:
    """An ideal-time dict by operation, as operation classes of stage kind ``kind``."""
    return {f"{kind}.{op}": seconds for op, seconds in ideal.items()}


class Calibration:
    """Per-class efficiencies in (0, 1.5], learned from measured timings.

    Args:
        efficiencies: starting values per class; missing classes use ``DEFAULT_EFFICIENCY``.
        rate: weight of a new observation in the log-space moving average (0 < rate <= 1).
    """

    def __init__(self, efficiencies: Mapping[str, float] | None = None, rate: float = 0.5) -> None:
        require(0 < rate <= 1, "calibration.rate", f"must be in (0, 1], got {rate}")
        self.rate = float(rate)
        self._eff: dict[str, float] = dict(DEFAULT_EFFICIENCY)
        self._count: dict[str, int] = {c: 0 for c in OP_CLASSES}
        for name, value in (efficiencies or {}).items():
            require(value > 0, f"calibration.{name}", f"efficiency must be positive, got {value}")
            for c in classes_of(name):  # operations first, then classes: a class overrides its operation
                if "." in name or c not in (efficiencies or {}):
                    self._eff[c] = float(value)

    @staticmethod
    def _check_class(name: str) -> None:
        if name not in DEFAULT_EFFICIENCY:
            raise NereusConfigError(
                f"calibration: unknown op class {name!r}; a class is <kind>.<operation>, e.g. "
                f"training.gemm ({_KNOWN})"
            )

    def efficiency(self, name: str) -> float:
        """The current efficiency of class ``name``."""
        self._check_class(name)
        return self._eff[name]

    def efficiencies(self) -> dict[str, float]:
        """A copy of every class's efficiency."""
        return dict(self._eff)

    def observations(self, name: str) -> int:
        """How many timings of class ``name`` were observed."""
        self._check_class(name)
        return self._count[name]

    def observe(self, name: str, predicted_s: float, measured_s: float) -> float:
        """Update class ``name`` from one timing predicted with the current efficiencies.

        ``predicted_s`` must come from the current efficiency of ``name``: sum a step's
        predictions and measurements of one class and observe them once, rather than observing
        many timings predicted before the first update. Returns the new efficiency.
        Non-positive times are rejected (they carry no information).
        """
        self._check_class(name)
        require(predicted_s > 0, "calibration.predicted_s", f"must be positive, got {predicted_s}")
        require(measured_s > 0, "calibration.measured_s", f"must be positive, got {measured_s}")
        implied = self._eff[name] * predicted_s / measured_s
        # The first observation replaces the prior outright: the prior is a guess, not data.
        weight = 1.0 if self._count[name] == 0 else self.rate
        log_eff = (1 - weight) * math.log(self._eff[name]) + weight * math.log(implied)
        self._eff[name] = min(1.5, math.exp(log_eff))
        self._count[name] += 1
        return self._eff[name]

    def version(self) -> tuple[tuple[str, float], ...]:
        """A hashable snapshot, used as a cache key by the cost model."""
        return tuple(sorted(self._eff.items()))

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (stored in Lightning checkpoints by the controller)."""
        return {"rate": self.rate, "efficiency": dict(self._eff), "count": dict(self._count)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict` output."""
        # A state saved before classes had kinds names operations: each stands for its classes.
        eff = {c: float(v) for k, v in state.get("efficiency", {}).items() for c in classes_of(k)}
        count = {c: int(v) for k, v in state.get("count", {}).items() for c in classes_of(k)}
        self.rate = float(state.get("rate", self.rate))
        self._eff.update(eff)
        self._count.update(count)

    def __repr__(self) -> str:
        seen = {k: round(v, 3) for k, v in self._eff.items() if self._count[k]}
        return f"Calibration(observed={seen})"


#: The workflow stages a peak-memory factor is kept for (``spec.workload.STAGES``).
MEMORY_STAGES = ("generation", "inference", "training")


class MemoryCalibration:
    """Per workflow stage, how far measured peak memory has exceeded the cost model's prediction.

    A stage's predicted peak on a GPU is the cost model's (its model-stages there run in turn:
    the largest of them, plus the training state resident beside it); a step's measurement is
    the allocator's peak of that stage on the same GPU. The planner and the admission check
    use ``predicted * factor(stage)`` against the memory cap.

    The factor is the largest ratio measured / predicted ever observed for the stage, and never
    less than ``floor`` (1 by default). It jumps up at once and never comes down, which is the
    promise: a plan that exceeded its prediction is never chosen again as if it fit (re-priced,
    it predicts at least what it measured). Why not let it decay: the ratio is systematic, not
    noise (the same code allocates the same temporaries step after step), so the maximum
    settles within the first steps of each plan shape, and being too careful costs a smaller
    batch while being too optimistic costs an out-of-memory restart. Why a floor of 1: a ratio
    below 1 (the model's workspace reserve unused, say) measured on one plan and length says
    nothing safe about another, where the terms that were overpriced may weigh less.

    Args:
        floor: the smallest factor (> 0): 1 never lets a measurement loosen the cost model.
    """

    def __init__(self, floor: float = 1.0) -> None:
        require(floor > 0, "memory_calibration.floor", f"must be positive, got {floor}")
        self.floor = float(floor)
        self._ratio: dict[str, float] = {}  # the largest ratio observed per stage
        self._count: dict[str, int] = {}

    @staticmethod
    def _check_stage(stage: str) -> None:
        require(
            stage in MEMORY_STAGES,
            "memory_calibration",
            f"unknown stage {stage!r}; one of {', '.join(MEMORY_STAGES)}",
        )

    def factor(self, stage: str) -> float:
        """The factor predicted peaks of ``stage`` are multiplied by (``floor`` until observed)."""
        self._check_stage(stage)
        return max(self.floor, self._ratio.get(stage, 0.0))

    def factors(self) -> dict[str, float]:
        """Every stage's factor."""
        return {stage: self.factor(stage) for stage in MEMORY_STAGES}

    def observations(self, stage: str) -> int:
        """How many steps of ``stage`` were observed."""
        self._check_stage(stage)
        return self._count.get(stage, 0)

    def observe(self, stage: str, predicted: float, measured: float) -> bool:
        """Take one step's peak of ``stage`` on a GPU (bytes, the prediction without the factor).

        Returns whether the factor rose (plans priced before are stale then).
        """
        self._check_stage(stage)
        require(predicted > 0, "memory_calibration.predicted", f"must be positive, got {predicted}")
        require(measured >= 0, "memory_calibration.measured", f"must be >= 0, got {measured}")
        before = self.factor(stage)
        self._ratio[stage] = max(self._ratio.get(stage, 0.0), measured / predicted)
        self._count[stage] = self._count.get(stage, 0) + 1
        return self.factor(stage) > before

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state (stored in Lightning checkpoints by the controller)."""
        return {"floor": self.floor, "ratio": dict(self._ratio), "count": dict(self._count)}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from :meth:`state_dict` output."""
        self.floor = float(state.get("floor", self.floor))
        self._ratio = {k: float(v) for k, v in state.get("ratio", {}).items() if k in MEMORY_STAGES}
        self._count = {k: int(v) for k, v in state.get("count", {}).items() if k in MEMORY_STAGES}

    def __repr__(self) -> str:
        return f"MemoryCalibration({ {k: round(v, 3) for k, v in self.factors().items()} })"
