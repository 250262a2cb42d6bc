"""The strategy's update is the one-process reference loop's: the same batch, the same weights, one update,
for every algorithm, on one rank and on four (DP, TP and PP): so an update does not depend on the layout."""

from __future__ import annotations

import pytest

from tests.lightning.helpers import update_and_reference

pytestmark = pytest.mark.distributed

ONE_RANK: dict = {  # every model-stage on rank 0 alone
    name: (0,)
    for name in (
        "actor_gen",
        "actor_greedy_gen",
        "actor_infer",
        "ref_infer",
        "critic_infer",
        "reward_infer",
        "actor_train",
        "critic_train",
    )
}
SHARDED = {  # four ranks: DP, TP and PP mixed; training at TP2 x PP2 and DP2 x PP2
    "actor_gen": ((2, 1), (0, 1, 2, 3)),
    "actor_greedy_gen": ((1, 2), (2, 3)),
    "actor_infer": ((1, 2), (3, 2)),
    "ref_infer": ((2, 1), (0, 1)),
    "critic_infer": (1, 2),
    "reward_infer": (0,),
    "actor_train": ((2, 2), (3, 2, 1, 0)),
    "critic_train": ((1, 2), (0, 1, 2, 3)),
}
CASES = {  # each algorithm, and between them every policy loss, loss aggregation and KL placement
    "ppo": {},
    "grpo": {"loss_agg_mode": "seq-mean-token-mean", "norm_adv_by_std_in_grpo": False},
    "remax": {"kl_coef": 0.05, "loss_agg_mode": "seq-mean-token-sum-norm"},
    "rloo": {
        "policy_loss": "gspo",
        "clip_ratio_low": 0.2,
        "clip_ratio_high": 0.28,
        "loss_agg_mode": "seq-mean-token-sum-norm",
        "entropy_coeff": 0.01,
    },
    "reinforce_plus_plus": {"kl_coef": 0.05, "loss_agg_mode": "seq-mean-token-sum", "clip_ratio_c": None},
    "reinforce_plus_plus_baseline": {"loss_agg_mode": "seq-mean-token-mean"},
}


@pytest.mark.parametrize("layout", ["one_rank", "sharded"])
@pytest.mark.parametrize("algorithm", list(CASES))
def test_the_strategys_update_is_the_reference_loops(dist4, algorithm, layout):
    placement = ONE_RANK if layout == "one_rank" else SHARDED
    out = dist4.run(update_and_reference, placement, algorithm, **CASES[algorithm])[0]
    roles = ["actor", "critic"] if algorithm == "ppo" else ["actor"]
    assert sorted(k for k in out if not k.endswith("_moved")) == roles
    for role in roles:
        assert out[f"{role}_moved"] > 1e-4, f"{role}: the update changed nothing"
        assert out[role] < 1e-5, f"{role}: strategy and reference differ by {out[role]:.2e} (relative)"
