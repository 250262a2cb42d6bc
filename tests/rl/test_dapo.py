"""DAPO's overlong reward shaping and dynamic sampling, against values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.lightning.samples import Rollout
from nereus_lightning.rl.dapo import FilterGroups, OverlongBuffer, varied_groups
from nereus_lightning.rl.data import Prompt
from nereus_lightning.rl.reward_function import RewardResult
from nereus_lightning.spec.errors import NereusConfigError


def test_overlong_penalty_ramps_over_the_last_tokens_of_the_budget():
    # budget 10, buffer 4: free up to 6 tokens; 7 -> -1/4 x 2, 8 -> -2/4 x 2, 10 -> -2
    buffer = OverlongBuffer.of({"len": 4, "penalty_factor": 2.0})
    assert buffer.penalty(torch.tensor([3, 6, 7, 8, 10]), 10).tolist() == [0.0, 0.0, -0.5, -1.0, -2.0]
    assert OverlongBuffer.of({"enable": False, "len": 4}).penalty(torch.tensor([10]), 10).tolist() == [0.0]
    assert OverlongBuffer.of(None).penalty(torch.tensor([10]), 10).tolist() == [0.0]
    with pytest.raises(NereusConfigError, match="leaves no room in a generation budget of 4 tokens"):
        buffer.penalty(torch.tensor([1]), 4)
    with pytest.raises(NereusConfigError, match="algorithm.overlong_buffer.len"):
        OverlongBuffer.of({"len": -1})
    with pytest.raises(NereusConfigError, match="unknown keys \\['length'\\]"):
        OverlongBuffer.of({"length": 3})


def test_groups_with_equal_scores_carry_no_signal():
    assert varied_groups([1.0, 1.0, 0.0, 1.0, 0.5, 0.5], 2) == [False, True, False]
    assert FilterGroups.of({"enable": True}).max_num_gen_batches == 10
    with pytest.raises(NereusConfigError, match="max_num_gen_batches"):
        FilterGroups.of({"enable": True, "max_num_gen_batches": 0})


def _round(scores: list[float], tag: int) -> Rollout:
    prompts = [Prompt(index=100 * tag + i // 2, ids=(1,)) for i in range(len(scores))]
    responses = [[tag, i] for i in range(len(scores))]
    return Rollout(
        prompts, responses, [RewardResult(s) for s in scores], versions=torch.full((len(scores),), tag)
    )


def test_rounds_combine_into_a_batch_of_varied_groups_then_filler():
    # 3 groups of 2 wanted. Round 0 has one varied group (the 2nd); round 1 has two (1st and 3rd).
    rounds = [_round([1, 1, 0, 1, 0, 0], 0), _round([0, 1, 1, 1, 1, 0], 1)]
    flags = [varied_groups([r.score for r in p.results], 2) for p in rounds]
    out = Rollout.of_groups(rounds, 2, 3, flags)
    assert out.responses == [[0, 2], [0, 3], [1, 0], [1, 1], [1, 4], [1, 5]]
    assert out.versions.tolist() == [0, 0, 1, 1, 1, 1]
    assert out.metrics == {
        "train/num_gen_batches": 2.0,
        "train/num_filtered_groups": 3.0,
        "train/num_filler_groups": 0.0,
    }
    # only one varied group in all rounds: the batch is filled with groups without signal, in order
    short = Rollout.of_groups(rounds[:1], 2, 3, flags[:1])
    assert short.responses == [[0, 2], [0, 3], [0, 0], [0, 1], [0, 4], [0, 5]]
    assert short.metrics["train/num_filler_groups"] == 2.0


@pytest.mark.distributed
def test_experiment_dapo_filters_groups_whose_rewards_are_equal(tmp_path):
    import csv
    import json
    import textwrap

    from tests.helpers import nereus_train, word_problem_job

    job = word_problem_job(tmp_path / "job", vocab_size=300)
    reward = tmp_path / "reward.py"
    reward.write_text(
        textwrap.dedent("""
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            # every sample of an odd answer's prompt scores the same: those groups carry no signal
            return 1.0 if int(ground_truth) % 2 else float(len(solution_str) % 2)
    """)
    )
    nereus_train(
        tmp_path / "run",
        "experiment=dapo",
        f"actor.path={job['model']}",
        f"data.train_files={job['train']}",
        f"custom_reward_function.path={reward}",
        "data.train_batch_size=4",
        "data.max_response_length=8",
        "algorithm.samples_per_prompt=2",
        "algorithm.overlong_buffer.len=2",
        "algorithm.filter_groups.max_num_gen_batches=3",
        "trainer.devices=2",
        "trainer.max_steps=2",
        "save_checkpoint=false",
        "plot=false",
        cwd=tmp_path,
    )
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    with open(next((tmp_path / "run").rglob("metrics.csv"))) as f:
        rows = [r for r in csv.DictReader(f) if r.get("train/num_gen_batches")]
    assert len(rows) == 2
    assert all(1 <= float(r["train/num_gen_batches"]) <= 3 for r in rows)
    assert any(float(r["train/num_gen_batches"]) > 1 for r in rows)  # a further round was generated
    assert sum(float(r["train/num_filtered_groups"]) for r in rows) > 0


def test_the_planner_is_told_the_rounds_recent_steps_took():
    from nereus_lightning.rl.dapo import expected_rounds

    assert expected_rounds([]) == 1.0
    assert expected_rounds([1.0, 3.0]) == 2.0
    assert expected_rounds([9.0] * 5 + [1.0, 2.0], window=2) == 1.5  # the recent window only
