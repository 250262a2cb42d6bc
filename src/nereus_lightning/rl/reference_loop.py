"""Single-process reference RL loop (any registered algorithm) on an unsharded tiny Llama and the repeat task.

The ground truth for the distributed strategy: the stage functions of
:mod:`nereus_lightning.rl.algorithm` applied to whole batches on one process.
``python -m nereus_lightning.rl.reference_loop --help`` runs one and prints a summary.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from nereus_lightning.engines.base import RolloutEngine
from nereus_lightning.engines.hf import HFGenerateEngine
from nereus_lightning.rl.algorithm import (
    RLConfig,
    RLModels,
    batch_metrics,
    compute_advantages,
    rollout,
    score_batch,
    update_actor,
    update_critic,
)
from nereus_lightning.rl.reward import RewardScorer, make_scorer
from nereus_lightning.rl.tasks import PromptSampler, RepeatTask
from nereus_lightning.rl.tokenizer import ByteTokenizer
from nereus_lightning.rl.update import ADAMW
from nereus_lightning.spec.algorithms import algorithm_names, algorithm_spec


def tiny_llama_config(
    vocab_size: int = 264,
    hidden: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 4,
    intermediate: int = 128,
    max_position: int = 256,
) -> Any:
    """A transformers ``LlamaConfig`` for a tiny fp32 model (built locally, nothing downloaded)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_position,
        pad_token_id=ByteTokenizer.pad_token_id,
        bos_token_id=ByteTokenizer.bos_token_id,
        eos_token_id=ByteTokenizer.eos_token_id,
        tie_word_embeddings=False,
    )


def build_models(cfg: RLConfig, model_config: Any | None = None) -> RLModels:
    """Seeded actor (``LlamaForCausalLM``), frozen reference copy, and critic (token classifier, 1 label)."""
    from transformers import LlamaForCausalLM, LlamaForTokenClassification

    model_config = model_config or tiny_llama_config()
    torch.manual_seed(cfg.seed)
    actor = LlamaForCausalLM(model_config)
    models = RLModels(actor, torch.optim.AdamW(actor.parameters(), lr=cfg.actor_lr, **ADAMW))
    if cfg.uses_reference:
        models.reference = copy.deepcopy(actor).eval().requires_grad_(False)
    if cfg.uses_critic:
        critic_config = copy.deepcopy(model_config)
        critic_config.num_labels = 1
        critic_config.classifier_dropout = 0.0  # the head's default dropout would make values random
        models.critic = LlamaForTokenClassification(critic_config)
        models.critic_optim = torch.optim.AdamW(models.critic.parameters(), lr=cfg.critic_lr, **ADAMW)
    return models


@dataclass
class ReferenceResult:
    """Per-step history of one reference run."""

    scores: list[float] = field(default_factory=list)
    response_lengths: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    metrics: list[dict[str, float]] = field(default_factory=list)
    models: RLModels | None = None
    sampler: PromptSampler | None = None

    def mean_score(self, first: int | None = None, last: int | None = None) -> float:
        """Mean score over the first or the last ``n`` steps (all steps if neither is given)."""
        if first is not None:
            window = self.scores[:first]
        elif last is not None:
            window = self.scores[-last:]
        else:
            window = self.scores
        return sum(window) / max(len(window), 1)


def run_reference(
    cfg: RLConfig,
    task: RepeatTask | None = None,
    model_config: Any | None = None,
    reward: Callable[..., Any] | nn.Module | None = None,
    on_step: Callable[[int, dict[str, float]], None] | None = None,
) -> ReferenceResult:
    """Train ``cfg.steps`` steps on the repeat task (or ``reward``) and return the history."""
    tokenizer = ByteTokenizer()
    model_config = model_config or tiny_llama_config(vocab_size=tokenizer.vocab_size)
    models = build_models(cfg, model_config)
    sampler = PromptSampler(task or RepeatTask(), seed=cfg.seed)
    scorer = make_scorer(reward if reward is not None else sampler.task.reward, tokenizer)
    engine = HFGenerateEngine(models.actor, tokenizer.eos_token_id, tokenizer.pad_token_id)
    result = ReferenceResult()
    result.models, result.sampler = models, sampler
    for step in range(cfg.steps):
        metrics = train_step(step, models, sampler, tokenizer, engine, scorer, cfg)
        result.scores.append(metrics["critic/score/mean"])
        result.response_lengths.append(metrics["response_length/mean"])
        result.counts.append(int(metrics["task/count"]))
        result.step_seconds.append(metrics["timing_s/step"])
        result.metrics.append(metrics)
        if on_step is not None:
            on_step(step, metrics)
    return result


def train_step(
    step: int,
    models: RLModels,
    sampler: PromptSampler,
    tokenizer: ByteTokenizer,
    engine: RolloutEngine,
    scorer: RewardScorer,
    cfg: RLConfig,
) -> dict[str, float]:
    """One RL step: generate, score, advantages, critic and actor updates, curriculum; returns metrics."""
    timing: dict[str, float] = {}
    t_step = time.perf_counter()
    max_new_tokens = sampler.max_new_tokens
    t = time.perf_counter()
    batch = rollout(step, sampler, tokenizer, engine, scorer, cfg)
    timing["timing_s/gen"] = time.perf_counter() - t
    t = time.perf_counter()
    batch = score_batch(batch, models, cfg)
    timing["timing_s/old_log_prob"] = time.perf_counter() - t
    batch, adv_metrics = compute_advantages(batch, cfg)
    metrics: dict[str, Tensor | float] = dict(adv_metrics)
    if models.critic is not None:
        assert models.critic_optim is not None  # build_models gives the critic its optimizer
        t = time.perf_counter()
        metrics.update(update_critic(models.critic, models.critic_optim, batch, cfg))
        timing["timing_s/update_critic"] = time.perf_counter() - t
    t = time.perf_counter()
    metrics.update(update_actor(models.actor, models.actor_optim, batch, cfg))
    timing["timing_s/update_actor"] = time.perf_counter() - t
    metrics.update(batch_metrics(batch, max_new_tokens))
    out = {name: float(value) for name, value in metrics.items()}
    out["task/count"] = float(sampler.count)
    sampler.observe(out["critic/score/mean"])
    timing["timing_s/step"] = time.perf_counter() - t_step
    tokens = float(batch.prompt_mask.sum() + batch.response_mask.sum())
    out["perf/throughput"] = tokens / timing["timing_s/step"]
    out.update(timing)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """``python -m nereus_lightning.rl.reference_loop``: one reference run, a short report, its history."""
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="grpo", choices=algorithm_names())
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--lr", type=float, default=RLConfig.actor_lr)
    parser.add_argument("--critic-lr", type=float, default=RLConfig.critic_lr)
    parser.add_argument("--alphabet", default=RepeatTask.alphabet)
    parser.add_argument("--max-count", type=int, default=RepeatTask.max_count)
    parser.add_argument("--patience", type=int, default=RepeatTask.patience)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None, help="write the per-step history here")
    args = parser.parse_args(argv)
    samples = max(algorithm_spec(args.algorithm).min_samples_per_prompt, args.samples)
    cfg = RLConfig(
        algorithm=args.algorithm,
        steps=args.steps,
        prompts_per_step=args.prompts,
        samples_per_prompt=samples,
        actor_lr=args.lr,
        critic_lr=args.critic_lr,
        seed=args.seed,
    )
    task = RepeatTask(alphabet=args.alphabet, max_count=args.max_count, patience=args.patience)
    model_config = tiny_llama_config(hidden=args.hidden, layers=args.layers, intermediate=2 * args.hidden)
    start, cpu_start = time.perf_counter(), time.process_time()
    result = run_reference(cfg, task, model_config)
    seconds, cpu_seconds = time.perf_counter() - start, time.process_time() - cpu_start
    summary = {
        "algorithm": args.algorithm,
        "steps": args.steps,
        "seed": args.seed,
        "alphabet": args.alphabet,
        "lr": args.lr,
        "layers": args.layers,
        "hidden": args.hidden,
        "first10_score": result.mean_score(first=10),
        "last10_score": result.mean_score(last=10),
        "first_step_reaching_0.5": next((i for i, s in enumerate(result.scores) if s >= 0.5), None),
        "response_length_first": result.response_lengths[0],
        "response_length_last": result.response_lengths[-1],
        "count_last": result.counts[-1],
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,  # what the run costs on an idle core, whatever the machine's load
        "seconds_per_step": seconds / args.steps,
    }
    print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in summary.items()))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"summary": summary, "scores": result.scores, "response_lengths": result.response_lengths}, f
            )
    return summary


if __name__ == "__main__":
    main()
