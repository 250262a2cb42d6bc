"""Per-row log-softmax statistics of vocabulary-sharded logits, and their gradient.

A tensor-parallel rank holds a slice [n, V] of the logits. :func:`row_stats` reduces it to four fp32
numbers per row (max, sum of exponentials, their entropy term, the target's logit); the ranks
combine them (:func:`combine_stats`, with all-reduces in place of its reductions over slices) into
log p(target), the entropy, and the global max M, sum S and mean ``sum_v p_v x_v``.
:func:`logit_grad` turns those global numbers and the upstream gradients into this slice's gradient
without another reduction. No fp32 copy of the whole vocabulary is ever needed.

The torch versions (:func:`row_stats_reference`, :func:`logit_grad_reference`) are the contract on
every device; on CUDA tensors, where triton imports, Triton kernels (``_softmax_stats_triton``) run
instead and match the reference to fp32 rounding (not bit for bit: the sums are ordered
differently, and the forward rescales partial sums as its running max moves).
``NEREUS_LOGPROB_KERNELS=0`` forces the reference.
"""

from __future__ import annotations

import logging
import os
import threading
from types import ModuleType

import torch
from torch import Tensor

log = logging.getLogger("nereus_lightning.kernels")

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# -inf logits (masked vocabulary) are clamped to this before a product with p = 0, so 0 * -inf
# never turns into NaN: such a logit contributes 0, the limit of p log p.
_FMIN = torch.finfo(torch.float32).min

_lock = threading.Lock()
_triton: ModuleType | None = None
_tried = False


def _kernels() -> ModuleType | None:
    """The Triton module, imported once; None (and one log line) where it cannot be used."""
    global _triton, _tried
    with _lock:
        if not _tried:
            _tried = True
            if os.environ.get("NEREUS_LOGPROB_KERNELS", "1") == "0":
                log.info("Triton log-prob kernels off (NEREUS_LOGPROB_KERNELS=0); using the torch reference")
            else:
                try:
                    from nereus_lightning.kernels import _softmax_stats_triton

                    _triton = _softmax_stats_triton
                except ImportError as exc:  # triton is optional: not a dependency
                    log.info("Triton log-prob kernels off (%s); using the torch reference", exc)
        return _triton


def _use_kernels(logits: Tensor) -> ModuleType | None:
    return _kernels() if logits.is_cuda else None


def _check(logits: Tensor, targets: Tensor) -> Tensor:
    """Validate the shared arguments; returns ``targets`` as int64."""
    if logits.dim() != 2 or logits.dtype not in _DTYPES:
        raise ValueError(f"logits must be 2-D fp32/bf16/fp16, got {logits.dtype} {tuple(logits.shape)}")
    if logits.shape[1] == 0 or (logits.shape[0] > 0 and logits.stride(1) != 1):
        raise ValueError(f"logits need V >= 1 and a contiguous last dim, got strides {logits.stride()}")
    n = logits.shape[0]
    if targets.shape != (n,) or targets.dtype.is_floating_point or targets.device != logits.device:
        raise ValueError(
            f"targets must be integer [{n}] on {logits.device}, "
            f"got {targets.dtype} {tuple(targets.shape)} on {targets.device}"
        )
    return targets.long().contiguous()


def _check_rows(n: int, device: torch.device, **rows: Tensor | None) -> None:
    for name, v in rows.items():
        if v is not None and (v.shape != (n,) or v.dtype != torch.float32 or v.device != device):
            raise ValueError(
                f"{name} must be fp32 [{n}] on {device}, got {v.dtype} {tuple(v.shape)} on {v.device}"
            )


def _scaled(logits: Tensor, scale: float) -> Tensor:
    """A fresh fp32 copy of ``logits * scale`` (ours to modify in place)."""
    x = logits.to(torch.float32, copy=True)
    return x if scale == 1.0 else x.mul_(scale)


def _target_cells(targets: Tensor, V: int) -> tuple[Tensor, Tensor]:
    """Rows whose target lies in [0, V), and those targets."""
    rows = ((targets >= 0) & (targets < V)).nonzero().squeeze(1)
    return rows, targets[rows]


@torch.no_grad()
def row_stats_reference(
    logits: Tensor, targets: Tensor, scale: float = 1.0
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`row_stats` in torch (the contract); at most two fp32 copies of ``logits`` at once."""
    targets = _check(logits, targets)
    x = _scaled(logits, scale)
    rows, cols = _target_cells(targets, x.shape[1])
    t = x.new_zeros(x.shape[0])
    t[rows] = x[rows, cols]
    m = x.amax(dim=1)
    d = x.sub_(m[:, None])
    p = d.exp()
    s = p.sum(dim=1)
    e = p.mul_(d.clamp_(min=_FMIN)).sum(dim=1)
    return m, s, e, t


def row_stats(logits: Tensor, targets: Tensor, scale: float = 1.0) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per-row statistics of ``x = logits.float() * scale`` over this rank's vocabulary slice.

    Args:
        logits: [n, V] fp32, bf16 or fp16, last dim contiguous (this rank's vocabulary slice).
        targets: [n] integer LOCAL indices; a row whose target is outside [0, V) gets t = 0.
        scale: multiplies the logits (e.g. 1 / temperature).

    Returns:
        fp32 [n] each: ``m = max_v x``, ``s = sum_v exp(x - m)``, ``e = sum_v exp(x - m) (x - m)``,
        ``t = x[target]``. Not differentiable: :func:`logit_grad` is the backward.
    """
    kernels = _use_kernels(logits)
    if kernels is None:
        return row_stats_reference(logits, targets, scale)
    return kernels.row_stats(logits, _check(logits, targets), scale)


@torch.no_grad()
def logit_grad_reference(
    logits: Tensor,
    targets: Tensor,
    scale: float,
    M: Tensor,
    S: Tensor,
    mean: Tensor,
    g_logp: Tensor | None,
    g_ent: Tensor | None,
) -> Tensor:
    """:func:`logit_grad` in torch (the contract); at most two fp32 copies of ``logits`` at once."""
    targets = _check(logits, targets)
    n = logits.shape[0]
    _check_rows(n, logits.device, M=M, S=S, mean=mean, g_logp=g_logp, g_ent=g_ent)
    if g_logp is None and g_ent is None:
        return torch.zeros(logits.shape, dtype=logits.dtype, device=logits.device)
    x = _scaled(logits, scale)
    # Same operations, in the same order, as the Triton kernel: p = exp(x - M) * (1 / S).
    p = torch.sub(x, M[:, None]).exp_().mul_(S.reciprocal()[:, None])
    ent = x.sub_(mean[:, None]).clamp_(min=_FMIN).mul_(p)  # p (x - mean); 0 where p = 0
    if g_logp is None:
        assert g_ent is not None  # both None returned above
        grad = ent.mul_(g_ent[:, None]).neg_()
    else:
        rows, cols = _target_cells(targets, logits.shape[1])
        grad = p.neg_()
        grad[rows, cols] += 1.0  # one-hot - p; a target outside the slice has its one-hot elsewhere
        grad.mul_(g_logp[:, None])
        if g_ent is not None:
            grad.sub_(ent.mul_(g_ent[:, None]))
    del p, ent, x
    return grad.mul_(scale).to(logits.dtype)


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
    """d(g_logp * logp + g_ent * entropy)/d(logits) for this rank's slice, in logits' dtype.

    With ``x = logits.float() * scale`` and the GLOBAL softmax ``p_v = exp(x_v - M) / S``:
    ``grad_x_v = g_logp (1[v == target] - p_v) - g_ent p_v (x_v - mean)`` and the result is
    ``scale * grad_x``.

    Args:
        logits, targets, scale: as for :func:`row_stats` (targets LOCAL, possibly outside the slice).
        M, S, mean: fp32 [n], the global max, sum of ``exp(x - M)`` and ``sum_v p_v x_v`` over the
            whole vocabulary (all ranks combined; see :func:`combine_stats`).
        g_logp, g_ent: fp32 [n] upstream gradients of log p(target) and of the entropy; None = zero.
    """
    kernels = _use_kernels(logits)
    if kernels is None or (g_logp is None and g_ent is None):
        return logit_grad_reference(logits, targets, scale, M, S, mean, g_logp, g_ent)
    tgt = _check(logits, targets)
    _check_rows(logits.shape[0], logits.device, M=M, S=S, mean=mean, g_logp=g_logp, g_ent=g_ent)
    return kernels.logit_grad(logits, tgt, scale, M, S, mean, g_logp, g_ent)


def rescale_stats(m: Tensor, s: Tensor, e: Tensor, M: Tensor) -> tuple[Tensor, Tensor]:
    """One slice's ``s`` and ``e`` taken from its own max ``m`` to the global max ``M`` (>= m).

    ``sum exp(x - M) = s exp(m - M)`` and ``sum exp(x - M)(x - M) = exp(m - M)(e + (m - M) s)``;
    summed over slices they give the global S and E.
    """
    w = torch.exp(m - M)
    # A slice with no finite logit (m = -inf, s = 0) adds nothing, not -inf * 0.
    return s * w, w * (e + torch.where(s > 0, (m - M) * s, 0.0))


def finish_stats(M: Tensor, S: Tensor, E: Tensor, T: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(logp, entropy, M, S, mean) from the global max, sums and target logit of each row."""
    log_s = S.log()
    ratio = E / S  # = sum_v p_v (x_v - M) <= 0
    return T - M - log_s, log_s - ratio, M, S, M + ratio


def combine_stats(
    m: Tensor, s: Tensor, e: Tensor, t: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(logp, entropy, M, S, mean) per row from the :func:`row_stats` of the vocabulary slices.

    ``m, s, e, t``: [k, n], the stats of k slices of the same rows (targets local to each slice), or
    [n] for one slice holding the whole vocabulary. Across TP ranks the two reductions over slices
    become all-reduces: ``M`` = MAX of ``m``; then SUM of :func:`rescale_stats`'s ``s, e`` and of ``t``.
    """
    if m.dim() == 1:
        m, s, e, t = (v.unsqueeze(0) for v in (m, s, e, t))
    M = m.amax(dim=0)
    s_k, e_k = rescale_stats(m, s, e, M)
    return finish_stats(M, s_k.sum(dim=0), e_k.sum(dim=0), t.sum(dim=0))
