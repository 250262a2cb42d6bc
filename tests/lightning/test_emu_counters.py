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


def saved_stages(rank: int, world_size: int, folder: str) -> dict:
    """One PPO step, a save; an actor update nobody syncs, a save: what each save holds (rank 0)."""
    import json
    import os

    from nereus_lightning.emu.checkpoint import read_dcp_metadata
    from nereus_lightning.lightning import NereusStrategy, PPOModule

    module = PPOModule(task=small_task(), prompts_per_step=4, seed=3)
    opt = module.configure_optimizers()
    strategy = NereusStrategy.without_trainer(module)
    strategy.transition(plan_of("ppo", EMU_P1))
    module.rl_step(0, strategy, opt)
    out: dict = {}
    for name in ("synced", "unsynced"):
        if name == "unsynced":
            strategy.update("actor_train")  # the module's own update without strategy.sync_weights()
        path = os.path.join(folder, name)
        strategy.units.save(path)
        if rank == 0:
            weights_from, keys = {}, {}
            for stage in strategy.units.plan:
                if os.path.isfile(os.path.join(path, stage, "weights_from.json")):
                    with open(os.path.join(path, stage, "weights_from.json")) as f:
                        weights_from[stage] = json.load(f)["weights_from"]
                stored = read_dcp_metadata(os.path.join(path, stage)).state_dict_metadata
                keys[stage] = {k.split("/")[0] for k in stored}
            out[name] = (weights_from, keys)
    return out


def test_a_checkpoint_stores_weights_that_a_training_stage_holds_once(dist4, tmp_path):
    out = dist4.run(saved_stages, str(tmp_path))[0]
    weights_from, keys = out["synced"]
    assert weights_from == {
        "actor_gen": "actor_train", "actor_infer": "actor_train", "critic_infer": "critic_train"
    }
    trained = {"counters", "param", "exp_avg", "exp_avg_sq", "step"}  # with AdamW's state
    for stage, stored in keys.items():
        expected = trained if stage.endswith("_train") else {"counters", "param"}
        assert stored == ({"counters"} if stage in weights_from else expected), (stage, stored)
    # After an update without a sync the actor's other stages hold older weights: saved in full.
    weights_from, keys = out["unsynced"]
    assert weights_from == {"critic_infer": "critic_train"}
    assert keys["actor_gen"] == keys["actor_infer"] == {"counters", "param"}
