"""The controller's plan as a checkpoint stores it: every layout dimension, ZeRO's included, comes back."""

from __future__ import annotations

from pathlib import Path

import pytest

from nereus_lightning.control.state import plan_from_state, plan_to_state
from nereus_lightning.lightning.checkpoint_values import check_plan_state
from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.spec.errors import CheckpointError

PLAN = Plan(
    (
        ("actor_gen", Candidate(Layout(2, 1), 2, (0, 1, 2, 3), 8, False)),
        ("actor_train", Candidate(Layout(1, 1, shard=2, zero=1), 2, (0, 1, 2, 3), 4, True)),
    )
)


def test_a_sharded_plan_round_trips_and_passes_the_resume_check():
    state = plan_to_state(PLAN)
    assert plan_from_state(state) == PLAN
    check_plan_state(state, Path("meta.json"), "plan")  # dp 2 x shard 2 x tp 1 x pp 1 = 4 GPU ids


def test_a_state_from_before_zero_is_unsharded_and_a_wrong_count_is_named():
    state = plan_to_state(PLAN)
    old = [{k: v for k, v in s.items() if k not in ("shard", "zero")} for s in state[:1]]
    assert plan_from_state(old) == Plan(PLAN.assignments[:1])
    state[1]["shard"] = 1  # then 2 GPUs, not 4
    with pytest.raises(CheckpointError, match=r"plan\[1\]\.gpus: .*2 distinct GPU ids \(dp 2 x shard 1"):
        check_plan_state(state, Path("meta.json"), "plan")
