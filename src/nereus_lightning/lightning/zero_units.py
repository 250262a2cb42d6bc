"""Sharded training units at rest and while read whole.

A sharded replica's EMU (``Layout.shard > 1``) holds at rest only its shard rank's row blocks of what
its ZeRO stage shards (:data:`~nereus_lightning.plan.layout.ZERO_STAGES`): from ZeRO-1 the AdamW
state, at ZeRO-3 the parameters too, which the compute module gathers for a training pass and
releases after the step. These are the tensors its :class:`~nereus_lightning.models.zero.ZeroShards`
steps, so ``plan.memory`` prices what the rank holds, and checkpoints save the rows as they are
(``emu.dcp_state``). Readers of whole ``(tp, pp)`` pieces (transitions, the weight sync, the logical
state) run inside :func:`whole`, which gathers the rows into whole tensors for the block and cuts
the EMU back to its rows after it. A transition moves a sharded stage that changes as its shard
groups (ZeRO-0 replicas of ``Layout(tp, pp)``, :func:`~nereus_lightning.plan.layout.moving_shard_groups`,
as the brain prices it): :func:`as_shard_groups` renames the registry's units for it and back. One whose
shard degree alone changes is re-cut in its rows instead (``emu.recut``), and :func:`sharded_optimizer`
steps the rows it then holds.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

import torch

from nereus_lightning import emu
from nereus_lightning.models import ShardedCausalLM
from nereus_lightning.models.groups import group_for, shard_ranks
from nereus_lightning.models.zero import ShardGroup, ZeroShards, cut_rows
from nereus_lightning.plan.layout import Layout, Plan
from nereus_lightning.plan.units import Unit
from nereus_lightning.rl.update import ADAMW


def module_params(state: emu.EMU) -> dict[str, torch.Tensor]:
    """The tensors a compute module of the EMU ``state`` is built on: its parameters, or where it holds
    their row blocks (ZeRO-3 after a re-cut) whole-shaped ones that :func:`sharded_optimizer` releases
    until the module gathers them."""
    if "param" not in state.row_keys:
        return state.params
    inner = Layout(state.unit.layout.tp, state.unit.layout.pp)
    return {
        n: torch.empty(state.schema.shard_shape(n, inner), dtype=t.dtype, device=t.device)
        for n, t in state.params.items()
    }


def sharded_optimizer(
    module: ShardedCausalLM, state: emu.EMU, layout: Layout, unit: Sequence[int], lr: float
) -> ZeroShards:
    """A ZeroShards stepping this shard rank's row blocks of the EMU ``state`` (the replica on ``unit``),
    and the EMU holding only those rows (:func:`at_rest`): cut from its whole tensors, which go, or the
    rows it holds already (re-cut to this shard degree in place, ``emu.recut``)."""
    peers = shard_ranks(unit, layout, unit.index(module.comm.rank))
    shards = ShardGroup(layout.zero, peers, module.comm.rank, group_for(peers))
    if state.row_keys:
        rows = dict(state.params) if layout.zero == 3 else None
        zero = ZeroShards(module, shards, rows, state.optim_state, lr=lr, **ADAMW)
        at_rest(zero, state)
        return zero
    blocks = {
        n: {
            k: t if k == "step" else cut_rows(t, shards.shard, shards.shard_rank).clone()
            for k, t in entry.items()
        }
        for n, entry in state.optim_state.items()
    }
    params = None
    if layout.zero == 3:
        params = {
            n: cut_rows(p.detach(), shards.shard, shards.shard_rank).clone()
            for n, p in module.named_parameters()
        }
    zero = ZeroShards(module, shards, params, blocks, lr=lr, **ADAMW)
    at_rest(zero, state)
    return zero


def at_rest(zero: ZeroShards, state: emu.EMU) -> None:
    """The EMU ``state`` holding only ``zero``'s row blocks (the optimizer's own tensors; named in its
    ``row_keys``) and, at ZeRO-3, the module's full parameters released."""
    state.optim_state = {n: zero.optimizer.state[block] for n, block in zero.blocks.items()}
    state.row_keys = frozenset(k for entry in state.optim_state.values() for k in entry if k != "step")
    if zero.shards.zero == 3:
        state.row_keys |= {"param"}
        state.params = dict(zero.blocks)
        zero.release()


def made_whole(
    optimizers: Mapping[str, torch.optim.Optimizer | ZeroShards], optim: bool = True
) -> list[tuple[ZeroShards, emu.EMU]]:
    """Every sharded training unit on this rank made whole, as an unsharded replica's (collective over
    each shard group): the module's parameters gathered (ZeRO-3; the EMU's parameters again) and, with
    ``optim``, the AdamW state's rows gathered into new whole tensors. Returns them, for :func:`at_rest`."""
    out = []
    for name, zero in optimizers.items():
        state = emu.registry().mine(name)
        if isinstance(zero, ZeroShards) and state is not None:
            zero.gather()
            if zero.shards.zero == 3:
                state.params = dict(zero.named)
                state.row_keys -= {"param"}
            if optim:
                state.optim_state = zero.whole_state()
                state.row_keys = frozenset()
            out.append((zero, state))
    return out


@contextmanager
def whole(optimizers: Mapping[str, torch.optim.Optimizer | ZeroShards], optim: bool = True) -> Iterator[None]:
    """Every sharded training unit on this rank whole while the block runs (:func:`made_whole`; its
    parameters only without ``optim``), cut back to its rows after it."""
    units = made_whole(optimizers, optim)
    yield
    for zero, state in units:
        at_rest(zero, state)


def as_shard_groups(plan: Plan, grouped: bool) -> None:
    """Rename the registry's units of ``plan``'s sharded model-stages (every rank alike): each replica as
    its shard groups (``grouped``), or each replica's shard groups as the replica again. This rank's EMU
    goes with its own group's unit, whose layout it then has."""
    reg = emu.registry()
    for name, cand in plan.items():
        if cand.layout.shard == 1:
            continue
        inner = Layout(cand.layout.tp, cand.layout.pp)
        for r in range(cand.dp):
            replica = Unit(cand.layout, cand.replica_gpus(r))
            groups = [
                Unit(inner, replica.gpus[s : s + inner.size]) for s in range(0, cand.layout.size, inner.size)
            ]
            olds, news = ([replica], groups) if grouped else (groups, [replica])
            mine = [state for old in olds if (state := reg.remove(name, old)) is not None]
            for new in news:
                state = mine[0] if mine and mine[0].rank in new.gpus else None
                if state is not None:
                    state.unit = new
                reg.add(name, new, state)
