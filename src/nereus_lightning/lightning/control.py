"""The default controller of a training job: the planner-backed `Controller` for the job's models."""

from __future__ import annotations

from typing import Any

from nereus_lightning.spec.cluster import cluster_preset
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.spec.workload import Workload


def job_workload(pl_module: Any) -> Workload:
    """The workload of ``pl_module``'s RL step (algorithm, batch, expected lengths)."""
    hp = pl_module.hparams
    source = pl_module.source
    length = float(source.max_response_len(0))
    return Workload(
        algorithm=pl_module.algorithm,
        prompts_per_step=hp.prompts_per_step,
        samples_per_prompt=hp.samples_per_prompt,
        prompt_len=source.mean_prompt_len(),
        response_len=length,
        mini_batches=hp.mini_batches,
        ppo_epochs=hp.ppo_epochs,
        reward_model=getattr(pl_module, "reward", None) is not None,
        generation_engine=pl_module.generation_engine,
    )


def model_specs(pl_module: Any) -> dict[str, ModelSpec]:
    """``ModelSpec`` per role (actor, critic, reference) from the module's transformers configs."""
    specs = {"actor": ModelSpec.from_hf_config(pl_module.actor.config, name="actor").with_name("actor")}
    specs["reference"] = specs["actor"].with_name("reference")
    if getattr(pl_module, "critic", None) is not None:
        specs["critic"] = ModelSpec.from_hf_config(pl_module.critic.config, name="critic")
    if getattr(pl_module, "reward", None) is not None:
        specs["reward"] = ModelSpec.from_hf_config(pl_module.reward.config, name="reward")
    return specs


def default_controller(
    pl_module: Any, world_size: int, decision_log: str | None = None, cluster: Any = "cpu4", **config: Any
) -> Any:
    """The planner-backed controller on ``cluster`` (a ``ClusterSpec`` or preset name) sized to ``world_size``
    ranks.

    Falls back to :class:`~nereus_lightning.lightning.callback.PoolFollower` (all model-stages
    data-parallel over the pool) when the planner is not installed.
    """
    from nereus_lightning.control import Controller, ControllerConfig, PlannerBackend

    try:
        from nereus_lightning.plan.planner import plan_job  # noqa: F401
    except ImportError:
        from nereus_lightning.lightning.callback import PoolFollower

        return PoolFollower(pl_module.algorithm)
    specs = model_specs(pl_module)
    backend = PlannerBackend.for_models(  # the pool is the Trainer's: Trainer(devices=...), trainer.devices
        specs["actor"], critic=specs.get("critic"), reference=specs["reference"], pool_key="trainer.devices"
    )
    spec = (cluster_preset(cluster) if isinstance(cluster, str) else cluster).with_gpus(world_size)
    return Controller(backend, spec, job_workload(pl_module), ControllerConfig(**config), log=decision_log)
