"""verl's config keys on nereus-train's command line.

The common ones are aliases of ours (:data:`ALIASES`: the same meaning and units); a verl key
without an alias is refused naming what nereus-train has instead (:data:`HINTS`), rather than
with Hydra's "use +key", which would add a key nothing reads. The README's table of verl's
names is :func:`alias_table`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from nereus_lightning.spec.errors import NereusConfigError


@dataclass(frozen=True)
class Alias:
    """Our key for a verl key; ``values`` translates verl's values where they differ from ours."""

    key: str
    values: Mapping[str, str] = field(default_factory=dict)
    #: A value outside ``values`` goes to ``other_key`` unchanged (None: it is refused).
    other_key: str | None = None


#: verl key -> nereus-train key.
ALIASES: dict[str, Alias] = {
    "actor_rollout_ref.model.path": Alias("actor.path"),
    "critic.model.path": Alias("critic.path"),
    "reward_model.model.path": Alias("reward_model.path"),
    "algorithm.adv_estimator": Alias(
        "algorithm",
        {
            "gae": "ppo",
            "grpo": "grpo",
            "rloo": "rloo",
            "reinforce_plus_plus": "reinforce_plus_plus",
            "reinforce_plus_plus_baseline": "reinforce_plus_plus_baseline",
            "remax": "remax",
        },
        other_key="algorithm.adv_estimator",  # a registered name or file.py:name of your Algorithm
    ),
    "actor_rollout_ref.rollout.n": Alias("algorithm.samples_per_prompt"),
    "actor_rollout_ref.actor.optim.lr": Alias("algorithm.actor_lr"),
    "critic.optim.lr": Alias("algorithm.critic_lr"),
    "actor_rollout_ref.actor.clip_ratio": Alias("algorithm.clip_ratio"),
    "actor_rollout_ref.actor.clip_ratio_low": Alias("algorithm.clip_ratio_low"),
    "actor_rollout_ref.actor.clip_ratio_high": Alias("algorithm.clip_ratio_high"),
    "actor_rollout_ref.actor.clip_ratio_c": Alias("algorithm.clip_ratio_c"),
    "actor_rollout_ref.actor.policy_loss.loss_mode": Alias("algorithm.policy_loss"),
    "actor_rollout_ref.actor.loss_agg_mode": Alias("algorithm.loss_agg_mode"),
    "actor_rollout_ref.actor.loss_scale_factor": Alias("algorithm.loss_scale_factor"),
    "actor_rollout_ref.actor.entropy_coeff": Alias("algorithm.entropy_coeff"),
    "critic.cliprange_value": Alias("algorithm.cliprange_value"),
    "actor_rollout_ref.actor.kl_loss_coef": Alias("algorithm.kl_loss_coef"),
    "actor_rollout_ref.actor.kl_loss_type": Alias("algorithm.kl_loss_type"),
    "algorithm.kl_ctrl.kl_coef": Alias("algorithm.kl_coef"),
    "reward_model.overlong_buffer.len": Alias("algorithm.overlong_buffer.len"),
    "reward_model.overlong_buffer.penalty_factor": Alias("algorithm.overlong_buffer.penalty_factor"),
    "actor_rollout_ref.actor.ppo_epochs": Alias("algorithm.ppo_epochs"),
    "actor_rollout_ref.actor.grad_clip": Alias("algorithm.grad_clip"),
    "actor_rollout_ref.rollout.temperature": Alias("algorithm.temperature"),
    "actor_rollout_ref.rollout.name": Alias("algorithm.rollout_engine"),
    "actor_rollout_ref.rollout.gpu_memory_utilization": Alias("algorithm.vllm.gpu_memory_utilization"),
    "actor_rollout_ref.model.use_remove_padding": Alias("algorithm.remove_padding"),
    "trainer.n_gpus_per_node": Alias("trainer.devices"),
    "trainer.nnodes": Alias("trainer.num_nodes"),
    "trainer.total_training_steps": Alias("trainer.max_steps"),
    "trainer.save_freq": Alias("checkpoint_every"),
    "trainer.test_freq": Alias("trainer.val_check_interval"),
}

_PLANNER = "the planner chooses every model-stage's layout and micro-batch (nereus-plan prints them)"

#: verl keys (or key prefixes, ending in ".") without an alias -> what nereus-train has instead.
HINTS: dict[str, str] = {
    "actor_rollout_ref.actor.ppo_mini_batch_size": (
        "use algorithm.mini_batches, the optimizer steps per RL step "
        "(data.train_batch_size / ppo_mini_batch_size)"
    ),
    "actor_rollout_ref.actor.use_kl_loss": "GRPO's KL loss is algorithm.kl_loss_coef (0 turns it off)",
    "actor_rollout_ref.actor.ppo_micro_batch_size": _PLANNER,
    "actor_rollout_ref.rollout.log_prob_micro_batch_size": _PLANNER,
    "actor_rollout_ref.ref.log_prob_micro_batch_size": _PLANNER,
    "critic.ppo_micro_batch_size": _PLANNER,
    "actor_rollout_ref.rollout.tensor_model_parallel_size": _PLANNER,
    "actor_rollout_ref.actor.fsdp_config.": _PLANNER,
    "actor_rollout_ref.ref.fsdp_config.": _PLANNER,
    "actor_rollout_ref.model.enable_gradient_checkpointing": (
        "the planner chooses recompute per model-stage (nereus-plan prints it)"
    ),
    "algorithm.use_kl_in_reward": "the KL is in the reward exactly when algorithm.kl_coef > 0",
    "reward_model.overlong_buffer.enable": "the overlong buffer is on when algorithm.overlong_buffer.len > 0",
    "reward_model.enable": "a reward model scores exactly when reward_model.path (or .preset) is set",
    "trainer.total_epochs": "nereus-train counts RL steps: trainer.max_steps",
    "trainer.logger": "choose loggers with logger=csv or logger=tensorboard",
    "trainer.project_name": "name the run's folder with hydra.run.dir",
    "trainer.experiment_name": "name the run's folder with hydra.run.dir",
    "trainer.default_local_dir": "checkpoints go to <hydra.run.dir>/checkpoints: set hydra.run.dir",
    "trainer.val_before_train": "validation runs every trainer.val_check_interval steps and at the end",
    "actor_rollout_ref.": "nereus-train has no such setting",
    "critic.optim.": "nereus-train has no such setting (AdamW: algorithm.critic_lr)",
    "critic.model.": "nereus-train has no such setting (the critic's folder: critic.path)",
    "reward_model.model.": "nereus-train has no such setting (the reward model's folder: reward_model.path)",
}

_OVERRIDE = re.compile(r"^(?P<prefix>\+{0,2}|~)(?P<key>[A-Za-z_][\w.]*)(?P<rest>=.*)?$", re.DOTALL)


def translate(overrides: Sequence[str]) -> tuple[list[str], list[str]]:
    """``overrides`` with verl's keys replaced by ours, and one note per replaced key.

    Raises:
        NereusConfigError: a verl key without an alias (naming what to set instead), or a verl
            value with no counterpart (naming the valid ones).
    """
    out, notes = [], []
    for item in overrides:
        match = _OVERRIDE.match(item)
        key = match.group("key") if match else ""
        if match is None or (key not in ALIASES and _hint(key) is None):
            out.append(item)
            continue
        if key not in ALIASES:
            raise NereusConfigError(f"{key} is verl's key: {_hint(key)} (README: verl's names)")
        alias, rest = ALIASES[key], match.group("rest") or ""
        target = alias.key
        if alias.values and rest and rest[1:] not in alias.values and alias.other_key is not None:
            target = alias.other_key
        elif alias.values and rest:
            value = rest[1:]
            if value not in alias.values:
                raise NereusConfigError(
                    f"{key}={value}: nereus-train has {alias.key}= one of {', '.join(alias.values.values())} "
                    f"(verl's {', '.join(alias.values)})"
                )
            rest = f"={alias.values[value]}"
        out.append(f"{match.group('prefix').lstrip('+')}{target}{rest}")
        if target != key:
            notes.append(f"{key} is verl's name for {target}")
    return out, notes


def _hint(key: str) -> str | None:
    """What nereus-train has instead of verl's ``key`` (the longest matching entry), None if not verl's."""
    found = [k for k in HINTS if key == k or key.startswith(k if k.endswith(".") else k + "_")]
    return HINTS[max(found, key=len)] if found else None


def alias_table() -> str:
    """The README's table: verl's key and nereus-train's."""
    rows = ["| verl | nereus-train |", "| --- | --- |"]
    for key, alias in ALIASES.items():
        renamed = [f"{a} -> {b}" for a, b in alias.values.items() if a != b]
        kept = [a for a, b in alias.values.items() if a == b]
        parts = renamed + ([f"{', '.join(kept)} as they are"] if kept else [])
        if alias.other_key:
            parts.append(f"any other value: `{alias.other_key}`")
        values = f" ({'; '.join(parts)})" if parts else ""
        rows.append(f"| `{key}` | `{alias.key}`{values} |")
    return "\n".join(rows)
