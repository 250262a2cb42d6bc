"""`NereusStrategy`: a Lightning `ParallelStrategy` whose parallel layout may change between steps.

The strategy sets up one process group over all ranks (gloo on CPU, NCCL on GPUs), holds the
current :class:`~nereus_lightning.plan.layout.Plan` (which ranks run each model-stage, in which
layout) and owns every model-stage's Elastic Model Units (:class:`EMUStates`): it cuts them from
the LightningModule's role models at setup (the module is a
:class:`~nereus_lightning.lightning.roles.RoleModule`), moves them when the callback hands it an
admitted plan (``transition``, at the safe boundary before the next step), syncs weights,
offloads idle units and checkpoints them. The module holds the algorithm and computes through
the strategy's small interface: :meth:`~NereusStrategy.slot` (its rows of the global batch),
:meth:`~NereusStrategy.stage` (this rank's compute module of a model-stage),
:meth:`~NereusStrategy.rollout_engine` (the rollout engine of a generation model-stage),
:meth:`~NereusStrategy.in_use`, :meth:`~NereusStrategy.update` (the optimizer step) and
:meth:`~NereusStrategy.sync_weights`. Ranks outside the GPU pool stay alive as processes but get
no work from the plan.

Checkpoints are layout-independent: every model-stage's logical state (parameters, optimizer
state and counters by parameter name) goes through ``torch.distributed.checkpoint`` into
``emu/<model_stage>/``, so a run saved under one plan and world size resumes under another. The
rest (step, loops, callback states) is JSON (:mod:`nereus_lightning.lightning.checkpoint`);
nothing is pickled, a save with non-finite state is refused, and a directory is renamed into
place only when complete.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager, suppress
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, cast

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from torch import Tensor
from typing_extensions import override

from nereus_lightning.control.follower import data_parallel_plan
from nereus_lightning.engines.base import StageEngine
from nereus_lightning.lightning.checkpoint import (
    META_FILE,
    StoredCheckpoint,
    check_step_tensors,
    commit,
    encode,
    read_metadata,
    remove,
    staging_path,
    write_metadata,
)
from nereus_lightning.lightning.devices import auto_cluster
from nereus_lightning.lightning.emu_state import EMUStates, StageUpdate
from nereus_lightning.lightning.integrity import (
    FileRecord,
    describe,
    differing,
    digests,
    mismatch_error,
    own_files,
    share,
)
from nereus_lightning.lightning.launch import check_launch, launch_of
from nereus_lightning.lightning.roles import RoleModels, RoleModule
from nereus_lightning.lightning.stages import StageSlot, slot_of
from nereus_lightning.models import ShardedCausalLM
from nereus_lightning.plan.layout import Plan
from nereus_lightning.spec.cluster import ClusterSpec, cluster_preset
from nereus_lightning.spec.errors import CheckpointError, NereusConfigError, require

log = logging.getLogger(__name__)

STATE = "emu"  # what a checkpoint's metadata says holds its tensors (``emu/<model_stage>/``)


class NereusStrategy(ParallelStrategy):
    """Adaptive DP/TP/PP for RL post-training, as a Lightning strategy (registered as ``"nereus"``).

    Args:
        plan: the initial plan; ``None`` lets the callback's controller choose one before step 0
            (every model-stage data-parallel over all ranks until then).
        start_method: ``None`` (default): ``"fork"`` on CPU (fast start, works in notebooks) and
            ``"popen"`` on GPUs (forking after CUDA is initialised is unsafe); or ``"spawn"``,
            or ``"popen"`` (re-run the script per rank, as Lightning's DDP does).
        process_group_backend: ``"gloo"`` / ``"nccl"``; by default from the device.
        timeout: collective timeout; a rank that dies makes the others fail after it.
        cluster: the cluster (a ``ClusterSpec`` or preset name: memory, FLOP/s, links) the
            transition DAG is priced and validated on, shaped as the launch (``num_nodes`` x
            processes per node, :attr:`topology`); give the one the controller plans on.
            ``"auto"`` (the default): ``cpu4`` on CPU ranks, else the GPU this job has
            (:func:`~nereus_lightning.lightning.devices.auto_cluster`). Every rank prices on
            rank 0's.
        export_hf: which checkpoints also hold ``hf/<model>/`` per trainable model (``save_pretrained``
            in safetensors plus the tokenizer, written by rank 0): ``"end"`` the one at the Trainer's
            ``max_steps``, ``"every"`` (or True) each, ``"never"`` (or False) none.
        write_back: at the end of ``fit``, gather every role's trained parameters into the
            module's full models (``module.actor`` ...) on rank 0 and, when Lightning forked the
            ranks, into the caller's module. Off by default: it moves every full model through
            one process (use the checkpoint's ``hf/`` folders or ``nereus-export`` instead).
    """

    strategy_name = "nereus"

    def __init__(
        self,
        plan: Plan | None = None,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | float = timedelta(seconds=120),
        start_method: Literal["fork", "spawn", "popen"] | None = None,
        cluster: ClusterSpec | str = "auto",
        export_hf: str | bool = "end",
        write_back: bool = False,
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        require(
            start_method in (None, "fork", "spawn", "popen"),
            "strategy.start_method",
            f"{start_method!r} is not one of 'fork', 'spawn', 'popen'",
        )
        self.export_hf = export_mode(export_hf)
        self.write_back = write_back
        if cluster != "auto" and isinstance(cluster, str):
            cluster = cluster_preset(cluster)  # an unknown name fails here, listing the presets
        self.cluster: ClusterSpec | str = cluster
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self._start_method = start_method
        self.plan: Plan | None = plan
        self.transitions: list[dict[str, Any]] = []
        self._units: EMUStates | None = None  # every model-stage's units (built at setup)
        #: The run's :class:`~nereus_lightning.lightning.preemption.Preemption` (it registers itself).
        self.preemption: Any = None
        #: Why ``fit`` stopped before ``max_steps``: the signal, the step and the checkpoint written (None: it
        #: did not); carried to the launching process too.
        self.stopped: dict[str, Any] | None = None
        #: The step in flight was dropped on a stop signal (every rank; nothing of it changed any state).
        self.step_abandoned = False
        self._hash_s = 0.0  # seconds the last save spent hashing its files (logged)

    @classmethod
    def without_trainer(
        cls, module: pl.LightningModule, plan: Plan | None = None, **kwargs: Any
    ) -> NereusStrategy:
        """The strategy of ``module`` in this process's initialised default process group, without a Trainer.

        For code that drives RL steps itself (tests, benchmarks): ``transition(plan)``, then
        ``module.rl_step(step, strategy)``. ``kwargs`` are the constructor's (``cluster``, ...).
        """
        env = LightningEnvironment()
        env.set_global_rank(dist.get_rank())
        env.set_world_size(dist.get_world_size())
        strategy = cls(plan, parallel_devices=[module.device], cluster_environment=env, **kwargs)
        strategy.connect(module)
        strategy._hold(module)
        return strategy

    # ---- processes and the process group ------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def num_nodes(self) -> int:
        """Nodes of the job (the Trainer sets this)."""
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        """Processes on this node."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        # Every rank sees the whole global batch; the plan partitions it per model-stage.
        return {"num_replicas": 1, "rank": 0}

    @property
    def topology(self) -> ClusterSpec:
        """The cluster the job runs on (the given one, or what ``"auto"`` detects) shaped as the
        launch, ``num_nodes`` x processes per node, so TP groups are priced inside a node and the
        rest across nodes as they really are."""
        return self._cluster().on_nodes(self.num_nodes, max(self.world_size // self.num_nodes, 1))

    def _cluster(self) -> ClusterSpec:
        """The given cluster, or for ``"auto"`` the one the job's devices make."""
        if isinstance(self.cluster, ClusterSpec):
            return self.cluster
        devices = self.parallel_devices or [torch.device("cpu")]  # one kind of device per job
        return auto_cluster(devices[0].type != "cpu", 1, 1)

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        # Before any process starts: the Trainer's num_nodes x devices must be the job the launcher started.
        check_launch(launch_of(self.cluster_environment), self.num_nodes, self.num_processes)
        if self.cluster_environment.creates_processes_externally:
            return
        method = self._start_method or ("fork" if self.root_device.type == "cpu" else "popen")
        if method == "popen":
            self._launcher = _SubprocessScriptLauncher(
                self.cluster_environment, self.num_processes, self.num_nodes
            )
        else:
            self._launcher = _ForkLauncher(self, start_method=method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        assert self.cluster_environment is not None
        self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
        self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # lightning types rank_zero_only as an overloaded function; its ``rank`` is set at runtime
        rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]
        if self.root_device.type == "cuda":
            use_expandable_segments()
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        self._process_group_backend = backend
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)
        # One cluster for every rank: a chip measured on each rank would price alike only by luck.
        self.cluster = self.broadcast(self._cluster() if self.global_rank == 0 else None)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None and self.lightning_module is not None
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if self.plan is not None:
            self.validate_plan(self.plan)
        self._hold(self.lightning_module)

    @override
    def connect(self, model: pl.LightningModule) -> None:
        if model.automatic_optimization:  # Lightning would look for a loss and an optimizer of its own
            raise NereusConfigError(
                f"NereusStrategy: {type(model).__name__} optimizes automatically; set "
                "self.automatic_optimization = False in its __init__ (the strategy's units hold the "
                "optimizer state: training_step calls strategy.update and self.optimizers().step(), "
                "and configure_optimizers may return None)"
            )
        super().connect(model)

    def _hold(self, module: pl.LightningModule) -> None:
        """Take ``module``'s role models: every model-stage's units are cut from them at the first plan."""
        if not isinstance(module, RoleModule):
            raise NereusConfigError(
                f"NereusStrategy: {type(module).__name__} does not say which role models it trains; give "
                "it role_models() -> RoleModels and workload(step) -> Workload "
                "(nereus_lightning.lightning.roles), as RLModule does"
            )
        roles = module.role_models()
        workload = module.workload(0)
        require(
            workload.algorithm == roles.algorithm,
            "workload.algorithm",
            f"the workload is {workload.algorithm!r} but the role models are {roles.algorithm!r}'s",
        )
        self._units = EMUStates(roles, workload, self.topology)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def on_train_start(self) -> None:
        if self.units.plan is None:  # no callback gave a plan: the given one, or every model-stage DP
            everywhere = data_parallel_plan(self.units.roles.algorithm, range(self.world_size))
            self.transition(self.plan or everywhere)

    @override
    def on_train_end(self) -> None:
        if self.write_back and self.units.plan is not None:
            self.units.write_back(dst=0)

    # ---- the model-stages, as the LightningModule computes on them ------------------------
    @property
    def units(self) -> EMUStates:
        """Every model-stage's units and this rank's compute modules on them (after setup)."""
        if self._units is None:
            raise NereusConfigError(
                "NereusStrategy: no model-stage units before setup (Trainer.fit sets the strategy up; "
                "outside a Trainer use NereusStrategy.without_trainer(module))"
            )
        return self._units

    @property
    def roles(self) -> RoleModels:
        """The module's role models (their configs stay; their tensors went into the units)."""
        return self.units.roles

    def slot(self, model_stage: str, num_samples: int, tokens: Sequence[int] | None = None) -> StageSlot:
        """This rank's place in ``model_stage`` of the current plan: its replica's rows of a global batch.

        ``tokens`` (each sample's) balances the replicas by tokens instead of sample counts.
        """
        require(self.plan is not None, "plan", "the strategy has no plan yet (it gets one before step 0)")
        assert self.plan is not None
        return slot_of(self.plan, model_stage, self.global_rank, num_samples, tokens)

    def stage(self, model_stage: str) -> ShardedCausalLM | None:
        """This rank's compute module of ``model_stage`` (its unit's very tensors), None when not a member."""
        return self.units.stage(model_stage)

    def trainable(self, model_stage: str) -> ShardedCausalLM | None:
        """This rank's compute module of training stage ``model_stage`` ready for a training pass, None when
        not a member (collective over a ZeRO-3 replica's shard group, which gathers its parameters: every
        member calls it before its backward, rows or not)."""
        return self.units.trainable(model_stage)

    def in_use(self, model_stage: str) -> AbstractContextManager[None]:
        """This rank's unit of ``model_stage`` on its device for the block (idle units wait on the host)."""
        return self.units.in_use(model_stage)

    def training_stages(self) -> list[str]:
        """The training model-stages with units, in workflow order."""
        return self.units.training_stages()

    def update(self, model_stage: str, max_norm: float = 1.0, samples: int = 0) -> StageUpdate:
        """The optimizer step of a training model-stage after its backward (collective over its ranks).

        Gradients are summed over its replicas and clipped to ``max_norm``; a non-finite norm
        steps nothing (see :class:`StageUpdate`). ``samples``: how many samples this update consumed.
        """
        return self.units.update(model_stage, max_norm, samples)

    def sync_weights(self) -> None:
        """Fresh weights from each training model-stage into its model's other model-stages (collective)."""
        self.units.sync_weights()

    def preemption_point(self) -> None:
        """A safe point of the step in flight (no state changed yet): with a
        :class:`~nereus_lightning.lightning.preemption.Preemption` callback that abandons steps, every rank
        raises :class:`~nereus_lightning.lightning.preemption.StepAbandoned` here once a rank got a stop
        signal (collective then; nothing otherwise)."""
        if self.preemption is not None and self.lightning_module is not None:
            self.preemption.preemption_point(self.lightning_module.trainer)

    def rollout_engine(self, model_stage: str) -> StageEngine:
        """This rank's rollout engine of a generation model-stage (the kind ``algorithm.rollout_engine``
        names), holding its unit's current weights; use it inside :meth:`in_use`."""
        return self.units.rollout_engine(model_stage)

    # ---- collectives Lightning needs ----------------------------------------------------
    @override
    def barrier(self, name: str | None = None) -> None:
        if _distributed_is_initialized():
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Tensor | Any:
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor

    # ---- plans and transitions ----------------------------------------------------------
    def validate_plan(self, plan: Plan) -> None:
        """Reject a plan that uses ranks this job does not have (before any state changes)."""
        for name, cand in plan.items():
            bad = [g for g in cand.gpus if not 0 <= g < self.world_size]
            require(
                not bad,
                f"plan.{name}.gpus",
                f"GPUs {bad} are outside this job's {self.world_size} ranks; "
                f"give the planner a pool within range(0, {self.world_size})",
            )

    def transition(self, target: Plan) -> float:
        """Execute the move from the current plan to ``target`` on every rank; returns seconds taken.

        The transition brain's DAG for ``current -> target`` runs through the EMU executor on
        every rank (plans the brain does not model move per model-stage through the same transfer
        plans), then the compute modules are rebuilt on the moved tensors; the first plan cuts the
        units from the role models. The record (:attr:`transitions`) carries the DAG's node
        counts, bytes moved and per-node observations. When the brain finds no safe transition,
        nothing moves and the current plan stays. The time covers moving the state, rebuilding
        the modules and a barrier.
        """
        self.validate_plan(target)
        start = time.perf_counter()
        previous = self.plan
        units = self.units
        units.ensure(target, self.global_rank)
        info = dict(units.last_transition)
        reached: Plan | None = target
        if info.get("mode") == "kept":
            log.warning("keeping the current plan: %s", info.get("reason"))
            reached = previous  # the brain found no safe transition; the units did not move
        self.plan = reached
        self.barrier("nereus-transition")
        seconds = time.perf_counter() - start
        self.transitions.append({"from": previous, "to": reached, "seconds": seconds, **info})
        return seconds

    # ---- layout-independent checkpoints -------------------------------------------------
    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint restores the optimizer by parameter name

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | os.PathLike, storage_options: Any = None
    ) -> None:
        """Write the checkpoint directory ``filepath`` (collective): tensors through DCP, the rest as JSON.

        Refused with a :class:`CheckpointError` on every rank, before anything is written, when any
        rank holds a NaN or an infinity in its state or a training unit's bf16/fp16 parameter that
        is not its fp32 master rounded (the checkpoint stores the master only; the error names the
        model-stage, tensor and rank), or a value of the checkpoint dict cannot be stored in JSON
        (it names the key). The directory is written under a staging name, every file's SHA-256 is
        recorded (each rank hashes a share), and it is renamed to ``filepath`` once complete; a save
        that fails on any rank (a full disk) removes its staging directory and raises on every rank.
        """
        path = Path(self.broadcast(str(filepath)))
        units = self.units
        require(units.plan is not None, "checkpoint", "no model-stage units yet: save after the first plan")
        checkpoint.pop("state_dict", None)  # the units hold the model state (the full modules are released)
        checkpoint.pop("optimizer_states", None)
        encoded = self._checked_for_save(path, checkpoint, units)
        staging = staging_path(path)
        started = time.perf_counter()
        try:
            self._write_staged(staging, encoded, int(checkpoint.get("global_step", 0)))
        except BaseException:
            if self.is_global_zero:
                remove(staging)  # nothing of a failed save stays on a full disk
            with suppress(Exception):  # (the failures above are raised on every rank): no rank leaves
                self.barrier("nereus-save-failed")  # before rank 0 has removed it
            raise
        if self.is_global_zero:
            commit(path)
            log.info(
                "checkpoint %s written in %.2f s (%.2f s of it hashing its files)",
                path,
                time.perf_counter() - started,
                self._hash_s,
            )
        self.barrier("nereus-save")

    def _write_staged(self, staging: Path, encoded: Any, step: int) -> None:
        """The checkpoint in ``staging``: tensors, Hugging Face folders when due, the hashed file list, the
        metadata last (collective; a failure on any rank raises on every rank)."""
        if self.is_global_zero:
            remove(staging)  # what an interrupted save of this name left
            staging.mkdir(parents=True)
        self.barrier("nereus-save-staging")
        self._require_shared(staging)
        self.units.save(str(staging / STATE), step=step)
        problem = None
        if self.is_global_zero and self._export_due():
            problem = _failure(lambda: self._write_hf(str(staging)))
        self._raise_shared(problem)
        started = time.perf_counter()
        files = self._hash_shared(staging)
        self._hash_s = time.perf_counter() - started
        if self.is_global_zero:
            problem = _failure(lambda: write_metadata(staging, encoded, STATE, files))
        self._raise_shared(problem)

    def _export_due(self) -> bool:
        """Whether this save also writes ``hf/<model>/``: every save (``export_hf="every"``), or the run's
        last one (``"end"``: the Trainer's ``max_steps`` reached)."""
        if self.export_hf == "every":
            return True
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return (
            self.export_hf == "end" and trainer is not None and trainer.global_step >= trainer.max_steps > 0
        )

    def _raise_shared(self, problem: str | None) -> None:
        """Raise rank 0's ``problem`` on every rank (collective)."""
        problem = self.broadcast(problem)
        if problem is not None:
            raise CheckpointError(problem)

    def _hash_shared(self, staging: Path) -> dict[str, FileRecord]:
        """The record (size, SHA-256) of every file in ``staging``; each rank hashes a share (collective)."""
        names: list[str] = self.broadcast(own_files(staging) if self.is_global_zero else None)
        sizes = {name: FileRecord((staging / name).stat().st_size, "") for name in names}
        mine = share(sizes, self.global_rank, self.world_size)
        found: dict[str, str] = {}
        problem = _failure(lambda: found.update(digests(staging, mine)))
        reports: list[Any] = [(found, problem)]
        if _distributed_is_initialized():
            reports = [None] * self.world_size
            dist.all_gather_object(reports, (found, problem))
        problems = [p for _, p in reports if p]
        if problems:
            raise CheckpointError(f"checkpoint {staging}: {problems[0]}")
        hashes = {name: digest for part, _ in reports for name, digest in part.items()}
        return describe(staging, names, hashes)

    def _write_hf(self, ckpt_dir: str) -> dict[str, str]:
        """Hugging Face folders of the trained models in a checkpoint being written (``hf/<model>``)."""
        from nereus_lightning.lightning.hf_export import TRAINED, write_hf_into, write_hf_metadata

        configs = {role: config for role, config in self.units.configs.items() if role in TRAINED}
        write_hf_metadata(configs, self.roles.tokenizer, ckpt_dir)
        return write_hf_into(ckpt_dir)

    def _require_shared(self, directory: Path) -> None:
        """Refuse (on every rank) a save into ``directory`` when some rank does not see it (collective).

        Every rank writes its own shards into the directory rank 0 created, so on several nodes it
        must lie on a filesystem they all share; otherwise each node would hold a part of the checkpoint.
        """
        seen: list[Any] = [directory.is_dir()]  # per rank (every entry filled by the gather)
        if _distributed_is_initialized():
            seen = [None] * self.world_size
            dist.all_gather_object(seen, directory.is_dir())
        blind = [rank for rank, ok in enumerate(seen) if not ok]
        if blind:
            raise CheckpointError(
                f"checkpoint {directory.parent}: ranks {blind} do not see the directory rank 0 created "
                f"({directory}); put the output directory (nereus-train's hydra.run.dir / output_dir, or "
                "ModelCheckpoint's dirpath) on a filesystem every node shares"
            )

    def _checked_for_save(self, path: Path, checkpoint: dict[str, Any], units: EMUStates) -> Any:
        """Rank 0's JSON encoding of ``checkpoint`` once every rank found its state finite and its bf16/fp16
        training parameters their masters rounded (collective).
        """
        from nereus_lightning.emu.dcp_state import nonfinite_tensors, params_off_master

        encoded, problem = None, None
        if self.is_global_zero:
            try:
                encoded = encode(checkpoint)
            except CheckpointError as exc:
                problem = str(exc)
        stages = units.holding_state()
        bad = [f"{name}/{t}" for name in stages for t in nonfinite_tensors(name)]
        off = [f"{name}/{t}" for name in stages for t in params_off_master(name)]
        mine = (self.global_rank, bad, off, problem)
        reports: list[Any] = [mine]  # per rank (filled by the gather)
        if _distributed_is_initialized():
            reports = [None] * self.world_size
            dist.all_gather_object(reports, mine)
        problems = list(dict.fromkeys(p for *_, p in reports if p))  # the same on every rank
        nonfinite = [f"{name} (rank {rank})" for rank, names, _, _ in reports for name in names]
        if nonfinite:
            problems.append(f"non-finite values (NaN or inf) in {_first_few(nonfinite)}")
        unrounded = [f"{name} (rank {rank})" for rank, _, names, _ in reports for name in names]
        if unrounded:
            problems.append(
                f"parameters that are not their fp32 master rounded: {_first_few(unrounded)} (changed "
                "outside the optimizer step; a checkpoint stores the master only, so it would not give them "
                "back)"
            )
        if problems:
            raise CheckpointError(
                f"checkpoint {path} not written: {'; '.join(problems)}. The checkpoints already on disk are "
                "kept"
            )
        return encoded

    @override
    def load_checkpoint(
        self, checkpoint_path: str | os.PathLike, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Read a directory written by :meth:`save_checkpoint`; nothing from it is unpickled.

        Rank 0 reads and checks the JSON metadata, the DCP metadata, the values a resume uses and every
        file's size (:func:`~nereus_lightning.lightning.checkpoint.read_metadata`); then every rank
        re-hashes a share of the files and rank 0 compares the step inside the tensors with the metadata's.
        Every rank raises the same :class:`CheckpointError`, naming the damaged file, before any state
        changes.
        """
        path = Path(self.broadcast(str(checkpoint_path)))
        stored, problem = None, None
        if self.is_global_zero:
            stored, problem = _attempt(lambda: read_metadata(path))
        stored, problem = self.broadcast((stored, problem))  # between this job's own ranks
        if problem is not None:
            raise CheckpointError(problem)
        self._verify_shared(stored)
        if stored.state != STATE:
            raise CheckpointError(
                f"ckpt_path: {path} holds {stored.state!r} state, written by the retired full-model backend; "
                "this nereus-lightning resumes only EMU checkpoints (emu/<model_stage>/): export its models "
                "with the nereus-lightning that wrote it and start from them"
            )
        self.units.resume_from = str(Path(stored.path) / STATE)  # loaded into the units when they are built
        meta = stored.checkpoint
        meta["state_dict"] = {}
        return meta

    def _verify_shared(self, stored: StoredCheckpoint) -> None:
        """Every file of ``stored`` re-hashed, a share per rank, and its step tensors checked (collective)."""
        started = time.perf_counter()
        mine = share(stored.files, self.global_rank, self.world_size)
        bad, problem = _attempt(lambda: differing(stored.path, stored.files, mine))
        reports: list[Any] = [(bad, problem)]
        if _distributed_is_initialized():
            reports = [None] * self.world_size
            dist.all_gather_object(reports, (bad, problem))
        problems = [p for _, p in reports if p]
        if problems:  # a file could not be read
            raise CheckpointError(problems[0])
        differ = sorted(name for names, _ in reports for name in names)
        if differ:
            raise mismatch_error(Path(stored.path), META_FILE, differ, len(stored.files))
        self._raise_shared(_failure(lambda: check_step_tensors(stored)) if self.is_global_zero else None)
        if self.is_global_zero:
            total = sum(r.size for r in stored.files.values())
            log.info(
                "checkpoint %s: %d files, %.1f MB verified (SHA-256) in %.2f s on %d ranks",
                stored.path,
                len(stored.files),
                total / 1e6,
                time.perf_counter() - started,
                self.world_size,
            )

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done in load_checkpoint

    @override
    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        if self.is_global_zero:  # hidden first, so no reader sees a half-removed checkpoint
            path = Path(filepath)
            aside = path.with_name(f".{path.name}.removing")
            if path.exists() and not path.is_symlink():
                remove(aside)
                os.rename(path, aside)
                path = aside
            remove(path)

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Nereus adaptive DP/TP/PP strategy")
        strategy_registry.register(
            "nereus_spawn", cls, description="Nereus strategy, spawned ranks", start_method="spawn"
        )


#: Which checkpoints hold Hugging Face folders (``NereusStrategy(export_hf=...)``, nereus-train's too).
EXPORT_MODES = ("end", "every", "never")


def export_mode(value: str | bool) -> str:
    """``export_hf`` as one of :data:`EXPORT_MODES` (True: ``"every"``, False: ``"never"``, as before)."""
    if isinstance(value, bool):
        return "every" if value else "never"
    require(
        value in EXPORT_MODES,
        "export_hf",
        f"{value!r} is not one of {', '.join(map(repr, EXPORT_MODES))} (or true / false)",
    )
    return str(value)


#: The CUDA allocator settings the strategy reads (the first is torch's name, the second its newer alias).
ALLOC_CONF_VARS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def use_expandable_segments() -> bool:
    """Turn on the CUDA allocator's expandable segments, unless the user configured them; returns
    whether it did.

    RL steps allocate blocks of a new size every step as responses grow; fixed segments then
    fragment (an OOM at 2K tokens with 21 GB reserved but unallocated). The setting is exported
    too, for the processes this one starts.
    """
    if any("expandable_segments" in os.environ.get(name, "") for name in ALLOC_CONF_VARS):
        return False
    setting = "expandable_segments:True"
    kept = os.environ.get(ALLOC_CONF_VARS[0], "")
    os.environ[ALLOC_CONF_VARS[0]] = f"{kept},{setting}" if kept else setting
    torch.cuda.memory._set_allocator_settings(setting)
    return True


def _attempt(action: Any) -> tuple[Any, str | None]:
    """``action()`` and None, or None and its error as a message (that a rank reports to the others)."""
    try:
        return action(), None
    except Exception as exc:  # reported on every rank by the caller
        return None, str(exc) if isinstance(exc, CheckpointError) else f"{type(exc).__name__}: {exc}"


def _failure(action: Any) -> str | None:
    """The error message of ``action()``, None when it returned."""
    return _attempt(action)[1]


def _first_few(names: list[str], shown: int = 8) -> str:
    """``names`` joined, the first ``shown`` of them and how many more."""
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


class _ForkLauncher(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher; rank 0's weights reach the
    caller's module only with ``write_back``, and only rank 0 prints Lightning's tips and warnings.
    """

    _strategy: NereusStrategy  # (the strategy that makes it)

    @override
    def _wrapping_function(self, process_idx: int, *args: Any, **kwargs: Any) -> None:
        quiet_unless_rank_zero(self._strategy.node_rank * self._strategy.num_processes + process_idx)
        super()._wrapping_function(process_idx, *args, **kwargs)

    @override
    def launch(self, function: Any, *args: Any, trainer: pl.Trainer | None = None, **kwargs: Any) -> Any:
        """Start the ranks; a stop signal this process gets meanwhile goes on to them (see ``preemption``)."""
        from nereus_lightning.lightning import preemption

        callbacks: list[Any] = cast(Any, trainer).callbacks if trainer is not None else []
        grace = next((c.grace_s for c in callbacks if isinstance(c, preemption.Preemption)), None)
        if grace is None:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        previous = preemption.forward_to(lambda: [p.pid for p in self.procs if p.pid], grace)
        try:
            return super().launch(function, *args, trainer=trainer, **kwargs)
        finally:
            preemption.restore(previous)

    @override
    def get_extra_results(self, trainer: pl.Trainer) -> dict[str, Any]:
        return {**super().get_extra_results(trainer), "nereus_stopped": self._strategy.stopped}

    @override
    def update_main_process_results(self, trainer: pl.Trainer, extra: dict[str, Any]) -> None:
        super().update_main_process_results(trainer, extra)
        self._strategy.stopped = extra.get("nereus_stopped")

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        output = super()._collect_rank_zero_results(trainer, results)
        if output is None or output.weights_path is None or self._strategy.write_back:
            return output
        # The full models went into the units: their empty tensors must not overwrite the caller's models.
        self._strategy.checkpoint_io.remove_checkpoint(output.weights_path)
        return output._replace(weights_path=None)


#: Third-party packages whose warnings every rank would print alike.
THIRD_PARTY = r"(lightning|torch|transformers)(\.|$)"


def quiet_unless_rank_zero(rank: int) -> None:
    """In a forked rank: Lightning's rank-zero tips and logs know this rank (it inherited rank 0's
    number), and on ranks other than 0 third-party warnings and Lightning's per-rank start line are off,
    so each prints once."""
    rank_zero_only.rank = rank  # type: ignore[attr-defined]
    if rank != 0:
        warnings.filterwarnings("ignore", module=THIRD_PARTY)
        logging.getLogger("lightning.fabric.utilities.distributed").setLevel(logging.WARNING)


if "nereus" not in StrategyRegistry:
    NereusStrategy.register_strategies(StrategyRegistry)
