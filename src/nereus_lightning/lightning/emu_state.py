"""`EMUStates`: every model-stage's state in Elastic Model Units on the ranks its plan gives it.

:class:`~nereus_lightning.lightning.strategy.NereusStrategy` holds one and is the only caller; the
LightningModule reaches the units through the strategy's interface (``stage``, ``update``,
``sync_weights``, ``rollout_engine``, ...).

Each model-stage with a model (actor, critic, reference, reward roles) is a set of live EMUs in
:func:`nereus_lightning.emu.registry` (one per replica, sharded by the stage's TP x PP layout).
This rank's compute module for a stage is a :class:`~nereus_lightning.models.ShardedCausalLM`
built on its EMU's very tensors; a training stage's AdamW is bound to the EMU's optimizer tensors
(:func:`~nereus_lightning.models.bind_adamw`), so an optimizer step updates the EMU in place; a
sharded replica's (``Layout.shard > 1``) shard ranks each hold and step only their own row blocks of it
through a :class:`~nereus_lightning.models.zero.ZeroShards`, gathered whole only while something reads
the EMU whole (transitions, the weight sync, the logical state; checkpoints save the rows:
:mod:`~nereus_lightning.lightning.zero_units`). No
rank keeps a full model beyond what its units hold: the module's full transformers models are
released (emptied) once the units exist. After each update the fresh weights go from every
training stage to the other model-stages of its model (:func:`nereus_lightning.emu.sync.sync_params`).

The concerns live in their own modules, which this class composes:

* plan changes: :mod:`~nereus_lightning.lightning.transition_runner` (the brain's DAG through the
  EMU executor, or per-model-stage relayout);
* the optimizer step: :mod:`~nereus_lightning.lightning.stage_step`;
* where idle units wait: :mod:`~nereus_lightning.lightning.residency` (transitions and checkpoint
  saves bring the units they read back to the GPU first: the transfers and DCP run on device
  tensors under NCCL);
* the rollout engine of each generation model-stage: :mod:`~nereus_lightning.lightning.rollout_engines`
  (placed for every plan, fed the generation unit's shards on its own rank after each weight sync);
* checkpoints: :mod:`~nereus_lightning.lightning.unit_checkpoints`.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import astuple
from typing import Any

import torch
from torch import nn

from nereus_lightning import emu
from nereus_lightning.emu.sync import local_refill, sync_params
from nereus_lightning.emu.unit import Counters
from nereus_lightning.engines.base import GenerationSite, StageEngine
from nereus_lightning.engines.registry import engine_kind
from nereus_lightning.lightning.residency import Residency
from nereus_lightning.lightning.roles import RoleModels
from nereus_lightning.lightning.rollout_engines import RolloutEngines
from nereus_lightning.lightning.stage_step import StageUpdate, step_stage
from nereus_lightning.lightning.transition_runner import TransitionRun, run_transition
from nereus_lightning.lightning.unit_checkpoints import load_units, save_units, write_back
from nereus_lightning.lightning.zero_units import (
    as_shard_groups,
    at_rest,
    made_whole,
    module_params,
    sharded_optimizer,
    whole,
)
from nereus_lightning.models import ReplicaComm, ShardedCausalLM, bind_adamw, replica_groups
from nereus_lightning.models.groups import dp_ranks, zero_groups
from nereus_lightning.models.sharded import is_tied
from nereus_lightning.models.zero import ZeroShards
from nereus_lightning.plan.layout import Plan, moving_shard_groups
from nereus_lightning.plan.rows import recut_stages
from nereus_lightning.rl.update import ADAMW
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.workload import Workload, workflow


def release(model: nn.Module) -> None:
    """Drop a full model's tensors (each becomes an empty tensor of its dtype and device).

    Empty rather than meta tensors, so Lightning's device moves (``.cpu()`` at teardown) still work.
    """
    with torch.no_grad():
        for t in (*model.parameters(), *model.buffers()):
            t.data = torch.empty(0, dtype=t.dtype, device=t.device)


def _frozen(tensor: torch.Tensor) -> nn.Parameter:
    """``tensor`` as a parameter that takes no gradient (the same object when it already is one)."""
    return tensor if isinstance(tensor, nn.Parameter) else nn.Parameter(tensor, requires_grad=False)


class EMUStates:
    """This job's model-stage state in EMUs, and this rank's compute modules and rollout engines on them.

    Args:
        roles: the module's role models: they seed the first units (then are released), and
            name the model-stages, their learning rates, the rollout engine and its decoding.
        workload: the RL step the transition brain prices a plan change for.
        cluster: the cluster it prices and validates the transition DAG on.
    """

    def __init__(self, roles: RoleModels, workload: Workload, cluster: ClusterSpec) -> None:
        self.roles = roles
        self.workload = workload
        self.cluster = cluster
        self.stages = {m.name: m for m in workflow(roles.algorithm)}
        self.configs = roles.configs()  # role -> transformers config (kept when the models are released)
        self.plan: Plan | None = None  # the plan of the live units (model-stages with a model only)
        self.units: dict[str, ShardedCausalLM] = {}
        self.optimizers: dict[str, torch.optim.Optimizer | ZeroShards] = {}
        self.resume_from: str | None = None  # a checkpoint directory to load when the units are built
        # Model-stages holding exactly the weights of their model's training stage (built from the same
        # model, or synced since its last update): checkpoints store them once, in the training stage.
        self.synced: set[str] = set()
        self.last_report: Any = None  # the reduced ExecutionReport of the last DAG transition
        self.last_transition: dict[str, Any] = {}
        kind = engine_kind(roles.rollout_engine)
        self.engines = RolloutEngines(kind, workload.generation_engine, roles.decoding)
        self.residency_of = Residency(self.stages, self.engines)

    # ---- building ------------------------------------------------------------------------
    def _stateful(self, plan: Plan) -> Plan:
        return Plan.of({n: c for n, c in plan.items() if self.stages[n].model in self.configs})

    def ensure(self, plan: Plan, rank: int) -> bool:
        """Make the live units those of ``plan`` (collective); False if they already are, or if the brain
        found no safe transition (then ``last_transition["mode"] == "kept"`` and nothing moved)."""
        self.last_transition = {}
        target = self._stateful(plan)
        if self.plan == target:
            return False
        self.engines.check(self._generation_sites(target))  # refused before anything moves
        if (
            self.plan is not None
            and list(self.plan) == list(target)
            and all(c.same_units(target[n]) for n, c in self.plan.items())
        ):
            self._retune(target)
            return True
        self.residency_of.settle()  # the transition reads every unit
        if self.plan is None:
            self._create(target)
        else:
            self.residency_of.onload(self.plan)  # the transfers read and write device tensors
            run = self._transition(target)
            self.last_transition = run.record
            self.last_report = run.report if run.report is not None else self.last_report
            if not run.moved:
                self.residency_of.offload_idle(self.plan)
                return False  # infeasible per the brain: the current plan stays
        staying = {n for n, c in (self.plan or {}).items() if c.same_units(target[n]) and c.layout.shard > 1}
        self.plan = target
        self._build_modules(rank, staying)
        self.residency_of.offload_idle(target)
        self.engines.place(self._generation_sites(target, built=True))
        return True

    def _retune(self, target: Plan) -> None:
        """A plan with the same units and other micro-batches or recomputation: nothing moves and the
        modules, optimizers and engines stay (the step reads micro-batches from the plan)."""
        self.plan = target
        for name, module in self.units.items():
            module.recompute = target[name].recompute
        self.last_transition = {"mode": "retune", "bytes": 0}

    def _transition(self, target: Plan) -> TransitionRun:
        """Run the brain's transition to ``target``: sharded units whose shard degree alone changes are
        re-cut in their rows (:func:`~nereus_lightning.plan.rows.recut_stages`; ``emu.recut``); other
        sharded units that change move whole as their shard groups
        (:func:`~nereus_lightning.plan.layout.moving_shard_groups`), their rows gathered first, and stay
        whole for :meth:`_build_modules` to cut, or are cut back to their rows when nothing moved;
        sharded units that stay keep their rows, modules and optimizers."""
        assert self.plan is not None
        specs = self.roles.specs()
        model_of = {n: specs[self.stages[n].model] for n in self.plan}
        current, moved_to = moving_shard_groups(self.plan, target, recut_stages(self.plan, target, model_of))
        moving = [n for n in self.plan if (current[n], moved_to[n]) != (self.plan[n], target[n])]
        units = made_whole({n: self.optimizers[n] for n in moving if n in self.optimizers})
        as_shard_groups(Plan.of({n: self.plan[n] for n in moving}), grouped=True)
        run = run_transition(current, moved_to, specs, self.cluster, self.workload)
        as_shard_groups(Plan.of({n: (target if run.moved else self.plan)[n] for n in moving}), grouped=False)
        if not run.moved:
            for zero, state in units:
                at_rest(zero, state)
        return run

    def _create(self, plan: Plan) -> None:
        """First units of every model-stage from the full models (or a checkpoint), then release the full
        models.
        """
        reg = emu.registry()
        reg.clear()
        names = list(plan)
        models = self.roles.present()
        for name, cand in plan.items():
            ms = self.stages[name]
            model = models[ms.model]
            others = [o for o in names if o != name]
            # Every rank still has the full model here, so each replica cuts its own shards (no traffic).
            for unit in emu.replica_units(cand):
                emu.create_unit(
                    name, model.config, model, cand.layout, unit.gpus, trains=ms.trains, colocate_with=others
                )
        self.synced = set(self._sources(plan))
        if self.resume_from is not None:
            self.synced = load_units(self.resume_from, plan, self._sources(plan))
            self.resume_from = None
        for model in models.values():
            release(model)  # the units hold the state now

    def _sources(self, plan: Plan | None = None) -> dict[str, str]:
        """Each model-stage that does not train -> the training stage of its model, where ``plan`` has one."""
        plan = plan if plan is not None else self.plan or Plan.of({})
        trains = {self.stages[n].model: n for n in plan if self.stages[n].trains}
        return {
            n: trains[self.stages[n].model]
            for n in plan
            if not self.stages[n].trains and self.stages[n].model in trains
        }

    def holding_state(self) -> list[str]:
        """The model-stages whose units hold state of their own: not those that follow their training
        stage (see :meth:`sync_weights`)."""
        return [n for n in self.plan or () if n not in self.residency_of.following]

    def _local(self, name: str) -> emu.EMU | None:
        return emu.registry().mine(name)

    def _generation_sites(self, plan: Plan, built: bool = False) -> list[GenerationSite]:
        """Where the plan's generation model-stages run; ``built``: with this rank's units and their dtype."""
        out = []
        for name, cand in plan.items():
            if self.stages[name].stage != "generation":
                continue
            schema = emu.registry().schema(name) if built else None
            out.append(
                GenerationSite(
                    name,
                    tuple(tuple(cand.replica_gpus(r)) for r in range(cand.dp)),
                    cand.layout.tp,
                    cand.layout.pp,
                    self.configs[self.stages[name].model],
                    None if schema is None else schema.dtype_of(schema.names[0]),
                    self.units.get(name) if built else None,
                )
            )
        return out

    def _build_modules(self, rank: int, staying: set[str] | frozenset[str] = frozenset()) -> None:
        """This rank's ShardedCausalLM per model-stage on its EMU's tensors (collective: group creation).

        A sharded replica's shard ranks compute as replicas of their own
        (:meth:`~nereus_lightning.plan.layout.Candidate.shard_groups`); its training stage steps through a
        :class:`~nereus_lightning.models.zero.ZeroShards` on its row blocks, which the EMU then holds
        (:mod:`~nereus_lightning.lightning.zero_units`). The sharded model-stages ``staying`` (their units
        unchanged, holding their rows) keep their modules and optimizers.
        """
        kept = {n: (self.units[n], self.optimizers[n]) for n in staying if n in self.units}
        self.units, self.optimizers = {}, {}
        reg = emu.registry()
        assert self.plan is not None
        for name, cand in self.plan.items():
            ms = self.stages[name]
            config = self.configs[ms.model]
            tied = is_tied(config)
            compute = cand.shard_groups()
            replicas = [compute.replica_gpus(r) for r in range(compute.dp)]
            units = [cand.replica_gpus(r) for r in range(cand.dp)]
            replica_groups(replicas, compute.layout, tied)  # every rank, same order
            zero_groups(units, cand.layout)
            if rank not in cand.gpus:
                continue
            if name in kept:
                self.units[name], self.optimizers[name] = kept[name]
                self.units[name].recompute = cand.recompute
                continue
            index = cand.gpus.index(rank)
            unit = units[index // cand.layout.size]
            comm = ReplicaComm.of(
                replicas[index // compute.layout.size],
                compute.layout,
                rank,
                tied=tied,
                dp_ranks=dp_ranks(units, index % cand.layout.size),
            )
            state = reg.local(name, emu.Unit(cand.layout, tuple(unit)))
            if not ms.trains:
                # The module's parameters are the EMU's tensors themselves, so offload/onload move both.
                state.params = {n: _frozen(t) for n, t in state.params.items()}
            module = ShardedCausalLM(config, comm, module_params(state))
            module.recompute = cand.recompute  # as the planner priced the stage's activations
            module.layers = self.roles.layers
            if ms.trains:
                lr = self.roles.learning_rates.get(ms.model, 1e-3)
                self.optimizers[name] = (
                    bind_adamw(module, state.optim_state, lr=lr, **ADAMW)
                    if cand.layout.shard == 1
                    else sharded_optimizer(module, state, cand.layout, unit, lr)
                )
            self.units[name] = module

    # ---- residency and generation ----------------------------------------------------------
    def in_use(self, model_stage: str) -> AbstractContextManager[None]:
        """This rank's unit of ``model_stage`` on its device while the block runs, back on the host after
        (see :class:`~nereus_lightning.lightning.residency.Residency`)."""
        return self.residency_of.in_use(model_stage)

    def residency(self) -> dict[str, bool]:
        """Whether this rank's unit of each model-stage is on its compute device (model-stages it holds)."""
        return self.residency_of.of(self.plan or {})

    def rollout_engine(self, model_stage: str) -> StageEngine:
        """This rank's rollout engine of generation model-stage ``model_stage``, holding its unit's current
        weights (see :class:`~nereus_lightning.lightning.rollout_engines.RolloutEngines`)."""
        return self.engines.engine(model_stage)

    # ---- compute -------------------------------------------------------------------------
    def stage(self, model_stage: str) -> ShardedCausalLM | None:
        """This rank's compute module of ``model_stage`` (None: not a member)."""
        return self.units.get(model_stage)

    def trainable(self, model_stage: str) -> ShardedCausalLM | None:
        """This rank's compute module of training stage ``model_stage`` ready for a training pass (None:
        not a member): a ZeRO-3 replica's parameters gathered from its shard group (collective over it:
        every member calls it, with rows to train or not), released again by :meth:`update`."""
        optimizer = self.optimizers.get(model_stage)
        if isinstance(optimizer, ZeroShards):
            optimizer.gather()
        return self.units.get(model_stage)

    def training_stages(self) -> list[str]:
        """The training model-stages with live units, in workflow order."""
        return [n for n in (self.plan or {}) if self.stages[n].trains]

    def update(self, model_stage: str, max_norm: float = 1.0, samples: int = 0) -> StageUpdate:
        """Sum gradients over the stage's replicas, clip, and step its EMU-bound AdamW
        (:func:`~nereus_lightning.lightning.stage_step.step_stage`).

        Every rank of the model-stage calls it; a rank outside it gets ``StageUpdate(None)``. The
        unit's counters advance with a step (one optimizer step, one update and policy version,
        ``samples`` more samples consumed), so they travel with the state through transitions and
        checkpoints.
        """
        # (every rank: whatever the outcome, the model's other stages may no longer hold its weights)
        self.synced -= {n for n, train in self._sources().items() if train == model_stage}
        module = self.units.get(model_stage)
        if module is None:
            return StageUpdate(None)
        result = step_stage(module, self.optimizers[model_stage], max_norm)
        if result.problem is None:
            step = Counters(optimizer_step=1, update_count=1, policy_version=1, sample_position=samples)
            self._advance(model_stage, step)
        return result

    def _advance(self, model_stage: str, steps: Counters) -> None:
        """Add ``steps`` to this rank's unit counters of ``model_stage`` (every member does the same)."""
        unit = self._local(model_stage)
        if unit is not None:
            now = zip(astuple(unit.counters), astuple(steps), strict=True)
            unit.counters = Counters(*(a + b for a, b in now))

    def sync_weights(self) -> None:
        """Copy each training stage's fresh parameters into the other model-stages of its model
        (collective); a rollout engine with weights of its own takes them at its next use.

        A model-stage whose sync moves nothing between ranks follows its training stage instead
        (:meth:`~nereus_lightning.lightning.residency.Residency.follow`): its unit is refilled from the
        training stage's shards on the device at each use, not written to its host copies now.
        """
        assert self.plan is not None
        sources = self._sources()
        # A sharded training stage holds its rows at rest: none follows it, its syncs gather them (below).
        refills = {
            n: local_refill(train, n)
            for n, train in sources.items()
            if self.plan[train].layout.shard == 1 and self.residency_of.can_follow(n)
        }
        trains = {n: o for n, o in self.optimizers.items() if n in sources.values()}
        with whole(trains, optim=False):
            for name, train in sources.items():
                refill = refills.get(name)
                if refill is not None:
                    self.residency_of.follow(name, train, refill)
                else:
                    sync_params(train, name)
                # a new policy version in this model-stage (one sync per update)
                self._advance(name, Counters(policy_version=1, stage_version=1))
                self.synced.add(name)

    # ---- state ---------------------------------------------------------------------------
    def save(self, path: str, step: int | None = None) -> None:
        """Every model-stage's logical state into ``path/<model_stage>`` (collective; see
        :func:`~nereus_lightning.lightning.unit_checkpoints.save_units`): a model-stage holding exactly
        its training stage's weights (:attr:`synced` on every rank) with its counters only; a sharded
        one as the row blocks it holds (nothing gathered).
        """
        assert self.plan is not None
        save_units(path, self.plan, self.stages, self.synced, self._sources(), step)

    def write_back(self, dst: int | None = None) -> None:
        """Put every role's logical parameters back into its (released) full model (collective).

        On every rank (``dst=None``) or on rank ``dst`` only. The end of fit uses ``dst=0``:
        Lightning's launcher hands rank 0's module weights to the caller.
        """
        assert self.plan is not None
        with whole(self.optimizers):
            write_back(self.plan, self.stages, self.roles.present(), dst)

    def logical_state(self, model_stage: str) -> emu.LogicalState | None:
        """The full state of ``model_stage`` on rank 0 (None elsewhere; collective)."""
        with whole(self.optimizers):
            return emu.gather_logical_state(model_stage, dst=0)

    def logical_params(self, model_stage: str) -> dict[str, torch.Tensor] | None:
        """The full parameters of ``model_stage`` on rank 0 (None elsewhere; collective)."""
        state = self.logical_state(model_stage)
        return None if state is None else state.params


__all__ = ["EMUStates", "StageUpdate", "release"]
