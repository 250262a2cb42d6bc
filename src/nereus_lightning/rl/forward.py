"""Forward passes the RL stages need: response log-probs (actor, reference) and values (critic).

Inputs are left-padded prompts followed by right-padded responses, as the rollout engine returns
them; position ids skip the left padding exactly as transformers ``generate`` does, so scores
match the distribution the responses were sampled from.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from nereus_lightning.models.pipeline import position_ids_from_mask
from nereus_lightning.rl.losses import entropy_from_logits, token_log_probs


def response_span(prompt_width: int, response_width: int) -> slice:
    """Positions whose outputs score the response tokens: position ``t`` predicts token ``t + 1``.

    Indexes per-position logits or values ``[B, P + R, ...]`` as well as per-target token
    log-probs ``[B, P + R - 1]`` (entry ``t`` is the log-prob of token ``t + 1``).
    """
    return slice(prompt_width - 1, prompt_width - 1 + response_width)


def _joined(
    prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
) -> tuple[Tensor, Tensor]:
    return torch.cat([prompt_ids, response_ids], dim=-1), torch.cat([prompt_mask, response_mask], dim=-1)


def response_log_probs(
    model: nn.Module,
    prompt_ids: Tensor,
    prompt_mask: Tensor,
    response_ids: Tensor,
    response_mask: Tensor,
    temperature: float = 1.0,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-prob of each response token under ``model`` (logits divided by ``temperature``).

    Returns:
        ``(log_probs, entropy)``, each ``(batch, response_len)``; entropy is None unless asked for.
    """
    input_ids, mask = _joined(prompt_ids, prompt_mask, response_ids, response_mask)
    logits = model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
    response_logits = (
        logits[:, response_span(prompt_ids.shape[-1], response_ids.shape[-1])].float() / temperature
    )
    log_probs = token_log_probs(response_logits, response_ids)
    entropy = entropy_from_logits(response_logits) if with_entropy else None
    return log_probs, entropy


def response_values(
    critic: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, response_ids: Tensor, response_mask: Tensor
) -> Tensor:
    """Critic value of the state before each response token, ``(batch, response_len)``.

    ``critic`` returns per-token values as ``.logits`` of shape ``(B, T, 1)`` (a transformers
    token-classification model with one label, as verl's critic) or ``(B, T)``.
    """
    input_ids, mask = _joined(prompt_ids, prompt_mask, response_ids, response_mask)
    values = critic(
        input_ids=input_ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)
    ).logits
    if values.dim() == 3:
        values = values.squeeze(-1)
    return values[:, response_span(prompt_ids.shape[-1], response_ids.shape[-1])].float()
