"""EMU counters advance with training and travel with the state through a transition."""

from __future__ import annotations

import pytest

from tests.lightning.helpers import EMU_P1, EMU_P2, plan_of, small_task

pytestmark = pytest.mark.distributed


def counters_after_steps(rank: int, world_size: int) -> dict:
    """Two PPO steps under P1, a transition to P2, one more step: every unit's counters on rank 0."""
    from nereus_lightning import emu
    from nereus_lightning.lightning import NereusStrategy, PPOModule

    module = PPOModule(task=small_task(), prompts_per_step=4, seed=3)
    opt = module.configure_optimizers()
    strategy = NereusStrategy.without_trainer(module)
    p1, p2 = plan_of("ppo", EMU_P1), plan_of("ppo", EMU_P2)
    out: dict = {}
    for step, plan in enumerate((p1, p1, p2)):
        strategy.transition(plan)
        if step == 2:
            out["moved"] = strategy.units.last_transition.get("mode")
        module.rl_step(step, strategy, opt)
    for name in strategy.units.plan:
        state = emu.gather_logical_state(name, dst=0)  # raises if ranks of one stage disagree
        if state is not None:
            out[name] = state.counters
    return out


def test_counters_count_updates_and_syncs_across_a_transition(dist4):
    out = dist4.run(counters_after_steps)[0]
    assert out["moved"] == "dag"
    for trainer in ("actor_train", "critic_train"):
        c = out[trainer]
        assert (c.optimizer_step, c.update_count, c.policy_version) == (3, 3, 3), (trainer, c)
        assert c.sample_position == 3 * 4, (trainer, c)  # 4 prompts a step, one sample each
    for follower in ("actor_gen", "actor_infer", "critic_infer"):
        c = out[follower]
        assert (c.optimizer_step, c.policy_version, c.stage_version) == (0, 3, 3), (follower, c)
    assert out["ref_infer"].policy_version == 0  # the reference never receives weights
