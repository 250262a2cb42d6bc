"""The default controller of a training job: the planner-backed `Controller` for the module's role models."""

from __future__ import annotations

from typing import Any

from nereus_lightning.control import Controller, ControllerConfig, PlannerBackend
from nereus_lightning.lightning.roles import RoleModule
from nereus_lightning.spec.cluster import ClusterSpec, cluster_preset


def default_controller(
    module: RoleModule,
    world_size: int,
    decision_log: str | None = None,
    cluster: ClusterSpec | str = "cpu4",
    **config: Any,
) -> Controller:
    """The planner-backed controller of ``module``'s models and workload on ``cluster`` (a ``ClusterSpec``
    or preset name) sized to ``world_size`` ranks."""
    specs = module.role_models().specs()
    backend = PlannerBackend.for_models(  # the pool is the Trainer's: Trainer(devices=...), trainer.devices
        specs["actor"], critic=specs.get("critic"), reference=specs["reference"], pool_key="trainer.devices"
    )
    spec = (cluster_preset(cluster) if isinstance(cluster, str) else cluster).with_gpus(world_size)
    return Controller(backend, spec, module.workload(0), ControllerConfig(**config), log=decision_log)
