"""``nereus-train``: RL post-training with adaptive parallelism, configured by Hydra.

With no arguments it runs the embedded default: a tiny Llama-style actor built from a config,
the byte tokenizer, the repeat task (answers grow as training goes on), PPO on 4 gloo CPU
processes, and a GPU-supply schedule that takes a rank away and gives it back. Examples::

    nereus-train
    nereus-train algorithm=grpo trainer.max_steps=40
    nereus-train experiment=quick logger=tensorboard
    nereus-train ckpt_path=outputs/.../checkpoints/last.ckpt trainer.devices=2
    nereus-train actor.path=/my/model data.train_files=train.parquet custom_reward_function.path=reward.py
"""

from __future__ import annotations

import atexit
import glob
import json
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from omegaconf import DictConfig

from nereus_lightning.cli._hydra import CONFIG_ROOT, compose, to_dict
from nereus_lightning.cli._resume import RunFolderLock, job_record
from nereus_lightning.console_log import current_rank
from nereus_lightning.spec.errors import InfeasiblePlanError, NereusConfigError

if TYPE_CHECKING:
    from nereus_lightning.control.follower import PlanController
    from nereus_lightning.lightning.checkpointing import NereusCheckpoint
    from nereus_lightning.lightning.launch import Launch
    from nereus_lightning.lightning.module import RLModule
    from nereus_lightning.lightning.preemption import Preemption
    from nereus_lightning.lightning.roles import RoleModule
    from nereus_lightning.plan.layout import Plan
    from nereus_lightning.rl.algorithm import RLConfig
    from nereus_lightning.spec.cluster import ClusterSpec
    from nereus_lightning.spec.model import ModelSpec
    from nereus_lightning.spec.workload import Workload

CONFIG_DIR = str(CONFIG_ROOT)


def train_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The composed nereus-train config with command-line style ``overrides`` (what :func:`run` takes),
    its ``trainer`` resolved (:func:`resolve_trainer`)."""
    from nereus_lightning.cli.verl import translate

    return resolve_trainer(compose(CONFIG_ROOT, "train", translate(overrides)[0]))


#: What ``trainer.devices`` and ``trainer.precision`` are when ``auto``, on GPUs and on CPU ranks.
AUTO_TRAINER = {
    "gpu": {"devices": -1, "precision": "bf16-mixed"},
    "cpu": {"devices": 4, "precision": "32-true"},
}


def resolve_trainer(cfg: DictConfig) -> DictConfig:
    """``cfg`` with ``trainer.accelerator``, ``devices`` and ``precision`` set where they are ``auto``:
    every visible GPU in bf16-mixed for a model folder (``actor.path``) where CUDA is available,
    else 4 CPU processes in fp32 (what ``trainer=gpu`` and ``trainer=cpu4`` set)."""
    from omegaconf import open_dict

    trainer = cfg.trainer
    with open_dict(cfg):
        if str(trainer.get("accelerator")) == "auto":
            trainer.accelerator = "gpu" if _folder_on_cuda(cfg) else "cpu"
        kind = "gpu" if _on_gpus(cfg) else "cpu"
        for key, value in AUTO_TRAINER[kind].items():
            if str(trainer.get(key)) == "auto":
                trainer[key] = value
    return cfg


def _folder_on_cuda(cfg: DictConfig) -> bool:
    """Whether the actor is a model folder and this machine has a CUDA (or ROCm) device."""
    import torch

    from nereus_lightning.lightning.roles import is_model_folder

    return is_model_folder(cfg.actor.get("path"), "actor.path") and torch.cuda.is_available()


#: ``trainer.*`` keys that configure nereus, not ``lightning.Trainer``.
NEREUS_TRAINER_KEYS = ("on_nonfinite", "rollout_data_dir")


def uses_data(cfg: DictConfig) -> bool:
    """Whether the job trains on prompt files (``data.train_files``) rather than the built-in task."""
    return cfg.get("data") is not None and cfg.data.get("train_files") is not None


def check_feasible(cfg: DictConfig, world_size: int) -> None:
    """Fail fast, before any model is built: the planner must find a plan for the first pool."""
    from nereus_lightning.plan.planner import plan_job

    counts = supply_counts(cfg)
    pool = min(int(counts[0]), world_size) if counts else world_size
    cluster = job_cluster(cfg).with_gpus(pool)
    # nereus-train's pool is trainer.devices (x trainer.num_nodes): name its key, not nereus-plan's.
    plan_job(_job_models(cfg), cluster, _workload(cfg, response_budget(cfg, 0)), pool_key="trainer.devices")


def supply_counts(cfg: DictConfig) -> list[int] | None:
    """The GPU supply per step: ``resources.counts``, else the built-in task's ``supply`` (None: all)."""
    counts = cfg.resources.get("counts") if cfg.get("resources") else None
    if counts is None and not uses_data(cfg):
        counts = cfg.task.get("supply")
    return [int(c) for c in counts] if counts else None


def response_budget(cfg: DictConfig, step: int) -> float:
    """Generation budget at ``step``: ``data.max_response_length``, or the built-in task's growing one."""
    if uses_data(cfg):
        return float(cfg.data.max_response_length)
    task = cfg.task
    grown = int(task.start_len) + step // max(int(task.grow_every), 1)
    return float(min(int(task.max_len), grown) + 3)


def job_cluster(cfg: DictConfig) -> ClusterSpec:
    """The job's cluster (:func:`job_cluster_preset`) with its per-GPU memory override (``"auto"``: below)."""
    from dataclasses import replace

    cluster = job_cluster_preset(cfg)
    memory = gpu_memory_setting(cfg)
    if memory == "auto":
        memory = tight_gpu_memory(cfg, cluster)
    return replace(cluster, gpu_memory=float(memory)) if memory else cluster


def gpu_memory_setting(cfg: DictConfig) -> float | str | None:
    """``cluster_gpu_memory``, else the built-in task's ``gpu_memory`` (None: the preset's)."""
    memory = cfg.get("cluster_gpu_memory")
    if memory is None and not uses_data(cfg):
        memory = cfg.task.get("gpu_memory")
    return memory


def job_cluster_preset(cfg: DictConfig) -> ClusterSpec:
    """The cluster ``cfg.cluster`` names (memory, FLOP/s, links), or for ``auto`` the one the job's
    devices make (:func:`~nereus_lightning.lightning.devices.auto_cluster`), shaped as the launch:
    ``trainer.num_nodes`` x GPUs per node (checked against the launcher by :func:`job_launch`)."""
    from nereus_lightning.lightning.devices import auto_cluster
    from nereus_lightning.spec import cluster_preset

    shape = (_num_nodes(cfg), _devices_per_node(cfg))
    if str(cfg.cluster) == "auto":
        return auto_cluster(_on_gpus(cfg), *shape)
    return cluster_preset(str(cfg.cluster)).on_nodes(*shape)


def _on_gpus(cfg: DictConfig) -> bool:
    """Whether the job's ranks are GPUs (``trainer.accelerator``, resolved by :func:`resolve_trainer`)."""
    return str(cfg.trainer.get("accelerator", "cpu")) in ("gpu", "cuda")


def _prompt_len(cfg: DictConfig) -> float:
    if uses_data(cfg):
        return float(cfg.data.max_prompt_length)  # an upper bound: the data is not read yet
    from hydra.utils import instantiate

    from nereus_lightning.rl.sources import TaskSource

    return TaskSource(instantiate(_task_config(cfg), seed=int(cfg.seed))).mean_prompt_len()


def _workload(cfg: DictConfig, length: float) -> Workload:
    """The job's RL step as the module will price it, at a response budget of ``length`` tokens."""
    from nereus_lightning.spec import GenerationEngine

    engine = GenerationEngine.of(
        str(cfg.algorithm.get("rollout_engine", "hf")), to_dict(cfg.algorithm.get("vllm"))
    )
    return rl_config(cfg).workload(
        _prompt_len(cfg), float(length), reward_model_source(cfg) is not None, engine
    )


def prompts_per_step(cfg: DictConfig) -> int:
    """``data.train_batch_size`` (verl's name) when set, else ``algorithm.prompts_per_step``."""
    size = cfg.data.get("train_batch_size") if cfg.get("data") else None
    return int(size if size is not None else cfg.algorithm.prompts_per_step)


def model_source(node: DictConfig | None, default: str | None = None) -> str | None:
    """A role's model: its ``path`` (a folder), else its ``preset``, else ``default``."""
    if node is None:
        return default
    if node.get("path"):
        return str(node.path)
    if node.get("preset"):
        return str(node.preset)
    return default


def reward_model_source(cfg: DictConfig) -> str | None:
    """The reward model (``reward_model.path`` / ``.preset``), None for a reward function."""
    return model_source(cfg.get("reward_model"))


def admit_families(cfg: DictConfig) -> None:
    """Prove each model folder's family exact before the job starts, if it is outside the registry.

    Once per model type and transformers version (``proof.admission``: the self-check on 4 CPU
    processes, cached); a failed proof is refused where the model is first read, naming the layout
    and the difference. Under torchrun or SLURM the ranks start together: run ``nereus-check-model``
    once on each node instead (the refusal says so).
    """
    from transformers import AutoConfig

    from nereus_lightning.proof.admission import admit
    from nereus_lightning.spec.families import FAMILIES

    for key in ("actor", "critic", "reference", "reward_model"):
        source = model_source(cfg.get(key))
        if not (isinstance(source, str) and os.path.isdir(source)):
            continue
        config = AutoConfig.from_pretrained(source)
        if str(config.model_type) in FAMILIES:
            continue
        _say(
            f"nereus-train: {key}.path: model type {config.model_type} is outside the registry: proving it "
            "exact at TP1/2 x PP1/2 and through Split/Merge on 4 CPU processes (once per version)"
        )
        verdict = admit(config)
        if verdict is not None:
            failed = verdict.failure
            _say(
                f"nereus-train: {config.model_type}: "
                + ("exact, admitted" if failed is None else f"refused at {failed[0]}: {failed[1].reason}")
                + f" ({verdict.seconds:.0f} s)"
            )


def _spec_of(source: str | None, key: str) -> ModelSpec:
    from nereus_lightning.spec import ModelSpec, model_preset

    if source is None:
        raise NereusConfigError(f"{key}: no model (give a folder saved with save_pretrained, or a preset)")
    if os.path.sep in source or os.path.isdir(source):
        if not os.path.isdir(source):
            raise NereusConfigError(
                f"{key}: {source!r} does not exist (give a folder saved with save_pretrained)"
            )
        return ModelSpec.from_hf_config(source)
    return model_preset(source)


def _job_models(cfg: DictConfig) -> dict[str, ModelSpec]:
    from nereus_lightning.plan.planner import job_models
    from nereus_lightning.spec.algorithms import algorithm_spec

    actor_source = model_source(cfg.actor)
    actor = _spec_of(actor_source, "actor.path")
    critic = _spec_of(model_source(cfg.get("critic"), actor_source), "critic.path")
    reward_source = reward_model_source(cfg)
    reward = _spec_of(reward_source, "reward_model.path") if reward_source else None
    uses_critic = algorithm_spec(_algorithm_name(cfg)).critic
    return job_models(actor, critic=critic if uses_critic else None, reward=reward)


def _task_config(cfg: DictConfig) -> DictConfig:
    """The task node without the drift keys the CLI reads itself (``supply``, ``gpu_memory``)."""
    from omegaconf import OmegaConf

    node = to_dict(cfg.task)
    for key in ("supply", "gpu_memory"):
        node.pop(key, None)
    return OmegaConf.create(node)


def _threshold(ok: Callable[[float], bool], lo: float, hi: float) -> float | None:
    """The smallest memory in [lo, hi] for which ``ok(memory)`` holds (bisection to 1 kB), None if none."""
    if not ok(hi):
        return None
    while hi - lo > 1e3:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def tight_gpu_memory(cfg: DictConfig, cluster: ClusterSpec) -> float | None:
    """Per-GPU memory that makes the run's drift matter, found with the planner itself.

    Just too small for the longest responses' state under one-rank layouts (the planner must
    split a model-stage with TP or PP when responses have grown), yet enough for one-rank layouts
    at the first steps and for a feasible plan while the supply schedule holds the fewest ranks.
    None (keep the preset) when no such memory exists.
    """
    from dataclasses import replace

    from nereus_lightning.plan.planner import plan_job
    from nereus_lightning.spec.errors import InfeasiblePlanError

    models = _job_models(cfg)
    steps = int(cfg.trainer.max_steps)

    def budget(step: int) -> float:
        return response_budget(cfg, step)

    counts = supply_counts(cfg) or [0]
    full = max(counts) if counts[0] else _world_size(cfg)
    fewest = min(counts) if counts[0] else full
    low_steps = [i for i, c in enumerate(counts) if c == fewest] or [0]

    def plan(memory: float, length: float, gpus: int) -> Plan | None:
        try:
            return plan_job(
                models, replace(cluster, gpu_memory=memory).with_gpus(gpus), _workload(cfg, length)
            ).plan
        except InfeasiblePlanError:
            return None

    def single(memory: float, length: float, gpus: int) -> bool:
        p = plan(memory, length, gpus)
        return p is not None and all(c.layout.size == 1 for _, c in p.items())

    lo, hi = 0.0, cluster.gpu_memory
    start = _threshold(lambda m: single(m, budget(0), full), lo, hi)
    during_drop = _threshold(lambda m: plan(m, budget(max(low_steps)), fewest) is not None, lo, hi)
    end = _threshold(lambda m: single(m, budget(steps - 1), full), lo, hi)
    if start is None or during_drop is None or end is None:
        return None
    floor = max(start, during_drop)
    return (floor + end) / 2 if end - floor > 2e3 else None


def module_class(cfg: DictConfig) -> type[RLModule]:
    """The RL module class ``algorithm._target_`` names."""
    from hydra.utils import get_class

    from nereus_lightning.lightning.module import RLModule

    target = str(cfg.algorithm._target_)
    try:
        cls = get_class(target)
    except Exception as exc:
        raise NereusConfigError(f"algorithm._target_: cannot import {target!r} ({exc})") from exc
    if not (isinstance(cls, type) and issubclass(cls, RLModule)):
        raise NereusConfigError(
            f"algorithm._target_: {target!r} is not an RLModule (e.g. nereus_lightning.lightning.GRPOModule)"
        )
    return cls


def rl_config(cfg: DictConfig) -> RLConfig:
    """The job's RL config as its module will build it (:meth:`RLModule.rl_config_for`), before any model
    exists."""
    values = {k: v for k, v in to_dict(cfg.algorithm).items() if k != "_target_"}
    values.update(
        actor=model_source(cfg.actor),
        critic=model_source(cfg.get("critic")),
        prompts_per_step=prompts_per_step(cfg),
        seed=int(cfg.seed),
    )
    return module_class(cfg).rl_config_for(values)


def _algorithm_name(cfg: DictConfig) -> str:
    """The registered name of the job's algorithm: ``algorithm.adv_estimator``, else its module class's."""
    return rl_config(cfg).algorithm


def _num_nodes(cfg: DictConfig) -> int:
    nodes = cfg.trainer.get("num_nodes", 1)
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
        raise NereusConfigError(f"trainer.num_nodes: must be a whole number >= 1, got {nodes!r}")
    return nodes


def _world_size(cfg: DictConfig) -> int:
    """The job's ranks: ``trainer.num_nodes`` x ``trainer.devices`` per node."""
    return _num_nodes(cfg) * _devices_per_node(cfg)


def job_launch(cfg: DictConfig) -> Launch:
    """The launch this process is part of, checked against ``trainer.num_nodes`` x ``trainer.devices``.

    Raises:
        NereusConfigError: the keys describe another job than the launcher (torchrun, SLURM, a
            plain start) started, or ``trainer.num_nodes > 1`` without any launcher for it.
    """
    from nereus_lightning.lightning.launch import check_launch, detect_environment, launch_of

    launch = launch_of(detect_environment())
    check_launch(launch, _num_nodes(cfg), _devices_per_node(cfg))
    return launch


def _say(text: str) -> None:
    """Print on global rank 0 only (under torchrun or srun every rank runs this CLI)."""
    if current_rank() == 0:
        print(text)


def _devices_per_node(cfg: DictConfig) -> int:
    devices = cfg.trainer.get("devices", 1)
    if isinstance(devices, int) and devices > 0:
        return devices
    if not isinstance(devices, (int, str)):  # a list of device indices
        return len(devices)
    if cfg.trainer.get("accelerator") == "cpu":
        return os.cpu_count() or 1
    import torch

    return max(torch.cuda.device_count(), 1)


def _quiet() -> None:
    """Silence third-party warnings that say nothing about this run (inherited by forked ranks)."""
    import warnings

    for pattern in (
        ".*past_key_values.*",
        ".*LeafSpec.*",
        ".*in eval mode at the start of training.*",
        ".*`overwrite` will default to False.*",
        ".*assuming the intent is to save in a single process.*",
        ".*optimizer.step\\(\\).*",
        ".*ModelCheckpoint with manual optimization.*",
        ".*does not have many workers.*",
        ".*Checkpoint directory.*exists.*",
        ".*The dirpath has changed from.*",  # a resume writes into its own run folder
    ):
        warnings.filterwarnings("ignore", message=pattern)


def build_module(cfg: DictConfig) -> RLModule:
    """The RL module of ``cfg``: models, data, reward and hyper-parameters, all checked (no process yet)."""
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    actor = model_source(cfg.actor)
    data = OmegaConf.to_container(cfg.data, resolve=True) if cfg.get("data") else None
    reward = (
        OmegaConf.to_container(cfg.custom_reward_function, resolve=True)
        if cfg.get("custom_reward_function")
        else None
    )
    trainer = cfg.trainer
    # Partial first: objects passed to instantiate() would be turned into configs.
    return instantiate(cfg.algorithm, _partial_=True)(
        actor=actor,
        critic=model_source(cfg.get("critic")),
        reference=model_source(cfg.get("reference")),
        reward_model=reward_model_source(cfg),
        task=None if uses_data(cfg) else instantiate(_task_config(cfg), seed=int(cfg.seed)),
        data=data,
        reward_function=reward,
        reward_workers=int(cfg.reward.get("num_workers", 0)) if cfg.get("reward") else 0,
        reward_timeout_s=cfg.reward.get("timeout_s") if cfg.get("reward") else None,
        reward_max_abs=cfg.reward.get("max_abs", 1e6) if cfg.get("reward") else 1e6,
        prompts_per_step=prompts_per_step(cfg),
        seed=int(cfg.seed),
        on_nonfinite=str(trainer.get("on_nonfinite", "raise")),
        rollout_data_dir=trainer.get("rollout_data_dir"),
    )


def check_config(cfg: DictConfig) -> None:
    """The numbers and files of ``cfg``, checked before the planner, any model or any process."""

    from nereus_lightning.lightning.module import check_hyperparameters, precision_dtype
    from nereus_lightning.lightning.strategy import export_mode
    from nereus_lightning.rl.data import DataConfig

    values = {k: v for k, v in to_dict(cfg.algorithm).items() if k != "_target_" and v is not None}
    values["prompts_per_step"] = prompts_per_step(cfg)
    values["on_nonfinite"] = cfg.trainer.get("on_nonfinite", "raise")
    values["reward_workers"] = cfg.reward.get("num_workers", 0) if cfg.get("reward") else 0
    if cfg.get("reward"):
        values["reward_timeout_s"] = cfg.reward.get("timeout_s")
        values["reward_max_abs"] = cfg.reward.get("max_abs", 1e6)
    check_hyperparameters(values)
    export_mode(cfg.get("export_hf", "end"))
    checkpoint_callback(cfg, "/")  # checkpoint_every, max_ckpt_to_keep
    preemption_callback(cfg)
    precision_dtype(str(cfg.trainer.get("precision", "32-true")))
    if cfg.get("data"):
        DataConfig.of(to_dict(cfg.data))


def run(cfg: DictConfig, overrides: Sequence[str] = ()) -> dict[str, Any]:
    """Train as configured; returns a summary (reward first/last 10 steps, transitions, paths; ``stopped``
    when a signal stopped it). ``overrides``: the job's command line, stored in its checkpoints."""
    import time

    started = time.perf_counter()
    from omegaconf import open_dict

    from nereus_lightning.console_log import propagate_to_root

    propagate_to_root()  # each log record once: through Hydra's handlers, not also Lightning's
    _quiet()
    resolve_trainer(cfg)
    check_config(cfg)
    launch = job_launch(cfg)  # before any model: the keys must describe the job the launcher started
    if launch.launcher == "Lightning" and "LOCAL_RANK" not in os.environ:  # this process starts the ranks
        admit_families(cfg)
    world = _world_size(cfg)
    if gpu_memory_setting(cfg) == "auto":  # resolve once, here, for every rank
        with open_dict(cfg):
            cfg.cluster_gpu_memory = tight_gpu_memory(cfg, job_cluster_preset(cfg))
        memory = cfg.cluster_gpu_memory
        if not memory and not uses_data(cfg):
            with open_dict(cfg):
                cfg.task.gpu_memory = None
        _say(
            f"nereus-train: per-GPU memory {memory:.6g} bytes (auto)"
            if memory
            else "nereus-train: cluster_gpu_memory=auto found no memory that forces a layout change; "
            "keeping the preset's"
        )
    _say(f"nereus-train: topology {job_cluster(cfg).describe()}; {world} ranks started by {launch.launcher}")
    check_feasible(cfg, world)
    module = build_module(cfg)  # every input checked here, before any rank starts
    out = str(cfg.output_dir)
    lock = RunFolderLock(out)
    if current_rank() == 0:
        lock.acquire()  # one job per run folder, refused before anything of this run is written
    try:
        return _fit(cfg, module, out, overrides, started)
    finally:
        lock.release()


def _fit(
    cfg: DictConfig, module: RLModule, out: str, overrides: Sequence[str], started: float
) -> dict[str, Any]:
    """Build the Trainer of ``cfg`` around ``module``, fit, and summarise (rank 0)."""
    import time

    from hydra.utils import instantiate

    from nereus_lightning.control import NodeInventory, SequenceResources
    from nereus_lightning.lightning import NereusCallback, NereusStrategy
    from nereus_lightning.lightning.checkpointing import JobRecord
    from nereus_lightning.lightning.console import print_summary
    from nereus_lightning.lightning.progress import NereusProgressBar

    counts = supply_counts(cfg)
    resources: SequenceResources | NodeInventory | None = SequenceResources(tuple(counts)) if counts else None
    if resources is None and _on_gpus(cfg):
        resources = NodeInventory()  # every node's usable GPUs (NVML), gathered through rank 0

    def controller(pl_module: RoleModule, world_size: int) -> PlanController:
        from nereus_lightning.lightning.callback import default_controller

        return default_controller(
            pl_module,
            world_size,
            os.path.join(out, "decisions.jsonl"),
            cluster=job_cluster(cfg),
            **dict(cfg.controller or {}),
        )

    plot_path = os.path.join(out, "run.png") if cfg.plot else None
    if cfg.get("adapt", True):
        callback = NereusCallback(controller=controller, resources=resources, plot_path=plot_path)
    else:  # adaptation off: every model-stage data-parallel over all ranks, never changed
        from nereus_lightning.control import PoolFollower

        callback = NereusCallback(controller=PoolFollower(_algorithm_name(cfg)), plot_path=plot_path)
    ckpt_dir = os.path.join(out, "checkpoints")
    loggers = [instantiate(v) for v in (cfg.logger or {}).values()]
    callbacks = [
        preemption_callback(cfg),
        callback,
        NereusProgressBar(),
        JobRecord(job_record(cfg, overrides)),
    ]
    if cfg.save_checkpoint:
        callbacks.append(checkpoint_callback(cfg, ckpt_dir))
    trainer_cfg = to_dict(cfg.trainer)
    for key in NEREUS_TRAINER_KEYS:
        trainer_cfg.pop(key, None)
    strategy = NereusStrategy(cluster=job_cluster(cfg), export_hf=cfg.get("export_hf", "end"))
    trainer = instantiate(
        trainer_cfg,
        strategy=strategy,
        callbacks=callbacks,
        logger=loggers or False,
        enable_checkpointing=bool(cfg.save_checkpoint),
    )
    try:
        trainer.fit(module, ckpt_path=cfg.ckpt_path)
    except Exception as exc:  # a rank died or raised: say so and point at the last checkpoint
        cause, kind = root_cause(exc)
        raise TrainingStopped(cause, resume_hint(ckpt_dir, cfg.ckpt_path, cause), kind) from exc
    if not trainer.is_global_zero:  # under torchrun or srun every rank returns here
        return {"stopped": strategy.stopped} if strategy.stopped else {}
    summary = summarize(out)
    summary["plot"] = plot_path
    if strategy.stopped:
        summary["stopped"] = strategy.stopped
    last = latest_checkpoint(ckpt_dir) if cfg.save_checkpoint else None
    if last and os.path.isdir(os.path.join(last, "hf")):
        summary["hf_export"] = os.path.join(last, "hf")  # from_pretrained(<this>/actor)
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print_summary(summary, out, wall_s=time.perf_counter() - started)
    return summary


def checkpoint_callback(cfg: DictConfig, ckpt_dir: str) -> NereusCheckpoint:
    """The run's :class:`~nereus_lightning.lightning.NereusCheckpoint` (``checkpoint_every``,
    ``max_ckpt_to_keep``)."""
    from nereus_lightning.lightning.checkpointing import NereusCheckpoint

    return NereusCheckpoint(
        ckpt_dir,
        every_n_train_steps=cfg.get("checkpoint_every", 10),
        max_ckpt_to_keep=cfg.get("max_ckpt_to_keep"),
    )


def preemption_callback(cfg: DictConfig) -> Preemption:
    """The run's :class:`~nereus_lightning.lightning.Preemption` from ``preemption.*``."""
    from nereus_lightning.lightning.preemption import Preemption

    node = cfg.get("preemption") or {}
    return Preemption(
        step_in_flight=str(node.get("step_in_flight", "finish")),
        grace_s=node.get("grace_s", 30.0),
        requeue=node.get("requeue"),
    )


class TrainingStopped(RuntimeError):
    """A rank raised or died: its cause in one line, and the way back (the resume command, if any).

    ``kind``: the name of the rank's exception type; bad input (:data:`INPUT_ERRORS`) exits with status 2.
    """

    def __init__(self, cause: str, hint: str, kind: str = "") -> None:
        super().__init__(f"training stopped: {cause}\n{hint}")
        self.cause, self.hint, self.kind = cause, hint, kind


#: Errors whose message says everything (the file or key, the way out): shown without their type.
SELF_EXPLAINING = ("CheckpointError", "NereusConfigError", "InfeasiblePlanError")
#: Errors of bad input (a damaged checkpoint, a value): exit status 2, as for nereus-train's own checks.
INPUT_ERRORS = ("CheckpointError", "NereusConfigError", "InfeasiblePlanError")


def root_cause(exc: BaseException) -> tuple[str, str]:
    """``exc`` in one line, and the name of its type: for a rank that raised, its own exception's (not the
    launcher's wrapper)."""
    text = str(exc)
    if "Traceback (most recent call last)" in text:  # torch.multiprocessing: the rank's traceback as text
        lines = [line for line in text.splitlines() if line.strip()]
        last = next((line for line in reversed(lines) if not line.startswith((" ", "\t"))), lines[-1])
        kind, sep, message = last.strip().partition(": ")
        name = kind.rsplit(".", 1)[-1]
        return (message if sep and name in SELF_EXPLAINING else f"{name}{sep}{message}"), name
    first = text.strip().splitlines()[0] if text.strip() else ""
    name = type(exc).__name__
    if name in SELF_EXPLAINING and first:
        return first, name
    return (f"{name}: {first}" if first else name), name


def resume_hint(ckpt_dir: str, resumed_from: str | None = None, cause: str = "") -> str:
    """The command that resumes from this run's newest complete checkpoint (else from the one it resumed
    from, unless that one failed), or that there is none."""
    last = latest_checkpoint(ckpt_dir) if os.path.isdir(ckpt_dir) else None
    if last is None and resumed_from and str(resumed_from) not in cause:
        last = str(resumed_from)
    return f"resume with: nereus-train ckpt_path={last}" if last else "no checkpoint written yet"


def latest_checkpoint(ckpt_dir: str) -> str | None:
    """The newest complete checkpoint under ``ckpt_dir`` whose tensors are all finite (None if none)."""
    from nereus_lightning.lightning.checkpoint import latest_checkpoint as newest_good

    return newest_good(ckpt_dir)


def summarize(out: str) -> dict[str, Any]:
    """Reward over the first and last 10 steps, transitions and plan changes, from the CSV log."""
    import csv

    files = sorted(glob.glob(os.path.join(out, "logs", "*", "metrics.csv")), key=os.path.getmtime)
    if not files:
        return {}
    rows = [r for r in csv.DictReader(open(files[-1])) if r.get("critic/score/mean")]
    scores = [float(r["critic/score/mean"]) for r in rows]
    trans = [r for r in rows if float(r.get("timing_s/transition") or 0) > 0]
    first = scores[:10]
    last = scores[-10:]
    return {
        "steps": len(scores),
        "reward_first10": sum(first) / max(len(first), 1),
        "reward_last10": sum(last) / max(len(last), 1),
        "transitions": len(trans),
        "transition_steps": [int(float(r["step"])) for r in trans],
        "metrics_csv": files[-1],
    }


def main() -> None:
    """The ``nereus-train`` entry point (Hydra)."""
    # One OpenMP thread per rank unless set, as torchrun does: the CPU ranks are forked, and a
    # child whose parent already ran a multi-threaded OpenMP region can hang in its first one.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import hydra

    from nereus_lightning.cli._help import register_help_resolver

    register_help_resolver()
    from nereus_lightning.cli.verl import translate

    try:
        sys.argv[1:], notes = translate(sys.argv[1:])  # verl's keys -> ours, before Hydra reads them
    except NereusConfigError as exc:
        print(f"nereus-train: {exc}", file=sys.stderr)
        sys.exit(2)
    for note in notes:
        _say(f"nereus-train: {note}")

    status = [0]

    @hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="train")
    def _main(cfg: DictConfig) -> None:
        status[0] = run_command(cfg)

    _main()
    leave(status[0])


def run_command(cfg: DictConfig) -> int:
    """``nereus-train`` inside its Hydra app: the job (a resumed one rebuilt from its checkpoint), trained;
    returns the exit status. A failure prints ``nereus-train: <cause>`` and the way out first; its
    traceback goes to the run's log file only."""
    from hydra import compose as hydra_compose
    from hydra.core.hydra_config import HydraConfig

    from nereus_lightning.cli._resume import NothingToDo, resumed_config
    from nereus_lightning.spec.errors import CheckpointError

    overrides = list(HydraConfig.get().overrides.task)
    try:
        cfg, overrides = resumed_config(
            cfg, overrides, lambda o: hydra_compose(config_name="train", overrides=o)
        )
        summary = run(cfg, overrides)
    except NothingToDo as exc:
        _say(f"nereus-train: {exc}")
        return 0
    except (NereusConfigError, InfeasiblePlanError, CheckpointError) as exc:
        _fail(str(exc), exc)
        return 2
    except TrainingStopped as exc:
        if exc.kind in INPUT_ERRORS and not exc.hint.startswith("resume with"):
            _fail(exc.cause, exc)
            return 2
        _fail(f"{exc.cause}\n{exc.hint}", exc)
        return 2 if exc.kind in INPUT_ERRORS else 1
    stopped = summary.get("stopped")
    if not stopped:
        return 0
    import signal

    _say(
        f"nereus-train: stopped by {stopped['signal']} after step {stopped['step']}; checkpoint "
        f"{stopped['checkpoint']}\nresume with: nereus-train ckpt_path={stopped['checkpoint']}"
    )
    return 128 + int(signal.Signals[stopped["signal"]])


def _fail(message: str, exc: BaseException) -> None:
    """Print ``nereus-train: <message>`` (rank 0; every rank under an external launcher logs it) and put the
    traceback into the run's log file only."""
    import logging
    import traceback

    if current_rank() == 0:
        print(f"nereus-train: {message}", file=sys.stderr)
    trace = "".join(traceback.format_exception(exc))
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler) and handler.stream is not None:
            handler.stream.write(f"nereus-train failed: {message}\n{trace}\n")
            handler.flush()


def leave(status: int) -> NoReturn:
    """End a finished run's process without the interpreter's teardown of its objects.

    After a GPU run, tearing down the ~1M objects that torch.compile, transformers and Lightning
    leave took 3.4 s of the time from the last step to process exit (0.5B on an H200,
    ``benchmarks/gpu_fit.py --phases``). Everything the run wrote is closed by now; the exit
    callbacks still run (logging, torch.compile's workers, the process group) and the streams are
    flushed. While a thread other than the main one is still running, the normal exit waits for it.
    """
    main = threading.main_thread()
    if any(t is not main and t.is_alive() and not t.daemon for t in threading.enumerate()):
        sys.exit(status)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


if __name__ == "__main__":
    main()
