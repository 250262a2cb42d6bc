"""The single-process reference loop: it learns the repeat task, updates are micro-batch invariant,
and PPO / ReMax (with KL terms) run end to end with verl's metric names."""

from __future__ import annotations

import copy
import math
import threading
import time

import pytest
import torch

from nereus_lightning.engines.hf import HFGenerateEngine
from nereus_lightning.rl import algorithm
from nereus_lightning.rl.algorithm import (
    RLConfig,
    compute_advantages,
    rollout,
    score_batch,
    update_actor,
    update_critic,
)
from nereus_lightning.rl.batch import RolloutBatch
from nereus_lightning.rl.reference_loop import build_models, run_reference, tiny_llama_config
from nereus_lightning.rl.reward import make_scorer
from nereus_lightning.rl.tasks import PromptSampler, RepeatTask
from nereus_lightning.rl.tokenizer import ByteTokenizer
from nereus_lightning.rl.update import run_updates
from nereus_lightning.spec.errors import NereusConfigError

SMALL = dict(hidden=32, layers=1, heads=2, kv_heads=2, intermediate=64)


def test_grpo_learns_the_repeat_task_and_responses_grow():
    cfg = RLConfig(
        algorithm="grpo", steps=70, prompts_per_step=8, samples_per_prompt=8, actor_lr=3e-3, seed=0
    )
    start = time.perf_counter()
    result = run_reference(cfg, task=RepeatTask(alphabet="a", start_count=2, max_count=8))
    seconds = time.perf_counter() - start
    first, last = result.mean_score(first=10), result.mean_score(last=10)
    print(
        f"grpo 70 steps: first-10 {first:.3f} last-10 {last:.3f}, response length "
        f"{result.response_lengths[0]:.1f} -> {result.response_lengths[-1]:.1f}, {seconds:.1f} s"
    )
    assert last > first + 0.5
    assert result.counts[-1] > result.counts[0]
    assert result.response_lengths[-1] > result.response_lengths[0] + 2


def _one_batch(cfg, models):
    tok = ByteTokenizer()
    sampler = PromptSampler(RepeatTask(alphabet="ab", start_count=4, count_spread=2), seed=cfg.seed)
    engine = HFGenerateEngine(models.actor, tok.eos_token_id, tok.pad_token_id)
    batch = rollout(0, sampler, tok, engine, make_scorer(sampler.task.reward, tok), cfg)
    # random scores give non-trivial advantages even for an untrained policy
    batch.scores = torch.rand(len(batch), generator=torch.Generator().manual_seed(1))
    batch = score_batch(batch, models, cfg)
    batch, _ = compute_advantages(batch, cfg)
    return batch


class _ThreadAllReduce:
    """Sums gradients over model copies trained in lock-step threads: a DP all-reduce stand-in."""

    def __init__(self, world: int) -> None:
        self.barrier = threading.Barrier(world)
        self.modules: list = [None] * world

    def hook(self, rank: int):
        def sync(module):
            self.modules[rank] = module
            self.barrier.wait()
            if rank == 0:  # fixed summation order: rank 0, 1, ...
                for group in zip(*(list(m.parameters()) for m in self.modules), strict=True):
                    total = sum(p.grad if p.grad is not None else torch.zeros_like(p) for p in group)
                    for p in group:
                        p.grad = total.clone()
            self.barrier.wait()

        return sync


def _update(models, batch, cfg, dp):
    copies = [copy.deepcopy(models) for _ in range(dp)]
    reduce = _ThreadAllReduce(dp)

    def train(rank):
        run, hook = copies[rank], reduce.hook(rank) if dp > 1 else None
        update_critic(run.critic, run.critic_optim, batch, cfg, dp, rank, sync_grads=hook)
        update_actor(run.actor, run.actor_optim, batch, cfg, dp, rank, sync_grads=hook)

    threads = [threading.Thread(target=train, args=(rank,)) for rank in range(dp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [[p.detach().clone() for p in [*c.actor.parameters(), *c.critic.parameters()]] for c in copies]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_updates_do_not_depend_on_dp_degree_or_micro_batch_size(agg):
    cfg = RLConfig(
        algorithm="ppo",
        prompts_per_step=4,
        samples_per_prompt=3,
        mini_batches=2,
        ppo_epochs=2,
        kl_loss_coef=0.1,
        entropy_coeff=0.01,
        loss_agg_mode=agg,
        seed=2,
    )
    models = build_models(cfg, tiny_llama_config(**SMALL))
    batch = _one_batch(cfg, models)
    reference = _update(models, batch, cfg, dp=1)[0]
    moved = max(
        (a - b).abs().max().item() for a, b in zip(reference, models.actor.parameters(), strict=False)
    )
    assert moved > 1e-4  # the update did something
    for dp, micro in ((1, 1), (2, 4), (3, 1), (5, 2)):  # dp 5: some ranks hold one sample of a mini-batch
        c = RLConfig(**{**cfg.__dict__, "micro_batch_size": micro})
        for params in _update(models, batch, c, dp):
            for a, b in zip(reference, params, strict=True):  # relative to the tensor's norm (fp32 order)
                assert (a - b).norm() <= 1e-5 * a.norm(), (dp, micro)


class _Watched:
    """A trainee that records, at each backward, whether ``other``'s parameters hold gradients."""

    def __init__(self, trainee, other):
        self.trainee, self.other, self.other_has_grads = trainee, other, []

    @property
    def role(self):
        return self.trainee.role

    def backward(self, mini, normalizer, tokens):
        self.other_has_grads.append(any(p.grad is not None for p in self.other.parameters()))
        return self.trainee.backward(mini, normalizer, tokens)

    def step(self, max_norm, samples):
        return self.trainee.step(max_norm, samples)


def test_each_trainee_steps_and_drops_its_gradients_before_the_next_ones_backward(monkeypatch):
    cfg = RLConfig(
        algorithm="ppo", prompts_per_step=4, samples_per_prompt=2, mini_batches=2, ppo_epochs=2, seed=3
    )
    models = build_models(cfg, tiny_llama_config(**SMALL))
    batch = _one_batch(cfg, models)
    alone = copy.deepcopy(models)  # each model updated by itself
    update_actor(alone.actor, alone.actor_optim, batch, cfg)
    update_critic(alone.critic, alone.critic_optim, batch, cfg)

    trainees = []
    monkeypatch.setattr(algorithm, "run_updates", lambda b, c, ts, **kw: trainees.extend(ts) or {})
    update_actor(models.actor, models.actor_optim, batch, cfg)
    update_critic(models.critic, models.critic_optim, batch, cfg)
    monkeypatch.undo()
    actor, critic = _Watched(trainees[0], models.critic), _Watched(trainees[1], models.actor)
    metrics = run_updates(batch, cfg, [actor, critic])

    assert critic.other_has_grads == [False] * 4  # 2 epochs x 2 mini-batches: the actor's were dropped
    assert actor.other_has_grads == [False] * 4
    assert {"actor/grad_norm", "critic/grad_norm", "actor/pg_loss", "critic/vf_loss"} <= set(metrics)
    together = [*models.actor.parameters(), *models.critic.parameters()]
    for a, b in zip([*alone.actor.parameters(), *alone.critic.parameters()], together, strict=True):
        assert torch.equal(a, b)  # independent models: the interleaved update changes no value


@pytest.mark.parametrize("algorithm", ["ppo", "remax"])
def test_ppo_and_remax_run_with_kl_and_report_verl_metrics(algorithm):
    cfg = RLConfig(
        algorithm=algorithm,
        steps=3,
        prompts_per_step=4,
        samples_per_prompt=2,
        kl_coef=0.05,
        kl_loss_coef=0.01,
        mini_batches=2,
        seed=1,
    )

    def spread_reward(prompts, responses):  # varied scores, so an untrained policy still moves
        return [(sum(map(ord, r)) % 7) / 7 for r in responses]

    result = run_reference(
        cfg, task=RepeatTask(start_count=3), model_config=tiny_llama_config(**SMALL), reward=spread_reward
    )
    metrics = result.metrics[-1]
    names = [
        "actor/pg_loss",
        "actor/pg_clipfrac",
        "actor/ppo_kl",
        "actor/kl",
        "actor/kl_loss",
        "actor/entropy",
        "actor/grad_norm",
        "critic/score/mean",
        "critic/rewards/mean",
        "critic/advantages/mean",
        "response_length/mean",
        "response_length/clip_ratio",
        "timing_s/gen",
        "timing_s/update_actor",
        "timing_s/step",
        "perf/throughput",
    ]
    if algorithm == "ppo":
        names += ["critic/vf_loss", "critic/vf_clipfrac", "critic/values/mean", "timing_s/update_critic"]
    for name in names:
        assert name in metrics and math.isfinite(metrics[name]), name
    assert metrics["actor/kl"] != 0.0  # the policy moved away from the reference
    assert len(result.scores) == 3


def test_rl_config_rejects_bad_input():
    with pytest.raises(
        NereusConfigError, match="'dpo' is not a known algorithm; choose one of ppo, grpo, rloo"
    ):
        RLConfig(algorithm="dpo")
    for name in ("grpo", "rloo"):
        with pytest.raises(NereusConfigError, match="needs >= 2 samples per prompt, got 1"):
            RLConfig(algorithm=name, samples_per_prompt=1)
    with pytest.raises(NereusConfigError, match="algorithm.loss_agg_mode"):
        RLConfig(loss_agg_mode="sequence-mean")
    with pytest.raises(NereusConfigError, match="algorithm.policy_loss"):
        RLConfig(policy_loss="dpo")
    with pytest.raises(NereusConfigError, match="algorithm.clip_ratio_c"):
        RLConfig(clip_ratio_c=0.5)


def test_reference_cli_writes_a_summary(tmp_path):
    from nereus_lightning.rl.reference_loop import main

    out = tmp_path / "run.json"
    summary = main(
        [
            "--steps",
            "2",
            "--prompts",
            "2",
            "--samples",
            "2",
            "--hidden",
            "32",
            "--layers",
            "1",
            "--json",
            str(out),
        ]
    )
    assert summary["steps"] == 2 and 0.0 <= summary["last10_score"] <= 1.0
    assert out.exists() and "response_lengths" in out.read_text()


def test_rollout_blocks_of_any_dp_degree_join_to_the_whole_rollout():
    cfg = RLConfig(algorithm="remax", prompts_per_step=3, samples_per_prompt=3, seed=3)
    models = build_models(cfg, tiny_llama_config(**SMALL))
    tok = ByteTokenizer()
    task = RepeatTask(alphabet="ab", start_count=15, count_spread=14)  # seed 3: '8*b=', '14*b=', '4*a='
    engine = HFGenerateEngine(models.actor, tok.eos_token_id, tok.pad_token_id)
    scorer = make_scorer(lambda p, r: [(sum(map(ord, x)) % 5) / 5 for x in r], tok)

    def blocks(dp):
        return [rollout(2, PromptSampler(task, seed=3), tok, engine, scorer, cfg, dp, r) for r in range(dp)]

    whole = blocks(1)[0]
    assert whole.prompt_mask.sum(-1).unique().numel() > 1  # some prompts really are left-padded
    for dp in (2, 4):
        joined = RolloutBatch.concat(blocks(dp))
        for name, tensor in whole.tensors().items():
            assert torch.equal(joined.tensors()[name], tensor), (dp, name)


def test_resume_from_saved_state_reproduces_the_next_steps():
    import io

    from nereus_lightning.rl.reference_loop import train_step

    cfg = RLConfig(
        algorithm="ppo", prompts_per_step=3, samples_per_prompt=2, kl_coef=0.05, kl_loss_coef=0.01, seed=5
    )
    tok = ByteTokenizer()
    task = RepeatTask(start_count=2, patience=1, raise_at=0.0)  # the count rises every step

    def fresh():
        models = build_models(cfg, tiny_llama_config(**SMALL))
        engine = HFGenerateEngine(models.actor, tok.eos_token_id, tok.pad_token_id)
        sampler = PromptSampler(task, seed=cfg.seed)
        return models, engine, sampler, make_scorer(lambda p, r: [(sum(map(ord, x)) % 5) / 5 for x in r], tok)

    def state(models, sampler):
        return {
            "actor": models.actor.state_dict(),
            "critic": models.critic.state_dict(),
            "actor_optim": models.actor_optim.state_dict(),
            "critic_optim": models.critic_optim.state_dict(),
            "sampler": sampler.state_dict(),
        }

    models, engine, sampler, scorer = fresh()
    straight, saved = [], io.BytesIO()
    for step in range(5):
        if step == 3:
            torch.save(state(models, sampler), saved)
        straight.append(train_step(step, models, sampler, tok, engine, scorer, cfg))

    models, engine, sampler, scorer = fresh()
    saved.seek(0)
    loaded = torch.load(saved, weights_only=True)
    for name in ("actor", "critic", "actor_optim", "critic_optim"):
        getattr(models, name).load_state_dict(loaded[name])
    sampler.load_state_dict(loaded["sampler"])
    for step in (3, 4):
        resumed = train_step(step, models, sampler, tok, engine, scorer, cfg)
        for name in (
            "actor/pg_loss",
            "critic/vf_loss",
            "actor/kl",
            "critic/score/mean",
            "response_length/mean",
        ):
            assert resumed[name] == pytest.approx(straight[step][name], rel=1e-5, abs=1e-7), (step, name)
        assert resumed["task/count"] == straight[step]["task/count"] == 2 + step
