"""Per-row log-softmax statistics of vocabulary-sliced logits, and their gradient (torch reference)."""

from __future__ import annotations

import torch
from torch import Tensor


def row_stats(logits: Tensor, targets: Tensor, scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per row of ``logits`` [n, V], x = logits * scale: max m, sum exp(x-m), sum exp(x-m)(x-m), x[target]."""
    x = logits.float() * scale
    m = x.max(dim=-1).values if x.shape[-1] else x.new_zeros(x.shape[0])
    x = x - m.unsqueeze(-1)
    inside = (targets >= 0) & (targets < logits.shape[-1])
    t = x.gather(-1, targets.clamp(0, max(logits.shape[-1] - 1, 0)).unsqueeze(-1)).squeeze(-1)
    t = torch.where(inside, t + m, torch.zeros_like(t))
    x.exp_()  # in place: at most one fp32 copy of the chunk besides the product below
    s = x.sum(-1)
    e = (x * (logits.float() * scale - m.unsqueeze(-1))).sum(-1)
    return m, s, e, t


def combine_stats(
    m: Tensor, s: Tensor, e: Tensor, t: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(logp, entropy, M, S, mean) of one rank holding the whole vocabulary."""
    logs = s.log()
    return t - m - logs, logs - e / s, m, s, m + e / s


def logit_grad(
    logits: Tensor,
    targets: Tensor,
    scale: float,
    M: Tensor,
    S: Tensor,
    mean: Tensor,
    g_logp: Tensor | None,
    g_ent: Tensor | None,
) -> Tensor:
    """d(g_logp * logp + g_ent * entropy) / d(logits), in logits' dtype."""
    x = logits.float() * scale
    p = (x - M.unsqueeze(-1)).exp_().div_(S.unsqueeze(-1))
    grad = torch.zeros_like(p)
    if g_ent is not None:
        grad = -(p * (x - mean.unsqueeze(-1))) * g_ent.unsqueeze(-1)
    if g_logp is not None:
        grad -= p * g_logp.unsqueeze(-1)
        inside = (targets >= 0) & (targets < logits.shape[-1])
        local = targets.clamp(0, max(logits.shape[-1] - 1, 0)).unsqueeze(-1)
        grad.scatter_add_(-1, local, (g_logp * inside).unsqueeze(-1))
    return (grad * scale).to(logits.dtype)
