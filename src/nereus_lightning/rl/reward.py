"""Rewards over token ids: from a Python function over texts, or from a reward model.

Both scorers share one signature, ``scorer(prompt_ids, prompt_mask, response_ids, response_mask)
-> Tensor[batch]``, so the RL loop does not care where the score comes from. :func:`make_scorer`
turns whatever the user passed into one.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

import torch
from torch import Tensor, nn

from nereus_lightning.models.pipeline import position_ids_from_mask
from nereus_lightning.rl.advantages import last_token_index
from nereus_lightning.spec.errors import NereusConfigError

RewardFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]


@runtime_checkable
class RewardScorer(Protocol):
    """Scores a batch of (prompt, response) token sequences, one float per sequence."""

    def __call__(
        self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
    ) -> Tensor:
        """One score per sequence, on the inputs' device."""
        ...


class FunctionReward:
    """A Python ``reward(prompts, responses) -> list[float]`` over decoded texts."""

    def __init__(self, fn: RewardFn, tokenizer: Any) -> None:
        self.fn = fn
        self.tokenizer = tokenizer

    def __call__(
        self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
    ) -> Tensor:
        """Decode prompts and responses (valid tokens only) and call the function."""
        prompts = [
            self.tokenizer.decode(ids[m.bool()].tolist())
            for ids, m in zip(prompt_ids, prompt_mask, strict=False)
        ]
        responses = [
            self.tokenizer.decode(ids[m.bool()].tolist())
            for ids, m in zip(response_ids, response_mask, strict=False)
        ]
        scores = list(self.fn(prompts, responses))
        if len(scores) != len(prompts):
            raise NereusConfigError(
                f"reward function returned {len(scores)} scores for {len(prompts)} responses"
            )
        return torch.tensor(scores, dtype=torch.float32, device=response_ids.device)


class ModelReward:
    """A reward model over the full token sequence.

    Accepts a module returning one score per sequence (``(B,)``), a sequence-classification head
    (``(B, 1)`` logits) or a token-level value head (``(B, T)`` / ``(B, T, 1)``, as verl's reward
    models; the score is read at the last valid token). Any callable taking ``input_ids`` and
    ``attention_mask`` keywords works; transformers models also get ``position_ids`` that skip
    the left padding.
    """

    def __init__(self, model: Callable[..., Any]) -> None:
        self.model = model

    @torch.no_grad()
    def __call__(
        self, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
    ) -> Tensor:
        """Run the model over ``prompt + response`` and return one score per sequence."""
        input_ids = torch.cat([prompt_ids, response_ids], dim=-1)
        mask = torch.cat([prompt_mask, response_mask], dim=-1)
        extra = {"position_ids": position_ids_from_mask(mask)} if hasattr(self.model, "config") else {}
        out = self.model(input_ids=input_ids, attention_mask=mask, **extra)
        scores = out.logits if hasattr(out, "logits") else out
        scores = scores.float()
        if scores.dim() == 3:
            scores = scores.squeeze(-1)
        if scores.dim() == 2 and scores.shape[-1] == 1:
            return scores[:, 0]
        if scores.dim() == 2:
            return scores.gather(-1, last_token_index(mask).unsqueeze(-1)).squeeze(-1)
        if scores.dim() == 1:
            return scores
        raise NereusConfigError(
            f"reward model returned shape {tuple(scores.shape)}; expected (B,), (B, 1), (B, T) or (B, T, 1)"
        )


def make_scorer(reward: Any, tokenizer: Any = None) -> RewardScorer:
    """Wrap ``reward`` (a module, a text function or a ready scorer) into a :class:`RewardScorer`."""
    if isinstance(reward, (FunctionReward, ModelReward)):
        return reward
    if isinstance(reward, nn.Module):
        return ModelReward(reward)
    if callable(reward):
        if tokenizer is None:
            raise NereusConfigError("reward: a text reward function needs a tokenizer to decode responses")
        return FunctionReward(reward, tokenizer)
    raise NereusConfigError(
        f"reward: {type(reward).__name__} is neither a reward model (nn.Module) nor a callable"
    )
