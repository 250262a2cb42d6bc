"""`LengthForecast`: the length signals extrapolated along their recent trend.

The monitor reports the lengths of the step that just finished, but a plan chosen now runs the
*next* step. In RL post-training response lengths drift steadily (hundreds of tokens over tens
of steps), so the last measurement systematically lags the step a plan will run: a plan sized
for it can miss the next step's memory cap or its best layout. With
``ControllerConfig.forecast_steps`` > 0 the controller plans for (and checks memory against) the
lengths that many steps ahead, extrapolated by a least-squares line through the last ``window``
measurements (off by default: see ``ControllerConfig``). The extrapolated change is clamped to ``clamp``
(relative) so one noisy step cannot swing the plan; the drift triggers keep reading the measured
values, so the paper's trigger rules are unchanged.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from nereus_lightning.control.signals import DRIFT_SIGNALS, StepSignals
from nereus_lightning.spec.errors import require


class LengthForecast:
    """Least-squares trend of each length signal over the last ``window`` steps.

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

    def observe(self, signals: StepSignals) -> None:
        """Record one step's measured lengths (a repeated step index replaces the older entry)."""
        values = tuple(signals.value(n) for n in DRIFT_SIGNALS)
        if self.history and self.history[-1][0] >= signals.step:
            self.history.pop()
        self.history.append((signals.step, values))

    def ahead(self, steps: float = 1.0) -> dict[str, float] | None:
        """The lengths ``steps`` steps after the last observation; None before two observations."""
        if len(self.history) < 2 or steps <= 0:
            return None
        xs = [float(s) for s, _ in self.history]
        mean_x = sum(xs) / len(xs)
        var = sum((x - mean_x) ** 2 for x in xs)
        if var <= 0:
            return None
        out = {}
        for i, name in enumerate(DRIFT_SIGNALS):
            ys = [v[i] for _, v in self.history]
            mean_y = sum(ys) / len(ys)
            slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys, strict=True)) / var
            last = ys[-1]
            value = last + slope * steps
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
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output."""
        self.window, self.clamp = int(state["window"]), float(state["clamp"])
        self.history = deque(
            ((int(s), tuple(float(x) for x in v)) for s, v in state["history"]), maxlen=self.window
        )
