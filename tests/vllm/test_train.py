"""nereus-train with algorithm.rollout_engine=vllm on 2 gloo ranks: TP1 x DP2, TP2 x DP1, and a transition
between them.

Each run's module (:class:`~tests.vllm.helpers.CheckedGRPOModule`) reads every generation rank's
engine back before each step's generation and compares it, bit for bit, with the training unit's
logical parameters (so from step 1 on: after an update and the sync).
"""

from __future__ import annotations

import csv
import glob
import json
import os

import pytest

from nereus_lightning.cli.train import train_config
from tests.vllm.conftest import VLLM

pytestmark = [*VLLM, pytest.mark.distributed]

STEPS = 5


def _train(job, out, monkeypatch, plans, extra=()):
    from nereus_lightning.cli.train import run
    from nereus_lightning.lightning import callback
    from tests.vllm.helpers import CHECKS, ScriptedPlans

    if plans is not None:  # the test hook: these layouts, whatever the planner would pick
        monkeypatch.setattr(callback, "default_controller", lambda *a, **k: ScriptedPlans(plans))
    checks = out / "checks"
    checks.mkdir()
    monkeypatch.setenv(CHECKS, str(checks))
    overrides = [
        f"actor.path={job['model']}",
        f"data.train_files={job['train']}",
        f"output_dir={out}",
        "algorithm=grpo",
        "algorithm.rollout_engine=vllm",
        "algorithm._target_=tests.vllm.helpers.CheckedGRPOModule",
        "algorithm.prompts_per_step=2",
        "algorithm.samples_per_prompt=2",
        "data.max_response_length=4",
        "trainer.devices=2",
        f"trainer.max_steps={STEPS}",
        "save_checkpoint=false",
        *extra,
    ]
    summary = run(train_config(overrides))
    records = [json.loads(line) for path in sorted(glob.glob(str(checks / "*.jsonl"))) for line in open(path)]
    rows = [r for r in csv.DictReader(open(summary["metrics_csv"])) if r.get("critic/score/mean")]
    return summary, records, rows


def _check(records, rows, tps_by_step):
    assert len(rows) == STEPS and all(float(r["response_length/mean"]) > 0 for r in rows)  # the reward curve
    assert sorted({r["step"] for r in records}) == list(range(STEPS))
    for r in records:
        assert r["tp"] == tps_by_step[r["step"]], r
        assert r["read_back"] and r["differ"] == [], r  # the engine holds the trained weights, bit for bit
        assert r["policy_version"] == r["train_version"] == r["step"], r  # one update and sync per step
        assert r["batch_versions"] == [r["step"]], r  # every sample carries the version it came from
    assert [float(r["rollout/policy_version"]) for r in rows] == list(range(STEPS))  # logged per step


def test_train_at_tp1_dp2(job, tmp_path, monkeypatch):
    from tests.vllm.helpers import plan_2ranks

    summary, records, rows = _train(job, tmp_path, monkeypatch, [plan_2ranks(1)])
    assert summary["steps"] == STEPS and os.path.getsize(summary["plot"]) > 1000
    _check(records, rows, [1] * STEPS)
    assert len(records) == 2 * STEPS  # both ranks generate (two replicas)


def test_train_at_tp2_dp1(job, tmp_path, monkeypatch):
    from tests.vllm.helpers import plan_2ranks

    summary, records, rows = _train(job, tmp_path, monkeypatch, [plan_2ranks(2)])
    _check(records, rows, [2] * STEPS)
    assert len(records) == 2 * STEPS  # both ranks of the one replica


def test_transition_from_tp1_dp2_to_tp2_dp1_keeps_generating_with_the_synced_weights(
    job, tmp_path, monkeypatch
):
    """Generation on rank 1 alone first (rank 0 holds no engine), then TP1 x DP2, then TP2 x DP1."""
    from tests.vllm.helpers import plan_2ranks

    plans = [plan_2ranks(1, (1,)), plan_2ranks(1), plan_2ranks(2)]
    summary, records, rows = _train(job, tmp_path, monkeypatch, plans)
    assert summary["transitions"] == 2 and summary["transition_steps"] == [1, 2]
    _check(records, rows, [1, 1, 2, 2, 2])
    assert [r["step"] for r in records].count(0) == 1  # one engine at step 0, on rank 1


def test_the_rollout_correction_weights_the_loss_and_reports_the_mismatch(job, tmp_path, monkeypatch):
    import math

    from tests.vllm.helpers import plan_2ranks

    extra = ["algorithm.rollout_is_threshold=2.0"]
    summary, records, rows = _train(job, tmp_path, monkeypatch, [plan_2ranks(1)], extra)
    _check(records, rows, [1] * STEPS)
    for row in rows:
        kl, weight = float(row["mismatch/mismatch_kl"]), float(row["mismatch/rollout_is_mean"])
        # the engine samples from the trained weights: vLLM's and the trainer's log-probs nearly agree
        assert math.isfinite(kl) and abs(kl) < 1e-2 and abs(weight - 1.0) < 1e-2, row
        assert 0.0 <= float(row["mismatch/rollout_is_ratio_fraction_high"]) <= 1.0
        assert float(row["training/rollout_probs_diff_max"]) < 0.1


def test_an_infinite_threshold_reproduces_the_uncorrected_update(job, tmp_path, monkeypatch):
    """vLLM samples from the trained weights, so the untruncated weights are 1 to fp32 rounding."""
    from tests.vllm.helpers import plan_2ranks

    runs = []
    for name, extra in (("plain", []), ("inf", ["algorithm.rollout_is_threshold=inf"])):
        (tmp_path / name).mkdir()
        runs.append(_train(job, tmp_path / name, monkeypatch, [plan_2ranks(1)], extra)[2])
    plain, corrected = runs
    assert "mismatch/rollout_is_ratio_fraction_high" in corrected[0]
    for a, b in zip(plain, corrected, strict=True):
        for key in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
            x, y = float(a[key]), float(b[key])
            assert abs(x - y) <= 1e-5 * max(1.0, abs(x)), (key, x, y)
