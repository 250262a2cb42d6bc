"""Executing a transfer: pack per peer, one P2P batch or broadcast, unpack on arrival.

Every buffer is built by :func:`nereus_lightning.kernels.pack` from strided views of the sender's
shards (parameters and optimizer tensors together, the fp32 master of a bf16/fp16 parameter too) and scattered by
:func:`nereus_lightning.kernels.unpack` into the receiver's new shards. Tensors stay on their
device: on NCCL the buffers are device tensors, on gloo CPU tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor

from nereus_lightning.emu.groups import member_group
from nereus_lightning.emu.plan import Interval, Move, TransferPlan
from nereus_lightning.emu.schema import StateSchema
from nereus_lightning.kernels.pack import byte_offsets, pack, unpack

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
    """Send this rank's moves and receive into ``new`` (already holding its local part): one buffer per peer."""
    me = dist.get_rank()
    traffic = Traffic()
    ops: list[dist.P2POp] = []
    inbox: list[tuple[Tensor, list[Tensor]]] = []
    pairs = plan.pairs()
    group = member_group(plan.ranks()) if me in plan.ranks() else None
    for (src, dst), moves in pairs.items():
        if src == me:
            views = [v for m in moves for v in move_views(schema, m, old, old_intervals[m.name], trains)]
            buffer = pack(views)
            ops.append(dist.P2POp(dist.isend, buffer, dst, group))
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
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    for buffer, views in inbox:
        unpack(buffer, views)
    return traffic


def broadcast_views(views: list[Tensor], src: int, ranks: tuple[int, ...], device: torch.device) -> Traffic:
    """Broadcast ``views`` from ``src`` to the other ``ranks`` as one packed buffer (receivers get them filled)."""
    me = dist.get_rank()
    traffic = Traffic()
    _, total = byte_offsets(views)
    buffer = pack(views) if me == src else torch.empty(total, dtype=torch.uint8, device=device)
    dist.broadcast(buffer, src=src, group=member_group(ranks))
    payload = _nbytes(views)
    if me == src:
        receivers = [r for r in ranks if r != src]
        traffic.sent_bytes = total * len(receivers)
        traffic.payload_sent = payload * len(receivers)
        traffic.buffers_sent = 1
        traffic.peers.update(receivers)
    else:
        unpack(buffer, views)
        traffic.received_bytes = total
        traffic.payload_received = payload
    return traffic
