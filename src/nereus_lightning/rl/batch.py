"""`RolloutBatch`: one RL step's samples, and their deterministic partition over DP ranks.

Every sample carries its global index in the step (``sample_index``). A DP layout of degree
``dp`` gives rank ``r`` the contiguous block :func:`dp_slice` of the global order, so moving a
batch between two stages with different DP degrees is a pure function of the indices: gather the
pieces (in any order), :meth:`RolloutBatch.concat` sorts them by index, :meth:`RolloutBatch.shard`
cuts the new rank's block.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from nereus_lightning.engines.base import RolloutOutput
from nereus_lightning.spec.errors import require


def dp_slice(num_samples: int, dp: int, rank: int) -> slice:
    """The block of global sample positions DP rank ``rank`` of ``dp`` owns (sizes differ by <= 1)."""
    require(dp >= 1, "dp", f"must be >= 1, got {dp}")
    require(0 <= rank < dp, "rank", f"must be in [0, {dp}), got {rank}")
    base, extra = divmod(num_samples, dp)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def balanced_slice(tokens: Sequence[int], dp: int, rank: int) -> slice:
    """DP rank ``rank``'s contiguous block of samples with ``tokens`` each, the blocks' tokens near equal.

    Cut ``r`` falls at the sample boundary nearest ``r / dp`` of the total; every block keeps at
    least one sample while there are as many samples as ranks (as :func:`dp_slice`).
    """
    require(dp >= 1, "dp", f"must be >= 1, got {dp}")
    require(0 <= rank < dp, "rank", f"must be in [0, {dp}), got {rank}")
    n = len(tokens)
    prefix = list(itertools.accumulate(tokens, initial=0))
    cuts = [0]
    for r in range(1, dp):
        target = prefix[-1] * r / dp
        i = bisect.bisect_left(prefix, target)
        if i > 0 and target - prefix[i - 1] <= prefix[min(i, n)] - target:
            i -= 1
        low, high = cuts[-1] + (1 if n >= dp else 0), n - (dp - r if n >= dp else 0)
        cuts.append(min(max(i, low), high))
    cuts.append(n)
    return slice(cuts[rank], cuts[rank + 1])


@dataclass
class RolloutBatch(RolloutOutput):
    """Per-sample tensors of one step (a rollout plus what scoring adds); fields not computed yet are None.

    Shapes: ids and masks ``(B, P)`` / ``(B, R)``; per-token fields ``(B, R)``; ``scores``,
    ``baseline_scores``, ``sample_index``, ``group_index`` (the prompt a sample answers, for
    GRPO) and ``policy_version`` (of the weights that generated a sample) ``(B,)``.
    """

    prompt_ids: Tensor
    prompt_mask: Tensor
    response_ids: Tensor
    response_mask: Tensor
    sample_index: Tensor
    group_index: Tensor
    old_log_probs: Tensor | None = None
    ref_log_probs: Tensor | None = None
    rollout_log_probs: Tensor | None = None  # the rollout engine's own (vLLM), for the mismatch correction
    values: Tensor | None = None
    scores: Tensor | None = None
    baseline_scores: Tensor | None = None
    token_rewards: Tensor | None = None
    advantages: Tensor | None = None
    returns: Tensor | None = None

    def __post_init__(self) -> None:
        n = self.prompt_ids.shape[0]
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None:
                require(
                    value.shape[0] == n,
                    f"RolloutBatch.{f.name}",
                    f"has {value.shape[0]} rows, prompt_ids has {n}",
                )

    def __len__(self) -> int:
        return self.prompt_ids.shape[0]

    def need(self, name: str) -> Tensor:
        """The field ``name``, which the step must have computed by now (an error names it otherwise)."""
        value = getattr(self, name)
        if value is None:
            raise ValueError(f"RolloutBatch.{name} is not computed yet; the stage that fills it did not run")
        return value

    def tensors(self) -> dict[str, Tensor]:
        """The fields that are set, by name."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}

    def select(self, rows: Tensor | Sequence[int] | slice) -> RolloutBatch:
        """The samples at local ``rows`` (a slice, or row positions)."""
        if not isinstance(rows, slice):
            rows = torch.as_tensor(rows, dtype=torch.long, device=self.prompt_ids.device)
        return replace(self, **{name: t[rows] for name, t in self.tensors().items()})

    def split(self, n: int) -> list[RolloutBatch]:
        """``n`` contiguous pieces (mini-batches), sizes differing by at most one."""
        require(1 <= n <= max(len(self), 1), "split", f"cannot split {len(self)} samples into {n} pieces")
        return [self.select(dp_slice(len(self), n, i)) for i in range(n)]

    def shard(self, dp: int, rank: int) -> RolloutBatch:
        """DP rank ``rank``'s block of this (global, index-sorted) batch."""
        return self.select(dp_slice(len(self), dp, rank))

    @staticmethod
    def concat(batches: Sequence[RolloutBatch]) -> RolloutBatch:
        """Join pieces and sort by ``sample_index``; responses are right-padded and prompts
        left-padded to a common width."""
        require(len(batches) > 0, "concat", "needs at least one batch")
        names = set(batches[0].tensors())
        for b in batches[1:]:
            require(
                set(b.tensors()) == names,
                "concat",
                f"pieces carry different fields: {sorted(names ^ set(b.tensors()))}",
            )
        prompt_width = max(b.prompt_ids.shape[-1] for b in batches)
        response_width = max(b.response_ids.shape[-1] for b in batches)
        joined = {}
        for name in names:
            parts = [_pad_to(getattr(b, name), name, prompt_width, response_width) for b in batches]
            joined[name] = torch.cat(parts, dim=0)
        order = torch.argsort(joined["sample_index"])
        return RolloutBatch(**{name: t[order] for name, t in joined.items()})

    @staticmethod
    def repartition(pieces: Sequence[RolloutBatch], dp: int) -> list[RolloutBatch]:
        """Re-cut the pieces of one step (any DP layout) into the blocks of a ``dp``-way layout."""
        whole = RolloutBatch.concat(pieces)
        return [whole.shard(dp, rank) for rank in range(dp)]


_PROMPT_FIELDS = ("prompt_ids", "prompt_mask")
_SCALAR_FIELDS = ("sample_index", "group_index", "scores", "baseline_scores", "policy_version")


def _pad_to(t: Tensor, name: str, prompt_width: int, response_width: int) -> Tensor:
    if name in _SCALAR_FIELDS:
        return t
    width = prompt_width if name in _PROMPT_FIELDS else response_width
    missing = width - t.shape[-1]
    if missing == 0:
        return t
    # pad ids carry no meaning under a zero mask; zeros keep every field's dtype
    fill = t.new_zeros((t.shape[0], missing))
    return torch.cat([fill, t], dim=-1) if name in _PROMPT_FIELDS else torch.cat([t, fill], dim=-1)
