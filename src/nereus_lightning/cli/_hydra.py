"""Shared helpers of the Hydra apps: where the configs live, composing them in Python, and the
``_target_`` builders that turn config nodes into specs (``ModelSpec``, ``ClusterSpec``, ``Workload``)."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from nereus_lightning._resources import resource_dir
from nereus_lightning.spec.cluster import ClusterSpec, cluster_preset
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.model import ModelSpec, model_preset
from nereus_lightning.spec.workload import GenerationEngine, Workload

#: The Hydra apps' config directory (``configs/`` of the repository; ``nereus_lightning/configs`` in a wheel).
CONFIG_ROOT = resource_dir("configs")


def compose(config_dir: str | Path, config_name: str, overrides: Sequence[str] = ()) -> DictConfig:
    """Compose ``config_name`` from ``config_dir`` with command-line style ``overrides`` (no app run)."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(Path(config_dir).resolve()), version_base=None):
        return hydra_compose(config_name=config_name, overrides=list(overrides))


def to_dict(cfg: DictConfig | Mapping[str, Any] | None) -> dict[str, Any]:
    """A plain, resolved dict of a config node (an empty dict for None)."""
    if cfg is None:
        return {}
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_container(cfg, resolve=True)  # type: ignore[return-value]
    return dict(cfg)


def _with_fields(spec: Any, fields: Mapping[str, Any], kind: str) -> Any:
    """``spec`` with every non-null entry of ``fields`` replaced; unknown names list the valid ones."""
    valid = {f.name for f in dataclasses.fields(spec)}
    unknown = sorted(set(fields) - valid)
    if unknown:
        raise NereusConfigError(
            f"{kind}: unknown field(s) {unknown}; valid fields: {', '.join(sorted(valid))}"
        )
    changes = {k: v for k, v in fields.items() if v is not None}
    return dataclasses.replace(spec, **changes) if changes else spec


def build_model(preset: str | None = None, config: str | None = None, **fields: Any) -> ModelSpec:
    """A ``ModelSpec`` from a preset name or a transformers ``config.json``, with field overrides."""
    if config:
        spec = ModelSpec.from_hf_config(config)
    elif preset:
        spec = model_preset(preset)
    else:
        raise NereusConfigError(
            "model: set model.preset (a spec.MODEL_PRESETS name) or model.config (a config.json path)"
        )
    return _with_fields(spec, fields, "model")


def build_models(
    preset: str | None = None,
    config: str | None = None,
    critic: str | None = None,
    reference: str | None = None,
    reward: str | None = None,
    **fields: Any,
) -> dict[str, ModelSpec]:
    """The role -> model mapping of an RL job (``plan.job_models``): the actor from ``preset``/``config``;
    other roles are preset names (or config.json paths), defaulting to the actor's architecture, the
    critic and the reward model as value models."""
    from nereus_lightning.plan.planner import job_models

    actor = build_model(preset, config, **fields)

    def other(value: str | None) -> ModelSpec | None:
        if value is None:
            return None
        return (
            ModelSpec.from_hf_config(value)
            if ("/" in value or value.endswith(".json"))
            else model_preset(value)
        )

    return job_models(actor, other(critic), other(reference), other(reward))


def build_cluster(preset: str | None = None, num_gpus: int | None = None, **fields: Any) -> ClusterSpec:
    """A ``ClusterSpec`` from a preset (or from every field when ``preset`` is null), sized ``num_gpus``."""
    if preset:
        spec = _with_fields(cluster_preset(preset), fields, "cluster")
    else:
        given = {k: v for k, v in fields.items() if v is not None}
        try:
            spec = ClusterSpec(**given)
        except TypeError as exc:
            valid = ", ".join(f.name for f in dataclasses.fields(ClusterSpec))
            raise NereusConfigError(
                f"cluster: a custom cluster needs every field ({exc}); fields: {valid}"
            ) from exc
    return spec.with_gpus(int(num_gpus)) if num_gpus is not None else spec


def build_workload(**fields: Any) -> Workload:
    """A ``Workload`` from its fields (``generation_engine`` a mapping); unknown names list the valid ones."""
    engine = to_dict(fields.get("generation_engine"))
    if engine:
        fields["generation_engine"] = GenerationEngine.of(str(engine.pop("kind", "hf")), engine)
    return _with_fields(Workload(), fields, "workload")
