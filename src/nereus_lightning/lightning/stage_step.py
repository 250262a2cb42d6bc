"""The optimizer step of a training model-stage on this rank: replica gradients summed, clipped, stepped."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nereus_lightning.models import ShardedCausalLM, clip_grad_norm_
from nereus_lightning.models.sharded import all_reduce_flat
from nereus_lightning.models.zero import ZeroShards


@dataclass(frozen=True)
class StageUpdate:
    """What one optimizer step of a training model-stage found (see :func:`step_stage`)."""

    norm: float | None  # the global gradient norm; None on a rank outside the model-stage
    problem: str | None = None  # the first non-finite gradient when ``norm`` is not finite (nothing stepped)


def step_stage(
    module: ShardedCausalLM, optimizer: torch.optim.Optimizer | ZeroShards, max_norm: float
) -> StageUpdate:
    """Sum ``module``'s gradients over its replicas, clip them to ``max_norm`` and step ``optimizer``.

    Every rank of the model-stage calls it (absent gradients count as zeros). When the global
    gradient norm is not finite nothing is stepped and the update names the first parameter here
    whose gradient is not finite. The gradients are dropped either way. A sharded replica's
    :class:`~nereus_lightning.models.zero.ZeroShards` sums them over its shard group as well, into
    its row blocks, and steps those.
    """
    if isinstance(optimizer, ZeroShards):
        return StageUpdate(*optimizer.step(max_norm, module.comm.dp_group))
    params = list(module.parameters())
    grads: list[torch.Tensor] = []  # per parameter its gradient (clipped and reduced in place)
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    if module.comm.dp_group is not None:
        all_reduce_flat(grads, module.comm.dp_group)
    norm = float(clip_grad_norm_(module, max_norm))
    problem = None
    if math.isfinite(norm):
        optimizer.step()
    else:
        named = zip(module.named_parameters(), grads, strict=True)
        names = [n for (n, _), g in named if not bool(torch.isfinite(g).all())]
        problem = f"first non-finite gradient here: {names[0]}" if names else "non-finite on another rank"
    for p in params:
        p.grad = None
    return StageUpdate(norm, problem)


__all__ = ["StageUpdate", "step_stage"]
