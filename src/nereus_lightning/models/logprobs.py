"""Token log-probs and entropy from a last stage's hidden states, without full-vocabulary logits.

The LM head (the family's own, with its scaling and soft-capping) runs over chunks of at most
:func:`chunk_rows` token rows; a chunk's logits live only while its statistics are taken, and
again in backward, where the chunk is recomputed (activation checkpointing of the head). Under TP
each rank holds a vocabulary slice: per-row statistics (max, sum of exp, ...) are combined with
one max and one sum all-reduce, so no rank gathers logits. The per-row work is
:mod:`nereus_lightning.kernels.softmax_stats` (a fused kernel on GPUs, the torch reference elsewhere).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import Tensor

from nereus_lightning.kernels.softmax_stats import (
    combine_stats,
    finish_stats,
    logit_grad,
    rescale_stats,
    row_stats,
)

if TYPE_CHECKING:
    from nereus_lightning.models.sharded import ShardedCausalLM

#: Logit elements one rank holds at once (per chunk): 64 Mi, 256 MB in fp32. The planner prices it
#: (``plan.memory.logits_bytes``).
LOGIT_CHUNK_ELEMENTS = 1 << 26


def chunk_rows(width: int) -> int:
    """Token rows per chunk for a vocabulary slice of ``width`` logits."""
    return max(1, LOGIT_CHUNK_ELEMENTS // max(width, 1))


def _combined(
    m: Tensor, s: Tensor, e: Tensor, t: Tensor, group: dist.ProcessGroup | None
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The whole vocabulary's (logp, entropy, M, S, mean) from every rank's slice statistics."""
    if group is None:
        return combine_stats(m, s, e, t)
    M = m.clone()
    dist.all_reduce(M, op=dist.ReduceOp.MAX, group=group)
    sums = torch.stack([*rescale_stats(m, s, e, M), t])
    dist.all_reduce(sums, group=group)
    return finish_stats(M, sums[0], sums[1], sums[2])


class _VocabParallelStats(torch.autograd.Function):
    """(log p(target), entropy) per row of this rank's logit slice; backward needs no collective."""

    @staticmethod
    def forward(
        ctx, logits: Tensor, targets: Tensor, scale: float, group: dist.ProcessGroup | None
    ) -> tuple[Tensor, Tensor]:
        logp, entropy, M, S, mean = _combined(*row_stats(logits, targets, scale), group)
        ctx.save_for_backward(logits, targets, M, S, mean)
        ctx.scale = scale
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp: Tensor | None, g_ent: Tensor | None) -> tuple[Tensor, None, None, None]:
        logits, targets, M, S, mean = ctx.saved_tensors
        return logit_grad(logits, targets, ctx.scale, M, S, mean, g_logp, g_ent), None, None, None


def _chunk(model: ShardedCausalLM, hidden: Tensor, targets: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    local = model.local_logits(hidden.unsqueeze(0))[0]
    return _VocabParallelStats.apply(local, targets - model.vocab_start, scale, model.comm.tp_collectives)


def head_logprobs(
    model: ShardedCausalLM, hidden: Tensor, targets: Tensor, temperature: float = 1.0
) -> tuple[Tensor, Tensor]:
    """``(log p(target), entropy)`` of ``softmax(logits / temperature)`` per row, float32 ``[n]`` each.

    ``hidden``: the last stage's final hidden states ``[n, H]`` (any leading shape flattened by the
    caller); ``targets``: global token ids ``[n]``. Identical on every TP rank; differentiable
    w.r.t. ``hidden`` and the head's weights. Every TP rank must call it with the same rows.
    """
    scale = 1.0 / temperature
    rows = chunk_rows(model.out_features // model.comm.layout.tp)
    recompute = torch.is_grad_enabled() and hidden.requires_grad
    parts = []
    for h, t in zip(hidden.split(rows), targets.split(rows), strict=True):
        if recompute:
            parts.append(torch.utils.checkpoint.checkpoint(_chunk, model, h, t, scale, use_reentrant=False))
        else:
            parts.append(_chunk(model, h, t, scale))
    if not parts:
        empty = hidden.new_zeros(0, dtype=torch.float32)
        return empty, empty
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
