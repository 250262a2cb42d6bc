"""Running the four primitives on real state: ``execute(op)`` and the unit constructor.

Protocol: call :func:`execute` with the same op on EVERY rank (a DAG executor runs the whole
global DAG everywhere). Members move state; the collectives span exactly the ranks that move
something (Split/Merge: one P2P batch among them; Extend: one broadcast group per position);
non-members only update their registry and return an empty report, without communicating.
A rank that skips an op it is not part of is safe, but its registry no longer sees that op.
Every check runs on every calling rank before any tensor moves, so a bad op fails everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nereus_lightning.emu.ops import Destroy, Extend, Merge, Op, Recut, Split, validate_op
from nereus_lightning.emu.recut import recut
from nereus_lightning.emu.registry import registry
from nereus_lightning.emu.schema import StateSchema
from nereus_lightning.emu.transfer import (
    InFlight,
    StateDict,
    default_device,
    slice_of,
    start_broadcast,
    start_plan,
)
from nereus_lightning.emu.transfer_plan import reshard_plan, unit_holdings
from nereus_lightning.emu.unit import EMU, Counters
from nereus_lightning.plan.layout import Layout
from nereus_lightning.plan.units import Primitive, Unit
from nereus_lightning.spec.errors import NereusConfigError, require
from nereus_lightning.spec.families import family_of


@dataclass(frozen=True)
class TransferReport:
    """What one rank did in one primitive call (sum the ranks' reports for the whole op)."""

    kind: Primitive
    model_stage: str
    rank: int
    sent_bytes: int = 0  # packed buffer bytes sent, once per receiving peer
    received_bytes: int = 0
    payload_sent: int = 0  # tensor bytes inside those buffers (no alignment padding)
    payload_received: int = 0
    buffers_sent: int = 0
    peers: tuple[int, ...] = ()
    freed_bytes: int = 0  # state bytes released on this rank
    seconds: float = 0.0


def create_unit(
    model_stage: str,
    config: Any,
    model_or_state: Any | None,
    layout: Layout,
    ranks: Sequence[int],
    *,
    trains: bool = False,
    full_optim: Mapping[str, Mapping[str, Tensor]] | None = None,
    counters: Counters | None = None,
    schema: StateSchema | None = None,
    device: torch.device | str | None = None,
    colocate_with: Collection[str] = (),
) -> EMU | None:
    """Create a live unit of ``model_stage`` from a full model; call on every rank (members cut their shards).

    Non-members may pass ``model_or_state=None``; they then read the shapes and dtypes from
    ``config`` (``config.dtype``), so pass ``schema`` on every rank when the model's dtype differs.
    Returns this rank's EMU, or None off the unit. Nothing is recorded if a check fails; a family the
    body cannot compute exactly is refused first (:func:`~nereus_lightning.spec.families.family_of`).
    """
    family_of(config)
    reg = registry()
    schema = schema or StateSchema.of(config, model_or_state)
    unit = Unit(layout, tuple(ranks))
    schema.validate(layout)
    reg.require_free(model_stage, unit.gpus, colocate_with=colocate_with)
    reg.declare(model_stage, schema, trains)
    emu = None
    if dist.get_rank() in unit.gpus:
        require(model_or_state is not None, "model", f"rank {dist.get_rank()} is in {unit} but got no model")
        emu = EMU.from_model(
            model_stage,
            schema,
            model_or_state,
            unit,
            dist.get_rank(),
            trains=trains,
            full_optim=full_optim,
            counters=counters,
            device=device or default_device(),
        )
    reg.add(model_stage, unit, emu)
    return emu


def execute(
    op: Op,
    *,
    colocate_with: Collection[str] = (),
    device: torch.device | str | None = None,
) -> TransferReport:
    """Run ``op`` (call on every rank; see the module docstring). Returns this rank's report."""
    return start(op, colocate_with=colocate_with, device=device).wait()


class Started:
    """A primitive issued on this rank and not yet completed (see :func:`start`)."""

    __slots__ = ("op", "flight", "freed", "began", "_report")

    def __init__(self, op: Op, flight: InFlight, freed: int, began: float) -> None:
        self.op, self.flight, self.freed, self.began = op, flight, freed, began
        self._report: TransferReport | None = None

    def is_completed(self) -> bool:
        """Whether its collectives have completed (``wait`` still has to be called)."""
        return self.flight.is_completed()

    def wait(self) -> TransferReport:
        """Wait for its collectives, finish the new shards and return this rank's report."""
        if self._report is None:
            traffic = self.flight.wait()
            self._report = TransferReport(
                self.op.kind,
                self.op.model_stage,
                dist.get_rank(),
                traffic.sent_bytes,
                traffic.received_bytes,
                traffic.payload_sent,
                traffic.payload_received,
                traffic.buffers_sent,
                tuple(sorted(traffic.peers)),
                self.freed,
                time.perf_counter() - self.began,
            )
        return self._report


def start(
    op: Op,
    *,
    colocate_with: Collection[str] = (),
    device: torch.device | str | None = None,
) -> Started:
    """Issue ``op`` without waiting for its collectives (call on every rank, in the same order).

    Checks run and the registry is updated now (the new units are recorded; their shards are
    filled once the returned :class:`Started` is waited for); the packed send buffers and the
    old shards stay referenced until then. Ops that read a unit another started op is still
    filling must wait for that op first (a DAG's deps say which).
    """
    began = time.perf_counter()
    reg = registry()
    schema, trains = reg.schema(op.model_stage), reg.trains[op.model_stage]
    _check(op, schema, colocate_with)
    me = dist.get_rank()
    device = torch.device(device) if device is not None else default_device()
    involved = {r for u in (*op.sources, *op.targets) for r in u.gpus}
    flight, freed = InFlight(), 0
    if me in involved:
        if isinstance(op, Destroy):
            freed = _destroy(op)
        elif isinstance(op, Extend):
            flight = _extend(op, schema, trains, device)
        elif isinstance(op, Recut):
            flight, freed = _recut(op, schema, device)
        else:
            flight, freed = _reshard(op, schema, trains, device)
    else:
        _record(op, {})
    return Started(op, flight, freed, began)


def _check(op: Op, schema: StateSchema, colocate_with: Collection[str]) -> None:
    reg = registry()
    validate_op(op)
    reg.require_live(op.model_stage, op.sources)
    for unit in op.targets:
        schema.validate(unit.layout)
    old = {r for u in op.sources for r in u.gpus}
    new = {r for u in op.targets for r in u.gpus} - old
    reg.require_free(op.model_stage, new, ignore=op.sources, colocate_with=colocate_with)
    if isinstance(op, Destroy) and len(reg.live(op.model_stage)) <= 1:
        raise NereusConfigError(
            f"destroy: {op.source} is the last copy of {op.model_stage!r}'s state; Extend it onto other "
            "ranks first"
        )
    world = dist.get_world_size()
    bad = sorted(r for r in new if not 0 <= r < world)
    require(not bad, "target ranks", f"ranks {bad} are outside the world (size {world})")


def _record(op: Op, local: dict[Unit, EMU]) -> None:
    reg = registry()
    if not isinstance(op, Extend):
        for unit in op.sources:
            reg.remove(op.model_stage, unit)
    for unit in op.targets:
        reg.add(op.model_stage, unit, local.get(unit))


def _destroy(op: Destroy) -> int:
    emu = registry().local(op.model_stage, op.source)
    freed = emu.nbytes()
    emu.free()
    _record(op, {})
    return freed


def _extend(op: Extend, schema: StateSchema, trains: bool, device: torch.device) -> InFlight:
    me = dist.get_rank()
    index = next(i for u in (op.source, *op.targets) for i, r in enumerate(u.gpus) if r == me)
    ranks = (op.source.gpus[index], *(u.gpus[index] for u in op.targets))
    if me == op.source.gpus[index]:
        emu = registry().local(op.model_stage, op.source)
        counters = emu.counters.as_tensor(emu.device)
        flight = start_broadcast([t for _, _, t in emu.tensors()] + [counters], ranks[0], ranks, device)
        local = {}
    else:
        target = next(u for u in op.targets if me in u.gpus)
        emu = EMU.empty(op.model_stage, schema, target, me, trains=trains, device=device)
        counters = torch.empty(Counters.size(), dtype=torch.int64, device=device)
        flight = start_broadcast([t for _, _, t in emu.tensors()] + [counters], ranks[0], ranks, device)
        flight.then(lambda: setattr(emu, "counters", Counters.from_tensor(counters)))
        local = {target: emu}
    _record(op, local)
    return flight


def _recut(op: Recut, schema: StateSchema, device: torch.device) -> tuple[InFlight, int]:
    """``emu.recut`` (synchronous: its flight has nothing left to wait for)."""
    reg = registry()
    old = reg.local(op.model_stage, op.source) if dist.get_rank() in op.source.gpus else None
    new, traffic = recut(op.model_stage, schema, old, op.source, op.target, device)
    freed = 0
    if old is not None:
        kept = {id(t) for _, _, t in new.tensors()} if new is not None else set()
        freed = sum(t.numel() * t.element_size() for _, _, t in old.tensors() if id(t) not in kept)
        old.free()
    _record(op, {op.target: new} if new is not None else {})
    return InFlight(traffic), freed


def _reshard(
    op: Split | Merge, schema: StateSchema, trains: bool, device: torch.device
) -> tuple[InFlight, int]:
    me = dist.get_rank()
    reg = registry()
    source = next(u for u in op.sources if me in u.gpus)
    target = next(u for u in op.targets if me in u.gpus)
    old_emu = reg.local(op.model_stage, source)
    old_iv = unit_holdings(schema, source.layout, source.gpus)[me]
    new_iv = unit_holdings(schema, target.layout, target.gpus)[me]
    old: StateDict = {(n, k): t for n, k, t in old_emu.tensors()}
    new = _new_state(schema, old, old_iv, new_iv, trains, device)
    flight = start_plan(schema, reshard_plan(op, schema, trains), trains, old, old_iv, new, new_iv, device)
    emu = EMU(op.model_stage, schema, target, me, {}, {}, old_emu.counters, trains)
    for (name, key), tensor in new.items():
        if key == "param":
            emu.params[name] = tensor
        else:
            emu.optim_state.setdefault(name, {})[key] = tensor
    kept = {id(t) for t in new.values()}
    freed = sum(t.numel() * t.element_size() for t in old.values() if id(t) not in kept)
    flight.then(old_emu.free)  # the old shards are read until the sends complete
    _record(op, {target: emu})
    return flight, freed


def _new_state(
    schema: StateSchema,
    old: StateDict,
    old_iv: Mapping[str, tuple[int, int]],
    new_iv: Mapping[str, tuple[int, int]],
    trains: bool,
    device: torch.device,
) -> StateDict:
    """This rank's new shards: reused when unchanged, else allocated and filled with what it already holds."""
    new: StateDict = {}
    for name, want in new_iv.items():
        have = old_iv.get(name)
        keys = schema.state_keys(name, trains)
        if have == want:
            for key in keys:
                new[(name, key)] = old[(name, key)]
            continue
        layout_shape = _shape_of_interval(schema, name, want)
        for key in keys:
            if key == "step":
                new[(name, key)] = (
                    old[(name, key)].clone()
                    if have is not None
                    else torch.empty((), dtype=torch.float32, device=device)
                )
                continue
            new[(name, key)] = torch.empty(layout_shape, dtype=schema.key_dtype(name, key), device=device)
        if have is not None:
            lo, hi = max(want[0], have[0]), min(want[1], have[1])
            if lo < hi:
                for key in schema.shaped_keys(name, trains):
                    slice_of(schema, name, new[(name, key)], want, lo, hi).copy_(
                        slice_of(schema, name, old[(name, key)], have, lo, hi)
                    )
    return new


def _shape_of_interval(schema: StateSchema, name: str, interval: tuple[int, int]) -> tuple[int, ...]:
    shape = list(schema.shape_of[name])
    dim = schema.placements[name].tp_dim
    if dim is not None:
        shape[dim] = interval[1] - interval[0]
    return tuple(shape)
