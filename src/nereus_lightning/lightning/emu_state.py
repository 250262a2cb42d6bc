"""`EMUStates`: every model-stage's state in Elastic Model Units on the ranks its plan gives it.

:class:`~nereus_lightning.lightning.strategy.NereusStrategy` holds one and is the only caller; the
LightningModule reaches the units through the strategy's interface (``stage``, ``update``,
``sync_weights``, ...).

Each model-stage with a model (actor, critic, reference, reward roles) is a set of live EMUs in
:func:`nereus_lightning.emu.registry` (one per replica, sharded by the stage's TP x PP layout).
This rank's compute module for a stage is a :class:`~nereus_lightning.models.ShardedCausalLM`
built on its EMU's very tensors; a training stage's AdamW is bound to the EMU's optimizer tensors
(:func:`~nereus_lightning.models.bind_adamw`), so an optimizer step updates the EMU in place. No
rank keeps a full model beyond what its units hold: the module's full transformers models are
released (emptied) once the units exist.

A plan change runs the transition brain's DAG (``build_transition``, priced on the strategy's
cluster) through the EMU executor (``execute_dag``) on every rank; plans the brain does not model
(model-stages of one stage sharing GPUs, as in the all-data-parallel fallback) move each model-stage with
:func:`nereus_lightning.emu.sync.relayout` (the same transfer plans). After each update the
fresh weights go from every training stage to the other model-stages of its model
(:func:`nereus_lightning.emu.sync.sync_params`).

Memory between uses follows the planner's rule (``plan.memory.boundary_state_bytes``): training
state stays on its GPUs; a generation or inference unit lives in host memory and is on its GPU
only while its model-stage runs (:meth:`EMUStates.in_use`), so model-stages sharing a GPU take it
in turn. Its EMU tensors are its module's parameters (the same objects), so
:meth:`~nereus_lightning.emu.EMU.offload` / ``onload`` move both. Weight sync writes into the host
copies; transitions and checkpoint saves bring the units they read back to the GPU first (the
transfers and DCP run on device tensors under NCCL).

With ``rollout_engine="vllm"`` every rank of a generation replica also holds one vLLM engine
(:class:`~nereus_lightning.engines.vllm_engine.VLLMInstance`, the replica a vLLM world of its own),
rebuilt when a transition changes the generation layout; the generation unit's shards go into
the engine on the same rank (no gather) before the first generation after each weight sync, and
the engine sleeps (frees its GPU memory) once its model-stage has run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import astuple, dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from nereus_lightning import emu
from nereus_lightning.emu.sync import relayout, sync_params
from nereus_lightning.emu.unit import Counters
from nereus_lightning.engines.vllm_engine import VLLMInstance, build_engine, check_replicas, check_vocabulary
from nereus_lightning.lightning.roles import RoleModels
from nereus_lightning.models import ReplicaComm, ShardedCausalLM, bind_adamw, clip_grad_norm_, replica_groups
from nereus_lightning.models.groups import dp_ranks, prepare_groups
from nereus_lightning.models.sharded import is_tied
from nereus_lightning.plan.layout import Candidate, Plan
from nereus_lightning.rl.update import ADAMW
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import CheckpointError, InfeasiblePlanError, NereusConfigError
from nereus_lightning.spec.workload import Workload, workflow

#: In a checkpoint's ``emu/<model_stage>/`` saved without weights: the training stage that holds them.
WEIGHTS_FROM = "weights_from.json"
log = logging.getLogger(__name__)


def _read_weights_from(path: str, plan: Plan) -> dict[str, str]:
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


def _require_masters_held(directory: str, model_stage: str) -> None:
    """Refuse (every rank alike) a model-stage directory that stores parameters as their fp32 masters only
    where this job's units hold them otherwise (another ``trainer.precision``): no master would fill them.
    """
    from nereus_lightning.emu.dcp_state import (
        PARAMS_FROM_MASTERS,
        params_from_masters,
        read_params_from_masters,
    )

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


def _units_of(plan: Plan, name: str) -> list[emu.Unit]:
    cand = plan[name]
    return [emu.Unit(cand.layout, tuple(cand.replica_gpus(r))) for r in range(cand.dp)]


def _tp_rank_sets(plan: Plan) -> list[tuple[int, ...]]:
    """The TP groups DCP meshes use (one per pipeline stage of every replica)."""
    out = []
    for name in plan:
        for unit in _units_of(plan, name):
            tp = unit.layout.tp
            out += [unit.gpus[p * tp : (p + 1) * tp] for p in range(unit.layout.pp)]
    return out


def _dag_rank_sets(dag: Any) -> list[tuple[int, ...]]:
    """Every rank set the executor's primitives will communicate over (same list on every rank)."""
    from nereus_lightning.emu.executor import ops_of

    reg = emu.registry()
    out: list[tuple[int, ...]] = []
    for op in (op for node in dag.nodes for op in ops_of(node)):  # a batched node: one op per lane
        if isinstance(op, emu.Extend):
            for i, sender in enumerate(op.source.gpus):
                out.append((sender, *(u.gpus[i] for u in op.targets)))
        elif isinstance(op, (emu.Split, emu.Merge)):
            name = op.model_stage
            out.append(emu.reshard_plan(op, reg.schema(name), reg.trains[name]).ranks())
    return out


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


@dataclass(frozen=True)
class StageUpdate:
    """What one optimizer step of a training model-stage found (see :meth:`EMUStates.update`)."""

    norm: float | None  # the global gradient norm; None on a rank outside the model-stage
    problem: str | None = None  # the first non-finite gradient when ``norm`` is not finite (nothing stepped)


class EMUStates:
    """This job's model-stage state in EMUs, and this rank's compute modules on them.

    Args:
        roles: the module's role models: they seed the first units (then are released), and
            name the model-stages, their learning rates and the rollout engine.
        workload: the RL step the transition brain prices a plan change for.
        cluster: the cluster it prices and validates the transition DAG on.
    """

    def __init__(self, roles: RoleModels, workload: Workload, cluster: ClusterSpec) -> None:
        self.roles = roles
        self.workload = workload
        self.cluster = cluster
        self.vllm: VLLMInstance | None = None  # this rank's engine (rollout_engine="vllm")
        self._vllm_key: tuple | None = None  # the (layout, gpus) of the generation stage it serves
        self._vllm_stale = False  # the generation units hold newer weights than the engine
        self.stages = {m.name: m for m in workflow(roles.algorithm)}
        self.configs = roles.configs()  # role -> transformers config (kept when the models are released)
        self.plan: Plan | None = None  # the plan of the live units (model-stages with a model only)
        self.units: dict[str, ShardedCausalLM] = {}
        self.optimizers: dict[str, torch.optim.Optimizer] = {}
        self.resume_from: str | None = None  # a checkpoint directory to load when the units are built
        # Model-stages holding exactly the weights of their model's training stage (built from the same
        # model, or synced since its last update): checkpoints store them once, in the training stage.
        self.synced: set[str] = set()
        self.last_report: Any = None  # the reduced ExecutionReport of the last DAG transition
        self.last_transition: dict[str, Any] = {}

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
        if self.roles.rollout_engine == "vllm":
            self._generation_candidate(target)  # refuse a layout vLLM cannot take before anything moves
        if self.plan is None:
            self._create(target)
        else:
            self._onload_all()  # the transfers read and write device tensors
            if not self._move(self.plan, target):
                self._offload_idle()
                return False  # infeasible per the brain: the current plan stays
        self.plan = target
        self._build_modules(rank)
        self._offload_idle()
        if self.roles.rollout_engine == "vllm":
            self._refresh_vllm()
        return True

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
            for unit in _units_of(plan, name):
                emu.create_unit(
                    name, model.config, model, cand.layout, unit.gpus, trains=ms.trains, colocate_with=others
                )
        self.synced = set(self._sources(plan))
        if self.resume_from is not None:
            self._load(plan, self.resume_from)
            self.resume_from = None
        for model in models.values():
            release(model)  # the units hold the state now

    def _load(self, plan: Plan, path: str) -> None:
        """Fill the new units from the checkpoint directory ``path`` (``<checkpoint>/emu``; collective)."""
        from nereus_lightning.emu.dcp_state import load_state

        weights_from = _read_weights_from(path, plan)
        sources = self._sources(plan)
        wrong = {n: s for n, s in weights_from.items() if sources.get(n) != s}
        if wrong:
            raise CheckpointError(
                f"ckpt_path: {path} takes the weights of {wrong} (<stage>/{WEIGHTS_FROM}) from training "
                f"stages this job's plan does not pair them with ({sources}); resume with the algorithm "
                "that wrote it"
            )
        for name in plan:
            if name not in weights_from:
                _require_masters_held(os.path.join(path, name), name)
        prepare_groups(_tp_rank_sets(plan))
        for name in plan:
            load_state(self._local(name), os.path.join(path, name), weights=name not in weights_from)
        for name, source in weights_from.items():
            sync_params(source, name)
        self.synced = set(weights_from)

    def _sources(self, plan: Plan | None = None) -> dict[str, str]:
        """Each model-stage that does not train -> the training stage of its model, where ``plan`` has one."""
        plan = plan if plan is not None else self.plan or Plan.of({})
        trains = {self.stages[n].model: n for n in plan if self.stages[n].trains}
        return {
            n: trains[self.stages[n].model]
            for n in plan
            if not self.stages[n].trains and self.stages[n].model in trains
        }

    def _local(self, name: str) -> emu.EMU | None:
        return next((e for e in emu.registry().units.get(name, {}).values() if e is not None), None)

    def _move(self, current: Plan, target: Plan) -> bool:
        """Move every model-stage from ``current`` to ``target``: the brain's DAG, or per-stage relayout.

        Returns False (nothing moved, ``last_transition["mode"] == "kept"``) when the brain finds
        no safe transition (``InfeasiblePlanError``); plans it does not model at all
        (``NereusConfigError``, e.g. model-stages of one stage sharing GPUs) move per model-stage.
        """
        from nereus_lightning import transition

        start = time.perf_counter()
        dag = None
        reason = ""
        try:
            specs = self.roles.specs()
            dag = transition.build_transition(current, target, specs, self.cluster, self.workload)
        except InfeasiblePlanError as exc:
            log.warning("transition to the new plan is infeasible (%s); keeping the current plan", exc)
            self.last_transition = {"mode": "kept", "reason": str(exc), "bytes": 0}
            return False
        except NereusConfigError as exc:
            reason = str(exc)
        info: dict[str, Any] = {"mode": "relayout", "reason": reason}
        if dag is not None:
            prepare_groups(_dag_rank_sets(dag))
            report = emu.execute_dag(dag)
            self.last_report = report.reduce()
            counts = dag.counts()
            info = {
                "mode": "dag",
                "counts": {k: int(v) for k, v in counts.items()},
                "bytes": sum(o.measured_bytes for o in self.last_report.node_observations()),
                "predicted_bytes": sum(o.predicted_bytes for o in self.last_report.node_observations()),
                "observations": self.last_report.node_observations(),
                "predicted_s": float(dag.cost),
            }
        else:
            moved = 0
            for name in target:
                if current[name] != target[name]:
                    traffic, _ = relayout(name, _units_of(target, name))
                    moved += traffic.payload_received
            box = torch.tensor([moved], dtype=torch.int64)
            dist.all_reduce(box)
            info["bytes"] = int(box.item())
            if reason:
                log.info("transition outside the brain's model (%s): per-model-stage relayout", reason)
        info["seconds"] = time.perf_counter() - start
        self.last_transition = info
        return True

    def _build_modules(self, rank: int) -> None:
        """This rank's ShardedCausalLM per model-stage on its EMU's tensors (collective: group creation)."""
        self.units, self.optimizers = {}, {}
        reg = emu.registry()
        assert self.plan is not None
        for name, cand in self.plan.items():
            ms = self.stages[name]
            config = self.configs[ms.model]
            tied = is_tied(config)
            replicas = [cand.replica_gpus(r) for r in range(cand.dp)]
            replica_groups(replicas, cand.layout, tied)  # every rank, same order
            if rank not in cand.gpus:
                continue
            index = cand.gpus.index(rank)
            replica = replicas[index // cand.layout.size]
            position = index % cand.layout.size
            comm = ReplicaComm.of(
                replica, cand.layout, rank, tied=tied, dp_ranks=dp_ranks(replicas, position)
            )
            state = reg.local(name, emu.Unit(cand.layout, tuple(replica)))
            if not ms.trains:
                # The module's parameters are the EMU's tensors themselves, so offload/onload move both.
                state.params = {n: _frozen(t) for n, t in state.params.items()}
            module = ShardedCausalLM(config, comm, state.params)
            module.recompute = cand.recompute  # as the planner priced the stage's activations
            if ms.trains:
                lr = self.roles.learning_rates.get(ms.model, 1e-3)
                self.optimizers[name] = bind_adamw(module, state.optim_state, lr=lr, **ADAMW)
            self.units[name] = module

    # ---- residency -------------------------------------------------------------------------
    @contextmanager
    def in_use(self, model_stage: str) -> Iterator[None]:
        """This rank's unit of ``model_stage`` on its device while the block runs, back on the host after.

        Training units never leave their device. With ``rollout_engine="vllm"`` a generation
        unit stays on the host: the engine computes, and takes the unit's shards from there.
        """
        unit = self._local(model_stage)
        if unit is None or self.stages[model_stage].trains:
            yield
            return
        engine = self.vllm if self.stages[model_stage].stage == "generation" else None
        if engine is None:
            unit.onload()
        try:
            yield
        finally:
            self._offload(model_stage)
            if engine is not None:
                engine.sleep()

    def residency(self) -> dict[str, bool]:
        """Whether this rank's unit of each model-stage is on its compute device (model-stages it holds)."""
        return {n: unit.resident for n in (self.plan or {}) if (unit := self._local(n)) is not None}

    def _offload(self, model_stage: str) -> None:
        """Move this rank's idle unit of a non-training model-stage to the host (its static decoder is freed
        first).
        """
        unit = self._local(model_stage)
        if unit is None or self.stages[model_stage].trains:
            return
        module = self.units.get(model_stage)
        if module is not None:
            from nereus_lightning.engines.static import release_decoder

            release_decoder(module)  # its KV cache and graphs hold device memory and the old addresses
        unit.offload()

    def _offload_idle(self) -> None:
        """Every non-training unit of this rank to the host (between their uses)."""
        for name in self.plan or {}:
            self._offload(name)

    def _onload_all(self) -> None:
        """Every unit of this rank back on its device (before transfers that run on device tensors)."""
        for name in self.plan or {}:
            unit = self._local(name)
            if unit is not None:
                unit.onload()

    # ---- vLLM generation ------------------------------------------------------------------
    def _generation_candidate(self, plan: Plan) -> Candidate:
        """The one candidate of the plan's generation model-stages, checked for vLLM's engines."""
        gens = [n for n in plan if self.stages[n].stage == "generation"]
        cands = {(plan[n].layout, plan[n].gpus) for n in gens}
        if len(cands) != 1:
            raise NereusConfigError(
                f"algorithm.rollout_engine=vllm: one vLLM layout per process, but the plan gives {gens} "
                f"{sorted(str(plan[n].describe()) for n in gens)}; use rollout_engine=hf for this plan"
            )
        cand = plan[gens[0]]
        check_replicas([cand.replica_gpus(r) for r in range(cand.dp)], cand.layout.pp, f"plan.{gens[0]}")
        vocab = int(self.configs[self.stages[gens[0]].model].vocab_size)
        check_vocabulary(vocab, cand.layout.tp, f"plan.{gens[0]} (actor vocab_size)")
        return cand

    def _refresh_vllm(self) -> None:
        """Build this rank's vLLM engine for the plan's generation layout unless it serves it already
        (collective).
        """
        assert self.plan is not None
        cand = self._generation_candidate(self.plan)
        key = (cand.layout, cand.gpus)
        if key == self._vllm_key:
            return
        name = next(n for n in self.plan if self.stages[n].stage == "generation")
        schema = emu.registry().schema(name)
        if self.vllm is not None:
            self.vllm.close()
        self.vllm = build_engine(  # None on a rank outside the generation replicas
            self.configs[self.stages[name].model],
            [cand.replica_gpus(r) for r in range(cand.dp)],
            schema.dtype_of(schema.names[0]),
            self.workload.generation_engine,
        )
        self._vllm_key = key
        self._vllm_stale = True

    def vllm_instance(self, model_stage: str) -> VLLMInstance:
        """This rank's vLLM engine for generation model-stage ``model_stage``, holding its unit's current
        weights.

        The unit's shards go into the engine here, on this rank, when a sync or a rebuild made them newer.
        """
        unit, engine = self._local(model_stage), self.vllm
        if engine is None or unit is None:
            raise NereusConfigError(
                f"algorithm.rollout_engine: {model_stage}: no vLLM engine with a unit on rank "
                f"{dist.get_rank()}"
            )
        if self._vllm_stale:
            schema = unit.schema
            tp_rank = unit.unit.gpus.index(unit.rank)  # PP 1: the position is the TP rank
            engine.load(
                unit.params, schema.shape_of, schema.placements, tp_rank, unit.counters.policy_version
            )
            self._vllm_stale = False
        return engine

    # ---- compute -------------------------------------------------------------------------
    def stage(self, model_stage: str) -> ShardedCausalLM | None:
        """This rank's compute module of ``model_stage`` (None: not a member)."""
        return self.units.get(model_stage)

    def training_stages(self) -> list[str]:
        """The training model-stages with live units, in workflow order."""
        return [n for n in (self.plan or {}) if self.stages[n].trains]

    def update(self, model_stage: str, max_norm: float = 1.0, samples: int = 0) -> StageUpdate:
        """Sum gradients over the stage's replicas, clip, and step its EMU-bound AdamW.

        Every rank of the model-stage calls it (absent gradients count as zeros); a rank outside
        it gets ``StageUpdate(None)``. When the global gradient norm is not finite, nothing is
        stepped, the gradients are dropped and the update names the first parameter here whose
        gradient is not finite. The unit's counters advance with a step (one optimizer step, one
        update and policy version, ``samples`` more samples consumed), so they travel with the
        state through transitions and checkpoints.
        """
        # (every rank: whatever the outcome, the model's other stages may no longer hold its weights)
        self.synced -= {n for n, train in self._sources().items() if train == model_stage}
        unit = self.units.get(model_stage)
        if unit is None:
            return StageUpdate(None)
        params = list(unit.parameters())
        grads: list[torch.Tensor] = []  # per parameter its gradient (clipped and reduced in place)
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        dp_group = unit.comm.dp_group
        if dp_group is not None:
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat, group=dp_group)
            offset = 0
            for g in grads:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        norm = float(clip_grad_norm_(unit, max_norm))
        problem = None
        if math.isfinite(norm):
            self.optimizers[model_stage].step()
            step = Counters(optimizer_step=1, update_count=1, policy_version=1, sample_position=samples)
            self._advance(model_stage, step)
        else:
            named = zip(unit.named_parameters(), grads, strict=True)
            names = [n for (n, _), g in named if not bool(torch.isfinite(g).all())]
            problem = f"first non-finite gradient here: {names[0]}" if names else "non-finite on another rank"
        for p in params:
            p.grad = None
        return StageUpdate(norm, problem)

    def _advance(self, model_stage: str, steps: Counters) -> None:
        """Add ``steps`` to this rank's unit counters of ``model_stage`` (every member does the same)."""
        unit = self._local(model_stage)
        if unit is not None:
            now = zip(astuple(unit.counters), astuple(steps), strict=True)
            unit.counters = Counters(*(a + b for a, b in now))

    def sync_weights(self) -> None:
        """Copy each training stage's fresh parameters into the other
        model-stages of its model (collective).
        """
        assert self.plan is not None
        for name, train in self._sources().items():
            sync_params(train, name)
            # a new policy version in this model-stage (one sync per update)
            self._advance(name, Counters(policy_version=1, stage_version=1))
            self.synced.add(name)
        self._vllm_stale = self.vllm is not None

    # ---- state ---------------------------------------------------------------------------
    def save(self, path: str, step: int | None = None) -> None:
        """Every model-stage's logical state through DCP into ``path/<model_stage>`` (collective); each also
        holds ``step`` (the global step, see :data:`~nereus_lightning.emu.dcp_state.STEP_KEY`) when given.

        A model-stage that holds exactly its training stage's weights (:attr:`synced` on every rank)
        is saved with its counters only and ``path/<model_stage>/weights_from.json`` names the
        training stage; loading syncs it from there (``actor_gen`` and ``actor_infer`` of a 0.5B
        actor are 2 GB of the checkpoint's 9 GB).
        """
        from nereus_lightning.emu.dcp_state import save_states

        assert self.plan is not None
        views: list[Any] = [sorted(self.synced)]  # per rank (filled by the gather)
        if dist.is_initialized():
            views = [None] * dist.get_world_size()
            dist.all_gather_object(views, sorted(self.synced))
        everywhere = set.intersection(*(set(v) for v in views))
        weights_from = {n: train for n, train in self._sources().items() if n in everywhere}
        prepare_groups(_tp_rank_sets(self.plan))
        # Each unit from where it is: an idle one from its pinned host memory, a resident one staged
        # in page-locked host memory first. Training units (resident) go last: they are staged while
        # the others are written, and being consecutive they go to different writers, so that PPO's
        # two are written at once (emu.dcp_state.save_states).
        order = sorted(self.plan, key=lambda n: self.stages[n].trains)
        save_states([(n, os.path.join(path, n), n not in weights_from) for n in order], step)
        if not dist.is_initialized() or dist.get_rank() == 0:
            for name, train in weights_from.items():
                with open(os.path.join(path, name, WEIGHTS_FROM), "w") as f:
                    json.dump({"weights_from": train}, f)
        if dist.is_initialized():  # the checkpoint is whole on return, on every rank (a load may follow)
            dist.barrier()

    def write_back(self, dst: int | None = None) -> None:
        """Put every role's logical parameters back into its (released) full model (collective).

        On every rank (``dst=None``) or on rank ``dst`` only. The end of fit uses ``dst=0``:
        Lightning's launcher hands rank 0's module weights to the caller.
        """
        assert self.plan is not None
        models = self.roles.present()
        done: set[str] = set()
        for name in self.plan:
            role = self.stages[name].model
            model = models.get(role)
            if role in done or model is None:
                continue
            if (
                any(self.stages[o].model == role and self.stages[o].trains for o in self.plan)
                and not self.stages[name].trains
            ):
                continue  # the training stage holds the role's freshest state
            state = emu.gather_logical_state(name, dst=dst)
            done.add(role)
            if state is None:
                continue  # not rank ``dst``
            with torch.no_grad():
                for pname, param in model.named_parameters():
                    param.data = state.params[pname].clone()

    def logical_params(self, model_stage: str) -> dict[str, torch.Tensor] | None:
        """The full parameters of ``model_stage`` on rank 0 (None elsewhere; collective)."""
        state = emu.gather_logical_state(model_stage, dst=0)
        return None if state is None else state.params
