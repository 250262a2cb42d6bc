"""Optimizer pieces over a sharded replica: AdamW bound to an owner's state tensors, global grad clipping."""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.distributed as dist
from torch import Tensor

from nereus_lightning.models.sharded import ShardedCausalLM, is_tied
from nereus_lightning.models.sharding import placement, tp_plan_of
from nereus_lightning.spec.errors import require

ADAMW_KEYS = ("exp_avg", "exp_avg_sq", "step")


def bind_adamw(
    model: ShardedCausalLM,
    state: Mapping[str, Mapping[str, Tensor]] | None = None,
    **hyper: float | tuple[float, float],
) -> torch.optim.AdamW:
    """A ``torch.optim.AdamW`` over ``model``'s parameters whose state IS ``state``'s tensors.

    ``state`` maps global parameter names to ``{"exp_avg", "exp_avg_sq", "step"}`` tensors (an
    EMU's ZeRO-0 optimizer shards; zeros and step 0 behave as a fresh AdamW). The optimizer updates
    them in place, so the owner sees every step; None gives an ordinary fresh AdamW. ``hyper`` are
    AdamW's keyword arguments (lr, betas, eps, weight_decay).
    """
    named = dict(model.named_parameters())
    opt = torch.optim.AdamW(list(named.values()), **hyper)  # type: ignore[arg-type]
    if state is None:
        return opt
    require(
        state.keys() == named.keys(),
        "optim_state",
        f"missing {sorted(named.keys() - state.keys())}, unexpected {sorted(state.keys() - named.keys())}",
    )
    for name, param in named.items():
        entry = state[name]
        require(
            set(ADAMW_KEYS) <= set(entry),
            "optim_state",
            f"{name} needs keys {ADAMW_KEYS}, has {sorted(entry)}",
        )
        for key in ("exp_avg", "exp_avg_sq"):
            require(
                entry[key].shape == param.shape,
                "optim_state",
                f"{name}.{key} has shape {tuple(entry[key].shape)}, the parameter {tuple(param.shape)}",
            )
        # The dict holds the owner's tensors themselves; AdamW mutates them in place.
        opt.state[param] = {key: entry[key] for key in ADAMW_KEYS}
    return opt


def _counted_once(model: ShardedCausalLM) -> list[bool]:
    """Which local gradients count toward the replica's norm (replicated tensors once per replica)."""
    comm, plan = model.comm, tp_plan_of(model.config)
    tied_copy = is_tied(model.config) and comm.layout.pp > 1 and not comm.is_first_stage
    counted = []
    for name, _ in model.named_parameters():
        replicated = placement(name, plan).tp_dim is None
        counted.append(
            not (replicated and comm.tp_rank != 0) and not (tied_copy and name == "model.embed_tokens.weight")
        )
    return counted


def grad_norm(model: ShardedCausalLM) -> Tensor:
    """The L2 norm of the whole replica's gradient (every logical parameter once), on every replica rank."""
    params = list(model.parameters())
    total = torch.zeros((), dtype=torch.float32, device=params[0].device)
    for param, counted in zip(params, _counted_once(model), strict=True):
        if counted and param.grad is not None:
            total += param.grad.float().pow(2).sum()
    if model.comm.layout.size > 1:
        dist.all_reduce(total, group=model.comm.replica_group)
    return total.sqrt()


def clip_grad_norm_(model: ShardedCausalLM, max_norm: float) -> Tensor:
    """Scale the replica's gradients so their global norm is at most ``max_norm``; returns the norm before.

    Same rule as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model.
    """
    norm = grad_norm(model)
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(scale.to(param.grad.dtype))
    return norm
