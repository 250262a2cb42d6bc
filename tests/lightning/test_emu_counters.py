"""EMU counters advance with training and travel with the state through a transition."""

from __future__ import annotations

import pytest
import torch

from tests.lightning.helpers import EMU_P1, EMU_P2, plan_of, small_task

pytestmark = pytest.mark.distributed


def counters_after_steps(rank: int, world_size: int) -> dict:
    """Two PPO steps under P1, a transition to P2, one more step: every unit's counters on rank 0."""
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
        state = strategy.units.logical_state(name)  # raises if ranks of one stage disagree
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


def retuned_units(rank: int, world_size: int) -> dict:
    """A PPO step under P1, then P1 with other micro-batches and recomputation on one stage, then a step:
    what moved and whether this rank's modules and optimizers stayed."""
    from dataclasses import replace

    from nereus_lightning.lightning import NereusStrategy, PPOModule
    from nereus_lightning.plan.layout import Plan

    module = PPOModule(task=small_task(), prompts_per_step=4, seed=3)
    opt = module.configure_optimizers()
    strategy = NereusStrategy.without_trainer(module)
    p1 = plan_of("ppo", EMU_P1)
    tuned = Plan.of({n: replace(c, micro_batch=2, recompute=n == "actor_train") for n, c in p1.items()})
    strategy.transition(p1)
    module.rl_step(0, strategy, opt)
    before = {n: (id(m), id(strategy.units.optimizers.get(n))) for n, m in strategy.units.units.items()}
    strategy.transition(tuned)
    out = {
        "mode": strategy.units.last_transition.get("mode"),
        "plan": strategy.plan == tuned and all(c == tuned[n] for n, c in strategy.units.plan.items()),
        "kept": before
        == {n: (id(m), id(strategy.units.optimizers.get(n))) for n, m in strategy.units.units.items()},
        "recompute": {n: m.recompute for n, m in strategy.units.units.items()},
    }
    module.rl_step(1, strategy, opt)
    state = strategy.units.logical_state("actor_train")
    out["actor_steps"] = None if state is None else state.counters.optimizer_step
    return out


def test_a_micro_batch_change_alone_moves_nothing_and_keeps_the_modules(dist4):
    outs = dist4.run(retuned_units)
    for rank, out in enumerate(outs):
        assert out["mode"] == "retune" and out["plan"] and out["kept"], (rank, out)
        assert all(on == (name == "actor_train") for name, on in out["recompute"].items()), (rank, out)
        assert ("actor_train" in out["recompute"]) is (rank in (0, 1)), (rank, out)  # its GPUs
    assert outs[0]["actor_steps"] == 2  # both steps trained after the retune


def saved_stages(rank: int, world_size: int, folder: str, dtype: torch.dtype) -> dict:
    """One PPO step with the role models in ``dtype``, a save; an actor update nobody syncs, a save; each save
    resumed under another plan. Rank 0: what each save holds and what differs after its resume.
    """
    import json
    import os

    from nereus_lightning.emu.dcp_state import read_dcp_metadata
    from nereus_lightning.lightning import NereusStrategy, PPOModule

    def module_in_dtype() -> PPOModule:
        module = PPOModule(task=small_task(), prompts_per_step=4, seed=3)
        for model in module.role_models().present().values():  # as RLModule.setup does for the precision
            model.to(dtype)
            model.config.dtype = dtype
        return module

    module = module_in_dtype()
    opt = module.configure_optimizers()
    strategy = NereusStrategy.without_trainer(module)
    strategy.transition(plan_of("ppo", EMU_P1))
    module.rl_step(0, strategy, opt)
    out: dict = {}
    saved = {}
    for name in ("synced", "unsynced"):
        if name == "unsynced":
            strategy.update("actor_train")  # the module's own update without strategy.sync_weights()
        path = os.path.join(folder, name)
        strategy.units.save(path)
        saved[name] = {stage: strategy.units.logical_state(stage) for stage in strategy.units.plan}
        if rank == 0:
            weights_from, keys = {}, {}
            for stage in strategy.units.plan:
                if os.path.isfile(os.path.join(path, stage, "weights_from.json")):
                    with open(os.path.join(path, stage, "weights_from.json")) as f:
                        weights_from[stage] = json.load(f)["weights_from"]
                stored = read_dcp_metadata(os.path.join(path, stage)).state_dict_metadata
                keys[stage] = {k.split("/")[0] for k in stored}
            out[name] = (weights_from, keys)
    for name in ("synced", "unsynced"):
        again = NereusStrategy.without_trainer(module_in_dtype())
        again.units.resume_from = os.path.join(folder, name)
        again.transition(plan_of("ppo", EMU_P2))  # every training stage in another layout
        resumed = {stage: again.units.logical_state(stage) for stage in again.units.plan}
        if rank == 0:
            out[f"{name} resumed"] = {s: saved[name][s].differences(state) for s, state in resumed.items()}
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_checkpoint_stores_weights_that_a_training_stage_holds_once(dist4, tmp_path, dtype):
    out = dist4.run(saved_stages, str(tmp_path), dtype)[0]
    weights_from, keys = out["synced"]
    assert weights_from == {
        "actor_gen": "actor_train",
        "actor_infer": "actor_train",
        "critic_infer": "critic_train",
    }
    # A training stage stores its AdamW state; bf16 weights as their fp32 masters only (each is its master
    # rounded), fp32 weights as they are.
    weights = {"master"} if dtype == torch.bfloat16 else {"param"}
    trained = {"counters", "exp_avg", "exp_avg_sq", "step"} | weights
    for stage, stored in keys.items():
        expected = trained if stage.endswith("_train") else {"counters", "param"}
        assert stored == ({"counters"} if stage in weights_from else expected), (stage, stored)
    # After an update without a sync the actor's other stages hold older weights: saved in full.
    weights_from, keys = out["unsynced"]
    assert weights_from == {"critic_infer": "critic_train"}
    assert keys["actor_gen"] == keys["actor_infer"] == {"counters", "param"}
    # Resumed under another plan, every model-stage holds what was saved, bit for bit: weights, masters,
    # AdamW moments and counters.
    for name in ("synced", "unsynced"):
        resumed = out[f"{name} resumed"]
        assert set(resumed) == set(keys) and all(d == [] for d in resumed.values()), (name, resumed)
