"""One PPO update gives the same parameters under different DP layouts (same rollout batch)."""

from __future__ import annotations

import pytest
import torch

from tests.lightning.helpers import one_update

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


def test_ppo_update_is_layout_independent(dist4):
    a = dist4.run(one_update, LAYOUT_A)
    b = dist4.run(one_update, LAYOUT_B)
    # Every rank ends with the same parameters within one run ...
    for rank in range(1, 4):
        for name, p in a[0]["params"].items():
            assert torch.equal(p, a[rank]["params"][name]), name
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
