"""Runs that survive: ``nereus-train`` stopped by SIGTERM or Ctrl-C saves its last step and prints a resume
command that runs as printed; a failure says its cause in one line (the traceback goes to the log)."""

from __future__ import annotations

import csv
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from nereus_lightning.lightning.checkpoint import read_checkpoint
from tests.helpers import launch_env, word_problem_job

pytestmark = pytest.mark.distributed
RESUME = re.compile(r"^resume with: (nereus-train .*)$", re.M)


def steps_logged(out: Path) -> int:
    """Training steps in the run's metrics so far."""
    rows = 0
    for file in out.glob("logs/*/metrics.csv"):
        try:
            rows += sum(1 for r in csv.DictReader(open(file)) if r.get("critic/score/mean"))
        except (OSError, csv.Error):
            pass
    return rows


def stop_after(out: Path, steps: int, signum: int, *overrides: str, cwd: Path) -> subprocess.CompletedProcess:
    """``nereus-train`` in its own process group, sent ``signum`` once ``steps`` steps are logged (SIGINT: to
    the
    whole group, as a terminal's Ctrl-C; else to the launching process only, as ``kill`` or Kubernetes)."""
    command = [sys.executable, "-m", "nereus_lightning.cli.train", f"hydra.run.dir={out}", *overrides]
    proc = subprocess.Popen(
        command,
        cwd=cwd,
        env=launch_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    deadline = time.monotonic() + 240
    while steps_logged(out) < steps and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    if signum == signal.SIGINT:
        os.killpg(proc.pid, signum)
    else:
        proc.send_signal(signum)
    stdout, _ = proc.communicate(timeout=240)
    return subprocess.CompletedProcess(command, proc.returncode, stdout)


def run_as_printed(done: subprocess.CompletedProcess, cwd: Path) -> subprocess.CompletedProcess:
    """The resume command ``done`` printed, run as printed (from ``cwd``: another folder than the job's)."""
    printed = shlex.split(RESUME.search(done.stdout).group(1))
    assert printed[0] == "nereus-train" and [a.split("=")[0] for a in printed[1:]] == ["ckpt_path"]
    cwd.mkdir(exist_ok=True)
    command = [sys.executable, "-m", "nereus_lightning.cli.train", *printed[1:]]
    return subprocess.run(command, cwd=cwd, env=launch_env(), capture_output=True, text=True, timeout=300)


def test_sigterm_saves_the_last_step_and_the_printed_command_resumes(tmp_path):
    out = tmp_path / "run"
    done = stop_after(out, 3, signal.SIGTERM, "trainer.max_steps=8", cwd=tmp_path)
    assert done.returncode == 128 + signal.SIGTERM, done.stdout[-3000:]
    step = int(re.search(r"nereus-train: stopped by SIGTERM after step (\d+)", done.stdout).group(1))
    assert step >= 3 and read_checkpoint(out / "checkpoints" / f"step{step}.ckpt").global_step == step
    assert os.readlink(out / "checkpoints" / "last.ckpt") == f"step{step}.ckpt"
    again = run_as_printed(done, tmp_path / "elsewhere")
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = next((tmp_path / "elsewhere" / "outputs").glob("*/*/checkpoints/last.ckpt"))
    assert read_checkpoint(resumed).global_step == 8  # the job's own max_steps, from the checkpoint


@pytest.fixture(scope="module")
def user_job(tmp_path_factory) -> Path:
    """A user's folder: a tiny Qwen2, prompts, and a reward that hangs while ``HANG`` is set."""
    root = tmp_path_factory.mktemp("job")
    word_problem_job(root, vocab_size=300)
    (root / "reward.py").write_text(
        textwrap.dedent(
            """
            import os, time

            def compute_score(data_source, solution_str, ground_truth, extra_info):
                while os.environ.get("HANG"):
                    time.sleep(1)
                return float(str(ground_truth) in solution_str)
            """
        )
    )
    return root


USER = (
    "algorithm=grpo",
    "actor.path=model",
    "data.train_files=train.parquet",
    "custom_reward_function.path=reward.py",
    "data.max_response_length=6",
    "algorithm.prompts_per_step=4",
    "algorithm.samples_per_prompt=2",
    "trainer.max_steps=6",
    "plot=false",
)


def test_ctrl_c_on_a_users_grpo_job_abandons_the_step_and_resumes_as_that_job(user_job, tmp_path):
    out = tmp_path / "run"
    done = stop_after(out, 2, signal.SIGINT, *USER, "preemption.step_in_flight=abandon", cwd=user_job)
    assert done.returncode == 128 + signal.SIGINT, done.stdout[-3000:]
    step = int(re.search(r"stopped by SIGINT after step (\d+)", done.stdout).group(1))
    assert step >= 2 and read_checkpoint(out / "checkpoints" / f"step{step}.ckpt").global_step == step
    again = run_as_printed(done, tmp_path / "elsewhere")  # relative paths of the job resolve from its folder
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    resumed = read_checkpoint(next((tmp_path / "elsewhere" / "outputs").glob("*/*/checkpoints/last.ckpt")))
    job = resumed.checkpoint["nereus_job"]["config"]
    assert resumed.global_step == 6 and job["algorithm"]["_target_"].endswith("GRPOModule")


def test_a_hanging_reward_fails_in_its_timeout_in_one_line_naming_the_sample(user_job, tmp_path):
    env = {**launch_env(), "HANG": "1"}
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "nereus_lightning.cli.train",
            f"hydra.run.dir={tmp_path}",
            *USER,
            "reward.timeout_s=5",
        ],
        cwd=user_job,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    seconds = time.monotonic() - started
    assert done.returncode == 1 and seconds < 120
    lines = done.stderr.strip().splitlines()
    assert re.fullmatch(
        r"nereus-train: RuntimeError: reward failed: .*reward\.py:compute_score did not return within "
        r"reward\.timeout_s=5 s on sample \d+ \(data_source 'arith_gsm8k'\); fix the reward, or raise "
        r"reward\.timeout_s( \(and \d+ more samples\))?",
        lines[-2],
    ), done.stderr[-2000:]
    assert lines[-1] == "no checkpoint written yet"
    assert "Traceback" not in done.stdout + done.stderr  # the traceback is in the run's log only
    assert "Traceback (most recent call last)" in (tmp_path / "train.log").read_text()
