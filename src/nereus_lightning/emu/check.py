"""Exactness checks: a model-stage's full logical state, reassembled from every live replica.

:func:`gather_logical_state` is collective over the whole default process group (every rank
calls it; ranks without a unit contribute nothing). It copies shards to the CPU, which is fine
for a check and never part of a transfer path. It also checks every replica against the
others, and every duplicated shard (TP-replicated norms, the tied embedding on two stages)
against its twin, raising :class:`StateMismatchError` on any difference.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from nereus_lightning.emu.registry import registry
from nereus_lightning.emu.unit import Counters
from nereus_lightning.kernels.pack import pack, unpack
from nereus_lightning.models.sharding import tp_slices


class StateMismatchError(AssertionError):
    """Two copies of the same logical state differ."""


@dataclass
class LogicalState:
    """Full (unsharded) parameters, every optimizer tensor and the counters of one model-stage."""

    params: dict[str, Tensor] = field(default_factory=dict)
    optim: dict[str, dict[str, Tensor]] = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    replicas: int = 0

    def differences(self, other: LogicalState) -> list[str]:
        """What differs bit for bit (empty when identical; replica counts are not compared)."""
        out = []
        if self.counters != other.counters:
            out.append(f"counters {self.counters} != {other.counters}")
        for mine, theirs, what in (
            (self.params, other.params, "param"),
            (_flat(self.optim), _flat(other.optim), "optim"),
        ):
            if mine.keys() != theirs.keys():
                out.append(f"{what} names differ: {sorted(set(mine) ^ set(theirs))[:5]}")
            out += [f"{what} {k}" for k in mine if k in theirs and not _same(mine[k], theirs[k])]
        return out

    def equal(self, other: LogicalState) -> bool:
        """Bit-identical parameters, optimizer tensors and counters."""
        return not self.differences(other)


def _flat(optim: dict[str, dict[str, Tensor]]) -> dict[str, Tensor]:
    return {f"{n}.{k}": t for n, state in optim.items() for k, t in state.items()}


def _same(a: Tensor, b: Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def gather_logical_state(model_stage: str, dst: int | None = None) -> LogicalState | None:
    """The logical state of ``model_stage`` on every rank
    (``dst=None``) or on rank ``dst`` (None elsewhere).
    """
    reg = registry()
    schema = reg.schema(model_stage)
    mine = []
    for unit, emu in reg.units.get(model_stage, {}).items():
        if emu is not None:
            # One packed byte string per unit: pickling thousands of small tensors is slow.
            tensors = list(emu.tensors())
            packed = pack([t.detach() for _, _, t in tensors]).to("cpu").numpy().tobytes() if tensors else b""
            meta = [(n, k, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, k, t in tensors]
            mine.append((unit, emu.rank, meta, packed, emu.counters))
    world = dist.get_world_size()
    if dst is None:
        everything: list = [None] * world
        dist.all_gather_object(everything, mine)
    else:
        gathered = [None] * world if dist.get_rank() == dst else None  # (None on the other ranks)
        dist.gather_object(mine, gathered, dst=dst)
        if gathered is None:
            return None
        everything = gathered
    by_unit: dict = {}
    for part in everything:
        for unit, rank, meta, packed, counters in part:
            by_unit.setdefault(unit, []).append((rank, _unpacked(meta, packed), counters))
    states = [_assemble(schema, unit, parts) for unit, parts in sorted(by_unit.items())]
    if not states:
        raise StateMismatchError(f"{model_stage!r} has no live replica")
    for unit, state in zip(sorted(by_unit)[1:], states[1:], strict=True):
        diff = states[0].differences(state)
        if diff:
            raise StateMismatchError(f"replicas of {model_stage!r} diverge ({unit}): {diff[:5]}")
    states[0].replicas = len(states)
    return states[0]


def _unpacked(meta: list, packed: bytes) -> dict[tuple[str, str], Tensor]:
    views = [torch.empty(shape, dtype=getattr(torch, dtype)) for _, _, shape, dtype in meta]
    if views:
        unpack(torch.frombuffer(bytearray(packed), dtype=torch.uint8), views)
    return {(name, key): view for (name, key, _, _), view in zip(meta, views, strict=True)}


def _assemble(schema, unit, parts) -> LogicalState:
    if len(parts) != unit.layout.size:
        raise StateMismatchError(f"{unit}: {len(parts)} of {unit.layout.size} ranks reported their shards")
    state = LogicalState(counters=parts[0][2])
    written: set[tuple[str, str, int]] = set()  # (name, slot, tp rank or -1 if replicated)
    for rank, shards, counters in sorted(parts, key=lambda p: p[0]):
        if counters != state.counters:
            raise StateMismatchError(f"{unit}: rank {rank} counters {counters} != {state.counters}")
        pos = unit.position(rank)
        for (name, key), shard in shards.items():
            if key == "step":
                full = state.optim.setdefault(name, {})
                if key in full and not torch.equal(full[key], shard):
                    raise StateMismatchError(f"{unit}: {name}.step differs between ranks")
                full[key] = shard
                continue
            box = state.params if key == "param" else state.optim.setdefault(name, {})
            slot = "param" if key == "param" else key
            target = box.get(name if key == "param" else key)
            if target is None:
                target = torch.empty(schema.shape_of[name], dtype=shard.dtype)
                box[name if key == "param" else key] = target
            index = tp_slices(schema.shape_of[name], schema.placements[name], unit.layout.tp, pos.tp_rank)
            where = (name, slot, pos.tp_rank if schema.placements[name].tp_dim is not None else -1)
            if where in written:
                if not torch.equal(target[index], shard):
                    raise StateMismatchError(
                        f"{unit}: copies of {name} ({slot}) at tp rank {pos.tp_rank} differ"
                    )
            else:
                target[index] = shard  # an index (not a view) for a fused tensor's rows
                written.add(where)
    for name in schema.names:
        pieces = unit.layout.tp if schema.placements[name].tp_dim is not None else 1
        if sum(1 for n, slot, _ in written if n == name and slot == "param") != pieces:
            raise StateMismatchError(f"{unit}: the shards of {name} do not cover it")
    return state
