"""Rewards that hang fail in about ``reward.timeout_s`` naming the sample; slow scoring says so; a finite
reward beyond ``reward.max_abs`` is refused like a NaN one."""

from __future__ import annotations

import logging
import math
import time

import pytest
import torch

from nereus_lightning.rl.reward_function import RewardFunction, RewardInput, RewardSpec
from nereus_lightning.spec.errors import NereusConfigError

HANGING = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info):
    if solution_str == "hang":
        while True:
            time.sleep(1)
    return 1.0
"""


def items(*texts: str) -> list[RewardInput]:
    return [RewardInput(i, "arith", text, "7") for i, text in enumerate(texts)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_hanging_reward_fails_within_its_timeout_naming_the_sample(tmp_path, workers):
    path = tmp_path / "reward.py"
    path.write_text(HANGING)
    reward = RewardFunction(RewardSpec(str(path)), num_workers=workers, timeout_s=2)
    started = time.monotonic()
    results = reward(items("7", "7", "hang", "7"))
    seconds = time.monotonic() - started
    reward.close()
    assert 2 <= seconds < 12  # the timeout, the workers' start, the poll
    assert [r.error is None for r in results[:2]] == [True, True]
    assert "within reward.timeout_s=2 s on sample 2 (data_source 'arith')" in results[2].error
    assert math.isnan(results[2].score)
    if not workers:  # a fresh worker after the stuck one was killed
        assert [r.score for r in reward(items("7"))] == [1.0]
        reward.close()


def test_a_hanging_python_callable_fails_within_its_timeout():
    def compute_score(data_source, solution_str, ground_truth, extra_info):  # noqa: ANN001, ANN202
        time.sleep(60 if solution_str == "hang" else 0)
        return 1.0

    results = RewardFunction(compute_score, timeout_s=1)(items("7", "hang", "7"))
    assert results[0].score == 1.0 and "sample 1" in results[1].error and "sample 1" in results[2].error


def test_slow_scoring_reports_its_progress(tmp_path, monkeypatch, caplog):
    import nereus_lightning.rl.reward_function as reward_function

    monkeypatch.setattr(reward_function, "PROGRESS_EVERY_S", 0.2)

    def compute_score(data_source, solution_str, ground_truth, extra_info):  # noqa: ANN001, ANN202
        time.sleep(0.15)
        return 1.0

    with caplog.at_level(logging.WARNING):
        RewardFunction(compute_score)(items("7", "7", "7", "7"))
    assert any("of 4 samples scored on this rank after" in r.getMessage() for r in caplog.records)


def test_timeouts_and_bounds_are_checked_naming_their_keys():
    from nereus_lightning.lightning.module import check_hyperparameters

    with pytest.raises(NereusConfigError, match=r"reward\.timeout_s: must be a number > 0"):
        check_hyperparameters({"reward_timeout_s": 0})
    with pytest.raises(NereusConfigError, match=r"reward\.max_abs: must be a number > 0"):
        check_hyperparameters({"reward_max_abs": float("inf")})


def test_a_finite_absurd_reward_is_refused_like_a_nan_one():
    from types import SimpleNamespace

    from nereus_lightning.lightning import GRPOModule
    from nereus_lightning.lightning.module import NonFiniteError
    from nereus_lightning.rl.tasks import DenseRepeatTask

    module = GRPOModule(task=DenseRepeatTask(), prompts_per_step=2, samples_per_prompt=2, reward_max_abs=1e6)
    batch = SimpleNamespace(scores=torch.tensor([0.5, 1e30, 0.0, 1.0]), baseline_scores=None)
    samples = [SimpleNamespace(index=i // 2, data_source="repeat") for i in range(4)]
    with pytest.raises(NonFiniteError, match=r"sample 1 .* is 1\.0+\d*e\+30 .*beyond reward\.max_abs=1e\+06"):
        module._check_rewards(7, batch, samples)
    batch.scores[1] = 1e5
    assert module._check_rewards(7, batch, samples) is False
