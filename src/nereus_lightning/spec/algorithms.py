"""The RL algorithms the planner knows: each one's name and which model-stages its step runs.

An algorithm's computation lives in the body (:mod:`nereus_lightning.rl.estimators`), which registers
its :class:`AlgorithmSpec` here; the brain reads only the spec, so it prices exactly the
model-stages the algorithm runs: a critic only for GAE, a greedy rollout only for ReMax.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from nereus_lightning.spec.errors import NereusConfigError, require

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass(frozen=True)
class AlgorithmSpec:
    """What a step of the algorithm runs, as the planner prices it.

    Attributes:
        name: the registered name (verl's ``algorithm.adv_estimator`` where verl has one).
        critic: a critic scores (``critic_infer``) and trains (``critic_train``): GAE.
        greedy_baseline: a greedy rollout per sample is generated and scored (``actor_greedy_gen``).
        min_samples_per_prompt: the fewest samples per prompt its advantages are defined for.
        aliases: other names it answers to (``gae`` for ``ppo``).
    """

    name: str
    critic: bool = False
    greedy_baseline: bool = False
    min_samples_per_prompt: int = 1
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in (self.name, *self.aliases):
            require(
                bool(_NAME.match(name)),
                "algorithm.adv_estimator",
                f"{name!r} is not a valid algorithm name (lower case letters, digits and _)",
            )
        require(
            self.min_samples_per_prompt >= 1,
            "min_samples_per_prompt",
            f"must be >= 1, got {self.min_samples_per_prompt}",
        )


_SPECS: dict[str, AlgorithmSpec] = {}
_NAMES: dict[str, str] = {}  # every name and alias -> the registered name


def register_spec(spec: AlgorithmSpec) -> AlgorithmSpec:
    """Make ``spec`` known by its name and aliases; registering the same spec again is a no-op.

    Raises:
        NereusConfigError: a name or alias is taken by another algorithm.
    """
    if _SPECS.get(spec.name) == spec:
        return spec
    for name in (spec.name, *spec.aliases):
        if name in _NAMES:
            raise NereusConfigError(
                f"algorithm {spec.name!r}: the name {name!r} is taken by {_NAMES[name]!r}; choose another"
            )
    _SPECS[spec.name] = spec
    for name in (spec.name, *spec.aliases):
        _NAMES[name] = spec.name
    return spec


def algorithm_names() -> tuple[str, ...]:
    """The registered algorithms' names (aliases not included), in registration order."""
    return tuple(_SPECS)


def algorithm_spec(name: str, key: str = "workload.algorithm") -> AlgorithmSpec:
    """The spec registered as ``name`` (or an alias of it); ``key`` names the setting in the error."""
    require(
        name in _NAMES,
        key,
        f"{name!r} is not a known algorithm; choose one of {', '.join(algorithm_names())}"
        " (or register one: nereus_lightning.rl.register_algorithm)",
    )
    return _SPECS[_NAMES[name]]


# The built-in algorithms (their computation: nereus_lightning.rl.estimators).
for _spec in (
    AlgorithmSpec("ppo", critic=True, aliases=("gae",)),
    AlgorithmSpec("grpo", min_samples_per_prompt=2),
    AlgorithmSpec("rloo", min_samples_per_prompt=2),
    AlgorithmSpec("reinforce_plus_plus"),
    AlgorithmSpec("reinforce_plus_plus_baseline"),
    AlgorithmSpec("remax", greedy_baseline=True),
):
    register_spec(_spec)
