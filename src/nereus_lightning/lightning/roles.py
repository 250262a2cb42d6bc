"""What a LightningModule gives `NereusStrategy`: the role models of its RL algorithm and its step's shape.

The module says which role models exist (actor, reference, critic, reward: full transformers
models) and holds the algorithm; the strategy cuts the models into every model-stage's Elastic
Model Units at setup and owns them from then on (transitions, weight sync, checkpoints, offload).
A module is a :class:`RoleModule` when it has the two methods below; ``RLModule`` is one, and so
is any LightningModule a user writes the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from torch import nn

from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.spec.workload import Workload, workflow

ROLLOUT_ENGINES = ("hf", "vllm")


@dataclass(frozen=True)
class RoleModels:
    """The role models of one RL algorithm and how their training model-stages learn.

    Args:
        algorithm: ``"ppo"``, ``"grpo"`` or ``"remax"``: names the model-stages
            (:func:`~nereus_lightning.spec.workload.workflow`) and which of them train.
        models: role (``actor``, ``reference``, ``critic``, ``reward``) -> its full model; a role
            that is absent or None has no model-stage state (e.g. a function reward).
        learning_rates: trainable role -> the AdamW learning rate of its training model-stage.
        rollout_engine: ``"hf"`` (generation on the units' modules) or ``"vllm"`` (vLLM engines
            fed from the generation units).
        tokenizer: saved beside each trained model in the checkpoint's ``hf/<model>/`` folder.
    """

    algorithm: str
    models: Mapping[str, nn.Module | None]
    learning_rates: Mapping[str, float] = field(default_factory=dict)
    rollout_engine: str = "hf"
    tokenizer: Any = None

    def __post_init__(self) -> None:
        workflow(self.algorithm)  # an unknown algorithm fails here, naming the known ones
        roles = {m.model for m in workflow(self.algorithm)}
        unknown = sorted(set(self.present()) - roles)
        if unknown:
            raise ValueError(f"role models {unknown} are not roles of {self.algorithm!r} ({sorted(roles)})")
        if self.rollout_engine not in ROLLOUT_ENGINES:
            raise ValueError(f"rollout_engine {self.rollout_engine!r} is not one of {ROLLOUT_ENGINES}")

    def present(self) -> dict[str, nn.Module]:
        """The roles that have a model."""
        return {role: model for role, model in self.models.items() if model is not None}

    def configs(self) -> dict[str, Any]:
        """The transformers config of every role that has a model."""
        return {role: model.config for role, model in self.present().items()}

    def specs(self) -> dict[str, ModelSpec]:
        """``ModelSpec`` per role from the models' configs (what the planner and the transition brain price).

        The reference prices as the actor when it has no model of its own.
        """
        configs = self.configs()
        out = {role: ModelSpec.from_hf_config(config, name=role) for role, config in configs.items()}
        if "reference" not in out and "actor" in out:
            out["reference"] = out["actor"].with_name("reference")
        return out


@runtime_checkable
class RoleModule(Protocol):
    """A LightningModule :class:`~nereus_lightning.lightning.strategy.NereusStrategy` can run."""

    def role_models(self) -> RoleModels:
        """The role models (called once, at setup: the strategy then owns their state)."""
        ...

    def workload(self, step: int = 0) -> Workload:
        """The RL step's shape at ``step`` (batch, expected lengths): prices plans and transitions."""
        ...
