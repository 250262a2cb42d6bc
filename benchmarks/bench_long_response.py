"""Long responses in bounded memory on the CPU: ``nereus-train`` on one rank, a 151,936-token vocabulary.

A tiny Qwen2-shaped folder (hidden 64, 2 layers) with Qwen2's full vocabulary, GRPO on 4 prompts x 4
samples, every response forced to ``--response-len`` tokens, under ``cluster_gpu_memory`` (bytes per
"GPU", here the rank's budget). Reports the rank's peak resident memory against the process's baseline
(the same imports with no job) and writes ``benchmarks/results/long_response.json``.

    python benchmarks/bench_long_response.py [--response-len 1024] [--budget 2e9] [--steps 1]

(``nox -s bench`` runs it with these defaults.) The issue's bound: the job's peak within the budget
plus the baseline, 3.5 GB in all.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
VOCAB = 151936
REWARD = (
    "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
    "    return len(solution_str) % 7 / 7\n"
)


def make_job(root: Path) -> tuple[Path, Path, Path]:
    """The model folder, the prompts (parquet) and the reward file."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    import transformers as tf

    from nereus_lightning.testing.folders import train_tokenizer

    folder = root / "model"
    texts = [f"Question {i}: what is {i} plus {i + 1}? Answer: {2 * i + 1}." for i in range(200)]
    tokenizer = train_tokenizer(texts)
    config = tf.Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    data = root / "prompts.parquet"
    rows = [
        {"prompt": f"Question {i}: what is {i} plus {i + 1}?", "data_source": "bench", "ground_truth": ""}
        for i in range(16)
    ]
    pq.write_table(pa.Table.from_pylist(rows), data)
    reward = root / "reward.py"
    reward.write_text(REWARD)
    return folder, data, reward


def peak_rss_gib(argv: list[str], cwd: Path) -> tuple[float, int, float]:
    """(peak resident GiB of the child, its return code, seconds): one child per call (a fresh process)."""
    probe = (
        "import resource, subprocess, sys; p = subprocess.run(sys.argv[1:]); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(p.returncode)"
    )
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", probe, *argv], cwd=cwd, capture_output=True, text=True)
    seconds = time.perf_counter() - start
    if done.returncode:
        print(done.stdout[-4000:], done.stderr[-6000:], sep="\n")
    kib = int(done.stdout.strip().splitlines()[-1]) if done.stdout.strip() else 0
    return kib / 2**20, done.returncode, seconds


def main(argv: list[str] | None = None) -> int:
    """Run the job and the baseline; print and save the peaks."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--response-len", type=int, default=1024)
    parser.add_argument("--budget", type=float, default=2e9)
    parser.add_argument("--steps", type=int, default=1)
    args = parser.parse_args(argv if argv is not None else sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder, data, reward = make_job(root)
        base, rc0, _ = peak_rss_gib(
            [sys.executable, "-c", "import lightning, transformers, nereus_lightning.cli.train"], root
        )
        train = [
            "nereus-train",
            "trainer.devices=1",
            "algorithm=grpo",
            "algorithm.prompts_per_step=4",
            "algorithm.samples_per_prompt=4",
            "algorithm.ignore_eos=true",
            f"actor.path={folder}",
            f"data.train_files={data}",
            f"data.max_response_length={args.response_len}",
            f"custom_reward_function.path={reward}",
            f"cluster_gpu_memory={int(args.budget)}",
            f"trainer.max_steps={args.steps}",
            "save_checkpoint=false",
            "export_hf=false",
            "plot=false",
            f"hydra.run.dir={root / 'run'}",
        ]
        peak, rc, seconds = peak_rss_gib(train, root)
    result = {
        "response_len": args.response_len,
        "sequences": 16,
        "vocab": VOCAB,
        "budget_gb": args.budget / 1e9,
        "baseline_peak_gib": round(base, 3),
        "job_peak_gib": round(peak, 3),
        "job_over_baseline_gb": round((peak - base) * 2**30 / 1e9, 3),
        "returncode": rc,
        "seconds": round(seconds, 1),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "long_response.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    if rc or rc0:
        raise RuntimeError(f"nereus-train exited with {rc} (baseline {rc0})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
