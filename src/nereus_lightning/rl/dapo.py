"""DAPO's two rollout-side rules: overlong reward shaping and dynamic sampling (filtered groups).

Overlong shaping (verl's ``reward_model.overlong_buffer``) lowers the score of a response that runs
into the last ``len`` tokens of the generation budget, linearly down to ``-penalty_factor`` at the
budget. Dynamic sampling (verl's ``algorithm.filter_groups``) keeps only the groups (the samples of
one prompt) whose scores differ, since a group of equal scores has zero group-relative advantage
and teaches nothing; the step generates further rounds until it has a full batch of such groups.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from nereus_lightning.rl.reward_function import RewardResult
from nereus_lightning.spec.errors import require


@dataclass(frozen=True)
class OverlongBuffer:
    """``len`` tokens before the budget where the penalty ramps from 0 to ``-penalty_factor`` (0: off)."""

    len: int = 0
    penalty_factor: float = 1.0

    @classmethod
    def of(cls, values: Mapping[str, Any] | None) -> OverlongBuffer:
        """From the config's mapping (verl's keys; ``enable: false`` turns it off)."""
        values = dict(values or {})
        if not values.pop("enable", True):
            return cls()
        unknown = set(values) - {"len", "penalty_factor", "log"}
        require(
            not unknown,
            "algorithm.overlong_buffer",
            f"unknown keys {sorted(unknown)}: use len, penalty_factor",
        )
        buffer = cls(int(values.get("len", 0)), float(values.get("penalty_factor", 1.0)))
        require(buffer.len >= 0, "algorithm.overlong_buffer.len", f"must be >= 0, got {buffer.len}")
        require(
            buffer.penalty_factor >= 0,
            "algorithm.overlong_buffer.penalty_factor",
            f"must be >= 0, got {buffer.penalty_factor}",
        )
        return buffer

    def penalty(self, lengths: Tensor, max_new: int) -> Tensor:
        """Each response's score change: ``min(0, -(length - (max_new - len)) / len * penalty_factor)``."""
        if self.len == 0:
            return torch.zeros_like(lengths, dtype=torch.float32)
        require(
            self.len < max_new,
            "algorithm.overlong_buffer.len",
            f"{self.len} leaves no room in a generation budget of {max_new} tokens; make it smaller",
        )
        exceed = lengths.float() - (max_new - self.len)
        return (-exceed / self.len * self.penalty_factor).clamp(max=0.0)


@dataclass(frozen=True)
class FilterGroups:
    """Dynamic sampling: keep groups whose scores differ, in at most ``max_num_gen_batches`` rounds.

    ``metric``: what must differ within a group: ``score`` (the reward), or a value the reward function
    returns beside it (verl's ``acc``).
    """

    enable: bool = False
    max_num_gen_batches: int = 10
    metric: str = "score"

    @classmethod
    def of(cls, values: Mapping[str, Any] | None) -> FilterGroups:
        """From the config's mapping (verl's keys)."""
        values = dict(values or {})
        unknown = set(values) - {"enable", "max_num_gen_batches", "metric"}
        require(
            not unknown,
            "algorithm.filter_groups",
            f"unknown keys {sorted(unknown)}: use enable, max_num_gen_batches, metric",
        )
        rule = cls(
            bool(values.get("enable", False)),
            int(values.get("max_num_gen_batches", 10)),
            str(values.get("metric") or "score"),
        )
        require(
            rule.max_num_gen_batches >= 1,
            "algorithm.filter_groups.max_num_gen_batches",
            f"must be >= 1, got {rule.max_num_gen_batches}",
        )
        return rule

    def signal(self, results: Sequence[RewardResult]) -> list[float]:
        """Each sample's value of ``metric``; refuses a reward function that does not return it."""
        if self.metric == "score":
            return [r.score for r in results]
        missing = next((r for r in results if self.metric not in r.metrics), None)
        require(
            missing is None,
            "algorithm.filter_groups.metric",
            f"the reward function returned no {self.metric!r} (it returned "
            f"{sorted(missing.metrics) if missing else []} beside the score); return it in its dict, or use "
            "metric=score",
        )
        return [r.metrics[self.metric] for r in results]


def varied_groups(scores: Sequence[float], group_size: int) -> list[bool]:
    """Per group of ``group_size`` adjacent samples: whether its scores are not all equal."""
    groups = [scores[i : i + group_size] for i in range(0, len(scores), group_size)]
    return [max(g) > min(g) for g in groups]


def expected_rounds(seen: Sequence[float], window: int = 10) -> float:
    """Generation rounds a step is expected to take: the mean of the last ``window`` seen (1 before any)."""
    recent = list(seen)[-window:]
    return max(1.0, sum(recent) / len(recent)) if recent else 1.0
