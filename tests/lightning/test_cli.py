"""nereus-train's configs: composition, valid-choice errors, fail-fast planner errors, a short run."""

from __future__ import annotations

import json

import pytest

from nereus_lightning.cli.train import train_config
from nereus_lightning.spec.errors import InfeasiblePlanError


def test_default_config_composes_to_the_embedded_default():
    cfg = train_config(["output_dir=/tmp/x"])
    assert cfg.trainer.devices == 4 and cfg.trainer.accelerator == "cpu"
    assert cfg.algorithm._target_.endswith("PPOModule") and cfg.actor.preset == "tiny_llama"
    from nereus_lightning.cli.train import supply_counts

    counts = supply_counts(cfg)  # the built-in task's supply schedule takes ranks away
    assert min(counts) < max(counts)
    assert cfg.controller.gamma == 0.5


def test_unknown_group_value_lists_the_valid_choices():
    from hydra.errors import MissingConfigException

    with pytest.raises(MissingConfigException) as info:
        train_config(["algorithm=dpo"])
    text = str(info.value)
    assert "grpo" in text and "ppo" in text and "remax" in text


def test_model_too_large_fails_fast_with_the_planners_explanation():
    from nereus_lightning.cli.train import check_feasible

    cfg = train_config(["actor=llama3_70b", "output_dir=/tmp/x"])
    with pytest.raises(InfeasiblePlanError, match="GB|memory|fit"):
        check_feasible(cfg, world_size=4)


@pytest.mark.distributed
def test_quick_experiment_trains_transitions_and_plots(tmp_path):
    from nereus_lightning.cli.train import run

    cfg = train_config(
        [
            "experiment=quick",
            f"output_dir={tmp_path}",
            "trainer.max_steps=6",
            "resources.counts=[4,4,3]",
            "save_checkpoint=false",
        ]
    )
    summary = run(cfg)
    assert summary["steps"] == 6
    assert summary["transitions"] >= 1  # the pool shrank from 4 to 3 ranks
    assert (tmp_path / "run.png").stat().st_size > 1000
    decisions = [json.loads(line) for line in open(tmp_path / "decisions.jsonl")]
    assert decisions[0]["decision"] == "initial" and any(d["decision"] == "transition" for d in decisions)


@pytest.mark.distributed
def test_dead_rank_stops_nereus_train_with_a_message_and_a_checkpoint(tmp_path):
    from nereus_lightning.cli.train import run

    cfg = train_config(
        [
            "experiment=quick",
            f"output_dir={tmp_path}",
            "trainer.devices=3",
            "algorithm._target_=tests.lightning.helpers.DyingPPOModule",
            "adapt=false",
            "plot=false",
            "checkpoint_every=1",
        ]
    )
    cfg.trainer.max_steps = 4
    with pytest.raises(
        RuntimeError, match="training stopped: .*\n.*resume with: nereus-train ckpt_path=.*"
    ) as info:
        run(cfg)
    ckpt = str(info.value).rsplit("ckpt_path=", 1)[1].strip()
    assert (tmp_path / "checkpoints").is_dir() and ckpt.startswith(str(tmp_path / "checkpoints"))


@pytest.mark.parametrize("busy", [False, True])
def test_leaving_runs_the_exit_callbacks_and_waits_for_working_threads(tmp_path, busy):
    import subprocess
    import sys

    script = f"""
import atexit, sys, threading, time
from nereus_lightning.cli.train import leave
atexit.register(lambda: open({str(tmp_path / "callback")!r}, "w").write("ran"))
def work():
    time.sleep(0.5)
    open({str(tmp_path / "thread")!r}, "w").write("done")
if {busy}:
    threading.Thread(target=work).start()
print("unflushed", end="")
leave(0)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "unflushed"
    assert (tmp_path / "callback").read_text() == "ran"
    assert (tmp_path / "thread").exists() == busy
