"""Policy losses (PPO, GSPO), loss aggregation and KL estimators against values worked out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from nereus_lightning.rl.losses import (
    agg_loss,
    entropy_from_logits,
    entropy_loss,
    gspo_policy_loss,
    kl_loss,
    kl_penalty,
    loss_normalizer,
    policy_loss,
    register_policy_loss,
    token_log_probs,
    value_loss,
)
from nereus_lightning.spec.errors import NereusConfigError

LN2 = 0.6931471805599453


def _policy_inputs():
    # Four real tokens: seq 0 holds t1, t2, t3; seq 1 holds t4 and two pad slots with junk values.
    #   t1: ratio 1.5, A = +1 -> unclipped -1.5, clipped -1.2 -> loss -1.2 (clipped)
    #   t2: ratio 0.5, A = +1 -> unclipped -0.5, clipped -0.8 -> loss -0.5
    #   t3: ratio 0.5, A = -1 -> unclipped +0.5, clipped +0.8 -> loss +0.8 (clipped)
    #   t4: ratio 1.0, A = +2 -> -2 both                       -> loss -2.0
    log_probs = torch.tensor([[math.log(1.5), math.log(0.5), math.log(0.5)], [0.0, 9.0, 9.0]])
    old = torch.zeros(2, 3)
    adv = torch.tensor([[1.0, 1.0, -1.0], [2.0, 7.0, -7.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    return log_probs, old, adv, mask


def test_policy_loss_token_mean_clipfrac_and_approx_kl():
    loss, metrics = policy_loss(*_policy_inputs(), clip_eps=0.2)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 0.8 - 2.0) / 4)  # -0.725
    assert metrics["actor/pg_loss"].item() == pytest.approx(-0.725)
    assert metrics["actor/pg_clipfrac"].item() == pytest.approx(2 / 4)
    # approx KL = mean(old - new) = -(ln1.5 + ln0.5 + ln0.5 + 0) / 4
    assert metrics["actor/ppo_kl"].item() == pytest.approx(-(0.4054651 - 0.6931472 - 0.6931472) / 4, abs=1e-6)


def test_policy_loss_sequence_aggregations():
    loss, _ = policy_loss(*_policy_inputs(), agg="seq-mean-token-mean")
    assert loss.item() == pytest.approx(((-1.2 - 0.5 + 0.8) / 3 + -2.0) / 2)  # -1.15
    loss, _ = policy_loss(*_policy_inputs(), agg="seq-mean-token-sum")
    assert loss.item() == pytest.approx(((-1.2 - 0.5 + 0.8) + -2.0) / 2)  # -1.45


def test_policy_loss_asymmetric_and_dual_clip():
    # ratio 1.5, A = +1, clip high 0.6: clamp(1.5, 0.8, 1.6) = 1.5 -> not clipped, loss -1.5
    lp = torch.tensor([[math.log(1.5)]])
    loss, m = policy_loss(
        lp, torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), clip_eps=0.2, clip_eps_high=0.6
    )
    assert loss.item() == pytest.approx(-1.5)
    assert m["actor/pg_clipfrac"].item() == 0.0
    # ratio 5, A = -1: max(5, 1.2) = 5; dual clip c = 3 caps it at -A * c = 3
    lp = torch.tensor([[math.log(5.0)]])
    loss, m = policy_loss(lp, torch.zeros(1, 1), -torch.ones(1, 1), torch.ones(1, 1), dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0)
    assert m["actor/pg_clipfrac_lower"].item() == 1.0


def test_policy_loss_gradient_is_zero_on_clipped_tokens():
    lp = torch.tensor([[math.log(1.5), math.log(0.9)]], requires_grad=True)
    loss, _ = policy_loss(lp, torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2))
    loss.backward()
    # token 0 clipped -> no gradient; token 1: d/dlp of -ratio/2 = -0.9/2
    assert lp.grad[0, 0].item() == 0.0
    assert lp.grad[0, 1].item() == pytest.approx(-0.45)


def test_value_loss_clipped():
    # t1: v 1.0, old 0.5 -> clipped v 0.7; errs (1-1.2)^2 = .04, (.7-1.2)^2 = .25 -> .25 (clipped)
    # t2: v 2.0, old 0.5 -> clipped v 0.7; errs 4, .49 -> 4
    # t3: v = old = 0, R = 1 -> 1;   pad slot ignored
    values = torch.tensor([[1.0, 2.0, 0.0, 5.0]])
    old = torch.tensor([[0.5, 0.5, 0.0, -5.0]])
    returns = torch.tensor([[1.2, 0.0, 1.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    loss, m = value_loss(values, old, returns, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(0.5 * (0.25 + 4.0 + 1.0) / 3)  # 0.875
    assert m["critic/vf_loss"].item() == pytest.approx(0.875)
    assert m["critic/vf_clipfrac"].item() == pytest.approx(1 / 3)


def test_kl_estimators():
    # token 0: p = 0.5, q = 0.25; token 1: p = 0.25, q = 0.5
    lp = torch.log(torch.tensor([[0.5, 0.25]]))
    ref = torch.log(torch.tensor([[0.25, 0.5]]))
    assert kl_penalty(lp, ref, "kl").tolist()[0] == pytest.approx([LN2, -LN2])
    assert kl_penalty(lp, ref, "k1").tolist()[0] == pytest.approx([LN2, -LN2])
    assert kl_penalty(lp, ref, "abs").tolist()[0] == pytest.approx([LN2, LN2])
    assert kl_penalty(lp, ref, "mse").tolist()[0] == pytest.approx([0.5 * LN2**2] * 2)
    # k3 = q/p - ln(q/p) - 1: 0.5 + ln2 - 1 and 2 - ln2 - 1
    assert kl_penalty(lp, ref, "low_var_kl").tolist()[0] == pytest.approx([LN2 - 0.5, 1 - LN2])
    loss, m = kl_loss(lp, ref, torch.ones(1, 2), kind="k3")
    assert loss.item() == pytest.approx(0.25)
    assert m["actor/kl"].item() == pytest.approx(0.25)
    with pytest.raises(NereusConfigError, match="low_var_kl"):
        kl_penalty(lp, ref, "k9")


def test_entropy_and_token_log_probs():
    logits = torch.tensor([[[0.0, 0.0], [0.0, math.log(3.0)]]])
    ent = entropy_from_logits(logits)
    # uniform over 2: ln 2; p = (1/4, 3/4): 0.25 ln 4 + 0.75 ln(4/3)
    assert ent.tolist()[0] == pytest.approx([LN2, 0.25 * math.log(4) + 0.75 * math.log(4 / 3)])
    assert token_log_probs(logits, torch.tensor([[0, 1]])).tolist()[0] == pytest.approx(
        [-LN2, math.log(0.75)]
    )
    loss, m = entropy_loss(ent, torch.tensor([[1, 0]]))
    assert loss.item() == pytest.approx(LN2)
    assert m["actor/entropy"].item() == pytest.approx(LN2)


def test_agg_loss_rejects_unknown_mode():
    with pytest.raises(NereusConfigError, match="seq-mean-token-mean"):
        agg_loss(torch.ones(1, 2), torch.ones(1, 2), "mean")
    # an all-masked sequence does not count in sequence means
    x = torch.tensor([[2.0, 4.0], [100.0, 100.0]])
    assert agg_loss(x, torch.tensor([[1, 1], [0, 0]]), "seq-mean-token-mean").item() == pytest.approx(3.0)


def test_seq_mean_token_sum_norm_divides_by_sequences_times_a_constant_length():
    # sums 6 and 4 over 2 sequences of width 3: 10 / (2 x 3); with a constant length of 5: 10 / (2 x 5)
    x = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    assert agg_loss(x, mask, "seq-mean-token-sum-norm").item() == pytest.approx(10 / 6)
    norm = loss_normalizer(mask, "seq-mean-token-sum-norm", length=5)
    assert agg_loss(x, mask, "seq-mean-token-sum-norm", norm).item() == pytest.approx(1.0)


def test_gspo_uses_one_ratio_per_sequence_with_each_tokens_gradient():
    # new log-probs ln 1.2 and 0 against old 0: the sequence's ratio is exp(ln(1.2)/2) = sqrt(1.2) on both
    # tokens; A = 1 inside [0.8, 1.28]: loss -sqrt(1.2) (token mean), d loss / d log p_t = -sqrt(1.2) / 2.
    new = torch.tensor([[math.log(1.2), 0.0]], requires_grad=True)
    old, adv, mask = torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2)
    loss, m = gspo_policy_loss(new, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    loss.backward()
    assert loss.item() == pytest.approx(-math.sqrt(1.2))
    assert new.grad.tolist() == [[pytest.approx(-math.sqrt(1.2) / 2)] * 2]
    assert m["actor/pg_clipfrac"].item() == 0.0
    # the same sequence clipped at 1 + 0.05: the loss is the clipped one, and no gradient flows
    new.grad = None
    loss, m = gspo_policy_loss(new, old, adv, mask, clip_eps=0.2, clip_eps_high=0.05)
    loss.backward()
    assert loss.item() == pytest.approx(-1.05)
    assert new.grad.abs().sum().item() == 0.0 and m["actor/pg_clipfrac"].item() == 1.0


def test_actor_loss_applies_verls_dual_clip_by_default_and_the_chosen_policy_loss():
    from nereus_lightning.rl.algorithm import RLConfig, actor_loss
    from nereus_lightning.rl.batch import RolloutBatch

    # one token, A = -1, ratio 5: the clipped surrogate is max(5, 1.2) = 5; dual clip caps it at 3
    ids = torch.ones(1, 1, dtype=torch.long)
    micro = RolloutBatch(ids, ids, ids, ids, torch.zeros(1), torch.zeros(1))
    micro.old_log_probs, micro.advantages = torch.zeros(1, 1), -torch.ones(1, 1)
    new, one = torch.full((1, 1), math.log(5.0)), torch.tensor(1.0)
    assert actor_loss(new, micro, RLConfig(), one, one)[0].item() == pytest.approx(3.0)
    assert actor_loss(new, micro, RLConfig(clip_ratio_c=None), one, one)[0].item() == pytest.approx(5.0)
    calls = []

    def doubled(*args, **kwargs):
        calls.append(kwargs["agg"])
        loss, m = policy_loss(*args, **kwargs)
        return 2 * loss, m

    register_policy_loss("doubled_for_test", doubled)
    cfg = RLConfig(policy_loss="doubled_for_test", loss_agg_mode="seq-mean-token-sum")
    assert actor_loss(new, micro, cfg, one, one)[0].item() == pytest.approx(6.0) and calls == [
        "seq-mean-token-sum"
    ]
    with pytest.raises(NereusConfigError, match="'doubled_for_test' is registered already"):
        register_policy_loss("doubled_for_test", lambda *a, **k: None)


def test_rollout_correction_weights_each_tokens_loss_by_the_truncated_ratio():
    from nereus_lightning.rl.algorithm import RLConfig, actor_loss, rollout_is_weights, rollout_mismatch
    from nereus_lightning.rl.batch import RolloutBatch

    # trainer over rollout probability: 0.5, 1 and 4 on three tokens (A = 1, the policy unchanged: loss -1
    # per token); threshold 2 truncates the last weight: loss -(0.5 + 1 + 2) / 3
    ids, mask = torch.ones(1, 3, dtype=torch.long), torch.ones(1, 3)
    micro = RolloutBatch(ids[:, :1], ids[:, :1], ids, mask.long(), torch.zeros(1), torch.zeros(1))
    micro.old_log_probs, micro.advantages = torch.zeros(1, 3), torch.ones(1, 3)
    micro.rollout_log_probs = torch.tensor([[math.log(2.0), 0.0, math.log(0.25)]])
    assert rollout_is_weights(micro, 2.0).tolist() == [[pytest.approx(0.5), 1.0, 2.0]]
    assert rollout_is_weights(micro, None) is None
    norm = torch.tensor(3.0)
    corrected = actor_loss(micro.old_log_probs, micro, RLConfig(rollout_is_threshold=2.0), norm, norm)[0]
    assert corrected.item() == pytest.approx(-(0.5 + 1 + 2) / 3)
    plain = actor_loss(micro.old_log_probs, micro, RLConfig(), norm, norm)[0]
    assert plain.item() == pytest.approx(-1.0)  # no threshold: the uncorrected loss
    m = rollout_mismatch(micro, 2.0)
    assert m["mismatch/rollout_is_max"] == pytest.approx(4.0)
    assert m["mismatch/rollout_is_ratio_fraction_high"] == pytest.approx(1 / 3)
    assert m["mismatch/mismatch_kl"] == pytest.approx((math.log(2.0) + math.log(0.25)) / 3)
    with pytest.raises(NereusConfigError, match="algorithm.rollout_is_threshold"):
        RLConfig(rollout_is_threshold=0.0)


def test_an_infinite_threshold_is_the_uncorrected_update_where_the_engines_agree():
    """Untruncated weights are exp(old - rollout): exactly 1 where the two engines' log-probs agree, so the
    loss and its gradient are the uncorrected ones bit for bit; where they differ, the weights do."""
    from nereus_lightning.rl.algorithm import RLConfig, actor_loss
    from nereus_lightning.rl.batch import RolloutBatch

    torch.manual_seed(3)
    ids, mask = torch.ones(2, 5, dtype=torch.long), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    micro = RolloutBatch(ids[:, :1], ids[:, :1], ids, mask, torch.zeros(2), torch.zeros(2))
    micro.old_log_probs, micro.advantages = -torch.rand(2, 5), torch.randn(2, 5)
    norm = mask.sum().float()

    def loss_and_grad(rollout: torch.Tensor, threshold: float | None) -> tuple[torch.Tensor, torch.Tensor]:
        micro.rollout_log_probs = rollout
        new = micro.old_log_probs + 0.1 * torch.randn(2, 5, generator=torch.Generator().manual_seed(0))
        new = new.requires_grad_()
        loss = actor_loss(new, micro, RLConfig(rollout_is_threshold=threshold), norm, norm)[0]
        loss.backward()
        return loss.detach(), new.grad

    agreeing = micro.old_log_probs.clone()
    plain, corrected = loss_and_grad(agreeing, None), loss_and_grad(agreeing, math.inf)
    assert torch.equal(plain[0], corrected[0]) and torch.equal(plain[1], corrected[1])
    differing = agreeing + 0.05
    assert not torch.equal(loss_and_grad(differing, math.inf)[0], plain[0])
