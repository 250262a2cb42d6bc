"""One PPO update gives the same parameters under different layouts (same rollout batch); every algorithm's
update against the reference loop on one and four ranks: tests/lightning/test_update_reference.py."""

from __future__ import annotations

import pytest
import torch

from tests.lightning.helpers import one_update, rollout_and_scores

pytestmark = pytest.mark.distributed

LAYOUT_A: dict[str, tuple[int, ...]] = {}  # every model-stage dp4 on ranks 0-3
LAYOUT_B = {  # different DP degrees and GPU sets per model-stage (the planner's kind of plan)
    "actor_gen": (2, 0, 1),
    "actor_infer": (3,),
    "ref_infer": (1, 2),
    "critic_infer": (0,),
    "reward_infer": (1,),
    "actor_train": (1, 3),
    "critic_train": (2,),
}

LAYOUT_C = {  # TP and PP: sharded units compute generation, inference and both updates
    "actor_gen": ((2, 1), (0, 1, 2, 3)),  # dp2 x TP2
    "actor_infer": ((1, 2), (3, 2)),  # PP2
    "ref_infer": ((2, 1), (0, 1)),
    "critic_infer": ((2, 2), (0, 1, 2, 3)),  # TP2 x PP2
    "reward_infer": (0,),
    "actor_train": ((2, 2), (3, 2, 1, 0)),
    "critic_train": ((1, 2), (0, 1, 2, 3)),  # dp2 x PP2
}


_RUNS: dict[str, list] = {}


def _run(pool, name: str) -> list:
    if name not in _RUNS:  # the reference run is shared by both comparisons
        _RUNS[name] = pool.run(one_update, {"A": LAYOUT_A, "B": LAYOUT_B, "C": LAYOUT_C}[name])
    return _RUNS[name]


@pytest.mark.parametrize("other", ["B", "C"], ids=["dp_layouts", "tp_pp_layouts"])
def test_ppo_update_is_layout_independent(dist4, other):
    a = _run(dist4, "A")
    b = _run(dist4, other)
    # The logical parameters (gathered from the EMUs onto rank 0) cover both models ...
    assert any(n.startswith("actor.") for n in a[0]["params"])
    assert any(n.startswith("critic.") for n in a[0]["params"])
    # ... and the two layouts agree within 1e-5 relative per model (fp32; reduction order differs).
    for model in ("actor", "critic"):
        names = [n for n in a[0]["params"] if n.startswith(model + ".")]
        pa = torch.cat([a[0]["params"][n].reshape(-1) for n in names])
        pb = torch.cat([b[0]["params"][n].reshape(-1) for n in names])
        rel = float((pa - pb).norm() / pa.norm())
        assert rel < 1e-5, (model, rel)
    for key in ("actor/pg_loss", "critic/vf_loss"):
        assert abs(a[0]["metrics"][key] - b[0]["metrics"][key]) <= 1e-5 * max(1.0, abs(a[0]["metrics"][key]))
    assert a[0]["metrics"]["critic/vf_loss"] > 0


def test_rollouts_and_scores_are_the_rl_reference_paths_under_tp_and_pp(dist4):
    # actor_gen dp2 x TP2 (transformers generate over ShardedGenerator), actor_infer PP2,
    # critic_infer TP2 x PP2: the same tokens and scores as the unsharded engines.hf / rl.forward.
    for rank, out in enumerate(dist4.run(rollout_and_scores, LAYOUT_C)):
        assert out["same_responses"], (
            f"rank {rank}: responses differ from HFGenerateEngine over the full actor"
        )
        assert out["log_prob_err"] <= 1e-5 and out["value_err"] <= 1e-5, (rank, out)
