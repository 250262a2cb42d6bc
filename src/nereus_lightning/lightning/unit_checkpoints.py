"""The units' state in a checkpoint: every model-stage's logical state through DCP, and back.

A checkpoint's ``emu/<model_stage>/`` holds one model-stage's parameters, optimizer state and
counters by parameter name, so a run saved under one plan and world size resumes under another.
A model-stage that holds exactly its training stage's weights is saved with its counters only,
and its ``weights_from.json`` names the training stage; loading syncs it from there.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nereus_lightning import emu
from nereus_lightning.emu.dcp_state import (
    PARAMS_FROM_MASTERS,
    load_state,
    params_from_masters,
    read_params_from_masters,
    save_states,
)
from nereus_lightning.emu.sync import sync_params
from nereus_lightning.models.groups import prepare_groups
from nereus_lightning.plan.layout import Plan
from nereus_lightning.spec.errors import CheckpointError
from nereus_lightning.spec.workload import ModelStage

#: In a checkpoint's ``emu/<model_stage>/`` saved without weights: the training stage that holds them.
WEIGHTS_FROM = "weights_from.json"


def read_weights_from(path: str, plan: Plan) -> dict[str, str]:
    """The model-stages of ``plan`` saved without weights in the checkpoint ``path`` (``<ckpt>/emu``) -> the
    training stage holding them (``<stage>/weights_from.json``; none in checkpoints before it existed).
    """
    found: dict[str, str] = {}
    for name in plan:
        file = os.path.join(path, name, WEIGHTS_FROM)
        if not os.path.isfile(file):
            continue
        try:
            with open(file) as f:
                source = json.load(f)["weights_from"]
            if not isinstance(source, str):
                raise ValueError(f"weights_from is {source!r}, not a model-stage name")
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{file}: damaged ({type(exc).__name__}: {exc})") from exc
        found[name] = source
    return found


def require_masters_held(directory: str, model_stage: str) -> None:
    """Refuse (every rank alike) a model-stage directory that stores parameters as their fp32 masters only
    where this job's units hold them otherwise (another ``trainer.precision``): no master would fill them.
    """
    reg = emu.registry()
    schema = reg.schema(model_stage)
    held = {n: schema.dtype_of(n) for n in params_from_masters(schema, reg.trains[model_stage])}
    other = [(n, dtype) for n, dtype in read_params_from_masters(directory).items() if held.get(n) != dtype]
    if other:
        name, dtype = other[0]
        stored = str(dtype).removeprefix("torch.")
        here = f"{schema.dtype_name_of[name]} {'with' if name in held else 'without'} a master"
        raise CheckpointError(
            f"{os.path.join(directory, PARAMS_FROM_MASTERS)}: stores {name} ({stored}) as its fp32 master "
            f"only, this job's {model_stage} holds it as {here} ({len(other)} such parameters); resume "
            "with the trainer.precision that wrote the checkpoint"
        )


def tp_rank_sets(plan: Plan) -> list[tuple[int, ...]]:
    """The TP groups DCP meshes use (one per pipeline stage of every replica)."""
    out = []
    for name in plan:
        for unit in emu.replica_units(plan[name]):
            tp = unit.layout.tp
            out += [unit.gpus[p * tp : (p + 1) * tp] for p in range(unit.layout.pp)]
    return out


def load_units(path: str, plan: Plan, sources: Mapping[str, str]) -> set[str]:
    """Fill the new units of ``plan`` from the checkpoint directory ``path`` (``<checkpoint>/emu``;
    collective); returns the model-stages synced from their training stage (``sources``: each
    model-stage that does not train -> the training stage of its model).
    """
    weights_from = read_weights_from(path, plan)
    wrong = {n: s for n, s in weights_from.items() if sources.get(n) != s}
    if wrong:
        raise CheckpointError(
            f"ckpt_path: {path} takes the weights of {wrong} (<stage>/{WEIGHTS_FROM}) from training "
            f"stages this job's plan does not pair them with ({dict(sources)}); resume with the algorithm "
            "that wrote it"
        )
    for name in plan:
        if name not in weights_from:
            require_masters_held(os.path.join(path, name), name)
    prepare_groups(tp_rank_sets(plan))
    for name in plan:
        load_state(emu.registry().mine(name), os.path.join(path, name), weights=name not in weights_from)
    for name, source in weights_from.items():
        sync_params(source, name)
    return set(weights_from)


def save_units(
    path: str,
    plan: Plan,
    stages: Mapping[str, ModelStage],
    synced: set[str],
    sources: Mapping[str, str],
    step: int | None = None,
) -> None:
    """Every model-stage's logical state through DCP into ``path/<model_stage>`` (collective); each also
    holds ``step`` (the global step, see :data:`~nereus_lightning.emu.dcp_state.STEP_KEY`) when given.

    A model-stage in ``synced`` on every rank (it holds exactly the weights of its training stage,
    ``sources``) is saved with its counters only, and ``path/<model_stage>/weights_from.json``
    names the training stage.
    """
    views: list[Any] = [sorted(synced)]  # per rank (filled by the gather)
    if dist.is_initialized():
        views = [None] * dist.get_world_size()
        dist.all_gather_object(views, sorted(synced))
    everywhere = set.intersection(*(set(v) for v in views))
    weights_from = {n: train for n, train in sources.items() if n in everywhere}
    prepare_groups(tp_rank_sets(plan))
    # Each unit from where it is: an idle one from its pinned host memory, a resident one staged
    # in page-locked host memory first. Training units (resident) go last: they are staged while
    # the others are written, and being consecutive they go to different writers, so that PPO's
    # two are written at once (emu.dcp_state.save_states).
    order = sorted(plan, key=lambda n: stages[n].trains)
    save_states([(n, os.path.join(path, n), n not in weights_from) for n in order], step)
    if not dist.is_initialized() or dist.get_rank() == 0:
        for name, train in weights_from.items():
            with open(os.path.join(path, name, WEIGHTS_FROM), "w") as f:
                json.dump({"weights_from": train}, f)
    if dist.is_initialized():  # the checkpoint is whole on return, on every rank (a load may follow)
        dist.barrier()


def write_back(
    plan: Plan, stages: Mapping[str, ModelStage], models: Mapping[str, nn.Module], dst: int | None = None
) -> None:
    """Put every role's logical parameters back into its (released) full model ``models[role]`` (collective).

    On every rank (``dst=None``) or on rank ``dst`` only. A role with a training stage takes
    that stage's state (its freshest).
    """
    done: set[str] = set()
    for name in plan:
        role = stages[name].model
        model = models.get(role)
        if role in done or model is None:
            continue
        if any(stages[o].model == role and stages[o].trains for o in plan) and not stages[name].trains:
            continue  # the training stage holds the role's freshest state
        state = emu.gather_logical_state(name, dst=dst)
        done.add(role)
        if state is None:
            continue  # not rank ``dst``
        with torch.no_grad():
            for pname, param in model.named_parameters():
                param.data = state.params[pname].clone()


__all__ = [
    "WEIGHTS_FROM",
    "load_units",
    "read_weights_from",
    "require_masters_held",
    "save_units",
    "tp_rank_sets",
    "write_back",
]
