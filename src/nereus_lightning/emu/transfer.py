"""Executing a transfer: pack per peer, one P2P batch or broadcast, unpack on arrival.

Every buffer is built by :func:`nereus_lightning.kernels.pack` from strided views of the sender's
shards (parameters and optimizer tensors together, the fp32 master of a bf16/fp16 parameter too) and scattered
by
:func:`nereus_lightning.kernels.unpack` into the receiver's new shards. Tensors stay on their
device: on NCCL the buffers are device tensors, on gloo CPU tensors.

Each transfer can be *started* (``start_plan``, ``start_broadcast``): its collectives are issued
asynchronously on the member group (on NCCL each group has its own stream) and an
:class:`InFlight` is returned that holds the packed send buffers and the receive buffers until
:meth:`InFlight.wait` has seen every collective complete and unpacked what arrived. The blocking
``run_plan`` is ``start_plan(...).wait()``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from nereus_lightning.emu.schema import StateSchema
from nereus_lightning.emu.transfer_plan import Interval, Move, TransferPlan
from nereus_lightning.kernels.pack import byte_offsets, pack, unpack
from nereus_lightning.models.groups import member_group
from nereus_lightning.plan.rows import row_block, row_moves

StateDict = dict[tuple[str, str], Tensor]  # (name, key) -> tensor; key "param" or an optimizer key


def default_device() -> torch.device:
    """Where received shards live: the current CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass
class Traffic:
    """Bytes this rank sent and received in one primitive call."""

    sent_bytes: int = 0  # buffer bytes on the wire (incl. 16-byte alignment), counted once per receiver
    received_bytes: int = 0
    payload_sent: int = 0  # tensor bytes only
    payload_received: int = 0
    buffers_sent: int = 0
    peers: set[int] = field(default_factory=set)


def slice_of(schema: StateSchema, name: str, tensor: Tensor, base: Interval, lo: int, hi: int) -> Tensor:
    """The view of ``[lo, hi)`` (global, along the TP dim) of a shard holding ``base``."""
    dim = schema.placements[name].tp_dim
    if dim is None or tensor.dim() == 0:
        return tensor
    return tensor.narrow(dim, lo - base[0], hi - lo)


def move_views(
    schema: StateSchema, move: Move, state: StateDict, base: Interval, trains: bool
) -> list[Tensor]:
    """The views one move reads (sender) or writes (receiver), in a fixed order."""
    views = [
        slice_of(schema, move.name, state[(move.name, k)], base, move.lo, move.hi)
        for k in schema.shaped_keys(move.name, trains)
    ]
    if trains and move.with_step:
        views.append(state[(move.name, "step")])
    return views


def _nbytes(views: list[Tensor]) -> int:
    return sum(v.numel() * v.element_size() for v in views)


class InFlight:
    """Collectives issued and not yet waited for, with every buffer they read or write.

    The send buffers stay referenced here until the collectives that read them have completed
    (``wait``); received buffers are unpacked into their views then. ``then`` callbacks run after
    the unpacking, in order (e.g. freeing the old shards of a reshard once nothing reads them).
    """

    __slots__ = ("works", "traffic", "_keep", "_inbox", "_then", "_done")

    def __init__(self, traffic: Traffic | None = None) -> None:
        self.works: list[Any] = []
        self.traffic = traffic if traffic is not None else Traffic()
        self._keep: list[Tensor] = []  # send buffers: alive until their collectives complete
        self._inbox: list[tuple[Tensor, list[Tensor]]] = []
        self._then: list[Callable[[], None]] = []
        self._done = False

    def add(self, other: InFlight) -> InFlight:
        """Take over ``other``'s collectives, buffers and callbacks (its traffic is added)."""
        self.works += other.works
        self._keep += other._keep
        self._inbox += other._inbox
        self._then += other._then
        add_traffic(self.traffic, other.traffic)
        other.works, other._keep, other._inbox, other._then, other._done = [], [], [], [], True
        return self

    def then(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` once everything has arrived (right away if nothing is in flight)."""
        if self._done:
            fn()
        else:
            self._then.append(fn)

    def is_completed(self) -> bool:
        """Whether every collective has completed (does not block; ``wait`` still unpacks)."""
        return self._done or all(w.is_completed() for w in self.works)

    def wait(self) -> Traffic:
        """Block until every collective has completed, unpack, run the callbacks; returns the traffic."""
        if not self._done:
            for work in self.works:
                work.wait()
            for buffer, views in self._inbox:
                unpack(buffer, views)
            self.works, self._keep, self._inbox = [], [], []
            self._done = True
            then, self._then = self._then, []
            for fn in then:
                fn()
        return self.traffic


def add_traffic(total: Traffic, part: Traffic) -> None:
    """Add ``part`` into ``total``."""
    total.sent_bytes += part.sent_bytes
    total.received_bytes += part.received_bytes
    total.payload_sent += part.payload_sent
    total.payload_received += part.payload_received
    total.buffers_sent += part.buffers_sent
    total.peers |= part.peers


def run_plan(
    schema: StateSchema,
    plan: TransferPlan,
    trains: bool,
    old: StateDict,
    old_intervals: Mapping[str, Interval],
    new: StateDict,
    new_intervals: Mapping[str, Interval],
    device: torch.device,
) -> Traffic:
    """Send this rank's moves and receive into ``new`` (already
    holding its local part): one buffer per peer.
    """
    return start_plan(schema, plan, trains, old, old_intervals, new, new_intervals, device).wait()


def start_plan(
    schema: StateSchema,
    plan: TransferPlan,
    trains: bool,
    old: StateDict,
    old_intervals: Mapping[str, Interval],
    new: StateDict,
    new_intervals: Mapping[str, Interval],
    device: torch.device,
) -> InFlight:
    """:func:`run_plan` issued asynchronously: one P2P batch on the plan's member group, not waited for."""
    me = dist.get_rank()
    flight = InFlight()
    traffic = flight.traffic
    ops: list[dist.P2POp] = []
    inbox = flight._inbox
    pairs = plan.pairs()
    group = member_group(plan.ranks()) if me in plan.ranks() else None
    for (src, dst), moves in pairs.items():
        if src == me:
            views = [v for m in moves for v in move_views(schema, m, old, old_intervals[m.name], trains)]
            buffer = pack(views)
            ops.append(dist.P2POp(dist.isend, buffer, dst, group))
            flight._keep.append(buffer)
            traffic.sent_bytes += buffer.numel()
            traffic.payload_sent += _nbytes(views)
            traffic.buffers_sent += 1
            traffic.peers.add(dst)
        elif dst == me:
            views = [v for m in moves for v in move_views(schema, m, new, new_intervals[m.name], trains)]
            buffer = torch.empty(byte_offsets(views)[1], dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, buffer, src, group))
            inbox.append((buffer, views))
            traffic.received_bytes += buffer.numel()
            traffic.payload_received += _nbytes(views)
    if ops:
        flight.works += dist.batch_isend_irecv(ops)
    return flight


def start_broadcast(views: list[Tensor], src: int, ranks: tuple[int, ...], device: torch.device) -> InFlight:
    """Broadcast ``views`` from ``src`` to the other ``ranks`` as one packed buffer on the ranks' member group
    (receivers get them filled), issued asynchronously, not waited for."""
    me = dist.get_rank()
    flight = InFlight()
    traffic = flight.traffic
    _, total = byte_offsets(views)
    buffer = pack(views) if me == src else torch.empty(total, dtype=torch.uint8, device=device)
    flight.works.append(dist.broadcast(buffer, src=src, group=member_group(ranks), async_op=True))
    flight._keep.append(buffer)
    payload = _nbytes(views)
    if me == src:
        receivers = [r for r in ranks if r != src]
        traffic.sent_bytes = total * len(receivers)
        traffic.payload_sent = payload * len(receivers)
        traffic.buffers_sent = 1
        traffic.peers.update(receivers)
    else:
        flight._inbox.append((buffer, views))
        traffic.received_bytes = total
        traffic.payload_received = payload
    return flight


def recut_rows(
    blocks: Mapping[str, Tensor],
    shapes: Mapping[str, tuple[tuple[int, ...], torch.dtype]],
    old: tuple[int, ...],
    new: tuple[int, ...],
    device: torch.device,
) -> tuple[dict[str, Tensor], Traffic]:
    """This rank's row blocks after a sharded unit's shard order changes from ``old`` to ``new`` (ranks in
    shard order), and what it sent and received.

    ``blocks``: this rank's blocks under ``old`` by key (empty off ``old``); ``shapes``: each key's
    full shape and dtype. The rows a rank holds in both cuts stay; the rest move as
    :func:`~nereus_lightning.plan.rows.row_moves` lists them, one packed buffer per peer in
    one P2P batch among the ranks that move something (each of them calls this).
    """
    me = dist.get_rank()
    rows = {key: shape[0] for key, (shape, _) in shapes.items()}
    out = {}
    if me in new:
        for key, (shape, dtype) in shapes.items():
            lo, hi = row_block(shape[0], len(new), new.index(me))
            out[key] = torch.empty((hi - lo, *shape[1:]), dtype=dtype, device=device)
            if me in old:
                have = row_block(shape[0], len(old), old.index(me))
                a, b = max(lo, have[0]), min(hi, have[1])
                if a < b:
                    out[key][a - lo : b - lo].copy_(blocks[key][a - have[0] : b - have[0]])
    moves = row_moves(rows, old, new)
    traffic = Traffic()
    pairs: dict[tuple[int, int], list[tuple[str, int, int]]] = {}
    for m in moves:
        pairs.setdefault((m.src, m.dst), []).append((m.key, m.lo, m.hi))
    ranks = sorted({r for pair in pairs for r in pair})
    if me not in ranks:
        return out, traffic
    group = member_group(ranks)
    ops, inbox, keep = [], [], []
    for (src, dst), slices in pairs.items():
        if me not in (src, dst):
            continue
        cut, held = (old, blocks) if src == me else (new, out)
        base = {key: row_block(rows[key], len(cut), cut.index(me))[0] for key, _, _ in slices}
        views = [held[key][lo - base[key] : hi - base[key]] for key, lo, hi in slices]
        if src == me:
            buffer = pack(views)
            keep.append(buffer)
            ops.append(dist.P2POp(dist.isend, buffer, dst, group))
            traffic.sent_bytes += buffer.numel()
            traffic.payload_sent += _nbytes(views)
            traffic.buffers_sent += 1
            traffic.peers.add(dst)
        else:
            buffer = torch.empty(byte_offsets(views)[1], dtype=torch.uint8, device=device)
            ops.append(dist.P2POp(dist.irecv, buffer, src, group))
            inbox.append((buffer, views))
            traffic.received_bytes += buffer.numel()
            traffic.payload_received += _nbytes(views)
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    for buffer, views in inbox:
        unpack(buffer, views)
    return out, traffic
