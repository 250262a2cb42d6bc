"""A user's folder of a family outside the registry: nereus-train proves it exact first, then trains."""

from __future__ import annotations

import json

import pytest

from tests.helpers import nereus_train


@pytest.mark.distributed
def test_nereus_train_admits_an_unregistered_family_by_proof_then_trains(tmp_path, monkeypatch):
    from nereus_lightning.rl.wordproblems import make_rows, write_parquet
    from nereus_lightning.spec.verdicts import cached_verdict
    from nereus_lightning.testing.folders import tiny_model_folder

    monkeypatch.setenv("NEREUS_FAMILY_CACHE", str(tmp_path / "cache"))  # no verdict yet
    rows = make_rows(16, "train")
    texts = [r["prompt"][0]["content"] + " " + r["extra_info"]["answer"] for r in rows]
    folder = tiny_model_folder(tmp_path / "model", texts, family="olmo")
    assert cached_verdict("olmo") is None
    out = nereus_train(
        tmp_path / "run",
        f"actor.path={folder}",
        f"data.train_files={write_parquet(rows, str(tmp_path / 'train.parquet'))}",
        "algorithm=grpo",
        "algorithm.prompts_per_step=2",
        "algorithm.samples_per_prompt=2",
        "data.max_response_length=6",
        "trainer.devices=2",
        "trainer.max_steps=2",
        "save_checkpoint=false",
        "plot=false",
        cwd=tmp_path,
    ).stdout
    assert "actor.path: model type olmo is outside the registry: proving it exact" in out
    assert "nereus-train: olmo: exact, admitted" in out
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["steps"] == 2
    verdict = cached_verdict("olmo")
    assert verdict is not None and verdict.failure is None  # the proof is kept for the next job
