"""Triggers: relative drift thresholds, pool changes, memory pressure, and their horizons H_x.

H_x estimates how many steps remain until signal x crosses its threshold again: an exponential
moving average of past intervals between crossings, updated at crossings only, and 1 step before
any interval has been seen (the paper's rule). Every clock is started at the first step the
controller sees (``CrossingClock.start``): its first interval runs from there to the first
crossing, since the signal held at least that long (a pool stable for 30 steps is not expected to
change in one; a length that took 13 steps to move 30% is not expected to move again in one).
A pool that grew to the whole cluster is judged over the supply's stability instead
(``PoolTrigger.stability``): it can only change next by losing GPUs.
A gain refused under a horizon that the conditions then outlast is looked at again
(:class:`Recheck`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from nereus_lightning.spec.errors import require

URGENT_KINDS = ("revocation", "memory")
#: Trigger kinds that are no crossing of a drift threshold: they leave the drift references where they are.
NON_CROSSING_KINDS = ("recheck", "headroom", "quiet", "retune")


@dataclass(frozen=True)
class Trigger:
    """One reason to replan: ``kind`` is ``drift:<signal>``, ``pool``, ``revocation``, ``memory``,
    ``schedule``, ``quiet``, ``recheck``, ``headroom`` or ``retune`` (a boundary without the others,
    where only micro-batches and recomputation may change).
    """

    kind: str
    horizon: float  # H_x in steps
    urgent: bool = False
    detail: str = ""

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable form."""
        return {"kind": self.kind, "horizon": self.horizon, "urgent": self.urgent, "detail": self.detail}


class CrossingClock:
    """Steps between threshold crossings of one signal, as an EMA (H_x)."""

    def __init__(self, alpha: float = 0.5) -> None:
        require(0 < alpha <= 1, "controller.ema_alpha", f"must be in (0, 1], got {alpha}")
        self.alpha = alpha
        self.last_crossing: int | None = None
        self.ema: float | None = None
        self.origin: int | None = None  # first step observed: the start of the first interval

    def start(self, step: int) -> None:
        """Note the first step the signal is observed (no-op once started or crossed)."""
        if self.origin is None and self.last_crossing is None:
            self.origin = step

    @property
    def horizon(self) -> float:
        """H_x: the EMA of intervals, or 1 step before any interval is seen."""
        return 1.0 if self.ema is None else self.ema

    def cross(self, step: int) -> None:
        """Record a crossing at ``step``; the only place the EMA changes."""
        since = self.last_crossing if self.last_crossing is not None else self.origin
        if since is not None and step > since:
            interval = float(step - since)
            self.ema = interval if self.ema is None else self.alpha * interval + (1 - self.alpha) * self.ema
        self.last_crossing = step

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state."""
        return {
            "alpha": self.alpha,
            "last_crossing": self.last_crossing,
            "ema": self.ema,
            "origin": self.origin,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.alpha = float(state["alpha"])
        self.last_crossing = state["last_crossing"]
        self.ema = state["ema"]
        self.origin = state.get("origin")  # absent in checkpoints of older versions


class DriftTrigger:
    """Fires when a signal differs from its reference by more than ``delta`` (relative)."""

    def __init__(self, name: str, delta: float = 0.3, alpha: float = 0.5) -> None:
        require(delta > 0, f"controller.delta.{name}", f"must be positive, got {delta}")
        self.name = name
        self.delta = delta
        self.reference: float | None = None
        self.clock = CrossingClock(alpha)

    def check(self, step: int, value: float) -> Trigger | None:
        """A trigger if ``value`` crossed the threshold (the clock records the crossing), else None."""
        if self.reference is None:
            self.reference = value
            return None
        base = max(abs(self.reference), 1e-12)
        change = (value - self.reference) / base
        if abs(change) <= self.delta:
            return None
        self.clock.cross(step)
        return Trigger(
            f"drift:{self.name}",
            self.clock.horizon,
            detail=f"{self.name} {self.reference:.1f} -> {value:.1f} "
            f"({change:+.1%}, threshold {self.delta:.0%})",
        )

    def reset(self, value: float) -> None:
        """Move the reference to ``value`` (after every replan, admitted or not)."""
        self.reference = value

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state."""
        return {"delta": self.delta, "reference": self.reference, "clock": self.clock.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.delta = float(state["delta"])
        self.reference = state["reference"]
        self.clock.load_state_dict(state["clock"])


class PoolTrigger:
    """Fires when the GPU pool differs from the pool of the last replan.

    Losing a GPU the current plan uses is a revocation (urgent); any other change is not.

    A pool that grew to the whole cluster (``capacity`` GPUs) can only change next by losing
    GPUs: its horizon is the supply's observed stability (:meth:`stability`), not the crossing
    clock's, whose intervals mix in how long revocation bursts lasted (after a burst, the short
    interval before the GPUs came back says nothing about how long they stay).
    """

    def __init__(self, alpha: float = 0.5, capacity: int | None = None) -> None:
        self.reference: tuple[int, ...] | None = None
        self.clock = CrossingClock(alpha)
        self.capacity = capacity  # GPUs of the whole cluster (None: unknown)
        self.losses = 0  # changes of the pool that took GPUs away (revocations or not)

    def check(self, step: int, pool: tuple[int, ...], used: frozenset[int]) -> Trigger | None:
        """A ``pool`` or ``revocation`` trigger if the pool changed since the reference."""
        if self.reference is None:
            self.reference = pool
            self.clock.start(step)
            return None
        if pool == self.reference:
            return None
        self.clock.cross(step)
        gone = set(self.reference) - set(pool)
        self.losses += bool(gone)
        lost = used - set(pool)
        detail = f"{len(self.reference)} -> {len(pool)} GPUs"
        if lost:
            return Trigger(
                "revocation", self.clock.horizon, urgent=True, detail=f"{detail}; lost {len(lost)} in use"
            )
        if gone or self.capacity is None or len(pool) < self.capacity:
            return Trigger("pool", self.clock.horizon, detail=detail)
        horizon = self.stability(step)
        return Trigger(
            "pool",
            horizon,
            detail=f"{detail}, the whole cluster; H = the supply's stability, {horizon:.1f} steps per loss",
        )

    def stability(self, step: int) -> float:
        """Steps observed per loss of GPUs: the expected steps until the supply next takes GPUs
        away, for losses that come at a steady rate (the rate's estimate over every step seen).
        Before any loss, the steps observed: the supply has held at least that long."""
        origin = self.clock.origin if self.clock.origin is not None else step - 1
        return max(float(step - origin), 1.0) / max(self.losses, 1)

    def reset(self, pool: tuple[int, ...]) -> None:
        """Move the reference to ``pool``."""
        self.reference = pool

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state."""
        return {
            "reference": None if self.reference is None else list(self.reference),
            "clock": self.clock.state_dict(),
            "losses": self.losses,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.reference = None if state["reference"] is None else tuple(state["reference"])
        self.clock.load_state_dict(state["clock"])
        self.losses = int(state.get("losses", 0))  # absent in checkpoints of older versions


class Recheck:
    """A faster target left out by a replan, looked at again once the conditions have lasted.

    A replan judges payback over H_x, an estimate of how long its conditions (pool, lengths)
    last; when they outlast it, a target refused for a short horizon (or passed over for a cheaper
    move) keeps costing its dL every step with no trigger to reconsider it. The conditions
    settle at every triggered replan; a refusal whose best target pays back in ``p`` steps is due
    again once they have held ``p`` steps: by then the gain given up has cost as much as the move.
    The ``recheck`` trigger carries ``age / gamma`` as its horizon, so the payback rule admits
    exactly such a move (``L_tran / dL <= age``): a refusal then costs at most twice the move
    it refused, whatever the conditions do next (the ski-rental bound).
    """

    def __init__(self) -> None:
        self.settled: int | None = None  # step of the last triggered replan
        self.due: int | None = None
        self.gamma = 1.0  # the payback rule's, at the refusal

    def settle(self, step: int) -> None:
        """A triggered replan at ``step``: new conditions, nothing refused yet."""
        self.settled, self.due = step, None

    def refuse(self, step: int, payback: float | None, gamma: float) -> None:
        """The replan at ``step`` left out a target paying back in ``payback`` steps (None: none)."""
        if payback is None or gamma <= 0 or self.settled is None or not math.isfinite(payback):
            self.due = None
            return
        self.gamma = gamma
        self.due = max(step + 1, self.settled + math.ceil(payback - 1e-9))

    def check(self, step: int) -> Trigger | None:
        """The ``recheck`` trigger when a refusal is due at ``step``, else None."""
        if self.due is None or self.settled is None or step < self.due:
            return None
        self.due = None
        age = step - self.settled
        return Trigger(
            "recheck",
            age / self.gamma,
            detail=f"a refused gain given up for {age} steps since the last trigger: H = {age}/gamma",
        )

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state."""
        return {"settled": self.settled, "due": self.due, "gamma": self.gamma}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.settled, self.due, self.gamma = state["settled"], state["due"], float(state["gamma"])


def smallest_horizon(triggers: list[Trigger] | tuple[Trigger, ...]) -> float:
    """With several triggers, the smallest H_x decides (the paper's rule), except that a due
    ``recheck`` keeps its own when longer: the gain given up has paid for the move already,
    whatever the other signals do next."""
    require(len(triggers) > 0, "triggers", "need at least one trigger to take a horizon")
    crossings = [t.horizon for t in triggers if t.kind != "recheck"]
    smallest = min(crossings) if crossings else 0.0
    return max([smallest, *(t.horizon for t in triggers if t.kind == "recheck")])


def bounded(trigger: Trigger, steps_left: int | None, relaunched: bool = False) -> Trigger:
    """``trigger`` with its horizon set by what is known of the remaining run.

    No horizon reaches past the run's last step (``steps_left``: steps still to run, None when
    the run has no step limit). After a relaunch the pool is the one the job was launched on
    for the rest of the run, not a fluctuation of the supply seen before: a pool trigger's
    horizon is then the steps left.
    """
    horizon, why = trigger.horizon, ""
    if relaunched and trigger.kind in ("pool", "revocation") and steps_left is not None:
        horizon, why = float(steps_left), f"relaunched on this pool: H = {steps_left} steps left"
    elif steps_left is not None and horizon > steps_left:
        horizon, why = float(max(steps_left, 1)), f"H capped at the {steps_left} steps left"
    if not why:
        return trigger
    detail = f"{trigger.detail}; {why}" if trigger.detail else why
    return Trigger(trigger.kind, horizon, trigger.urgent, detail)
