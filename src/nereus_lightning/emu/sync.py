"""Copying state between unit sets of one model's schema: weight sync between model-stages, and re-layout.

Both run the transfer plan of :mod:`nereus_lightning.emu.transfer_plan` (each missing slice from one
holder, one packed buffer per peer pair) through :func:`nereus_lightning.emu.transfer.run_plan`;
a rank that holds a source and a target shard copies their overlap locally first.

* :func:`sync_params` copies the parameters of model-stage A's live units into model-stage B's
  live units, in place (B's tensors keep their identity, so modules built on them stay valid):
  the weight synchronisation actor_train -> actor_gen / actor_infer after an update. B does not
  train (its parameters would part from its optimizer state).
  :func:`local_refill` gives the same sync as a copy on each rank alone where it crosses no ranks.
* :func:`relayout` moves a model-stage's whole state (parameters, AdamW state, counters) from its
  live units onto new units of any layouts and ranks, then makes those the live units: the
  per-model-stage fallback for plans the transition brain does not model (e.g. model-stages of
  one stage sharing GPUs).

Call both on EVERY rank with the same arguments (ranks outside every unit only update their registry).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
import torch.distributed as dist

from nereus_lightning.emu.registry import registry
from nereus_lightning.emu.schema import StateSchema
from nereus_lightning.emu.transfer import StateDict, Traffic, default_device, run_plan, slice_of
from nereus_lightning.emu.transfer_plan import (
    Holdings,
    Interval,
    merged_holdings,
    plan_transfer,
    unit_holdings,
)
from nereus_lightning.emu.unit import EMU, Counters
from nereus_lightning.models.groups import prepare_groups
from nereus_lightning.plan.units import Unit
from nereus_lightning.spec.errors import require


def copy_between(
    schema: StateSchema,
    sources: Sequence[Unit],
    targets: Sequence[Unit],
    old: StateDict,
    new: StateDict,
    *,
    trains: bool,
    device: torch.device | None = None,
) -> Traffic:
    """Fill this rank's ``new`` shards (of ``targets``) from the ``sources`` units' shards (``old`` here).

    ``old`` / ``new`` map ``(name, key)`` to this rank's tensors (empty off the units); keys are
    ``"param"`` and, with ``trains``, the AdamW keys (``schema.state_keys``). Returns this rank's traffic.
    """
    me = dist.get_rank()
    held, needed = _holdings(schema, sources), _holdings(schema, targets)
    old_iv: Mapping[str, Interval] = held.get(me, {})
    new_iv: Mapping[str, Interval] = needed.get(me, {})
    with torch.no_grad():
        _copy_overlaps(schema, old, old_iv, new, new_iv, trains)
        plan = plan_transfer(schema, held, needed, trains)
        prepare_groups([plan.ranks()])  # every rank computes the same plan
        return run_plan(schema, plan, trains, old, old_iv, new, new_iv, device or default_device())


def _copy_overlaps(
    schema: StateSchema,
    old: StateDict,
    old_iv: Mapping[str, Interval],
    new: StateDict,
    new_iv: Mapping[str, Interval],
    trains: bool,
) -> None:
    """Copy the overlap of this rank's source and target shards locally (GPU -> host: one wait)."""
    to_host = False  # a GPU -> host copy in flight (into an offloaded unit)
    for name, want in new_iv.items():
        have = old_iv.get(name)
        if have is None:
            continue
        lo, hi = max(want[0], have[0]), min(want[1], have[1])
        if lo < hi:
            for key in schema.shaped_keys(name, trains):  # with AdamW's (+ master below fp32)
                dst = slice_of(schema, name, new[(name, key)], want, lo, hi)
                src = slice_of(schema, name, old[(name, key)], have, lo, hi)
                if dst.data_ptr() != src.data_ptr():
                    leaving = dst.device.type == "cpu" and src.is_cuda
                    dst.copy_(src, non_blocking=leaving)  # one wait below, not one per tensor
                    to_host |= leaving
        if trains:
            new[(name, "step")].copy_(old[(name, "step")])
    if to_host:
        torch.cuda.synchronize()  # the host copies are complete before anything reads them


def _state_of(emu: EMU | None, with_optim: bool) -> StateDict:
    if emu is None:
        return {}
    return {(n, k): t for n, k, t in emu.tensors() if with_optim or k == "param"}


def _local(model_stage: str) -> EMU | None:
    return next((e for e in registry().units.get(model_stage, {}).values() if e is not None), None)


def _sync_units(source_stage: str, target_stage: str) -> tuple[StateSchema, list[Unit], list[Unit]]:
    """The schema and the live units of a weight sync ``source_stage`` -> ``target_stage``, checked."""
    reg = registry()
    schema = reg.schema(source_stage)
    require(
        reg.schema(target_stage) == schema,
        "target_stage",
        f"{target_stage!r} holds another model than {source_stage!r}; weight sync needs one schema",
    )
    # A training unit's parameters are its optimizer's (through fp32 masters below fp32): written here,
    # they would part from the masters that the next step and every checkpoint take them from.
    require(
        not reg.trains[target_stage],
        "target_stage",
        f"{target_stage!r} trains; weight sync writes parameters into generation and inference stages only",
    )
    sources, targets = reg.live(source_stage), reg.live(target_stage)
    require(bool(sources), "source_stage", f"{source_stage!r} has no live unit")
    return schema, list(sources), list(targets)


def _holdings(schema: StateSchema, units: Sequence[Unit]) -> Holdings:
    return merged_holdings(*(unit_holdings(schema, u.layout, u.gpus) for u in units))


def sync_params(source_stage: str, target_stage: str, device: torch.device | None = None) -> Traffic:
    """Copy ``source_stage``'s parameters into ``target_stage``'s live units in place (same model schema)."""
    schema, sources, targets = _sync_units(source_stage, target_stage)
    old, new = _state_of(_local(source_stage), False), _state_of(_local(target_stage), False)
    return copy_between(schema, sources, targets, old, new, trains=False, device=device)


def local_refill(source_stage: str, target_stage: str) -> Callable[[], None] | None:
    """The weight sync ``source_stage`` -> ``target_stage`` as a copy on this rank alone, where it moves
    nothing between ranks (every rank holds the source shards its target shards need; the same answer
    on every rank), else None. The copy finds the units at call time: it refills the target's tensors."""
    schema, sources, targets = _sync_units(source_stage, target_stage)
    held, needed = _holdings(schema, sources), _holdings(schema, targets)
    if plan_transfer(schema, held, needed, False).moves:
        return None
    me = dist.get_rank()
    old_iv, new_iv = held.get(me, {}), needed.get(me, {})

    def refill() -> None:
        old, new = _state_of(_local(source_stage), False), _state_of(_local(target_stage), False)
        with torch.no_grad():
            _copy_overlaps(schema, old, old_iv, new, new_iv, False)

    return refill


def relayout(
    model_stage: str, targets: Sequence[Unit], device: torch.device | None = None
) -> tuple[Traffic, EMU | None]:
    """Move ``model_stage``'s state from its live units onto ``targets`` (which then are its live units).

    Counters travel from the first live unit's first rank. Returns this rank's traffic and its new
    EMU (None off the targets).
    """
    reg = registry()
    schema, trains = reg.schema(model_stage), reg.trains[model_stage]
    sources = reg.live(model_stage)
    require(bool(sources), "model_stage", f"{model_stage!r} has no live unit to move")
    for unit in targets:
        schema.validate(unit.layout)
    used = [r for u in targets for r in u.gpus]
    require(len(set(used)) == len(used), "targets", f"target units share ranks: {used}")
    device = device or default_device()
    me = dist.get_rank()
    mine = next((u for u in targets if me in u.gpus), None)
    emu = EMU.empty(model_stage, schema, mine, me, trains=trains, device=device) if mine is not None else None
    old_emu = _local(model_stage)
    traffic = copy_between(
        schema, sources, targets, _state_of(old_emu, True), _state_of(emu, True), trains=trains, device=device
    )
    counters = (old_emu.counters if old_emu is not None else Counters()).as_tensor(device)
    dist.broadcast(counters, src=sources[0].gpus[0])
    if emu is not None:
        emu.counters = Counters.from_tensor(counters)
    for unit in sources:
        gone = reg.remove(model_stage, unit)
        if gone is not None:
            gone.free()
    for unit in targets:
        reg.add(model_stage, unit, emu if unit == mine else None)
    return traffic, emu


__all__ = ["copy_between", "relayout", "sync_params"]
