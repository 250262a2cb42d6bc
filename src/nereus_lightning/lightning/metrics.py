"""Aggregated run metrics (torchmetrics): running reward mean, windowed means, maxima.

Every rank holds the same per-step values (the RL step's metrics are global), so the metrics
never sync across processes.
"""

from __future__ import annotations

from collections import deque

import torch
import torchmetrics
from torch import nn


class RunMetrics(nn.Module):
    """Reward running mean over the run and over the last ``window`` steps, and the longest response."""

    def __init__(self, window: int = 10) -> None:
        super().__init__()
        self.reward = torchmetrics.MeanMetric(sync_on_compute=False)
        self.response_max = torchmetrics.MaxMetric(sync_on_compute=False)
        self.window: deque[float] = deque(maxlen=window)

    def update(self, stats: dict[str, float]) -> dict[str, float]:
        """Add one step's metrics; returns the aggregates under ``reward/...`` and ``response_length/...``."""
        score = float(stats["critic/score/mean"])
        self.reward.update(torch.tensor(score))
        self.response_max.update(torch.tensor(float(stats["response_length/max"])))
        self.window.append(score)
        return {
            "reward/running_mean": float(self.reward.compute()),
            f"reward/mean_last{self.window.maxlen}": sum(self.window) / len(self.window),
            "response_length/run_max": float(self.response_max.compute()),
        }
