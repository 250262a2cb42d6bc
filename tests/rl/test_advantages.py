"""Advantage estimators against values worked out by hand in the comments."""

from __future__ import annotations

import math

import pytest
import torch

from nereus_lightning.rl.advantages import (
    apply_kl_penalty,
    gae_advantages,
    grpo_advantages,
    masked_var,
    masked_whiten,
    reinforce_plus_plus_advantages,
    reinforce_plus_plus_baseline_advantages,
    remax_advantages,
    returns_to_go,
    rloo_advantages,
    scores_to_token_rewards,
)
from nereus_lightning.spec.errors import NereusConfigError


def _rows(t):
    return [pytest.approx(r, abs=1e-6) for r in t.tolist()]


def test_gae_gamma_lambda_one_gives_total_reward_returns():
    # deltas from the end: 1 - .7 = .3; 0 + .7 - .6 = .1; 0 + .6 - .5 = .1 -> A = .5, .4, .3
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae_advantages(r, v, torch.ones(1, 3), gamma=1.0, lam=1.0, whiten=False)
    assert adv.tolist() == _rows(torch.tensor([[0.5, 0.4, 0.3]]))
    assert ret.tolist() == _rows(torch.tensor([[1.0, 1.0, 1.0]]))


def test_gae_discounted():
    # gamma = lam = 0.5: A2 = .3; A1 = (.5*.7 - .6) + .25*.3 = -.175; A0 = (.5*.6 - .5) + .25*(-.175)
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    adv, ret = gae_advantages(r, v, torch.ones(1, 3), gamma=0.5, lam=0.5, whiten=False)
    assert adv.tolist() == _rows(torch.tensor([[-0.24375, -0.175, 0.3]]))
    assert ret.tolist() == _rows(torch.tensor([[0.25625, 0.425, 1.0]]))


def test_gae_skips_padding_on_either_side_and_in_between():
    r = torch.tensor([[0.0, 2.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 2.0]])
    v = torch.tensor([[1.0, 1.0, 9.0], [9.0, 1.0, 1.0], [1.0, 9.0, 3.0]])
    mask = torch.tensor([[1, 1, 0], [0, 1, 1], [1, 0, 1]])
    adv, ret = gae_advantages(r, v, mask, gamma=1.0, lam=1.0, whiten=False)
    # rows 0, 1: delta(last) = 2 - 1 = 1, delta(first) = 1 - 1 = 0 -> A = 1, 1
    assert adv[0].tolist() == pytest.approx([1.0, 1.0, 0.0])
    assert adv[1].tolist() == pytest.approx([0.0, 1.0, 1.0])
    assert ret[0].tolist() == pytest.approx([2.0, 2.0, 0.0])
    # row 2 with gamma = .5: A2 = 2 - 3 = -1; A0 = (.5*3 - 1) + .5*(-1) = 0 (slot 1 is skipped)
    adv, ret = gae_advantages(r[2:], v[2:], mask[2:], gamma=0.5, lam=1.0, whiten=False)
    assert adv[0].tolist() == pytest.approx([0.0, 0.0, -1.0])
    assert ret[0].tolist() == pytest.approx([1.0, 0.0, 2.0])


def test_gae_whitened_over_valid_tokens():
    r = torch.tensor([[0.0, 0.0, 1.0]])
    v = torch.tensor([[0.5, 0.6, 0.7]])
    adv, _ = gae_advantages(r, v, torch.ones(1, 3), whiten=True)
    # raw A = .5, .4, .3: mean .4, unbiased var (.01 + 0 + .01) / 2 = .01 -> 1, 0, -1
    assert adv.tolist() == _rows(torch.tensor([[1.0, 0.0, -1.0]]))


def test_masked_var_and_whiten():
    x = torch.tensor([[1.0, 2.0, 3.0, 100.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    assert masked_var(x, mask).item() == pytest.approx(1.0)  # (1 + 0 + 1) / 2
    assert masked_var(x, mask, unbiased=False).item() == pytest.approx(2 / 3)
    assert masked_whiten(x, mask).tolist() == _rows(torch.tensor([[-1.0, 0.0, 1.0, 0.0]]))
    assert masked_whiten(x, mask, shift_mean=False).tolist() == _rows(torch.tensor([[1.0, 2.0, 3.0, 0.0]]))


def test_grpo_groups_by_id_not_by_position():
    # group 7: scores 1, 3, 5 -> mean 3, std sqrt((4 + 0 + 4) / 2) = 2 -> -1, 0, 1
    # group 3: scores 10, 20 -> mean 15, std sqrt(25 + 25) -> -/+ 5 / sqrt(50)
    scores = torch.tensor([1.0, 10.0, 3.0, 20.0, 5.0])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1], [0, 1]])
    adv, ret = grpo_advantages(scores, mask, [7, 3, 7, 3, 7], eps=0.0)
    s = 5 / math.sqrt(50)
    assert adv.tolist() == _rows(torch.tensor([[-1.0, -1.0], [-s, 0.0], [0.0, 0.0], [s, s], [0.0, 1.0]]))
    assert torch.equal(adv, ret)
    adv, _ = grpo_advantages(scores, torch.ones(5, 1), [7, 3, 7, 3, 7], norm_by_std=False)
    assert adv[:, 0].tolist() == pytest.approx([-2.0, -5.0, 0.0, 5.0, 2.0])


def test_grpo_constant_group_and_singleton():
    # equal scores -> 0 advantage; a singleton group keeps its score (mean 0, std 1)
    adv, _ = grpo_advantages(torch.tensor([1.0, 1.0, 0.75]), torch.ones(3, 1), torch.tensor([0, 0, 1]))
    assert adv[:, 0].tolist() == pytest.approx([0.0, 0.0, 0.75], abs=1e-5)
    with pytest.raises(NereusConfigError, match="group_ids"):
        grpo_advantages(torch.zeros(3), torch.ones(3, 1), [0, 1])


def test_remax_and_returns_to_go():
    # row 0: reward 1 at the end, baseline .25 -> .75 everywhere; row 1: .5 on its last token, baseline 1
    r = torch.tensor([[0.0, 0.0, 1.0], [0.0, 0.5, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = remax_advantages(r, torch.tensor([0.25, 1.0]), mask)
    assert adv.tolist() == _rows(torch.tensor([[0.75, 0.75, 0.75], [-0.5, -0.5, 0.0]]))
    assert ret.tolist() == _rows(torch.tensor([[1.0, 1.0, 1.0], [0.5, 0.5, 0.0]]))
    # per-token KL in the rewards: -.1, -.1, .9 -> returns .7, .8, .9; discounted by .5: .075, .35, .9
    r = torch.tensor([[-0.1, -0.1, 0.9]])
    adv, _ = remax_advantages(r, torch.tensor([0.25]), torch.ones(1, 3))
    assert adv.tolist() == _rows(torch.tensor([[0.45, 0.55, 0.65]]))
    assert returns_to_go(r, torch.ones(1, 3), gamma=0.5).tolist() == _rows(torch.tensor([[0.075, 0.35, 0.9]]))


def test_scores_on_last_token_and_kl_penalty():
    mask = torch.tensor([[1, 1, 0], [0, 1, 1]])
    rewards = scores_to_token_rewards(torch.tensor([3.0, 5.0]), mask)
    assert rewards.tolist() == [[0.0, 3.0, 0.0], [0.0, 0.0, 5.0]]
    # k1 per token: logp - ref = .5 and -1; coef .1 -> rewards 0 - .05, 1 + .1
    lp = torch.tensor([[-1.0, -2.0]])
    ref = torch.tensor([[-1.5, -1.0]])
    penalised, m = apply_kl_penalty(
        torch.tensor([[0.0, 1.0]]), lp, ref, torch.ones(1, 2), kl_coef=0.1, kind="kl"
    )
    assert penalised.tolist() == _rows(torch.tensor([[-0.05, 1.1]]))
    assert m["actor/kl"].item() == pytest.approx(-0.25)
    assert m["actor/reward_kl_penalty_coeff"].item() == pytest.approx(0.1)


# A batch of five samples of two prompts; responses of 2, 1, 3, 1 and 2 tokens.
GROUPS = torch.tensor([0, 0, 0, 1, 1])
SCORES = torch.tensor([1.0, 0.0, 2.0, 3.0, 5.0])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 0, 0], [1, 1, 0]])


def test_rloo_subtracts_the_mean_of_the_other_samples():
    # group 0: 1 - (0+2)/2 = 0; 0 - (1+2)/2 = -1.5; 2 - (1+0)/2 = 1.5. group 1: 3 - 5 = -2; 5 - 3 = 2.
    adv, ret = rloo_advantages(SCORES, MASK, GROUPS)
    assert _rows(adv) == [[0, 0, 0], [-1.5, 0, 0], [1.5, 1.5, 1.5], [-2, 0, 0], [2, 2, 0]]
    assert torch.equal(adv, ret)
    # a prompt with one sample has no other sample: its score stays
    alone, _ = rloo_advantages(torch.tensor([4.0]), torch.ones(1, 2), [7])
    assert _rows(alone) == [[4, 4]]


def test_grpo_without_std_division_only_removes_the_group_mean():
    # Dr. GRPO: group means 1 and 4 -> 0, -1, 1, -1, 1 (a std of 1 would hide the difference: use x10)
    adv, _ = grpo_advantages(10 * SCORES, MASK, GROUPS, norm_by_std=False)
    assert _rows(adv) == [[0, 0, 0], [-10, 0, 0], [10, 10, 10], [-10, 0, 0], [10, 10, 0]]


def test_reinforce_plus_plus_baseline_whitens_the_centred_scores_over_the_batch_tokens():
    # centred: 0, -1, 1, -1, 1 on 2, 1, 3, 1, 2 tokens: 9 values summing to 3, mean 1/3; squared deviations
    # 2 x 1/9 + 2 x 16/9 + 5 x 4/9 = 6; unbiased variance 6/8 = 0.75.
    adv, ret = reinforce_plus_plus_baseline_advantages(SCORES, MASK, GROUPS)
    s = math.sqrt(0.75 + 1e-8)
    lo, mid, hi = (-1 / 3) / s, (-4 / 3) / s, (2 / 3) / s
    assert _rows(adv) == [[lo, lo, 0], [mid, 0, 0], [hi, hi, hi], [mid, 0, 0], [hi, hi, 0]]
    assert torch.equal(adv, ret)


def test_reinforce_plus_plus_whitens_discounted_returns_to_go():
    # gamma 0.5: rewards [0, 0, 1] -> returns .25, .5, 1; rewards [0, -1, pad] -> -.5, -1.
    # 5 values, mean .05; squared deviations .04 + .2025 + .9025 + .3025 + 1.1025 = 2.55; variance 2.55/4.
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    adv, ret = reinforce_plus_plus_advantages(rewards, mask, gamma=0.5)
    assert _rows(ret) == [[0.25, 0.5, 1.0], [-0.5, -1.0, 0.0]]
    s = math.sqrt(2.55 / 4 + 1e-8)
    assert _rows(adv) == [[0.2 / s, 0.45 / s, 0.95 / s], [-0.55 / s, -1.05 / s, 0.0]]
