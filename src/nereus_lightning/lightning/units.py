"""This rank's sharded units: one `ShardedCausalLM` per model-stage whose layout is larger than one rank.

The logical state of each role model (actor, critic, reference) is a full transformers module
kept on every rank, with its AdamW state; the units are its TP/PP shards in the layout the plan
gives each model-stage. Forward and backward run through the units (TP collectives, PP
send/recv); gradients flow back into the logical model (each shard's gradient is written into its
slice, counted once), are summed over replicas, and one optimizer step updates the logical
state. The units are then refreshed from it (weight synchronisation), and a new plan rebuilds
them (a transition). Layout(1, 1) model-stages use the logical module directly.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from nereus_lightning.models import ReplicaComm, ShardedCausalLM, replica_groups, shard_state
from nereus_lightning.models.sharding import placement, tp_plan_of, tp_slices
from nereus_lightning.plan.layout import Plan
from nereus_lightning.spec.workload import STAGES, workflow


def role_of(model_stage: str, algorithm: str) -> str | None:
    """The role model a model-stage runs (``actor``, ``critic``, ``reference`` or ``reward``)."""
    for ms in workflow(algorithm):
        if ms.name == model_stage:
            return ms.model
    return None


class StageUnits:
    """The units of one plan on this rank; ``ensure(plan)`` (re)builds them on a plan change."""

    def __init__(self, algorithm: str) -> None:
        self.algorithm = algorithm
        self.plan: Plan | None = None
        self.units: dict[str, ShardedCausalLM] = {}

    def ensure(self, plan: Plan, models: Mapping[str, nn.Module | None], rank: int) -> bool:
        """Build this rank's units for ``plan`` (collective: every rank calls it); False if already built."""
        if self.plan == plan:
            return False
        self.units = {}
        for name, cand in plan.items():
            role = role_of(name, self.algorithm)
            model = models.get(role) if role else None
            if model is None or cand.layout.size == 1:
                continue
            tied = bool(getattr(model.config, "tie_word_embeddings", False))
            replicas = [cand.replica_gpus(r) for r in range(cand.dp)]
            replica_groups(replicas, cand.layout, tied)  # every rank, same order
            if rank in cand.gpus:
                replica = replicas[cand.gpus.index(rank) // cand.layout.size]
                comm = ReplicaComm.of(replica, cand.layout, rank, tied=tied)
                self.units[name] = ShardedCausalLM.from_model(model, comm)
        self.plan = plan
        return True

    def get(self, model_stage: str) -> ShardedCausalLM | None:
        """This rank's unit of ``model_stage`` (None: not a member, or a Layout(1, 1) stage)."""
        return self.units.get(model_stage)

    @torch.no_grad()
    def refresh(self, role: str, model: nn.Module) -> None:
        """Copy the logical ``model``'s current values into every unit of ``role`` (weight sync)."""
        for name, unit in self.units.items():
            if role_of(name, self.algorithm) != role:
                continue
            comm = unit.comm
            fresh = shard_state(model, model.config, comm.layout, comm.pp_rank, comm.tp_rank)
            for pname, param in unit.named_parameters():
                param.copy_(fresh[pname])

    @staticmethod
    def add_grads_to(unit: ShardedCausalLM, model: nn.Module) -> None:
        """Add the unit's shard gradients into the logical model's gradients, each element once.

        Replicated tensors count on TP rank 0 only; a tied embedding held by the first and the
        last pipeline stage counts on the first only.
        """
        comm = unit.comm
        plan = tp_plan_of(model.config)
        full = dict(model.named_parameters())
        for pname, param in unit.named_parameters():
            if param.grad is None:
                continue
            p = placement(pname, plan)
            if p.tp_dim is None and comm.tp_rank != 0:
                continue
            if pname == "model.embed_tokens.weight" and not comm.is_first_stage:
                continue  # the tied copy on the last stage
            target = full[pname]
            if target.grad is None:
                target.grad = torch.zeros_like(target)
            target.grad[tp_slices(tuple(target.shape), p, comm.layout.tp, comm.tp_rank)] += param.grad


def stage_order(plan: Plan, algorithm: str) -> list[str]:
    """Model-stages of ``plan`` in execution order (generation, inference, training)."""
    ms = {m.name: m for m in workflow(algorithm)}
    return sorted(plan, key=lambda n: STAGES.index(ms[n].stage))
