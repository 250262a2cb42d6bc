"""A step's generated and scored samples, and how dynamic sampling's rounds combine into one batch."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from nereus_lightning.rl.data import Prompt
from nereus_lightning.rl.reward_function import RewardResult


@dataclass(frozen=True)
class Generated:
    """What the generation model-stages return: per sample its response, and what the engine reports."""

    responses: list[list[int]]
    greedy: list[list[int]] | None  # the greedy baseline's responses (ReMax)
    versions: Tensor | None  # the policy version that generated each sample
    log_probs: list[list[float]] | None  # the engine's log-prob of each response token (vLLM)


@dataclass
class Rollout:
    """Per sample (the samples of a prompt adjacent): its prompt, response, reward and policy version."""

    samples: list[Prompt]
    responses: list[list[int]]
    results: list[RewardResult]
    greedy_results: list[RewardResult] | None = None  # the greedy baseline's rewards (ReMax)
    versions: Tensor | None = None
    log_probs: list[list[float]] | None = None  # the rollout engine's token log-probs (vLLM)
    metrics: dict[str, float] = field(default_factory=dict)

    def scores(self, device: torch.device, greedy: bool = False) -> Tensor:
        """The rewards (or the greedy baseline's) as a float32 tensor."""
        results = self.greedy_results if greedy else self.results
        assert results is not None
        return torch.tensor([r.score for r in results], dtype=torch.float32, device=device)

    def groups(self, size: int) -> list[Rollout]:
        """One rollout per group of ``size`` adjacent samples."""
        return [self._rows(range(lo, lo + size)) for lo in range(0, len(self.samples), size)]

    def _rows(self, rows: Sequence[int]) -> Rollout:
        return Rollout(
            [self.samples[i] for i in rows],
            [self.responses[i] for i in rows],
            [self.results[i] for i in rows],
            None if self.greedy_results is None else [self.greedy_results[i] for i in rows],
            None if self.versions is None else self.versions[list(rows)],
            None if self.log_probs is None else [self.log_probs[i] for i in rows],
        )

    @staticmethod
    def concat(parts: Sequence[Rollout]) -> Rollout:
        """The parts' samples one after another."""
        versions = [p.versions for p in parts]
        greedy = [p.greedy_results for p in parts]
        log_probs = [p.log_probs for p in parts]
        return Rollout(
            [s for p in parts for s in p.samples],
            [r for p in parts for r in p.responses],
            [r for p in parts for r in p.results],
            None if any(g is None for g in greedy) else [r for g in greedy for r in g or ()],
            None if any(v is None for v in versions) else torch.cat([v for v in versions if v is not None]),
            None if any(lp is None for lp in log_probs) else [r for lp in log_probs for r in lp or ()],
        )

    @staticmethod
    def of_groups(
        rounds: Sequence[Rollout], size: int, want: int, varied: Sequence[Sequence[bool]]
    ) -> Rollout:
        """``want`` groups from dynamic sampling's ``rounds``: those whose scores differ (``varied``) in
        the order generated; if too few, groups without signal fill the batch (counted in the metrics)."""
        groups = [
            (g, ok)
            for part, flags in zip(rounds, varied, strict=True)
            for g, ok in zip(part.groups(size), flags, strict=True)
        ]
        kept = [g for g, ok in groups if ok][:want]
        filler = [g for g, ok in groups if not ok][: want - len(kept)]
        out = Rollout.concat(kept + filler)
        out.metrics = {
            "train/num_gen_batches": float(len(rounds)),
            "train/num_filtered_groups": float(sum(not ok for _, ok in groups)),
            "train/num_filler_groups": float(len(filler)),
        }
        return out
