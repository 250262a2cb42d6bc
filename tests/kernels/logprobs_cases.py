"""Inputs and float64 oracles shared by the log-prob kernel tests (and their Triton-interpreter run)."""

from __future__ import annotations

import torch
from torch import Tensor


def random_logits(n: int, V: int, dtype: torch.dtype, seed: int, std: float = 4.0) -> Tensor:
    """Random logits (never zeros: zeros hide wrong indexing); std 4 puts |logp| near 10 at large V."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, V, generator=gen, dtype=torch.float64) * std).to(dtype)


def random_targets(n: int, V: int, seed: int, outside: float = 0.3) -> Tensor:
    """int64 [n]: most in [0, V), a share ``outside`` of them below 0 or at/after V."""
    gen = torch.Generator().manual_seed(seed + 7919)
    targets = torch.randint(0, V, (n,), generator=gen)
    away = torch.rand(n, generator=gen) < outside
    shift = torch.where(torch.rand(n, generator=gen) < 0.5, -V - 1, V)
    return torch.where(away, targets + shift, targets)


def direct_stats(logits: Tensor, targets: Tensor, scale: float) -> dict[str, Tensor]:
    """m, s, e, t of :func:`row_stats`, and logp, entropy, mean, in float64 straight from the definitions."""
    x = logits.double() * scale
    V = x.shape[1]
    inside = (targets >= 0) & (targets < V)
    t = torch.where(inside, x.gather(1, targets.clamp(0, V - 1)[:, None]).squeeze(1), 0.0)
    m = x.amax(dim=1)
    d = x - m[:, None]
    p = d.exp()
    s = p.sum(dim=1)
    e = torch.where(p > 0, p * d, 0.0).sum(dim=1)
    logp_all = torch.log_softmax(x, dim=1)
    q = logp_all.exp()
    entropy = -torch.where(q > 0, q * logp_all, 0.0).sum(dim=1)
    return {
        "m": m,
        "s": s,
        "e": e,
        "t": t,
        "logp": t - torch.logsumexp(x, dim=1),
        "entropy": entropy,
        "mean": (q * torch.where(q > 0, x, 0.0)).sum(dim=1),
    }


def autograd_grad(
    logits: Tensor, targets: Tensor, scale: float, g_logp: Tensor | None, g_ent: Tensor | None
) -> Tensor:
    """float64 d(g_logp * logp + g_ent * entropy)/d(logits) by autograd over the whole vocabulary.

    A target outside [0, V) stands for a logit held elsewhere: a constant, so logp's gradient is
    then -softmax alone.
    """
    x = logits.double().requires_grad_()
    y = x * scale
    V = y.shape[1]
    logp_all = torch.log_softmax(y, dim=1)
    inside = (targets >= 0) & (targets < V)
    picked = y.gather(1, targets.clamp(0, V - 1)[:, None]).squeeze(1)
    logp = torch.where(inside, picked, 0.0) - torch.logsumexp(y, dim=1)
    entropy = -(logp_all.exp() * logp_all).sum(dim=1)
    loss = y.new_zeros(())
    if g_logp is not None:
        loss = loss + (g_logp.double() * logp).sum()
    if g_ent is not None:
        loss = loss + (g_ent.double() * entropy).sum()
    if not loss.requires_grad:
        return torch.zeros_like(x)
    (grad,) = torch.autograd.grad(loss, x)
    return grad


def rel_norm(a: Tensor, b: Tensor) -> float:
    """||a - b|| / ||b|| in float64 (0 when both are empty or zero)."""
    a, b = a.double(), b.double()
    denom = b.norm().item()
    diff = (a - b).norm().item()
    return diff if denom == 0 else diff / denom


# Relative-norm bound of a gradient rounded to each dtype (the reference's grad vs float64 autograd).
GRAD_RTOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
