"""Tensor-parallel collectives as autograd functions (Megatron-style), device-agnostic.

- :func:`copy_to_tp`: identity forward, all-reduce backward (before a column-parallel matmul).
- :func:`reduce_from_tp`: all-reduce forward, identity backward (after a row-parallel matmul).
- :func:`gather_from_tp`: all-gather along the last dim forward, keep own slice backward.

Every function is a no-op when the group has one rank. Their collectives are opaque to
torch.compile (a compiled layer runs them eagerly, between its compiled pieces): every rank then
issues them in program order, as the eager layer does.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor


def _size(group: dist.ProcessGroup | None) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _all_reduce(
    x: Tensor, group: dist.ProcessGroup, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM
) -> Tensor:
    x = x.contiguous()
    dist.all_reduce(x, op=op, group=group)
    return x


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup) -> Tensor:
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


def _gather_last(x: Tensor, group: dist.ProcessGroup, order: Sequence[int]) -> Tensor:
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    # all_gather lists group ranks (sorted global ranks); reorder to tp-rank order.
    return torch.cat([parts[i] for i in order], dim=-1)


class _GatherFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, group: dist.ProcessGroup, order: tuple[int, ...], tp_rank: int) -> Tensor:
        ctx.width, ctx.tp_rank = x.shape[-1], tp_rank
        return _gather_last(x, group, order)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        start = ctx.tp_rank * ctx.width
        return grad[..., start : start + ctx.width].contiguous(), None, None, None


def copy_to_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Identity forward, sum of gradients over ``group`` backward."""
    return x if group is None else _apply(_CopyToTP, x, group)


def reduce_from_tp(x: Tensor, group: dist.ProcessGroup | None) -> Tensor:
    """Sum over ``group`` forward, identity backward."""
    return x if group is None else _apply(_ReduceFromTP, x, group)


@torch.compiler.disable
def _apply(fn: type[torch.autograd.Function], x: Tensor, group: dist.ProcessGroup, *args: object) -> Tensor:
    """``fn.apply`` outside any compiled graph; the identity for a group of one rank."""
    if _size(group) == 1:
        return x
    return fn.apply(x, group, *args)


def group_order(group: dist.ProcessGroup, ranks: Sequence[int]) -> tuple[int, ...]:
    """For global ``ranks`` in tp order, their indices in ``group`` (whose ranks are sorted)."""
    return tuple(dist.get_group_rank(group, r) for r in ranks)


def gather_from_tp(x: Tensor, group: dist.ProcessGroup | None, ranks: Sequence[int], tp_rank: int) -> Tensor:
    """Concatenate the last dim of ``x`` over ``group`` in the tp order of ``ranks``; backward: own slice."""
    if group is None:
        return x
    return _apply(_GatherFromTP, x, group, group_order(group, ranks), tp_rank)
