"""A user's own job through nereus-train: a model folder with its tokenizer, parquet prompts, a reward file.

The folder is a tiny Qwen2 saved with ``save_pretrained`` beside a tokenizer trained in the test;
the data are chat-format arithmetic word problems with ground truths; the reward is a file whose
``compute_score`` appends to a counter file, so the test can count its calls.
"""

from __future__ import annotations

import glob
import json
import os
import textwrap
from collections import Counter

import pytest

from nereus_lightning.cli.train import train_config
from nereus_lightning.spec.errors import NereusConfigError
from tests.helpers import word_problem_job

REWARD = """
import math, os

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    with open(os.environ["NEREUS_TEST_COUNTER"], "a") as f:
        f.write(f"{extra_info['split']} {extra_info['index']}\\n")
    nan_after = int(os.environ.get("NEREUS_TEST_NAN_AFTER", "-1"))
    if nan_after >= 0 and sum(1 for _ in open(os.environ["NEREUS_TEST_COUNTER"])) > nan_after:
        return math.nan
    score = float(str(ground_truth) in solution_str)
    return {"score": score, "digits": float(any(c.isdigit() for c in solution_str))}
"""


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """The user's files: model folder, train/val parquet, reward file."""
    from nereus_lightning.rl.wordproblems import make_rows, write_parquet

    root = tmp_path_factory.mktemp("user_job")
    files = word_problem_job(root, vocab_size=300)
    files["val"] = write_parquet(make_rows(8, "test"), str(root / "test.parquet"))
    files["reward"] = str(root / "reward.py")
    (root / "reward.py").write_text(textwrap.dedent(REWARD))
    return files


def _user_cfg(job, out, *overrides: str):
    return train_config(
        [
            f"actor.path={job['model']}",
            f"data.train_files={job['train']}",
            f"custom_reward_function.path={job['reward']}",
            f"output_dir={out}",
            f"trainer.rollout_data_dir={out}/rollouts",
            "data.max_response_length=6",
            "algorithm.prompts_per_step=4",
            "plot=false",
            *overrides,
        ]
    )


def _rollouts(out) -> list[dict]:
    rows = []
    for path in sorted(
        glob.glob(os.path.join(out, "rollouts", "*.jsonl")), key=lambda p: int(os.path.basename(p)[:-6])
    ):
        rows += [json.loads(line) for line in open(path)]
    return rows


def _metric_rows(out, key: str = "critic/score/mean") -> list[dict]:
    import csv

    files = sorted(glob.glob(os.path.join(out, "logs", "*", "metrics.csv")), key=os.path.getmtime)
    return [r for r in csv.DictReader(open(files[-1])) if r.get(key)]


@pytest.mark.distributed
@pytest.mark.parametrize(
    ("algorithm", "devices"), [("grpo", 2), ("grpo", 4), ("ppo", 2), ("ppo", 4)], ids=lambda v: str(v)
)
def test_user_job_trains_on_its_folder_data_and_reward(job, tmp_path, monkeypatch, algorithm, devices):
    import transformers as tf

    from nereus_lightning.cli.train import run

    counter = tmp_path / "counter.txt"
    monkeypatch.setenv("NEREUS_TEST_COUNTER", str(counter))
    samples = 2 if algorithm == "grpo" else 1
    cfg = _user_cfg(
        job,
        tmp_path,
        f"algorithm={algorithm}",
        f"algorithm.samples_per_prompt={samples}",
        f"trainer.devices={devices}",
        "trainer.max_steps=5",
        "trainer.val_check_interval=2",
        f"data.val_files={job['val']}",
        "checkpoint_every=5",
    )
    summary = run(cfg)
    assert summary["steps"] == 5
    # Tokens are the folder tokenizer's, through its chat template.
    tokenizer = tf.AutoTokenizer.from_pretrained(job["model"])
    rollouts = _rollouts(tmp_path)
    assert len(rollouts) == 5 * 4 * samples
    for r in rollouts:
        want = tokenizer.apply_chat_template(
            job["rows"][r["prompt_index"]]["prompt"], add_generation_prompt=True
        )
        want = want["input_ids"] if isinstance(want, dict) or hasattr(want, "keys") else want
        assert r["prompt_tokens"] == len(want)
    # The reward ran exactly once per sample in the whole job: training samples, then validation
    # (greedy, every 2 steps and at the end: after steps 2, 4 and 5).
    calls = Counter(open(counter).read().split("\n")[:-1])
    trained = Counter(f"train {r['prompt_index']}" for r in rollouts)
    assert {k: v for k, v in calls.items() if k.startswith("train")} == trained
    assert {k: v for k, v in calls.items() if k.startswith("test")} == {f"test {i}": 3 for i in range(8)}
    assert all(r["reward/digits/mean"] != "" for r in _metric_rows(tmp_path))
    val = _metric_rows(tmp_path, "val/reward/mean")
    assert [int(r["step"]) for r in val] == [1, 3, 4] and all(r["val/arith_gsm8k/reward/mean"] for r in val)
    # Every checkpoint holds Hugging Face folders of the trained models.
    hf = tmp_path / "checkpoints" / "last.ckpt" / "hf"
    assert (hf / "actor" / "model.safetensors").is_file() and (hf / "actor" / "tokenizer.json").is_file()
    assert (hf / "critic" / "model.safetensors").is_file() == (algorithm == "ppo")


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["qwen2", "phi3"])  # phi3: fused QKV and gate-up projections
def test_exported_models_reload_equal_to_the_logical_state(job, tmp_path, monkeypatch, family):
    import torch
    import transformers as tf

    from nereus_lightning.cli.train import build_module
    from nereus_lightning.testing.folders import tiny_model_folder
    from tests.lightning.helpers import fit

    monkeypatch.setenv("NEREUS_TEST_COUNTER", str(tmp_path / "counter.txt"))
    texts = [r["prompt"][0]["content"] for r in job["rows"]]
    folder = tiny_model_folder(tmp_path / "model", texts, family=family, vocab_size=300)
    module = build_module(_user_cfg(job, tmp_path, "algorithm=ppo", f"actor.path={folder}"))
    fit(str(tmp_path), devices=3, max_steps=2, every=2, module=module, write_back=True)
    # The parent's module holds rank 0's logical weights after fit (gathered from the EMUs) ...
    folder = tmp_path / "ckpt" / "s2.ckpt" / "hf"
    for role, auto in (("actor", tf.AutoModelForCausalLM), ("critic", tf.AutoModelForTokenClassification)):
        reloaded = dict(auto.from_pretrained(folder / role).named_parameters())
        logical = dict(getattr(module, role).named_parameters())
        assert reloaded.keys() == logical.keys()
        for name, p in logical.items():  # ... and the export (read back from DCP) equals it bit for bit
            assert torch.equal(reloaded[name], p.detach()), (role, name)
    # nereus-export does the same for an existing checkpoint, into another folder.
    from nereus_lightning.lightning.hf_export import export_hf

    out = export_hf(str(tmp_path / "ckpt" / "s2.ckpt"), str(tmp_path / "exported"))
    assert set(out) == {"actor", "critic"}
    again = tf.AutoModelForCausalLM.from_pretrained(out["actor"])
    assert all(torch.equal(p, module.actor.get_parameter(n).detach()) for n, p in again.named_parameters())
    assert tf.AutoTokenizer.from_pretrained(out["actor"]).chat_template is not None


@pytest.mark.distributed
def test_resume_on_another_world_size_uses_every_prompt_once_per_epoch(job, tmp_path, monkeypatch):
    from nereus_lightning.cli.train import run
    from nereus_lightning.rl.wordproblems import make_rows, write_parquet

    monkeypatch.setenv("NEREUS_TEST_COUNTER", str(tmp_path / "counter.txt"))
    data = write_parquet(make_rows(10, "train", seed=1), str(tmp_path / "small.parquet"))
    common = (f"data.train_files={data}", "algorithm=grpo", "algorithm.samples_per_prompt=2", "adapt=false")
    # 2 epochs of 10 prompts, 4 per step: 5 steps, the epoch boundary inside step 2.
    run(_user_cfg(job, tmp_path, *common, "trainer.devices=2", "trainer.max_steps=2", "checkpoint_every=2"))
    ckpt = tmp_path / "checkpoints" / "step2.ckpt"
    assert ckpt.is_dir()
    run(_user_cfg(job, tmp_path, *common, "trainer.devices=3", "trainer.max_steps=5", f"ckpt_path={ckpt}"))
    rollouts = [r for r in _rollouts(tmp_path) if r["sample"] % 2 == 0]  # one line per prompt
    assert [r["step"] for r in rollouts] == [s for s in range(5) for _ in range(4)]
    order = [r["prompt_index"] for r in rollouts]
    assert sorted(order[:10]) == list(range(10)) and sorted(order[10:20]) == list(range(10))
    assert order[:10] != order[10:20]  # each epoch in its own seeded order


@pytest.mark.distributed
def test_nan_reward_stops_the_run_and_every_checkpoint_stays_finite(job, tmp_path, monkeypatch):
    import torch

    from nereus_lightning.cli.train import run
    from nereus_lightning.lightning.hf_export import logical_params

    counter = tmp_path / "counter.txt"
    monkeypatch.setenv("NEREUS_TEST_COUNTER", str(counter))
    monkeypatch.setenv("NEREUS_TEST_NAN_AFTER", "8")  # steps 0 and 1 score 4 samples each, then NaN
    common = ("algorithm=ppo", "trainer.devices=3", "checkpoint_every=1", "adapt=false")
    with pytest.raises(RuntimeError) as info:
        run(_user_cfg(job, tmp_path, *common, "trainer.max_steps=4"))
    text = str(info.value)
    assert "NonFiniteError" in text and "step 2" in text and "reward of sample" in text
    for stage_dir in glob.glob(str(tmp_path / "checkpoints" / "*" / "emu" / "*")):
        for name, tensor in logical_params(stage_dir).items():
            assert bool(torch.isfinite(tensor).all()), (stage_dir, name)
    resume = text.rsplit("ckpt_path=", 1)[1].strip()
    assert os.path.dirname(resume) == str(tmp_path / "checkpoints")
    # The printed checkpoint resumes, with a reward that no longer returns NaN.
    monkeypatch.delenv("NEREUS_TEST_NAN_AFTER")
    summary = run(_user_cfg(job, tmp_path / "resumed", *common, "trainer.max_steps=3", f"ckpt_path={resume}"))
    assert summary["steps"] >= 1
    # With on_nonfinite=skip the run goes on and says which steps it skipped.
    monkeypatch.setenv("NEREUS_TEST_NAN_AFTER", "4")
    counter.unlink()
    run(_user_cfg(job, tmp_path / "skip", *common, "trainer.max_steps=2", "trainer.on_nonfinite=skip"))
    assert [float(r["train/skipped_update"]) for r in _metric_rows(tmp_path / "skip")] == [0.0, 1.0]


def _refused(job, tmp_path, *overrides: str) -> str:
    from nereus_lightning.cli.train import run

    with pytest.raises(NereusConfigError) as info:
        run(_user_cfg(job, tmp_path, *overrides))
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "logs").exists()  # nothing ran
    return str(info.value)


def test_missing_data_file_is_refused_naming_the_key(job, tmp_path):
    text = _refused(job, tmp_path, f"data.train_files={tmp_path}/nope.parquet")
    assert "data.train_files" in text and "nope.parquet" in text


def test_missing_prompt_column_lists_the_columns(job, tmp_path):
    text = _refused(job, tmp_path, "data.prompt_key=question")
    assert "data.prompt_key" in text and "'question'" in text and "reward_model" in text and "prompt" in text


def test_reward_file_that_does_not_import_is_refused(job, tmp_path):
    bad = tmp_path / "broken.py"
    bad.write_text("import no_such_module_here\n")
    text = _refused(job, tmp_path, f"custom_reward_function.path={bad}")
    assert "custom_reward_function.path" in text and "no_such_module_here" in text


def test_reward_with_the_wrong_signature_is_refused(job, tmp_path):
    bad = tmp_path / "two_args.py"
    bad.write_text("def compute_score(prompt, response):\n    return 0.0\n")
    text = _refused(job, tmp_path, f"custom_reward_function.path={bad}")
    assert "custom_reward_function.name" in text and "solution_str" in text


def test_reward_file_without_the_named_function_lists_its_functions(job, tmp_path):
    text = _refused(job, tmp_path, "custom_reward_function.name=score_it")
    assert "score_it" in text and "compute_score" in text


def test_tokenizer_larger_than_the_models_vocabulary_is_refused(job, tmp_path):
    import transformers as tf

    small = tmp_path / "small_vocab"
    config = tf.AutoConfig.from_pretrained(job["model"])
    config.vocab_size = 256
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(small)
    tf.AutoTokenizer.from_pretrained(job["model"]).save_pretrained(small)
    text = _refused(job, tmp_path, f"actor.path={small}")
    assert "300 tokens" in text and "256" in text and "data.tokenizer" in text


@pytest.mark.parametrize(
    ("override", "key"),
    [
        ("algorithm.actor_lr=-1e-3", "algorithm.actor_lr"),
        ("algorithm.prompts_per_step=0", "algorithm.prompts_per_step"),
        ("algorithm.lam=1.5", "algorithm.lam"),
        ("data.max_response_length=0", "data.max_response_length"),
        ("trainer.on_nonfinite=ignore", "trainer.on_nonfinite"),
    ],
)
def test_bad_numbers_are_refused_before_any_process_starts(job, tmp_path, override, key):
    assert key in _refused(job, tmp_path, override)


def test_a_model_folder_without_data_is_refused(job, tmp_path):
    from nereus_lightning.cli.train import run

    with pytest.raises(NereusConfigError, match="data.train_files"):
        run(train_config([f"actor.path={job['model']}", f"output_dir={tmp_path}"]))


@pytest.mark.parametrize("experiment", ["gsm8k_grpo", "gsm8k_ppo"])
def test_gsm8k_experiments_build_with_the_builtin_reward(job, tmp_path, experiment):
    from nereus_lightning.cli.train import build_module, check_config
    from nereus_lightning.rl.data import Prompt
    from nereus_lightning.rl.sources import Sample

    cfg = train_config(
        [f"experiment={experiment}", f"actor.path={job['model']}", f"data.train_files={job['train']}"]
    )
    check_config(cfg)
    module = build_module(cfg)
    assert module.hparams.prompts_per_step == 16 and (module.critic is not None) == (
        experiment == "gsm8k_ppo"
    )
    ids = tuple(module.tokenizer("The answer is #### 12")["input_ids"])
    right, wrong = (Prompt(0, (), ground_truth=t, data_source="arith_gsm8k") for t in ("12", "13"))
    scores = module.source.score([Sample(0, right, ids), Sample(1, wrong, ids)])
    assert [s.score for s in scores] == [1.0, 0.0]  # the built-in GSM8K reward, picked by data_source
