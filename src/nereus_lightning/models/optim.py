"""Optimizer pieces over a sharded replica: AdamW bound to an owner's state tensors, global grad clipping.

AdamW state per parameter (ZeRO-0, the standard mixed-precision recipe, priced by
``plan.memory.optimizer_bytes_per_param``): ``exp_avg``, ``exp_avg_sq`` and the 0-d fp32 ``step``;
a parameter whose dtype is floating point below fp32 (bf16, fp16) also keeps an fp32 ``master``
copy, and its moments are fp32. :func:`adamw_keys` / :func:`adamw_dtype` are the one definition of
that layout; the EMU (``emu.schema``) holds, moves and prices exactly these tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim.adam import adam as adam_update
from typing_extensions import override

from nereus_lightning.models.sharded import ShardedCausalLM, is_tied
from nereus_lightning.models.sharding import placement, tp_plan_of
from nereus_lightning.spec.errors import require

#: The AdamW tensors of an fp32 parameter (torch's names); ``step`` is a 0-d fp32 tensor.
ADAMW_KEYS = ("exp_avg", "exp_avg_sq", "step")
#: The fp32 copy of a low-precision parameter that AdamW actually updates.
MASTER_KEY = "master"
_LOW_PRECISION = ("bfloat16", "float16")


def _dtype_name(dtype: torch.dtype | str) -> str:
    return str(dtype).removeprefix("torch.")


def needs_master(dtype: torch.dtype | str) -> bool:
    """Whether a parameter of ``dtype`` (torch dtype or its name) is stepped through an fp32 master copy."""
    return _dtype_name(dtype) in _LOW_PRECISION


def shaped_adamw_keys(dtype: torch.dtype | str) -> tuple[str, ...]:
    """The AdamW tensors shaped like a parameter of ``dtype``: the moments, plus ``master`` below fp32."""
    return ("exp_avg", "exp_avg_sq", MASTER_KEY) if needs_master(dtype) else ("exp_avg", "exp_avg_sq")


def adamw_keys(dtype: torch.dtype | str) -> tuple[str, ...]:
    """Every AdamW tensor of a parameter of ``dtype``: :func:`shaped_adamw_keys`, then ``step``."""
    return (*shaped_adamw_keys(dtype), "step")


def adamw_dtype(dtype: torch.dtype | str) -> str:
    """The dtype name of the shaped AdamW tensors of a ``dtype`` parameter: fp32 below fp32, else its own."""
    return "float32" if needs_master(dtype) else _dtype_name(dtype)


def fresh_adamw_state(param: Tensor) -> dict[str, Tensor]:
    """A fresh AdamW state for ``param`` on its device: zero moments, step 0, a master copy of ``param``."""
    dtype = getattr(torch, adamw_dtype(param.dtype))
    state = {
        key: torch.zeros(param.shape, dtype=dtype, device=param.device) for key in ("exp_avg", "exp_avg_sq")
    }
    if needs_master(param.dtype):
        state[MASTER_KEY] = param.detach().to(dtype=torch.float32, copy=True)
    state["step"] = torch.zeros((), dtype=torch.float32, device=param.device)
    return state


def off_master(param: Tensor, master: Tensor) -> Tensor:
    """Whether ``param`` is not ``master`` rounded to its dtype as a step leaves it, bit for bit (a 0-d bool
    tensor, no device sync).

    Bytes, not values: -0.0 and 0.0 are not the same parameter.
    """
    return torch.ne(param.view(torch.uint8), master.to(param.dtype).view(torch.uint8)).any()


#: Elements of one piece of an AdamW step: the step's fp32 temporaries (the gradients upcast, torch's
#: ``sqrt(exp_avg_sq)``) exist for one piece at a time, so they stay bounded whatever the model's size
#: (``plan.memory.STEP_PIECE_ELEMENTS`` mirrors it; a test pins them equal).
STEP_PIECE_ELEMENTS = 2**26


def _pieces(tensors: tuple[Tensor, ...], limit: int) -> list[tuple[Tensor, ...]]:
    """Flat views of ``tensors`` (same shape) cut into pieces of at most ``limit`` elements, in order.

    A non-contiguous tensor has no flat view; it stays one piece.
    """
    if tensors[0].numel() <= limit or not all(t.is_contiguous() for t in tensors):
        return [tensors]
    flat = [t.view(-1) for t in tensors]
    return [tuple(f[i : i + limit] for f in flat) for i in range(0, flat[0].numel(), limit)]


class BoundedAdamW(torch.optim.AdamW):
    """``torch.optim.AdamW`` stepped in pieces of bounded size, low-precision parameters through fp32 masters.

    ``param_groups`` hold the model's own parameters (so ``zero_grad``, clipping and schedulers act
    on them); ``state[p]`` holds ``exp_avg``, ``exp_avg_sq``, ``step`` and, for a bf16/fp16 ``p``, an
    fp32 ``master`` (moments fp32 too). A step runs torch's AdamW arithmetic over pieces of at most
    :data:`STEP_PIECE_ELEMENTS` elements (flat views of the state, so the updates land in place), each
    piece's gradient upcast to fp32 only while it steps; then it copies each master into its
    parameter (same storage). AdamW is elementwise, so the pieces change no value.
    """

    @override
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One AdamW step (see the class docstring); returns ``closure()`` when given."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lows, steps, pieces = [], [], []
            for p in group["params"]:
                if p.grad is None:
                    continue
                require(not p.grad.is_sparse, "grad", "AdamW does not support sparse gradients")
                state = self.state[p]
                if not state:
                    state.update(fresh_adamw_state(p))
                master = state.get(MASTER_KEY)
                if master is not None:
                    lows.append((p, master))
                steps.append(state["step"])
                weight = p if master is None else master
                tensors = (weight, p.grad, state["exp_avg"], state["exp_avg_sq"])
                pieces += [(*piece, state["step"]) for piece in _pieces(tensors, STEP_PIECE_ELEMENTS)]
            for bucket in _buckets(pieces, STEP_PIECE_ELEMENTS):
                _adamw(group, bucket)
            if steps:
                torch._foreach_add_(steps, 1)
            for p, master in lows:
                p.copy_(master)
        return loss


def _buckets(pieces: list[tuple[Tensor, ...]], limit: int) -> list[list[tuple[Tensor, ...]]]:
    """Consecutive pieces grouped so that each group holds at most ``limit`` elements (or one piece)."""
    out: list[list[tuple[Tensor, ...]]] = []
    size = limit
    for piece in pieces:
        if size + piece[0].numel() > limit:
            out.append([])
            size = 0
        out[-1].append(piece)
        size += piece[0].numel()
    return out


def _adamw(group: Mapping[str, Any], bucket: list[tuple[Tensor, ...]]) -> None:
    """torch's AdamW arithmetic on one bucket of (weight, grad, exp_avg, exp_avg_sq, step) pieces.

    torch increments the step tensors it is given; it gets copies (a parameter cut in several pieces
    counts one step), and :meth:`BoundedAdamW.step` advances the real ones once.
    """
    weights, grads, avgs, sqs, steps = (list(column) for column in zip(*bucket, strict=True))
    beta1, beta2 = group["betas"]
    adam_update(
        weights,
        [g if g.dtype == w.dtype else g.to(w.dtype) for w, g in zip(weights, grads, strict=True)],
        avgs,
        sqs,
        [],
        [s.clone() for s in steps],
        foreach=group["foreach"],
        # step tensors live beside their parameter; off the CPU, torch reads them on the device
        # (capturable) instead of one host sync per tensor
        capturable=group["capturable"] or steps[0].device.type != "cpu",
        differentiable=group["differentiable"],
        fused=group["fused"],
        decoupled_weight_decay=True,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=group["lr"],
        weight_decay=group["weight_decay"],
        eps=group["eps"],
        maximize=group["maximize"],
    )


def bind_adamw(
    model: nn.Module | Mapping[str, nn.Parameter],
    state: Mapping[str, Mapping[str, Tensor]] | None = None,
    **hyper: float | tuple[float, float],
) -> torch.optim.AdamW:
    """A ``torch.optim.AdamW`` over ``model``'s parameters (or the named parameters given) whose state IS
    ``state``'s tensors.

    ``state`` maps global parameter names to their :func:`adamw_keys` tensors (an EMU's ZeRO-0
    optimizer shards; zeros and step 0 behave as a fresh AdamW): ``exp_avg``, ``exp_avg_sq``,
    ``step``, and for bf16/fp16 parameters fp32 moments and an fp32 ``master``. The optimizer
    updates them in place, so the owner sees every step; None gives a fresh AdamW. It is a
    :class:`BoundedAdamW` (a bf16/fp16 parameter's update runs on its fp32 master, then is copied
    into the parameter; the step's temporaries stay bounded). ``hyper`` are AdamW's keyword
    arguments (lr, betas, eps, weight_decay).
    """
    named = dict(model.named_parameters()) if isinstance(model, nn.Module) else dict(model)
    mixed = any(needs_master(p.dtype) for p in named.values())
    require(not hyper.get("amsgrad"), "amsgrad", "nereus' AdamW does not keep amsgrad state; drop it")
    opt = BoundedAdamW(list(named.values()), **hyper)  # type: ignore[arg-type]
    if state is None:
        return opt
    require(
        state.keys() == named.keys(),
        "optim_state",
        f"missing {sorted(named.keys() - state.keys())}, unexpected {sorted(state.keys() - named.keys())}",
    )
    for name, param in named.items():
        entry, keys = state[name], adamw_keys(param.dtype)
        require(
            set(keys) <= set(entry),
            "optim_state",
            f"{name} ({_dtype_name(param.dtype)}) needs keys {keys}, has {sorted(entry)}",
        )
        for key in shaped_adamw_keys(param.dtype):
            require(
                entry[key].shape == param.shape,
                "optim_state",
                f"{name}.{key} has shape {tuple(entry[key].shape)}, the parameter {tuple(param.shape)}",
            )
            if mixed:
                require(
                    _dtype_name(entry[key].dtype) == adamw_dtype(param.dtype),
                    "optim_state",
                    f"{name}.{key} is {_dtype_name(entry[key].dtype)}; "
                    f"a {_dtype_name(param.dtype)} parameter "
                    f"needs {adamw_dtype(param.dtype)} (see models.optim.fresh_adamw_state)",
                )
        # The dict holds the owner's tensors themselves; AdamW mutates them in place.
        opt.state[param] = {key: entry[key] for key in keys}
    return opt


def counted_once(model: ShardedCausalLM) -> list[bool]:
    """Per parameter of ``model``, whether its local gradient counts toward the replica's norm (replicated
    tensors once per replica)."""
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
    for param, counted in zip(params, counted_once(model), strict=True):
        if counted and param.grad is not None:  # in pieces: one piece's fp32 copy at a time, as the step
            for (piece,) in _pieces((param.grad,), STEP_PIECE_ELEMENTS):
                total += piece.float().pow(2).sum()
    if model.comm.layout.size > 1:
        dist.all_reduce(total, group=model.comm.replica_group)
    return total.sqrt()


def clip_grad_norm_(model: ShardedCausalLM, max_norm: float) -> Tensor:
    """Scale the replica's gradients so their global norm is at most ``max_norm``; returns the norm before.

    Same rule as ``torch.nn.utils.clip_grad_norm_`` on the unsharded model. A non-finite norm
    leaves the gradients as they are, so the caller can still find the tensor that broke.
    """
    norm = grad_norm(model)
    if not bool(torch.isfinite(norm)):
        return norm
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for param in model.parameters():
        if param.grad is not None:
            param.grad.mul_(scale.to(param.grad.dtype))
    return norm
