"""PPO-family losses: clipped policy loss, clipped value loss, KL estimators, entropy.

All functions take per-token tensors of shape ``(batch, response_len)`` and a ``mask`` of the same
shape (1 for response tokens that count, 0 for padding) and return ``(loss, metrics)`` where
``metrics`` maps verl's metric names to detached 0-dim tensors (no host sync in the hot path).
Losses accept a ``normalizer`` (see :func:`agg_loss`) for micro-batched / data-parallel updates.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from nereus_lightning.spec.errors import NereusConfigError, require

LossAgg = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)

# verl's names, plus the k1/k2/k3 names of Schulman's note on KL approximations.
KL_ESTIMATORS: dict[str, str] = {
    "kl": "k1",
    "k1": "k1",
    "abs": "abs",
    "mse": "k2",
    "k2": "k2",
    "low_var_kl": "k3",
    "k3": "k3",
}


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over the entries where ``mask`` is 1 (over ``dim``, or all of them)."""
    mask = mask.to(x.dtype)
    if dim is None:
        return (x * mask).sum() / mask.sum().clamp_min(1.0)
    return (x * mask).sum(dim) / mask.sum(dim).clamp_min(1.0)


def agg_loss(
    loss_mat: Tensor, mask: Tensor, mode: str = "token-mean", normalizer: float | Tensor | None = None
) -> Tensor:
    """Reduce a per-token loss to a scalar (verl's ``loss_agg_mode``).

    ``token-mean`` averages over all valid tokens of the batch; ``seq-mean-token-mean`` averages
    each sequence over its tokens, then over sequences; ``seq-mean-token-sum`` sums each sequence,
    then averages over sequences; ``seq-mean-token-sum-norm`` (Dr. GRPO) sums each sequence and
    divides by the number of sequences times a constant length (by default the batch's width).

    Args:
        normalizer: the denominator to use instead of this batch's own (:func:`loss_normalizer` of
            the whole global mini-batch). With it, the losses (and gradients) of the micro-batches
            of all DP ranks *sum* to the global mini-batch loss, whatever the DP degree and
            micro-batch size: this is what keeps an update layout-independent.
    """
    mask = mask.to(loss_mat.dtype)
    count = loss_normalizer(mask, mode).clamp_min(1.0) if normalizer is None else normalizer
    if mode == "seq-mean-token-mean":
        seq_has_tokens = (mask.sum(-1) > 0).to(loss_mat.dtype)
        return (masked_mean(loss_mat, mask, dim=-1) * seq_has_tokens).sum() / count
    return (loss_mat * mask).sum() / count


def check_loss_agg(mode: str) -> None:
    """Refuse a loss aggregation mode that does not exist, naming the ones that do."""
    require(
        mode in LOSS_AGG_MODES,
        "algorithm.loss_agg_mode",
        f"unknown mode {mode!r}; choose one of {', '.join(LOSS_AGG_MODES)}",
    )


def loss_normalizer(mask: Tensor, mode: str, length: float | None = None) -> Tensor:
    """The denominator of :func:`agg_loss` over ``mask``'s batch: its valid tokens (``token-mean``), its
    non-empty sequences (``seq-mean-*``), or those times ``length`` (``seq-mean-token-sum-norm``;
    None: ``mask``'s width)."""
    check_loss_agg(mode)
    mask = mask.float()
    if mode == "token-mean":
        return mask.sum()
    sequences = (mask.sum(-1) > 0).sum().to(mask.dtype)
    if mode == "seq-mean-token-sum-norm":
        return sequences * (mask.shape[-1] if length is None else length)
    return sequences


def policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 0.2,
    clip_eps_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    normalizer: float | Tensor | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO clipped surrogate loss; ``weights`` (per token, no gradient) scale it (the rollout correction).

    ``ratio = exp(log_probs - old_log_probs)``; per token the loss is
    ``max(-A * ratio, -A * clamp(ratio, 1 - clip_eps, 1 + clip_eps_high))``. With ``dual_clip = c``
    (> 1) tokens with negative advantage are additionally capped at ``-A * c``.

    Returns:
        The aggregated loss and ``actor/pg_loss``, ``actor/pg_clipfrac``, ``actor/ppo_kl`` (the
        approximate KL ``mean(old - new)``) and, with dual clip, ``actor/pg_clipfrac_lower``.
    """
    require(clip_eps >= 0, "actor.clip_ratio", f"must be >= 0, got {clip_eps}")
    high = clip_eps if clip_eps_high is None else clip_eps_high
    log_ratio = log_probs - old_log_probs
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    loss_mat = torch.maximum(unclipped, clipped)
    metrics = {
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).to(log_probs.dtype), mask).detach(),
        "actor/ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }
    if dual_clip is not None:
        require(dual_clip > 1.0, "actor.clip_ratio_c", f"must be > 1, got {dual_clip}")
        capped = torch.minimum(loss_mat, -advantages * dual_clip)
        lower = (advantages < 0) & (capped < loss_mat)
        loss_mat = torch.where(advantages < 0, capped, loss_mat)
        metrics["actor/pg_clipfrac_lower"] = masked_mean(lower.to(log_probs.dtype), mask).detach()
    if weights is not None:
        loss_mat = loss_mat * weights
    loss = agg_loss(loss_mat, mask, agg, normalizer)
    metrics["actor/pg_loss"] = loss.detach()
    return loss, metrics


def gspo_policy_loss(
    log_probs: Tensor,
    old_log_probs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_eps: float = 3e-4,
    clip_eps_high: float | None = 4e-4,
    dual_clip: float | None = None,
    agg: str = "token-mean",
    normalizer: float | Tensor | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """GSPO: the clipped surrogate with one importance ratio per sequence, the geometric mean of its tokens'.

    Each token carries the sequence's ratio ``exp(mean_t(log p - log p_old))`` as its value and its
    own log-prob's gradient (``log p - sg(log p)`` added), clipped to ``[1 - clip_eps, 1 +
    clip_eps_high]``; ``dual_clip`` does not apply. Metrics as :func:`policy_loss`.
    """
    del dual_clip  # a sequence-level ratio has no dual clip (as GSPO's paper and verl)
    high = clip_eps if clip_eps_high is None else clip_eps_high
    m = mask.to(log_probs.dtype)
    log_ratio = log_probs - old_log_probs
    seq_log_ratio = (log_ratio * m).sum(-1) / m.sum(-1).clamp_min(1.0)
    token_log_ratio = log_probs - log_probs.detach() + seq_log_ratio.detach().unsqueeze(-1)
    ratio = torch.exp(torch.clamp(token_log_ratio, max=10.0))
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_eps, 1.0 + high)
    loss_mat = torch.maximum(unclipped, clipped)
    loss = agg_loss(loss_mat if weights is None else loss_mat * weights, mask, agg, normalizer)
    return loss, {
        "actor/pg_loss": loss.detach(),
        "actor/pg_clipfrac": masked_mean((clipped > unclipped).to(log_probs.dtype), mask).detach(),
        "actor/ppo_kl": masked_mean(-log_ratio, mask).detach(),
    }


#: ``(log_probs, old_log_probs, advantages, mask, clip_eps, clip_eps_high, dual_clip, agg, normalizer)``
#: -> ``(loss, metrics)``; metrics include ``actor/pg_loss``, ``actor/pg_clipfrac`` and ``actor/ppo_kl``.
#: With the rollout correction on it is also given ``weights=`` (per token, to scale the loss by).
PolicyLoss = Callable[..., tuple[Tensor, dict[str, Tensor]]]
POLICY_LOSSES: dict[str, PolicyLoss] = {"vanilla": policy_loss, "gspo": gspo_policy_loss}


def register_policy_loss(name: str, fn: PolicyLoss) -> PolicyLoss:
    """Make ``fn`` selectable as ``algorithm.policy_loss=name`` (verl's ``register_policy_loss``)."""
    existing = POLICY_LOSSES.get(name)
    if existing is not None and existing is not fn:
        same = (existing.__module__, existing.__qualname__) == (fn.__module__, fn.__qualname__)
        require(same, "algorithm.policy_loss", f"{name!r} is registered already; choose another name")
    POLICY_LOSSES[name] = fn
    return fn


def policy_loss_of(name: str) -> PolicyLoss:
    """The policy loss registered as ``name``."""
    require(
        name in POLICY_LOSSES,
        "algorithm.policy_loss",
        f"{name!r} is not one of {', '.join(POLICY_LOSSES)} (or register one: "
        "nereus_lightning.rl.losses.register_policy_loss)",
    )
    return POLICY_LOSSES[name]


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    clip_eps: float = 0.5,
    agg: str = "token-mean",
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Clipped value loss: ``0.5 * max((v - R)^2, (old + clamp(v - old, -eps, eps) - R)^2)``.

    Returns:
        The aggregated loss and ``critic/vf_loss``, ``critic/vf_clipfrac``.
    """
    require(clip_eps >= 0, "critic.cliprange_value", f"must be >= 0, got {clip_eps}")
    clipped_values = old_values + torch.clamp(values - old_values, -clip_eps, clip_eps)
    unclipped_err = (values - returns) ** 2
    clipped_err = (clipped_values - returns) ** 2
    loss = 0.5 * agg_loss(torch.maximum(unclipped_err, clipped_err), mask, agg, normalizer)
    metrics = {
        "critic/vf_loss": loss.detach(),
        "critic/vf_clipfrac": masked_mean((clipped_err > unclipped_err).to(values.dtype), mask).detach(),
    }
    return loss, metrics


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, kind: str = "low_var_kl") -> Tensor:
    """Per-token estimate of KL(policy || reference) from the sampled tokens' log-probs.

    ``k1``/``kl``: ``log p - log q``; ``abs``: ``|log p - log q|``; ``k2``/``mse``:
    ``0.5 (log p - log q)^2``; ``k3``/``low_var_kl``: ``q/p - log(q/p) - 1`` (non-negative, low
    variance; clamped to [-10, 10] for stability, as verl does).
    """
    if kind not in KL_ESTIMATORS:
        raise NereusConfigError(
            f"kl_penalty: unknown estimator {kind!r}; choose one of {', '.join(KL_ESTIMATORS)}"
        )
    diff = log_probs - ref_log_probs
    estimator = KL_ESTIMATORS[kind]
    if estimator == "k1":
        return diff
    if estimator == "abs":
        return diff.abs()
    if estimator == "k2":
        return 0.5 * diff.square()
    log_ratio = torch.clamp(-diff, -20.0, 20.0)  # log(q/p), clamped so exp cannot overflow
    return torch.clamp(torch.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)


def kl_loss(
    log_probs: Tensor,
    ref_log_probs: Tensor,
    mask: Tensor,
    kind: str = "low_var_kl",
    agg: str = "token-mean",
    normalizer: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """KL to the reference policy as a loss term (GRPO style); returns ``actor/kl_loss``, ``actor/kl``."""
    loss = agg_loss(kl_penalty(log_probs, ref_log_probs, kind), mask, agg, normalizer)
    return loss, {"actor/kl_loss": loss.detach(), "actor/kl": loss.detach()}


def token_log_probs(logits: Tensor, labels: Tensor) -> Tensor:
    """Log-probability of each label under ``logits`` (``(..., vocab)`` -> ``(...)``), in fp32."""
    return torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.unsqueeze(-1)).squeeze(-1)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Per-token entropy of the categorical distribution of ``logits`` (``(..., vocab)`` -> ``(...)``)."""
    logits = logits.float()
    log_p = torch.log_softmax(logits, dim=-1)
    return -(log_p.exp() * log_p).sum(-1)


def entropy_loss(
    entropy: Tensor, mask: Tensor, agg: str = "token-mean", normalizer: float | Tensor | None = None
) -> tuple[Tensor, dict[str, Tensor]]:
    """Aggregated entropy (subtract ``coef * loss`` to use it as a bonus); returns ``actor/entropy``."""
    loss = agg_loss(entropy, mask, agg, normalizer)
    return loss, {"actor/entropy": loss.detach()}
