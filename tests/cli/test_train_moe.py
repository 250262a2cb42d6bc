"""The first mixtures of experts train through nereus-train on 2 ranks from a user's folder.

The folder holds a tiny model and a tokenizer trained here, as a user's checkpoint would.
"""

from __future__ import annotations

import pytest

from nereus_lightning.cli.train import train_config


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("family", "experts"),
    [("mixtral", {"num_local_experts": 4}), ("qwen3_moe", {"num_experts": 4, "moe_intermediate_size": 32})],
)
def test_a_mixture_of_experts_trains_five_steps_from_its_folder(tmp_path, family, experts) -> None:
    from nereus_lightning.cli.train import run
    from nereus_lightning.rl.wordproblems import make_rows, write_parquet
    from nereus_lightning.spec.model import ModelSpec
    from nereus_lightning.testing.folders import tiny_model_folder

    rows = make_rows(16, "train")
    texts = [r["prompt"][0]["content"] + " " + r["extra_info"]["answer"] for r in rows]
    folder = tiny_model_folder(tmp_path / "model", texts, family=family, num_experts_per_tok=2, **experts)
    spec = ModelSpec.from_hf_config(folder)
    assert spec.num_experts == 4 and spec.active_params < spec.num_params  # priced as a mixture
    cfg = train_config(
        [
            f"actor.path={folder}",
            f"data.train_files={write_parquet(rows, str(tmp_path / 'train.parquet'))}",
            f"output_dir={tmp_path / 'out'}",
            "data.max_response_length=6",
            "algorithm.prompts_per_step=4",
            "algorithm=grpo",
            "algorithm.samples_per_prompt=2",
            "trainer.devices=2",
            "trainer.max_steps=5",
            "plot=false",
        ]
    )
    summary = run(cfg)
    assert summary["steps"] == 5
