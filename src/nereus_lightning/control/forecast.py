"""`LengthForecast`: the length signals extrapolated along their recent trend.

The monitor reports the lengths of the step that just finished, but a plan chosen now runs the
*next* step. In RL post-training response lengths drift steadily (hundreds of tokens over tens
of steps), so the last measurement systematically lags the step a plan will run: a plan sized
for it can miss the next step's memory cap or its best layout. With
``ControllerConfig.forecast_steps`` > 0 the controller plans for (and checks memory against) the
lengths that many steps ahead, extrapolated along the trend of the last ``window``
measurements (off by default: see ``ControllerConfig``). The trend is the minmod of the
step-to-step slopes (the smallest when they agree in sign, none when they disagree): a steady
drift is followed, but a level shift (a curriculum raising the length cap, one noisy step) is
not extrapolated onward, which a line fitted through both levels would do. The extrapolated
change is also clamped to ``clamp`` (relative); the drift triggers keep reading the measured
values, so the paper's trigger rules are unchanged.

No trend sees a jump coming (a curriculum raising the length cap at a step nobody announced).
The forecast keeps score of its own misses: every step whose p95 length came in more than
``clamp`` above the next-step forecast made for it is a *surprise*, and :meth:`LengthForecast.surprise`
reports how often they came and the largest step-to-step rise among them, so the controller can
price the risk of the next one (``control.candidates.Surprise``). Smaller misses are kept as
well (:attr:`LengthForecast.misses`): the risk that the next step comes in above its forecast by
as much as an earlier one did is priced the same way (``control.candidates.Shortfall``).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from nereus_lightning.control.signals import DRIFT_SIGNALS, StepSignals
from nereus_lightning.spec.errors import require

_P95 = DRIFT_SIGNALS.index("response_len_p95")


class LengthForecast:
    """The minmod trend of each length signal over the last ``window`` steps.

    Args:
        window: how many measurements the trend line is fitted to (>= 2).
        clamp: the largest relative change a forecast may apply to the last measurement.
    """

    def __init__(self, window: int = 3, clamp: float = 0.3) -> None:
        require(window >= 2, "controller.forecast_window", f"must be >= 2, got {window}")
        require(clamp >= 0, "controller.forecast_clamp", f"must be >= 0, got {clamp}")
        self.window = window
        self.clamp = clamp
        self.history: deque[tuple[int, tuple[float, ...]]] = deque(maxlen=window)
        self.scored = 0  # steps whose p95 was compared with the forecast made for it
        self.surprises: list[float] = []  # p95 over the step before's, where it beat the forecast by > clamp
        self.misses: list[float] = []  # p95 over its forecast, where it beat it by up to clamp

    def observe(self, signals: StepSignals) -> None:
        """Record one step's measured lengths (a repeated step index replaces the older entry) and
        score the next-step forecast that was made for it."""
        values = tuple(signals.value(n) for n in DRIFT_SIGNALS)
        if self.history and self.history[-1][0] >= signals.step:
            self.history.pop()
        elif self.history:
            last = self.history[-1][1][_P95]
            forecast = self.next_step()
            expected = last if forecast is None else forecast["response_len_p95"]
            self.scored += 1
            if last > 0 and signals.response_len_p95 > expected * (1 + self.clamp):
                self.surprises.append(signals.response_len_p95 / last)
            elif forecast is not None and signals.response_len_p95 > expected > 0:
                self.misses.append(signals.response_len_p95 / expected)
        self.history.append((signals.step, values))

    def surprise(self) -> tuple[float, float] | None:
        """``(rate, ratio)``: the share of scored steps that came in above the forecast by more than
        ``clamp`` (a jump the trend did not announce), and the largest rise of the p95 length over
        the step before among them; None while there was none."""
        if not self.surprises:
            return None
        return len(self.surprises) / self.scored, max(self.surprises)

    def ahead(self, steps: float = 1.0) -> dict[str, float] | None:
        """The lengths ``steps`` steps after the last observation along the minmod trend; None
        before two observations."""
        if len(self.history) < 2 or steps <= 0:
            return None
        return self._moved(steps, [_minmod(s) for s in self._slopes()])

    def over_horizon(self, horizon: float, points: int = 4) -> list[dict[str, float]]:
        """The lengths at ``points`` steps spread over the next ``horizon`` steps along the minmod
        trend (``horizon_offsets``); empty before two observations or while no length has a trend
        (then every step of the horizon runs at the last measurement)."""
        if len(self.history) < 2:
            return []
        slopes = [_minmod(s) for s in self._slopes()]
        if not any(slopes):
            return []
        return [self._moved(k, slopes) for k in horizon_offsets(horizon, points)]

    def next_step(self) -> dict[str, float] | None:
        """The next step's lengths on the safe side: moved on by the trend or by the last step's
        own change, whichever is larger (a rise that has just begun, or a level shift, may go on
        for one more step before the trend shows it); None before two observations."""
        if len(self.history) < 2:
            return None
        return self._moved(1.0, [max(_minmod(s), s[-1]) for s in self._slopes()])

    def _slopes(self) -> list[list[float]]:
        """Per length signal, its step-to-step slopes over the window, oldest first."""
        h = list(self.history)
        return [
            [(b[1][i] - a[1][i]) / (b[0] - a[0]) for a, b in zip(h, h[1:], strict=False)]
            for i in range(len(DRIFT_SIGNALS))
        ]

    def _moved(self, steps: float, slopes: list[float]) -> dict[str, float]:
        """The last measurement moved ``steps`` steps along ``slopes`` (clamped)."""
        out = {}
        for i, name in enumerate(DRIFT_SIGNALS):
            last = self.history[-1][1][i]
            value = last + slopes[i] * steps
            lo, hi = last * (1 - self.clamp), last * (1 + self.clamp)
            out[name] = min(max(value, lo), hi) if last > 0 else max(value, 0.0)
        out["response_len"] = max(out["response_len"], 1e-6)
        out["response_len_p95"] = max(out["response_len_p95"], out["response_len"])
        return out

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state."""
        return {
            "window": self.window,
            "clamp": self.clamp,
            "history": [[s, list(v)] for s, v in self.history],
            "scored": self.scored,
            "surprises": list(self.surprises),
            "misses": list(self.misses),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.window, self.clamp = int(state["window"]), float(state["clamp"])
        self.history = deque(
            ((int(s), tuple(float(x) for x in v)) for s, v in state["history"]), maxlen=self.window
        )
        self.scored = int(state.get("scored", 0))  # absent in checkpoints of older versions
        self.surprises = [float(x) for x in state.get("surprises", ())]
        self.misses = [float(x) for x in state.get("misses", ())]


def horizon_offsets(horizon: float, points: int) -> tuple[float, ...]:
    """``points`` step offsets whose mean stands for the mean over the steps 1 .. ``horizon``
    after the last measurement: the midpoints of equal parts of [0.5, horizon + 0.5]."""
    span = max(horizon, 1.0)
    return tuple(0.5 + span * (i + 0.5) / points for i in range(points))


def _minmod(slopes: list[float]) -> float:
    """The smallest of ``slopes`` in magnitude when all share a sign, else 0."""
    if all(x > 0 for x in slopes) or all(x < 0 for x in slopes):
        return min(slopes, key=abs)
    return 0.0
