"""End-to-end training through Lightning: resume under another world size, GRPO/ReMax, failures, bad input."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.lightning.helpers import fit

pytestmark = pytest.mark.distributed


def test_resume_under_another_world_size_matches_uninterrupted(tmp_path):
    # Uninterrupted: 3 steps on 4 ranks (dp4), checkpoint after step 2.
    _, full = fit(str(tmp_path / "a"), devices=4, max_steps=3, every=2)
    ckpt = tmp_path / "a" / "ckpt" / "s2.ckpt"
    assert (ckpt / "nereus_meta.json").is_file()
    # Resumed: step 3 on 2 ranks (dp2), from the checkpoint written under dp4.
    _, resumed = fit(str(tmp_path / "b"), devices=2, max_steps=3, ckpt_path=str(ckpt))
    assert [int(float(r["step"])) for r in resumed] == [2]
    for key in ("actor/pg_loss", "critic/vf_loss", "critic/score/mean"):
        a, b = float(full[2][key]), float(resumed[0][key])
        assert abs(a - b) <= 1e-5 * max(1.0, abs(a)), (key, a, b)
    assert float(resumed[0]["plan/actor_train/dp"]) == 2 and float(full[2]["plan/actor_train/dp"]) == 4


@pytest.mark.parametrize("algorithm", ["grpo", "remax"])
def test_grpo_and_remax_run_end_to_end(tmp_path, algorithm):
    trainer, rows = fit(str(tmp_path), devices=2, max_steps=2, algorithm=algorithm)
    assert [int(float(r["step"])) for r in rows] == [0, 1]
    assert all(0.0 <= float(r["critic/score/mean"]) <= 1.0 for r in rows)
    assert "critic/vf_loss" not in rows[0] or rows[0]["critic/vf_loss"] == ""
    assert float(rows[0]["actor/grad_norm"]) > 0


def test_dead_rank_stops_the_job_with_a_resumable_checkpoint(tmp_path):
    from tests.lightning.helpers import DyingPPOModule, small_task

    module = DyingPPOModule(task=small_task(), seed=3, prompts_per_step=8)
    with pytest.raises(Exception, match="exit code|terminated|signal"):
        fit(str(tmp_path / "a"), devices=2, max_steps=4, every=1, module=module)
    ckpts = sorted(os.listdir(tmp_path / "a" / "ckpt"))
    assert ckpts == ["s1.ckpt", "s2.ckpt"]  # the steps that finished before the death
    trainer, rows = fit(
        str(tmp_path / "b"), devices=2, max_steps=3, ckpt_path=str(tmp_path / "a" / "ckpt" / "s2.ckpt")
    )
    assert trainer.state.finished and [int(float(r["step"])) for r in rows] == [2]


def test_ppo_with_a_reward_model_runs_end_to_end(tmp_path):
    from nereus_lightning.lightning import PPOModule
    from tests.lightning.helpers import small_task

    module = PPOModule(task=small_task(), reward_model="tiny_llama", seed=3, prompts_per_step=4)
    assert module.reward is not None and not any(p.requires_grad for p in module.reward.parameters())
    _, rows = fit(str(tmp_path), devices=2, max_steps=1, module=module)
    score = float(rows[0]["critic/score/mean"])
    assert score != 0.0 and abs(score) < 100  # the reward model's value head, not the task's [0, 1] credit


def test_a_given_plan_is_where_training_starts(tmp_path):
    import lightning.pytorch as pl

    from nereus_lightning.control import PoolFollower
    from nereus_lightning.lightning import NereusCallback, NereusStrategy, PPOModule
    from tests.lightning.helpers import plan_of, quiet_trainer, small_task

    plan = plan_of(
        "ppo",
        {
            "actor_train": ((1, 2), (0, 1)),
            "actor_gen": (1,),
            **{
                k: (0, 1)
                for k in ("actor_infer", "ref_infer", "critic_infer", "reward_infer", "critic_train")
            },
        },
    )  # PP2 training, dp1 generation
    module = PPOModule(task=small_task(), seed=3, prompts_per_step=4)
    callbacks = [NereusCallback(controller=PoolFollower("ppo"))]
    trainer = quiet_trainer(2, NereusStrategy(plan=plan), 1, callbacks, pl.loggers.CSVLogger(tmp_path))
    trainer.fit(module)
    import csv
    import glob

    row = next(csv.DictReader(open(glob.glob(str(tmp_path / "lightning_logs" / "*" / "metrics.csv"))[0])))
    assert float(row["plan/actor_train/pp"]) == 2 and float(row["plan/actor_gen/dp"]) == 1


@pytest.mark.parametrize("on_nonfinite", ["raise", "skip"])
def test_a_nan_gradient_norm_stops_the_update_before_the_optimizer_step(tmp_path, on_nonfinite):
    from tests.lightning.helpers import NaNGradientPPOModule, small_task

    module = NaNGradientPPOModule(task=small_task(), seed=3, prompts_per_step=4, on_nonfinite=on_nonfinite)
    if on_nonfinite == "raise":
        with pytest.raises(
            Exception,
            match=r"step 1: actor_train's gradient norm is nan \(first non-finite gradient here: model\.",
        ):
            fit(str(tmp_path), devices=2, max_steps=3, module=module)
        return
    _, rows = fit(str(tmp_path), devices=2, max_steps=3, module=module)
    assert [int(float(r["step"])) for r in rows] == [0, 1, 2]
    # step 1's update was skipped (no gradient norm, no loss), step 2's was not
    assert math.isnan(float(rows[1]["actor/grad_norm"])) and math.isnan(float(rows[1]["actor/pg_loss"]))
    assert float(rows[2]["actor/grad_norm"]) > 0
    assert [float(r["train/skipped_update"]) for r in rows] == [0.0, 1.0, 0.0]


def test_bf16_mixed_trains_on_bf16_weights_with_fp32_masters(tmp_path):
    import math

    from safetensors.torch import load_file

    from nereus_lightning.emu.dcp_state import read_dcp_metadata
    from nereus_lightning.lightning import GRPOModule
    from nereus_lightning.lightning.hf_export import logical_params
    from tests.lightning.helpers import small_task

    module = GRPOModule(task=small_task(), seed=3, samples_per_prompt=2, prompts_per_step=4)
    _, rows = fit(
        str(tmp_path), 2, 2, "grpo", every=2, module=module, write_back=True, precision="bf16-mixed"
    )
    assert all(math.isfinite(float(r["actor/pg_loss"])) and float(r["actor/grad_norm"]) > 0 for r in rows)
    ckpt = tmp_path / "ckpt" / "s2.ckpt"
    meta = read_dcp_metadata(ckpt / "emu" / "actor_train").state_dict_metadata
    name = "model.layers.0.mlp.up_proj.weight"
    # The training stage stores each bf16 weight as its fp32 master only (the weight is the master rounded).
    assert not [k for k in meta if k.startswith("param/")]
    assert meta[f"master/{name}"].properties.dtype == torch.float32
    assert meta[f"exp_avg/{name}"].properties.dtype == torch.float32
    # The reference is stored whole, in bf16 and without masters; the generation unit holds the
    # training stage's weights, so the checkpoint keeps its counters and names where they are.
    ref = read_dcp_metadata(ckpt / "emu" / "ref_infer").state_dict_metadata
    assert ref[f"param/{name}"].properties.dtype == torch.bfloat16 and f"master/{name}" not in ref
    gen = ckpt / "emu" / "actor_gen"
    assert set(read_dcp_metadata(gen).state_dict_metadata) == {"counters", "global_step"}
    assert (gen / "weights_from.json").read_text() == '{"weights_from": "actor_train"}'
    # Read back from the masters, the weights are the trained bf16 weights bit for bit: those the caller's
    # module received from the units (write_back) and those of the Hugging Face export.
    trained = dict(module.actor.named_parameters())
    params = logical_params(str(ckpt / "emu" / "actor_train"))
    assert params.keys() == trained.keys()
    assert all(p.dtype == torch.bfloat16 and torch.equal(p, trained[n].detach()) for n, p in params.items())
    exported = load_file(ckpt / "hf" / "actor" / "model.safetensors")
    assert exported and all(torch.equal(t, trained[n].detach()) for n, t in exported.items())
    # In fp32 the actor's weights have no masters to come from: refused, naming the precision.
    with pytest.raises(
        Exception,
        match=r"actor_train/params_from_masters\.json: stores .* as its fp32 master only, this job's "
        r"actor_train holds it as float32 without a master .* resume with the trainer\.precision",
    ):
        fit(str(tmp_path / "fp32"), 2, 3, "grpo", ckpt_path=str(ckpt))


def test_an_unsupported_precision_is_refused_naming_the_key():
    from nereus_lightning.lightning.module import precision_dtype
    from nereus_lightning.spec.errors import NereusConfigError

    with pytest.raises(NereusConfigError, match="trainer.precision: '16-mixed'.*loss scaling"):
        precision_dtype("16-mixed")
