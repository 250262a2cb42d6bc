"""RL algorithms as registered objects: what a step runs and how scores become advantages.

An :class:`Algorithm` is its :class:`~nereus_lightning.spec.algorithms.AlgorithmSpec` (what the
planner prices), its advantage estimator and its own config checks. Everything that lists
algorithms reads this registry, so adding one is one file: define an ``Algorithm``, call
:func:`register_algorithm`, and name it (``algorithm.adv_estimator=name``, or
``file.py:attribute`` / ``module:attribute`` to have every process of the job import it).
Policy losses are registered beside it (:func:`~nereus_lightning.rl.losses.register_policy_loss`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

from nereus_lightning.rl import advantages as adv
from nereus_lightning.rl.batch import RolloutBatch
from nereus_lightning.rl.plugins import load_attribute
from nereus_lightning.spec.algorithms import AlgorithmSpec, algorithm_spec, register_spec
from nereus_lightning.spec.errors import NereusConfigError, require

if TYPE_CHECKING:
    from nereus_lightning.rl.algorithm import RLConfig

#: ``(batch, token_rewards, cfg) -> (advantages, returns)``, each ``[n, R]``; ``token_rewards`` carry
#: each score on its last token, minus the in-reward KL when ``cfg.kl_coef > 0``.
AdvantageFn = Callable[[RolloutBatch, Tensor, "RLConfig"], tuple[Tensor, Tensor]]

KEY = "algorithm.adv_estimator"


@dataclass(frozen=True)
class Algorithm:
    """One RL algorithm: its spec, advantage estimator and (optional) config check."""

    spec: AlgorithmSpec
    advantages: AdvantageFn
    check: Callable[[RLConfig], None] | None = None

    @property
    def name(self) -> str:
        """The registered name."""
        return self.spec.name


_ALGORITHMS: dict[str, Algorithm] = {}


def _same_code(a: Algorithm, b: Algorithm) -> bool:
    """Whether two registrations come from the same definition (a module imported again)."""

    def where(fn: Callable[..., object]) -> tuple[str, str]:
        return getattr(fn, "__module__", ""), getattr(fn, "__qualname__", "")

    return a.spec == b.spec and where(a.advantages) == where(b.advantages)


def register_algorithm(algorithm: Algorithm) -> Algorithm:
    """Make ``algorithm`` known to the planner and the trainer by its name (and aliases).

    Raises:
        NereusConfigError: another algorithm has that name.
    """
    existing = _ALGORITHMS.get(algorithm.name)
    if existing is not None and not _same_code(existing, algorithm):
        raise NereusConfigError(f"{KEY}: {algorithm.name!r} is registered already; choose another name")
    if existing is None:
        register_spec(algorithm.spec)
    _ALGORITHMS[algorithm.name] = algorithm
    return algorithm


def algorithm_of(name: str) -> Algorithm:
    """The algorithm registered as ``name`` (or an alias), or named by ``file.py:attr``/``module:attr``."""
    if ":" in name:
        found = load_attribute(name, KEY)
        require(isinstance(found, Algorithm), KEY, f"{name!r} is a {type(found).__name__}, not an Algorithm")
        return register_algorithm(found)
    spec = algorithm_spec(name, KEY)
    require(
        spec.name in _ALGORITHMS,
        KEY,
        f"{name!r} is known to the planner but no computation is registered for it; import the module "
        "that registers it, or name it as 'file.py:attribute'",
    )
    return _ALGORITHMS[spec.name]


def _outcome(batch: RolloutBatch, token_rewards: Tensor) -> Tensor:
    """Each sequence's return (its score minus the in-reward KL); an empty response keeps its score."""
    has_tokens = batch.response_mask.sum(-1) > 0
    return token_rewards.sum(-1).where(has_tokens, batch.need("scores"))


def _gae(batch: RolloutBatch, rewards: Tensor, cfg: RLConfig) -> tuple[Tensor, Tensor]:
    return adv.gae_advantages(rewards, batch.need("values"), batch.response_mask, cfg.gamma, cfg.lam)


def _grpo(batch: RolloutBatch, rewards: Tensor, cfg: RLConfig) -> tuple[Tensor, Tensor]:
    scores = _outcome(batch, rewards)
    return adv.grpo_advantages(
        scores, batch.response_mask, batch.group_index, norm_by_std=cfg.norm_adv_by_std_in_grpo
    )


def _rloo(batch: RolloutBatch, rewards: Tensor, cfg: RLConfig) -> tuple[Tensor, Tensor]:
    return adv.rloo_advantages(_outcome(batch, rewards), batch.response_mask, batch.group_index)


def _reinforce_plus_plus(batch: RolloutBatch, rewards: Tensor, cfg: RLConfig) -> tuple[Tensor, Tensor]:
    return adv.reinforce_plus_plus_advantages(rewards, batch.response_mask, cfg.gamma)


def _reinforce_plus_plus_baseline(
    batch: RolloutBatch, rewards: Tensor, cfg: RLConfig
) -> tuple[Tensor, Tensor]:
    scores = _outcome(batch, rewards)
    return adv.reinforce_plus_plus_baseline_advantages(scores, batch.response_mask, batch.group_index)


def _remax(batch: RolloutBatch, rewards: Tensor, cfg: RLConfig) -> tuple[Tensor, Tensor]:
    return adv.remax_advantages(rewards, batch.need("baseline_scores"), batch.response_mask)


for _name, _fn in (
    ("ppo", _gae),
    ("grpo", _grpo),
    ("rloo", _rloo),
    ("reinforce_plus_plus", _reinforce_plus_plus),
    ("reinforce_plus_plus_baseline", _reinforce_plus_plus_baseline),
    ("remax", _remax),
):
    register_algorithm(Algorithm(algorithm_spec(_name), _fn))
