"""A user's defaults in nereus-train: a model folder on a CUDA machine trains on its GPUs in bf16-mixed,
priced on the GPU it has (cluster=auto); a folder learns at verl's rates, a preset at its own."""

from __future__ import annotations

import pytest
import torch

from nereus_lightning.cli.train import job_cluster, train_config
from nereus_lightning.lightning import devices
from nereus_lightning.spec.cluster import DeviceFacts
from tests.helpers import word_problem_job

H100 = DeviceFacts("NVIDIA H100 80GB HBM3", 85_045_477_376.0, nvlinks=18, nvlink_version=4)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    return word_problem_job(tmp_path_factory.mktemp("job"), vocab_size=300)


@pytest.fixture(scope="module")
def folder(job):
    return job["model"]


@pytest.fixture
def one_h100(monkeypatch):
    """This machine as torch sees one H100 (the facts the probe would read from it)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(devices, "probe_device", lambda index=0: H100)


def test_a_folder_on_a_gpu_machine_trains_on_its_gpus_priced_as_that_gpu(job, one_h100):
    cfg = train_config([f"actor.path={job['model']}", f"data.train_files={job['train']}"])
    trainer = cfg.trainer
    assert (trainer.accelerator, trainer.devices, trainer.precision) == ("gpu", -1, "bf16-mixed")
    cluster = job_cluster(cfg)
    assert cluster.describe().startswith("1 node x 1 GPUs (NVIDIA H100 80GB HBM3), 85.05 GB per GPU")
    assert cluster.peak_flops == 989e12


def test_a_preset_stays_on_four_cpu_ranks_and_a_chosen_key_stands(folder, one_h100):
    cfg = train_config(["output_dir=/tmp/x"])  # the embedded default: a preset, even with a GPU
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.precision) == ("cpu", 4, "32-true")
    assert job_cluster(cfg).name == "CPU x4 (gloo)"
    cfg = train_config([f"actor.path={folder}", "trainer.precision=32-true", "trainer.devices=1"])
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.precision) == ("gpu", 1, "32-true")


def test_without_cuda_a_folder_trains_on_the_cpu(folder):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    cfg = train_config([f"actor.path={folder}"])
    assert (cfg.trainer.accelerator, cfg.trainer.devices, cfg.trainer.precision) == ("cpu", 4, "32-true")


def test_a_folder_learns_at_verls_rates_and_a_preset_at_its_own(folder):
    from nereus_lightning.lightning.module import default_lr

    assert (default_lr("actor", folder), default_lr("critic", folder)) == (1e-6, 1e-5)
    assert (default_lr("actor", "tiny_llama"), default_lr("critic", "tiny_llama")) == (3e-3, 3e-3)
    assert train_config([f"actor.path={folder}"]).algorithm.actor_lr is None  # resolved by the module


def test_the_modules_record_the_rates_they_train_at(job):
    from nereus_lightning.lightning import GRPOModule, PPOModule

    data = {"train_files": job["train"]}
    assert GRPOModule(actor=job["model"], data=data).hparams.actor_lr == 1e-6
    ppo = PPOModule(actor=job["model"], data=data, critic_lr=2e-5)
    assert (ppo.hparams.actor_lr, ppo.hparams.critic_lr) == (1e-6, 2e-5)
    assert [g["lr"] for g in ppo.configure_optimizers().param_groups] == [1e-6, 2e-5]


@pytest.mark.parametrize("algorithm", ["ppo", "grpo"])
def test_nereus_train_prices_the_workload_its_module_plans_with(algorithm):
    """The fail-fast check and the memory search price the RL step the module will run: one builder."""
    from nereus_lightning.cli.train import _workload, build_module, response_budget

    cfg = train_config(
        [f"algorithm={algorithm}", "algorithm.mini_batches=2", "algorithm.ppo_epochs=3", "output_dir=/tmp/x"]
    )
    module = build_module(cfg)
    priced = _workload(cfg, response_budget(cfg, 0))
    assert priced == module.workload(0)
    assert (priced.mini_batches, priced.ppo_epochs) == (2, 3)
    assert priced.samples_per_prompt == module.rl_config.samples_per_prompt
