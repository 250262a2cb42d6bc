"""``nereus-train ckpt_path=...`` rebuilds the job stored in the checkpoint; one job per run folder."""

from __future__ import annotations

import os

import pytest

from nereus_lightning.cli._resume import (
    NothingToDo,
    RunFolderLock,
    absolute_paths,
    job_record,
    resumed_config,
)
from nereus_lightning.cli.train import train_config
from nereus_lightning.lightning.checkpoint import encode, write_metadata
from nereus_lightning.spec.errors import NereusConfigError

JOB = [
    "algorithm=grpo",
    "algorithm.samples_per_prompt=2",
    "data.max_response_length=6",
    "trainer.max_steps=20",
]


@pytest.fixture
def grpo_checkpoint(tmp_path):
    """A checkpoint (its metadata only) of a GRPO job at step 10."""
    folder = tmp_path / "step10.ckpt"
    folder.mkdir()
    record = job_record(train_config([*JOB, f"output_dir={tmp_path}"]), JOB)
    write_metadata(folder, encode({"global_step": 10, "epoch": 0, "nereus_job": record}), "emu", files={})
    return str(folder)


def resume(ckpt: str, tmp_path, *given: str):  # noqa: ANN001, ANN201
    overrides = [f"ckpt_path={ckpt}", *given]
    cfg = train_config([*overrides, f"output_dir={tmp_path / 'run'}"])
    return resumed_config(cfg, overrides, lambda o: train_config(o))


def test_ckpt_path_alone_restores_the_job_and_explicit_overrides_win(grpo_checkpoint, tmp_path):
    cfg, job = resume(grpo_checkpoint, tmp_path)
    assert cfg.algorithm._target_.endswith("GRPOModule") and cfg.algorithm.samples_per_prompt == 2
    assert cfg.trainer.max_steps == 20 and cfg.ckpt_path == grpo_checkpoint and job == JOB
    cfg, job = resume(grpo_checkpoint, tmp_path, "trainer.max_steps=30", "trainer.devices=2")
    assert cfg.trainer.max_steps == 30 and cfg.trainer.devices == 2 and cfg.algorithm.samples_per_prompt == 2
    assert job[-2:] == ["trainer.max_steps=30", "trainer.devices=2"]  # the next checkpoints store the first
    assert "trainer.devices=2" not in job_record(cfg, job)["overrides"]  # (the launch is not stored)


@pytest.mark.parametrize(
    "given, message",
    [
        (
            "algorithm=ppo",
            r"algorithm: .* trained with algorithm\._target_=.*GRPOModule', this command gives .*PPOModule",
        ),
        (
            "actor=tiny_qwen2",
            r"actor: .* trained with actor\.preset='tiny_llama', this command gives 'tiny_qwen2'",
        ),
        ("trainer.max_steps=5", r"trainer\.max_steps: 5 is below the checkpoint's step 10"),
    ],
)
def test_a_command_for_another_job_is_refused_naming_both(grpo_checkpoint, tmp_path, given, message):
    with pytest.raises(NereusConfigError, match=message):
        resume(grpo_checkpoint, tmp_path, given)


def test_nothing_to_do_says_so(grpo_checkpoint, tmp_path):
    with pytest.raises(NothingToDo, match=r"nothing to train: .* at step 10 = trainer\.max_steps"):
        resume(grpo_checkpoint, tmp_path, "trainer.max_steps=10")


def test_last_without_a_checkpoint_starts_afresh(tmp_path):
    cfg = train_config(["ckpt_path=last", f"output_dir={tmp_path}"])
    cfg, _ = resumed_config(cfg, ["ckpt_path=last"], lambda o: train_config(o))
    assert cfg.ckpt_path is None


def test_relative_paths_are_stored_absolute(tmp_path, monkeypatch):
    (tmp_path / "reward.py").write_text("")
    monkeypatch.chdir(tmp_path)
    given = ["custom_reward_function.path=reward.py", "trainer.max_steps=3"]
    assert absolute_paths(given, os.getcwd()) == [
        f"custom_reward_function.path={tmp_path / 'reward.py'}",
        given[1],
    ]


def test_a_second_job_on_a_run_folder_in_use_is_refused(tmp_path):
    first, second = RunFolderLock(tmp_path), RunFolderLock(tmp_path)
    first.acquire()
    with pytest.raises(
        NereusConfigError, match=rf"hydra\.run\.dir: {tmp_path} is in use by another nereus-train \(pid"
    ):
        second.acquire()
    first.release()
    second.acquire()  # free again once the first job ended
    second.release()


def test_path_keys_and_lists_of_files_are_stored_absolute(tmp_path):
    for name in ("model", "a.parquet", "b.parquet"):
        (tmp_path / name).mkdir() if name == "model" else (tmp_path / name).write_text("")
    given = ["actor.path=model", "data.train_files=[a.parquet,b.parquet]", "actor.preset=tiny_llama"]
    assert absolute_paths(given, str(tmp_path)) == [
        f"actor.path={tmp_path / 'model'}",
        f"data.train_files=[{tmp_path / 'a.parquet'},{tmp_path / 'b.parquet'}]",
        "actor.preset=tiny_llama",
    ]
