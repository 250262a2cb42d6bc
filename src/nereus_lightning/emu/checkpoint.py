"""A model-stage's state through torch.distributed.checkpoint (DCP): the restart fallback and the test oracle.

Each rank offers its shards as DTensors on a one-dimensional mesh over its stage's TP group
(``Shard(tp_dim)``), replicated tensors as plain tensors, so DCP records every shard with its
global offsets. Loading into a unit of any other layout lets DCP compute, independently of our
transfer plans, which bytes each new shard needs. Both calls are collective over the default
process group (ranks without a unit of the model-stage take part with nothing).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from nereus_lightning.emu.groups import member_group
from nereus_lightning.emu.registry import registry
from nereus_lightning.emu.unit import EMU, Counters


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, out = 1, []
    for size in reversed(shape):
        out.append(stride)
        stride *= size
    return tuple(reversed(out))


def dcp_state_dict(emu: EMU) -> dict[str, Tensor]:
    """This rank's shards keyed ``"<key>/<global name>"``: DTensors for TP-cut tensors, plain tensors otherwise.

    The values share storage with the EMU, so :func:`dcp.load` fills the EMU in place.
    """
    layout, pos = emu.layout, emu.position
    mesh = None
    if layout.tp > 1:
        tp_ranks = tuple(emu.unit.rank_at(pos.pp_rank, t) for t in range(layout.tp))
        mesh = DeviceMesh.from_group(member_group(tp_ranks), emu.device.type)
    out: dict[str, Tensor] = {}
    for name, key, tensor in emu.tensors():
        dim = emu.schema.placements[name].tp_dim
        if mesh is not None and dim is not None and tensor.dim() > 0:
            shape = emu.schema.shape_of[name]
            tensor = DTensor.from_local(
                tensor,
                mesh,
                [Shard(dim)],
                run_check=False,
                shape=torch.Size(shape),
                stride=_contiguous_stride(shape),
            )
        out[f"{key}/{name}"] = tensor
    out["counters"] = emu.counters.as_tensor(emu.device)
    return out


def _local_emus(model_stage: str) -> list[EMU]:
    return [emu for emu in registry().units.get(model_stage, {}).values() if emu is not None]


def save_state(model_stage: str, path: str | os.PathLike) -> None:
    """Save every live replica of ``model_stage`` to ``path`` (duplicate shards are written once)."""
    emus = _local_emus(model_stage)
    state = dcp_state_dict(emus[0]) if emus else {}
    dcp.save(state, checkpoint_id=os.fspath(path))


def load_state(emu: EMU | None, path: str | os.PathLike) -> None:
    """Fill ``emu``'s shards (any layout) and counters from a checkpoint written by :func:`save_state`; None off the unit."""
    state = dcp_state_dict(emu) if emu is not None else {}
    dcp.load(state, checkpoint_id=os.fspath(path))
    if emu is not None:
        emu.counters = Counters.from_tensor(state["counters"])
    if dist.is_initialized():
        dist.barrier()
