"""Advantage estimators: GAE (PPO), GRPO, RLOO, REINFORCE++ (with and without a group baseline), ReMax.

Tensors are per token, ``(batch, response_len)``, with a ``mask`` that is 1 on response tokens
that count. Padding may sit on either side (or in between): masked positions are skipped, so a
token's "next" token is the next *valid* one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from nereus_lightning.rl.losses import kl_penalty, masked_mean
from nereus_lightning.spec.errors import require


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True) -> Tensor:
    """Variance of ``x`` over the masked entries (Bessel-corrected unless ``unbiased=False``)."""
    mask = mask.to(x.dtype)
    mean = masked_mean(x, mask)
    count = mask.sum()
    var = ((x - mean) ** 2 * mask).sum() / count.clamp_min(1.0)
    if unbiased:
        var = var * count / (count - 1).clamp_min(1.0)
    return var


def masked_whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Normalise the masked entries of ``x`` to unit variance (and zero mean unless ``shift_mean=False``)."""
    mean = masked_mean(x, mask)
    whitened = (x - mean) * torch.rsqrt(masked_var(x, mask) + eps)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask.to(x.dtype)


def last_token_index(mask: Tensor) -> Tensor:
    """Index of the last valid token of each row (0 for an all-zero row)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(mask.bool(), positions, torch.zeros_like(positions)).amax(-1)


def scores_to_token_rewards(scores: Tensor, mask: Tensor) -> Tensor:
    """Per-token rewards with each sequence's scalar score on its last valid token, zero elsewhere."""
    rewards = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    rewards.scatter_(-1, last_token_index(mask).unsqueeze(-1), scores.unsqueeze(-1))
    return rewards * mask.to(scores.dtype)


def apply_kl_penalty(
    token_rewards: Tensor,
    log_probs: Tensor,
    ref_log_probs: Tensor,
    mask: Tensor,
    kl_coef: float,
    kind: str = "kl",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Subtract ``kl_coef * KL`` per token from the rewards (PPO's in-reward KL penalty).

    Returns:
        The penalised rewards and ``actor/reward_kl_penalty`` (mean KL), ``actor/kl`` (same),
        ``actor/reward_kl_penalty_coeff``.
    """
    kl = kl_penalty(log_probs, ref_log_probs, kind) * mask.to(log_probs.dtype)
    mean_kl = masked_mean(kl, mask).detach()
    metrics = {
        "actor/reward_kl_penalty": mean_kl,
        "actor/kl": mean_kl,
        "actor/reward_kl_penalty_coeff": torch.tensor(float(kl_coef)),
    }
    return token_rewards - kl_coef * kl, metrics


def gae_advantages(
    token_rewards: Tensor,
    values: Tensor,
    mask: Tensor,
    gamma: float = 1.0,
    lam: float = 1.0,
    whiten: bool = True,
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation over the valid tokens of each response.

    ``delta_t = r_t + gamma * V_next - V_t`` and ``A_t = delta_t + gamma * lam * A_next``, where
    "next" is the next valid token (``V = A = 0`` past the last one).

    Returns:
        ``(advantages, returns)`` with ``returns = A + V`` (taken before whitening) and the
        advantages whitened over the batch when ``whiten``; both are zero on masked positions.
    """
    m = mask.to(values.dtype)
    next_value = torch.zeros_like(values[:, 0])
    next_adv = torch.zeros_like(values[:, 0])
    advantages = torch.zeros_like(values)
    for t in reversed(range(values.shape[-1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]
        adv = delta + gamma * lam * next_adv
        advantages[:, t] = adv * m[:, t]
        next_value = torch.where(m[:, t] > 0, values[:, t], next_value)
        next_adv = torch.where(m[:, t] > 0, adv, next_adv)
    returns = (advantages + values) * m
    if whiten:
        advantages = masked_whiten(advantages, m)
    return advantages, returns


def _group_ids(groups: Tensor | Sequence[int], n: int, device: torch.device) -> Tensor:
    ids = torch.as_tensor(groups, device=device).long().reshape(-1)
    require(ids.numel() == n, "group_ids", f"expected one group id per sample ({n}), got {ids.numel()}")
    return ids


@dataclass(frozen=True)
class Groups:
    """Per-sample statistics of the groups (the samples of one prompt) a batch's scores fall in."""

    size: Tensor  # samples in the sample's group
    mean: Tensor  # the group's mean score (0 for a group of one sample)
    std: Tensor  # the group's Bessel-corrected std (1 for a group of one sample)


def group_stats(scores: Tensor, group_ids: Tensor | Sequence[int]) -> Groups:
    """Each sample's group size, mean and std; a group is the samples with the same ``group_ids`` entry."""
    ids = _group_ids(group_ids, scores.shape[0], scores.device)
    _, inverse, counts = torch.unique(ids, return_inverse=True, return_counts=True)
    sums = torch.zeros(counts.numel(), dtype=scores.dtype, device=scores.device).index_add_(
        0, inverse, scores
    )
    counts_f = counts.to(scores.dtype)
    means = sums / counts_f
    sq = torch.zeros_like(means).index_add_(0, inverse, (scores - means[inverse]) ** 2)
    stds = torch.sqrt(sq / (counts_f - 1).clamp_min(1.0))
    singleton = counts == 1
    means = torch.where(singleton, torch.zeros_like(means), means)
    stds = torch.where(singleton, torch.ones_like(stds), stds)
    return Groups(counts_f[inverse], means[inverse], stds[inverse])


def _per_token(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """A per-sequence advantage broadcast over its valid tokens, as ``(advantages, returns)``."""
    advantages = values.unsqueeze(-1) * mask.to(values.dtype)
    return advantages, advantages.clone()


def grpo_advantages(
    scores: Tensor,
    mask: Tensor,
    group_ids: Tensor | Sequence[int],
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[Tensor, Tensor]:
    """GRPO: each sequence's score minus its group's mean, divided by the group's std + eps.

    A group of one sample gets mean 0 and std 1 (its advantage is its score). With
    ``norm_by_std=False`` only the mean is removed (Dr. GRPO).

    Returns:
        ``(advantages, returns)``, both the normalised score broadcast over the valid tokens.
    """
    g = group_stats(scores, group_ids)
    centred = scores - g.mean
    return _per_token(centred / (g.std + eps) if norm_by_std else centred, mask)


def rloo_advantages(scores: Tensor, mask: Tensor, group_ids: Tensor | Sequence[int]) -> tuple[Tensor, Tensor]:
    """RLOO: each sequence's score minus the mean of the other samples of its prompt (leave one out).

    A group of one sample keeps its score (no other sample to compare with), as verl.
    """
    g = group_stats(scores, group_ids)
    n = g.size
    others = torch.where(n > 1, (g.mean * n - scores) / (n - 1).clamp_min(1.0), torch.zeros_like(scores))
    return _per_token(scores - others, mask)


def reinforce_plus_plus_advantages(
    token_rewards: Tensor, mask: Tensor, gamma: float = 1.0
) -> tuple[Tensor, Tensor]:
    """REINFORCE++: the discounted return-to-go of each token, whitened over the whole batch.

    Returns:
        ``(advantages, returns)``; ``returns`` is the return-to-go before whitening.
    """
    returns = returns_to_go(token_rewards, mask, gamma)
    return masked_whiten(returns, mask), returns


def reinforce_plus_plus_baseline_advantages(
    scores: Tensor, mask: Tensor, group_ids: Tensor | Sequence[int]
) -> tuple[Tensor, Tensor]:
    """REINFORCE++ with a baseline: the score minus its group's mean, whitened over the batch's tokens."""
    centred, _ = _per_token(scores - group_stats(scores, group_ids).mean, mask)
    advantages = masked_whiten(centred, mask)
    return advantages, advantages.clone()


def returns_to_go(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """Discounted sum of the rewards from each valid token to the end of its response."""
    m = mask.to(token_rewards.dtype)
    running = torch.zeros_like(token_rewards[:, 0])
    returns = torch.zeros_like(token_rewards)
    for t in reversed(range(token_rewards.shape[-1])):
        updated = token_rewards[:, t] + gamma * running
        returns[:, t] = updated * m[:, t]
        running = torch.where(m[:, t] > 0, updated, running)
    return returns


def remax_advantages(token_rewards: Tensor, baseline_scores: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """ReMax: return-to-go of the sampled response minus the greedy response's score.

    Returns:
        ``(advantages, returns)``; ``returns`` is the undiscounted return-to-go per valid token.
    """
    returns = returns_to_go(token_rewards, mask)
    advantages = (returns - baseline_scores.unsqueeze(-1)) * mask.to(token_rewards.dtype)
    return advantages, returns
