"""`NereusStrategy`: a Lightning `ParallelStrategy` whose parallel layout may change between steps.

The strategy sets up one process group over all ranks (gloo on CPU, NCCL on GPUs) and holds the
current :class:`~nereus_lightning.plan.layout.Plan`: which ranks run each model-stage, in which
layout. The RL module asks it where each stage runs (``plan``); the callback hands it admitted
decisions, which it executes at the safe boundary before the next step (``transition``).
Ranks outside the GPU pool stay alive as processes but get no work from the plan.

Checkpoints are layout-independent: the logical state (full parameters and optimizer state by
parameter name) goes through ``torch.distributed.checkpoint`` into a directory, so a run saved
under one plan and world size resumes under another. The rest (step, loops, callback states) is
JSON (:mod:`nereus_lightning.lightning.checkpoint`); nothing is pickled, a save with non-finite
state is refused, and a directory is renamed into place only when complete.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal, Protocol, TypeGuard

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
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
from torch import Tensor, nn
from typing_extensions import override

from nereus_lightning.lightning.checkpoint import (
    commit,
    encode,
    read_checkpoint,
    remove,
    staging_path,
    write_metadata,
)
from nereus_lightning.lightning.launch import check_launch, launch_of
from nereus_lightning.plan.layout import Plan
from nereus_lightning.spec.cluster import ClusterSpec, cluster_preset
from nereus_lightning.spec.errors import CheckpointError, NereusConfigError, require


class _UnitsModule(Protocol):
    """What the strategy reads from a LightningModule that keeps its model-stage state in units
    (an ``RLModule``)."""

    units: Any  # ``EMUStates`` or ``StageUnits`` (``units.kind == "emu"``: the EMUs)

    def role_models(self) -> Mapping[str, nn.Module | None]: ...

    def write_hf(self, ckpt_dir: str) -> dict[str, str]: ...  # (read only with ``export_hf``)


def _has_units(module: object) -> TypeGuard[_UnitsModule]:
    """Whether ``module`` keeps its model-stage state in units."""
    return hasattr(module, "units")


def _emu_module(module: object) -> _UnitsModule | None:
    """``module`` when its model-stage state lives in EMUs (``units.kind == "emu"``), else None."""
    return module if _has_units(module) and getattr(module.units, "kind", None) == "emu" else None

log = logging.getLogger(__name__)

OPTIMIZER_GROUPS = "nereus_optimizer_groups"  # the full-model state's optimizer settings, kept in the JSON


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
        state: where model-stage state lives. ``"emu"`` (default): in Elastic Model Units on the
            ranks the plan gives each model-stage; plan changes run the transition DAG through
            the EMU executor, weights sync from actor_train to the actor's other model-stages
            through the same transfer plans. ``"full"``: every rank keeps each full model and
            re-slices it per plan (the earlier backend).
        cluster: the cluster (a ``ClusterSpec`` or preset name: memory, FLOP/s, links) the
            transition DAG is priced and validated on, shaped as the launch (``num_nodes`` x
            processes per node, :attr:`topology`); give the one the controller plans on.
            ``None``: the ``cpu4`` preset.
        export_hf: every checkpoint also holds ``hf/<model>/`` per trainable model
            (``save_pretrained`` in safetensors plus the tokenizer), written by rank 0.
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
        state: Literal["emu", "full"] = "emu",
        cluster: ClusterSpec | str | None = None,
        export_hf: bool = True,
        write_back: bool = False,
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        require(
            start_method in (None, "fork", "spawn", "popen"),
            "strategy.start_method",
            f"{start_method!r} is not one of 'fork', 'spawn', 'popen'",
        )
        require(state in ("emu", "full"), "strategy.state", f"{state!r} is not one of 'emu', 'full'")
        self.state = state
        self.export_hf = export_hf
        self.write_back = write_back
        if isinstance(cluster, str):
            cluster = cluster_preset(cluster)  # an unknown name fails here, listing the presets
        self.cluster: ClusterSpec | None = cluster
        self._num_nodes = 1
        self._process_group_backend = process_group_backend
        self._timeout = timeout if isinstance(timeout, timedelta) else timedelta(seconds=float(timeout))
        self._start_method = start_method
        self.plan: Plan | None = plan
        self.transitions: list[dict[str, Any]] = []

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
        """The cluster the job runs on: the given one (``cpu4`` by default) shaped as the launch,
        ``num_nodes`` x processes per node, so TP groups are priced inside a node and the rest
        across nodes as they really are."""
        cluster = self.cluster or cluster_preset("cpu4")
        return cluster.on_nodes(self.num_nodes, max(self.world_size // self.num_nodes, 1))

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
        backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        self._process_group_backend = backend
        _init_dist_connection(self.cluster_environment, backend, timeout=self._timeout)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        assert self.model is not None
        use_state = getattr(self.lightning_module, "use_state", None)
        if use_state is not None:
            use_state(self.state)
        self.model_to_device()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if self.plan is not None:
            self.validate_plan(self.plan)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def on_train_end(self) -> None:
        module = _emu_module(self.lightning_module)
        if self.write_back and module is not None and module.units.plan is not None:
            module.units.write_back(module.role_models(), dst=0)

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

        ``state="emu"``: the transition brain's DAG for ``current -> target`` runs through the
        EMU executor on every rank (plans the brain does not model move per model-stage through
        the same transfer plans), then the compute modules are rebuilt on the moved tensors; the
        record carries the DAG's node counts, bytes moved and per-node observations.
        ``state="full"``: the units are re-sliced from the logical models every rank keeps.
        The time covers moving the state, rebuilding the modules and a barrier.
        """
        self.validate_plan(target)
        start = time.perf_counter()
        previous = self.plan
        module = self.lightning_module
        info: dict[str, Any] = {}
        if _has_units(module):
            units = module.units
            if hasattr(units, "cluster"):  # transitions priced on the controller's cluster
                units.cluster = self.topology
            units.ensure(target, module.role_models(), self.global_rank)
            info = dict(getattr(units, "last_transition", {}) or {})
            if hasattr(units, "last_transition"):
                units.last_transition = {}
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
        rank holds a NaN or an infinity in its state (the error names the model-stage, tensor and
        rank) or a value of the checkpoint dict cannot be stored in JSON (it names the key). The
        directory is written under a staging name and renamed to ``filepath`` once complete.
        """
        from nereus_lightning.emu.checkpoint import save_tensors

        path = Path(self.broadcast(str(filepath)))
        module = _emu_module(self.lightning_module)
        state = "emu" if module is not None else "full"
        model = checkpoint.pop("state_dict", None)
        checkpoint.pop("optimizer_states", None)
        tensors: dict[str, Any] = {}
        if state == "full":  # the EMUs hold the state otherwise (the full modules are released)
            optim = self._optimizer_state()
            tensors = {"model": model, "optim": optim.get("state", {})}
            checkpoint[OPTIMIZER_GROUPS] = optim.get("param_groups", [])
        emus = module.units if module is not None else None
        encoded = self._checked_for_save(path, checkpoint, emus, tensors)
        staging = staging_path(path)
        if self.is_global_zero:
            remove(staging)  # what an interrupted save of this name left
            staging.mkdir(parents=True)
        self.barrier("nereus-save-staging")
        self._require_shared(staging)
        if module is not None:
            module.units.save(str(staging / "emu"))
        else:
            save_tensors(tensors, staging)
        if self.is_global_zero:
            if self.export_hf and module is not None:  # inside the staging directory: part of the atomic save
                module.write_hf(str(staging))
            write_metadata(staging, encoded, state)
            commit(path)
        self.barrier("nereus-save")

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

    def _checked_for_save(
        self, path: Path, checkpoint: dict[str, Any], units: Any, tensors: dict[str, Any]
    ) -> Any:
        """Rank 0's JSON encoding of ``checkpoint``, once every rank
        has found its state finite (collective).
        """
        from nereus_lightning.emu.checkpoint import nonfinite_names, nonfinite_tensors

        encoded, problem = None, None
        if self.is_global_zero:
            try:
                encoded = encode(checkpoint)
            except CheckpointError as exc:
                problem = str(exc)
        if units is not None:
            bad = [f"{name}/{t}" for name in (units.plan or {}) for t in nonfinite_tensors(name)]
        else:
            leaves = list(_leaves(tensors))
            problem = problem or next(
                (
                    f"{key}: a {type(v).__name__}, not a tensor (DCP would pickle it)"
                    for key, v in leaves
                    if not isinstance(v, Tensor)
                ),
                None,
            )
            bad = nonfinite_names((k, v) for k, v in leaves if isinstance(v, Tensor))
        reports: list[Any] = [(self.global_rank, bad, problem)]  # per rank (filled by the gather)
        if _distributed_is_initialized():
            reports = [None] * self.world_size
            dist.all_gather_object(reports, (self.global_rank, bad, problem))
        nonfinite = [f"{name} (rank {rank})" for rank, names, _ in reports for name in names]
        problems = list(dict.fromkeys(p for _, _, p in reports if p))  # the same on every rank
        if nonfinite:
            shown = ", ".join(nonfinite[:8]) + (
                f" and {len(nonfinite) - 8} more" if len(nonfinite) > 8 else ""
            )
            problems.append(f"non-finite values (NaN or inf) in {shown}")
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

        Rank 0 reads and checks the JSON metadata, the DCP metadata and every file's size
        (:func:`~nereus_lightning.lightning.checkpoint.read_checkpoint`); every rank raises the
        same :class:`CheckpointError`, naming the damaged file, before any state changes.
        """
        from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

        from nereus_lightning.emu.checkpoint import load_tensors

        path = Path(self.broadcast(str(checkpoint_path)))
        stored, problem = None, None
        if self.is_global_zero:
            try:
                stored = read_checkpoint(path)
            except CheckpointError as exc:
                problem = str(exc)
        stored, problem = self.broadcast((stored, problem))  # between this job's own ranks
        if problem is not None:
            raise CheckpointError(problem)
        meta = stored.checkpoint
        module = self.lightning_module
        assert module is not None
        emu_module = _emu_module(module)
        if (emu_module is not None) != (stored.state == "emu"):
            raise NereusConfigError(
                f"ckpt_path: {path} holds {stored.state!r} state; resume it with "
                f"NereusStrategy(state={stored.state!r})"
            )
        if emu_module is not None:
            emu_module.units.resume_from = str(path / "emu")  # loaded into the units when they are built
            meta["state_dict"] = {}
            return meta
        optim = self._optimizer_state()
        state = {"model": module.state_dict(), "optim": optim.get("state", {})}
        load_tensors(state, path)
        module.load_state_dict(state["model"])
        groups = meta.pop(OPTIMIZER_GROUPS, optim.get("param_groups", []))
        for opt in self.optimizers:
            set_optimizer_state_dict(module, opt, {"state": state["optim"], "param_groups": groups})
        meta["state_dict"] = state["model"]
        return meta

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        pass  # done in load_checkpoint

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        pass  # done in load_checkpoint

    @override
    def remove_checkpoint(self, filepath: str | os.PathLike) -> None:
        if self.is_global_zero:
            remove(filepath)

    def _optimizer_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        module = self.lightning_module
        if not self.optimizers or module is None:
            return {}
        return get_optimizer_state_dict(module, self.optimizers[0])

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="Nereus adaptive DP/TP/PP strategy")
        strategy_registry.register(
            "nereus_spawn", cls, description="Nereus strategy, spawned ranks", start_method="spawn"
        )


def _leaves(tree: Any, prefix: str = "") -> Any:
    """``(dotted key, value)`` for every non-dict value of a nested dict."""
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _leaves(value, f"{name}.")
        else:
            yield name, value


class _ForkLauncher(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher; rank 0's weights reach the
    caller's module only with ``write_back``.
    """

    _strategy: NereusStrategy  # (the strategy that makes it)

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> Any:
        output = super()._collect_rank_zero_results(trainer, results)
        released = _emu_module(trainer.lightning_module) is not None  # the full models went into the EMUs
        if output is None or output.weights_path is None or self._strategy.write_back or not released:
            return output
        # Their empty tensors must not overwrite the caller's models.
        self._strategy.checkpoint_io.remove_checkpoint(output.weights_path)
        return output._replace(weights_path=None)


if "nereus" not in StrategyRegistry:
    NereusStrategy.register_strategies(StrategyRegistry)
