"""Algorithms as registered objects: the planner's view, aliases, plug-ins by file, and a new one trained."""

from __future__ import annotations

import csv
import json
import math
import textwrap

import pytest

from nereus_lightning.rl.algorithm import RLConfig
from nereus_lightning.rl.estimators import Algorithm, algorithm_of, register_algorithm
from nereus_lightning.spec.algorithms import AlgorithmSpec, algorithm_names
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.workload import Workload, workflow
from tests.helpers import nereus_train, word_problem_job

#: A user's algorithm in one file: its advantage (the sign of the score minus the prompt's median) and
#: its policy loss (the clipped surrogate plus a metric of its own), registered on import.
PLUGIN = """
import torch
from nereus_lightning.rl import Algorithm, policy_loss, register_algorithm, register_policy_loss
from nereus_lightning.spec.algorithms import AlgorithmSpec


def sign_advantages(batch, token_rewards, cfg):
    scores = token_rewards.sum(-1)
    medians = torch.stack([scores[batch.group_index == g].median() for g in batch.group_index])
    adv = torch.sign(scores - medians).unsqueeze(-1) * batch.response_mask
    return adv, adv.clone()


def marked_loss(*args, **kwargs):
    loss, metrics = policy_loss(*args, **kwargs)
    metrics["actor/marked_loss"] = loss.detach()
    return loss, metrics


SIGN = register_algorithm(Algorithm(AlgorithmSpec("sign_median", min_samples_per_prompt=2), sign_advantages))
register_policy_loss("marked", marked_loss)
"""


def test_the_built_in_algorithms_and_what_the_planner_prices_for_them():
    assert set(algorithm_names()) >= {"ppo", "grpo", "rloo", "reinforce_plus_plus", "remax"}
    critic = {a for a in algorithm_names() if any(m.model == "critic" for m in workflow(a))}
    greedy = {a for a in algorithm_names() if any(m.name == "actor_greedy_gen" for m in workflow(a))}
    assert (critic, greedy) <= ({"ppo"}, {"remax"}) and "ppo" in critic and "remax" in greedy
    assert RLConfig(algorithm="gae").algorithm == "ppo" and Workload("gae").algorithm == "gae"
    assert workflow("gae") == workflow("ppo")


def test_a_registered_algorithm_is_known_everywhere_and_names_are_unique():
    def constant(batch, rewards, cfg):  # noqa: ANN001, ANN202
        return rewards, rewards

    algo = register_algorithm(Algorithm(AlgorithmSpec("constant_for_test", aliases=("cft",)), constant))
    assert algorithm_of("cft") is algo and "constant_for_test" in algorithm_names()
    assert [m.name for m in workflow("cft")] == [m.name for m in workflow("grpo")]
    assert register_algorithm(Algorithm(algo.spec, constant)) is not None  # the same definition again
    with pytest.raises(NereusConfigError, match="'constant_for_test' is registered already"):
        register_algorithm(Algorithm(algo.spec, lambda b, r, c: (r, r)))
    with pytest.raises(NereusConfigError, match="the name 'cft' is taken by 'constant_for_test'"):
        register_algorithm(Algorithm(AlgorithmSpec("other_for_test", aliases=("cft",)), constant))
    with pytest.raises(NereusConfigError, match="algorithm.adv_estimator.*not a valid algorithm name"):
        AlgorithmSpec("Bad-Name")


def test_a_plugin_file_registers_its_algorithm_and_bad_references_are_refused(tmp_path):
    path = tmp_path / "sign_median.py"
    path.write_text(textwrap.dedent(PLUGIN))
    cfg = RLConfig(algorithm=f"{path}:SIGN", policy_loss="marked", samples_per_prompt=2)
    assert cfg.algorithm == "sign_median" and algorithm_of("sign_median").spec.min_samples_per_prompt == 2
    with pytest.raises(NereusConfigError, match="needs >= 2 samples per prompt"):
        RLConfig(algorithm=f"{path}:SIGN", samples_per_prompt=1)
    with pytest.raises(NereusConfigError, match="has no 'NOPE'; it defines"):
        algorithm_of(f"{path}:NOPE")
    with pytest.raises(NereusConfigError, match="is a function, not an Algorithm"):
        algorithm_of(f"{path}:sign_advantages")
    with pytest.raises(NereusConfigError, match="does not exist"):
        algorithm_of(f"{tmp_path / 'missing.py'}:SIGN")


@pytest.mark.distributed
def test_an_algorithm_in_one_file_trains_through_nereus_train_on_two_ranks(tmp_path):
    job = word_problem_job(tmp_path / "job", vocab_size=300)
    plugin = tmp_path / "sign_median.py"
    plugin.write_text(textwrap.dedent(PLUGIN))
    out = nereus_train(
        tmp_path / "run",
        f"actor.path={job['model']}",
        f"data.train_files={job['train']}",
        "algorithm=grpo",
        f"algorithm.adv_estimator={plugin}:SIGN",
        "algorithm.policy_loss=marked",
        "algorithm.prompts_per_step=2",
        "algorithm.samples_per_prompt=2",
        "data.max_response_length=6",
        "trainer.devices=2",
        "trainer.max_steps=2",
        "save_checkpoint=false",
        "plot=false",
        cwd=tmp_path,
    ).stdout
    assert "; 2 ranks started by" in out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    with open(next((tmp_path / "run").rglob("metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("actor/marked_loss")]
    assert len(rows) == 2  # the plug-in's own loss ran at both steps


REWARD = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return float(str(ground_truth) in solution_str) + 0.1 * (len(solution_str) % 3)
"""


@pytest.mark.distributed
@pytest.mark.parametrize("devices", [1, 4])
@pytest.mark.parametrize(
    "name", ["ppo", "grpo", "rloo", "reinforce_plus_plus", "reinforce_plus_plus_baseline", "remax"]
)
def test_every_algorithm_trains_five_steps_on_a_users_job(tmp_path, name, devices):
    job = word_problem_job(tmp_path / "job", vocab_size=300)
    reward = tmp_path / "reward.py"
    reward.write_text(REWARD)
    # REINFORCE++ with its usual KL in the reward, the coefficient adapted toward a target
    adaptive = ["algorithm.kl_coef=0.1", "algorithm.kl_ctrl.type=adaptive", "algorithm.kl_ctrl.horizon=10"]
    nereus_train(
        tmp_path / "run",
        f"actor.path={job['model']}",
        f"data.train_files={job['train']}",
        f"custom_reward_function.path={reward}",
        f"algorithm={name}",
        "algorithm.prompts_per_step=2",
        "algorithm.samples_per_prompt=2",
        "data.max_response_length=4",
        f"trainer.devices={devices}",
        "trainer.max_steps=5",
        "save_checkpoint=false",
        "plot=false",
        *(adaptive if name == "reinforce_plus_plus" else []),
        cwd=tmp_path,
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 5
    with open(next((tmp_path / "run").rglob("metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("actor/pg_loss")]
    assert len(rows) == 5 and all(math.isfinite(float(r["actor/pg_loss"])) for r in rows)
    assert ("critic/vf_loss" in rows[0] and rows[0]["critic/vf_loss"] != "") == (
        name == "ppo"
    )  # critic: GAE only
    if name == "reinforce_plus_plus":  # the coefficient moved after the first step
        coeffs = [float(r["actor/reward_kl_penalty_coeff"]) for r in rows]
        assert coeffs[0] == pytest.approx(0.1) and coeffs[1] != pytest.approx(0.1)
