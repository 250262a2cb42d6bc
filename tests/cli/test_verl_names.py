"""verl's key names on nereus-train's command line: aliases of ours, and pointers for the rest."""

from __future__ import annotations

import json
import textwrap

import pytest

from nereus_lightning.cli.train import train_config
from nereus_lightning.cli.verl import ALIASES, alias_table, translate
from nereus_lightning.spec.errors import NereusConfigError
from tests.helpers import nereus_train, word_problem_job

VERL_LINE = [
    "actor_rollout_ref.rollout.n=4",
    "actor_rollout_ref.actor.optim.lr=1e-6",
    "trainer.n_gpus_per_node=2",
    "trainer.total_training_steps=3",
]


def test_the_common_verl_keys_set_ours():
    cfg = train_config([*VERL_LINE, "algorithm.adv_estimator=grpo", "trainer.save_freq=5"])
    assert cfg.algorithm._target_.endswith("GRPOModule")
    assert (cfg.algorithm.samples_per_prompt, cfg.algorithm.actor_lr) == (4, 1e-6)
    assert (cfg.trainer.devices, cfg.trainer.max_steps, cfg.checkpoint_every) == (2, 3, 5)
    out, notes = translate(["+critic.optim.lr=1e-5", "hydra.run.dir=/tmp/x", "--help"])
    assert out == ["algorithm.critic_lr=1e-5", "hydra.run.dir=/tmp/x", "--help"]
    assert notes == ["critic.optim.lr is verl's name for algorithm.critic_lr"]


def test_verl_estimators_choose_our_presets_and_other_values_reach_adv_estimator():
    for verl, ours in (
        ("gae", "ppo"),
        ("rloo", "rloo"),
        ("reinforce_plus_plus_baseline", "reinforce_plus_plus_baseline"),
    ):
        cfg = train_config([f"algorithm.adv_estimator={verl}"])
        assert cfg.algorithm.get("adv_estimator", None) in (None, ours)
        assert cfg.algorithm._target_.rsplit(".", 1)[-1] in ("PPOModule", "RLModule")
    cfg = train_config(["algorithm.adv_estimator=rloo"])
    assert (cfg.algorithm.adv_estimator, cfg.algorithm.samples_per_prompt) == ("rloo", 4)  # GRPO's keys
    out, _ = translate(["algorithm.adv_estimator=my_algo.py:ALGO"])
    assert out == ["algorithm.adv_estimator=my_algo.py:ALGO"]  # ours too: a plug-in


def test_every_alias_names_a_key_of_ours():
    from omegaconf import OmegaConf

    missing = object()
    configs = [train_config(["algorithm=ppo"]), train_config(["algorithm=grpo"])]  # critic_lr, kl_loss_coef
    for verl, alias in ALIASES.items():
        if alias.key != "algorithm":  # a config group, not a key
            found = [OmegaConf.select(cfg, alias.key, default=missing) is not missing for cfg in configs]
            assert any(found), f"{verl} -> {alias.key}"


def test_a_verl_key_without_an_alias_names_what_to_set_instead():
    cases = {
        "actor_rollout_ref.actor.ppo_mini_batch_size=16": "mini_batch_size is verl.s key: use algorithm.mini",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4": "the planner chooses every model-stage's",
        "critic.optim.weight_decay=0": "no such setting .AdamW: algorithm.critic_lr",
    }
    for override, message in cases.items():
        with pytest.raises(NereusConfigError, match=message):
            translate([override])
    ours = ["critic.path=/m", "reward_model.path=/r"]  # our own keys under roots verl shares
    assert translate(ours) == (ours, [])


def test_the_readme_table_lists_every_alias():
    table = alias_table()
    assert all(f"`{verl}` | `{alias.key}`" in table for verl, alias in ALIASES.items())


@pytest.mark.distributed
def test_a_verl_style_command_line_runs(tmp_path):
    job = word_problem_job(tmp_path / "job", vocab_size=300)
    reward = tmp_path / "reward.py"
    reward.write_text(
        textwrap.dedent("""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            return float(str(ground_truth) in solution_str)
    """)
    )
    out = nereus_train(
        tmp_path / "run",
        f"data.train_files={job['train']}",
        f"actor_rollout_ref.model.path={job['model']}",
        "algorithm.adv_estimator=grpo",
        f"custom_reward_function.path={reward}",
        "data.train_batch_size=2",
        "data.max_response_length=6",
        *VERL_LINE,
        "save_checkpoint=false",
        "plot=false",
        cwd=tmp_path,
    ).stdout
    assert "nereus-train: actor_rollout_ref.rollout.n is verl's name for algorithm.samples_per_prompt" in out
    assert "; 2 ranks started by" in out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 3
