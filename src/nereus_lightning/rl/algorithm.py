"""RL stages of one step as functions over a whole :class:`RolloutBatch`, for every registered algorithm.

:func:`rollout` (generate + score), :func:`score_batch` (old / reference log-probs, values),
:func:`compute_advantages`, :func:`update_critic`, :func:`update_actor`. The reference loop runs
them on one process; the strategy runs the same functions on each stage's DP shards. Updates
split each mini-batch into micro-batches whose losses are normalised by the mini-batch's global
token (or sequence) count, so the result does not depend on the micro-batch size (nor on DP,
when the strategy passes the count over all ranks and sums gradients).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from nereus_lightning.engines.base import RolloutEngine, sample_seeds
from nereus_lightning.rl.advantages import apply_kl_penalty, scores_to_token_rewards
from nereus_lightning.rl.batch import RolloutBatch, dp_slice
from nereus_lightning.rl.estimators import algorithm_of
from nereus_lightning.rl.forward import response_log_probs, response_values
from nereus_lightning.rl.losses import (
    KL_ESTIMATORS,
    check_loss_agg,
    entropy_loss,
    kl_loss,
    loss_normalizer,
    masked_mean,
    policy_loss_of,
    value_loss,
)
from nereus_lightning.rl.reward import RewardScorer
from nereus_lightning.rl.tasks import PromptSampler
from nereus_lightning.rl.tokenizer import ByteTokenizer
from nereus_lightning.rl.update import Stepped, run_updates
from nereus_lightning.spec.algorithms import algorithm_spec
from nereus_lightning.spec.errors import require
from nereus_lightning.spec.workload import GenerationEngine, Workload


@dataclass(frozen=True)
class RLConfig:
    """Knobs of one RL run, by verl's key names (the last part of verl's key; where verl has none, its
    key in a comment); :class:`~nereus_lightning.lightning.module.RLModule` takes the same names."""

    algorithm: str = "grpo"  # algorithm.adv_estimator: a registered name (rl.estimators)
    steps: int = 100
    prompts_per_step: int = 8  # data.train_batch_size
    samples_per_prompt: int = 8  # actor_rollout_ref.rollout.n
    actor_lr: float = 1.5e-3
    critic_lr: float = 5e-3
    ppo_epochs: int = 1
    mini_batches: int = 1  # train batch / ppo_mini_batch_size
    micro_batch_size: int = 64  # ppo_micro_batch_size_per_gpu
    policy_loss: str = "vanilla"  # actor.policy_loss.loss_mode (rl.losses.POLICY_LOSSES)
    clip_ratio: float = 0.2
    clip_ratio_low: float | None = None  # None: clip_ratio
    clip_ratio_high: float | None = None  # None: clip_ratio
    clip_ratio_c: float | None = 3.0  # dual clip: negative-advantage tokens' loss capped at -A * c
    cliprange_value: float = 0.5
    kl_coef: float = 0.0  # in-reward KL penalty (algorithm.kl_ctrl.kl_coef)
    kl_penalty: str = "kl"  # its estimator (algorithm.kl_penalty)
    kl_loss_coef: float = 0.0  # KL as a loss term (actor.kl_loss_coef)
    kl_loss_type: str = "low_var_kl"  # its estimator (actor.kl_loss_type)
    entropy_coeff: float = 0.0
    gamma: float = 1.0
    lam: float = 0.95
    norm_adv_by_std_in_grpo: bool = True  # False: Dr. GRPO
    temperature: float = 1.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None  # seq-mean-token-sum-norm's length; None: the batch's width
    rollout_is_threshold: float | None = None  # truncated IS of the rollout engine's mismatch; None: off
    grad_clip: float = 1.0
    seed: int = 0

    def __post_init__(self) -> None:
        algorithm = algorithm_of(self.algorithm)
        spec = algorithm.spec
        object.__setattr__(self, "algorithm", spec.name)  # an alias (gae) or a plug-in path: its name
        for name in (
            "steps",
            "prompts_per_step",
            "samples_per_prompt",
            "ppo_epochs",
            "mini_batches",
            "micro_batch_size",
        ):
            require(getattr(self, name) >= 1, f"rl.{name}", f"must be >= 1, got {getattr(self, name)}")
        require(
            self.mini_batches <= self.prompts_per_step * self.samples_per_prompt,
            "rl.mini_batches",
            "more mini-batches than samples per step",
        )
        require(
            self.samples_per_prompt >= spec.min_samples_per_prompt,
            "algorithm.samples_per_prompt",
            f"{spec.name} compares the samples of a prompt: it needs >= {spec.min_samples_per_prompt} "
            f"samples per prompt, got {self.samples_per_prompt}",
        )
        self._check_losses()
        if algorithm.check is not None:
            algorithm.check(self)

    def _check_losses(self) -> None:
        policy_loss_of(self.policy_loss)
        check_loss_agg(self.loss_agg_mode)
        for key, kind in (("kl_penalty", self.kl_penalty), ("kl_loss_type", self.kl_loss_type)):
            require(
                kind in KL_ESTIMATORS,
                f"algorithm.{key}",
                f"{kind!r} is not one of {', '.join(KL_ESTIMATORS)}",
            )
        for key in ("clip_ratio", "clip_ratio_low", "clip_ratio_high"):
            value = getattr(self, key)
            require(value is None or value >= 0, f"algorithm.{key}", f"must be >= 0, got {value}")
        require(
            self.clip_ratio_c is None or self.clip_ratio_c > 1.0,
            "algorithm.clip_ratio_c",
            f"must be > 1 (or null: no dual clip), got {self.clip_ratio_c}",
        )
        require(
            self.rollout_is_threshold is None or self.rollout_is_threshold > 0,
            "algorithm.rollout_is_threshold",
            f"must be > 0 (or null: no correction), got {self.rollout_is_threshold}",
        )
        require(
            self.loss_scale_factor is None or self.loss_scale_factor > 0,
            "algorithm.loss_scale_factor",
            f"must be > 0 (or null: the batch's response width), got {self.loss_scale_factor}",
        )

    @property
    def uses_critic(self) -> bool:
        """Whether the algorithm trains a critic (GAE)."""
        return algorithm_spec(self.algorithm).critic

    @property
    def uses_reference(self) -> bool:
        """A reference model is needed when any KL term is on."""
        return self.kl_coef > 0 or self.kl_loss_coef > 0

    def normalizer(self, mask: Tensor) -> Tensor:
        """The loss denominator of the global mini-batch whose response mask is ``mask``."""
        return loss_normalizer(mask, self.loss_agg_mode, self.loss_scale_factor).clamp_min(1.0)

    def workload(
        self,
        prompt_len: float,
        response_len: float,
        reward_model: bool,
        engine: GenerationEngine,
        generation_rounds: float = 1.0,
    ) -> Workload:
        """This config's RL step as the planner prices it, at these mean lengths (tokens), with or
        without a reward model, generating on ``engine`` in ``generation_rounds`` rounds."""
        return Workload(
            algorithm=self.algorithm,
            prompts_per_step=self.prompts_per_step,
            samples_per_prompt=self.samples_per_prompt,
            prompt_len=prompt_len,
            response_len=response_len,
            mini_batches=self.mini_batches,
            ppo_epochs=self.ppo_epochs,
            reward_model=reward_model,
            generation_engine=engine,
            generation_rounds=generation_rounds,
        )

    @property
    def clip_range(self) -> tuple[float, float]:
        """The policy ratio's clip range below and above 1: ``clip_ratio_low`` and ``clip_ratio_high``,
        each ``clip_ratio`` when unset."""
        low, high = self.clip_ratio_low, self.clip_ratio_high
        return (self.clip_ratio if low is None else low, self.clip_ratio if high is None else high)


@dataclass
class RLModels:
    """The models and optimisers of one run; ``reference`` and ``critic`` only when needed."""

    actor: nn.Module
    actor_optim: torch.optim.Optimizer
    reference: nn.Module | None = None
    critic: nn.Module | None = None
    critic_optim: torch.optim.Optimizer | None = None


def rollout(
    step: int,
    sampler: PromptSampler,
    tokenizer: ByteTokenizer,
    engine: RolloutEngine,
    scorer: RewardScorer,
    cfg: RLConfig,
    dp: int = 1,
    dp_rank: int = 0,
    device: torch.device | str | None = None,
) -> RolloutBatch:
    """Draw the step's prompts, sample ``samples_per_prompt`` responses each, score them (and, for
    ReMax, the greedy answer of each prompt).

    Every rank draws the same global prompts (the sampler advances identically everywhere) and
    generates only its DP block (:func:`~nereus_lightning.rl.batch.dp_slice` of the global sample
    order). Prompts are padded to the global width and each sample is seeded by its global index,
    so a sample's tokens do not depend on ``dp``.
    """
    prompts = sampler.next_prompts(cfg.prompts_per_step)
    n = cfg.samples_per_prompt
    all_ids, all_mask = tokenizer.pad(
        [tokenizer.encode(p.text, add_bos=True) for p in prompts for _ in range(n)]
    )
    all_groups = torch.tensor([p.index for p in prompts for _ in range(n)])
    rows = dp_slice(len(all_ids), dp, dp_rank)
    prompt_ids, prompt_mask = all_ids[rows].to(device), all_mask[rows].to(device)
    index = torch.arange(len(all_ids))[rows].to(device)
    groups = all_groups[rows].to(device)
    out = engine.generate(
        prompt_ids,
        prompt_mask,
        sampler.max_new_tokens,
        do_sample=True,
        temperature=cfg.temperature,
        sample_seeds=sample_seeds(cfg.seed, step, index),
    )
    batch = RolloutBatch(out.prompt_ids, out.prompt_mask, out.response_ids, out.response_mask, index, groups)
    batch.scores = scorer(batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    if algorithm_spec(cfg.algorithm).greedy_baseline:
        # one greedy answer per prompt present in this block (samples of a prompt are contiguous)
        starts = torch.ones_like(groups, dtype=torch.bool)
        starts[1:] = groups[1:] != groups[:-1]
        greedy = engine.generate(
            prompt_ids[starts], prompt_mask[starts], sampler.max_new_tokens, do_sample=False
        )
        baseline = scorer(greedy.prompt_ids, greedy.prompt_mask, greedy.response_ids, greedy.response_mask)
        batch.baseline_scores = baseline[starts.long().cumsum(0) - 1]
    return batch


@torch.no_grad()
def score_batch(batch: RolloutBatch, models: RLModels, cfg: RLConfig) -> RolloutBatch:
    """Old log-probs (actor), reference log-probs and values, as the inference stages compute them."""
    ids = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    batch.old_log_probs, _ = response_log_probs(models.actor, *ids, temperature=cfg.temperature)
    if models.reference is not None:
        batch.ref_log_probs, _ = response_log_probs(models.reference, *ids, temperature=cfg.temperature)
    if models.critic is not None:
        batch.values = response_values(models.critic, *ids)
    return batch


def compute_advantages(batch: RolloutBatch, cfg: RLConfig) -> tuple[RolloutBatch, dict[str, Tensor]]:
    """Token rewards (score on the last token, minus the in-reward KL), then the algorithm's advantages.

    With reference log-probs the in-reward KL (``cfg.kl_penalty``) is measured (``actor/kl``) and,
    when ``cfg.kl_coef > 0``, subtracted from the token rewards.
    """
    mask = batch.response_mask
    rewards = scores_to_token_rewards(batch.need("scores"), mask)
    metrics: dict[str, Tensor] = {}
    if batch.ref_log_probs is not None:
        penalised, metrics = apply_kl_penalty(
            rewards, batch.need("old_log_probs"), batch.ref_log_probs, mask, cfg.kl_coef, cfg.kl_penalty
        )
        if cfg.kl_coef > 0:
            rewards = penalised
    batch.token_rewards = rewards
    batch.advantages, batch.returns = algorithm_of(cfg.algorithm).advantages(batch, rewards, cfg)
    return batch, metrics


def actor_loss(
    log_probs: Tensor,
    micro: RolloutBatch,
    cfg: RLConfig,
    normalizer: Tensor,
    tokens: Tensor,
    entropy: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The actor's loss on one micro-batch: clipped policy loss, minus the entropy bonus, plus the KL loss.

    Args:
        log_probs: the micro-batch's response log-probs under the current policy.
        normalizer: the global mini-batch's token (or sequence) count the losses are divided by.
        tokens: its token count (turns per-micro token means into shares that sum over micro-batches
            and ranks).
        entropy: per-token entropy (reported as ``actor/entropy``); needed when ``cfg.entropy_coeff > 0``.

    Returns:
        The loss and its metrics, each a contribution that sums over micro-batches and DP ranks.
    """
    mask = micro.response_mask
    weights = rollout_is_weights(micro, cfg.rollout_is_threshold)
    loss, m = policy_loss_of(cfg.policy_loss)(
        log_probs,
        micro.need("old_log_probs"),
        micro.need("advantages"),
        mask,
        clip_eps=cfg.clip_range[0],
        clip_eps_high=cfg.clip_range[1],
        dual_clip=cfg.clip_ratio_c,
        agg=cfg.loss_agg_mode,
        normalizer=normalizer,
        **({} if weights is None else {"weights": weights}),
    )
    require(
        entropy is not None or cfg.entropy_coeff == 0,
        "algorithm.entropy_coeff",
        "an entropy bonus needs the per-token entropy",
    )
    if entropy is not None:
        ent, em = entropy_loss(entropy, mask, cfg.loss_agg_mode, normalizer)
        m.update(em)
        loss = loss - cfg.entropy_coeff * ent
    if cfg.kl_loss_coef > 0:
        kl, km = kl_loss(
            log_probs, micro.need("ref_log_probs"), mask, cfg.kl_loss_type, cfg.loss_agg_mode, normalizer
        )
        loss = loss + cfg.kl_loss_coef * kl
        m.update(km)
    share = mask.sum() / tokens
    for name in ("actor/pg_clipfrac", "actor/ppo_kl"):
        m[name] = m[name] * share
    return loss, m


def rollout_is_weights(batch: RolloutBatch, threshold: float | None) -> Tensor | None:
    """Truncated importance weights of the rollout engine's mismatch (verl's TIS):
    ``min(exp(old - rollout), threshold)`` per token, or None without a threshold or rollout log-probs."""
    if threshold is None or batch.rollout_log_probs is None:
        return None
    log_ratio = (batch.need("old_log_probs") - batch.rollout_log_probs).clamp(-20.0, 20.0)
    return torch.exp(log_ratio).clamp(max=threshold).detach()


def rollout_mismatch(batch: RolloutBatch, threshold: float | None) -> dict[str, float]:
    """How far the rollout engine's token log-probs are from the trainer's old_log_probs (verl's names)."""
    mask = batch.response_mask.float()
    old, rollout = batch.need("old_log_probs"), batch.need("rollout_log_probs")
    log_ratio = (old - rollout).clamp(-20.0, 20.0)  # training over rollout, per token
    ratio = torch.exp(log_ratio)
    diff = (torch.exp(old) - torch.exp(rollout)).abs()
    valid = mask.bool()
    metrics = {
        "training/rollout_probs_diff_mean": float(masked_mean(diff, mask)),
        "training/rollout_probs_diff_max": float(diff[valid].max()) if valid.any() else 0.0,
        "mismatch/mismatch_kl": float(masked_mean(-log_ratio, mask)),  # k1 of KL(rollout || training)
        "mismatch/mismatch_k3_kl": float(masked_mean(ratio - log_ratio - 1.0, mask)),
        "mismatch/rollout_is_mean": float(masked_mean(ratio, mask)),
        "mismatch/rollout_is_max": float(ratio[valid].max()) if valid.any() else 1.0,
    }
    if threshold is not None:
        metrics["mismatch/rollout_is_ratio_fraction_high"] = float(
            masked_mean((ratio > threshold).float(), mask)
        )
    return metrics


def critic_loss(
    values: Tensor, micro: RolloutBatch, cfg: RLConfig, normalizer: Tensor, tokens: Tensor
) -> tuple[Tensor, dict[str, Tensor]]:
    """The critic's clipped value loss on one micro-batch; arguments and metrics as :func:`actor_loss`."""
    mask = micro.response_mask
    loss, m = value_loss(
        values,
        micro.need("values"),
        micro.need("returns"),
        mask,
        cfg.cliprange_value,
        cfg.loss_agg_mode,
        normalizer,
    )
    m["critic/vf_clipfrac"] = m["critic/vf_clipfrac"] * mask.sum() / tokens
    return loss, m


GradHook = Callable[[nn.Module], None]
ClipHook = Callable[[nn.Module, float], Tensor]
MicroLoss = Callable[[RolloutBatch, Tensor, Tensor], tuple[Tensor, dict[str, Tensor]]]


@dataclass(frozen=True)
class PlainTrainee:
    """A plain (unsharded) model as :func:`~nereus_lightning.rl.update.run_updates` trains it: this DP
    rank's block of each mini-batch in micro-batches of ``cfg.micro_batch_size`` rows, each micro-batch's
    loss from ``micro_loss``; gradients summed over DP by ``sync_grads``, clipped by ``clip_grads``."""

    role: str
    module: nn.Module
    optim: torch.optim.Optimizer
    micro_loss: MicroLoss
    micro_batch_size: int
    dp: int = 1
    dp_rank: int = 0
    sync_grads: GradHook | None = None
    clip_grads: ClipHook | None = None

    def backward(self, mini: RolloutBatch, normalizer: Tensor, tokens: Tensor) -> dict[str, Tensor]:
        """Backward of this DP rank's block of ``mini``, micro-batch by micro-batch."""
        self.module.train()
        self.optim.zero_grad(set_to_none=True)
        mine = mini.shard(self.dp, self.dp_rank)
        micros = mine.split(max(1, math.ceil(len(mine) / self.micro_batch_size))) if len(mine) else []
        metrics: dict[str, Tensor] = {}
        for micro in micros:
            loss, m = self.micro_loss(micro, normalizer, tokens)
            loss.backward()
            for k, v in m.items():
                metrics[k] = metrics[k] + v.detach() if k in metrics else v.detach()
        return metrics

    def step(self, max_norm: float, samples: int) -> Stepped:
        """Sum gradients over DP, clip and step; a non-finite norm steps nothing. The gradients are dropped
        either way."""
        del samples  # a plain model keeps no sample counter
        if self.sync_grads is not None:
            self.sync_grads(self.module)
        clip = self.clip_grads or _clip
        norm = float(clip(self.module, max_norm))
        finite = math.isfinite(norm)
        if finite:
            self.optim.step()
        self.optim.zero_grad(set_to_none=True)
        return Stepped(norm) if finite else Stepped(norm, f"{self.role}'s gradient norm is {norm}")


def _clip(module: nn.Module, max_norm: float) -> Tensor:
    return torch.nn.utils.clip_grad_norm_(module.parameters(), max_norm)


def update_actor(
    actor: nn.Module,
    optim: torch.optim.Optimizer,
    batch: RolloutBatch,
    cfg: RLConfig,
    dp: int = 1,
    dp_rank: int = 0,
    sync_grads: GradHook | None = None,
    clip_grads: ClipHook | None = None,
) -> dict[str, float]:
    """PPO epochs over mini-batches of the clipped policy loss (+ KL loss, - entropy bonus) of a plain
    model, through :func:`~nereus_lightning.rl.update.run_updates`.

    Args:
        batch: the step's *global* batch, sorted by sample index (every rank holds it; it is only
            token ids and per-token floats). Mini-batch ``i`` is the ``i``-th global block, and this
            rank trains on its DP block of it, in micro-batches of ``cfg.micro_batch_size``.
        dp: the DP degree of the training stage; ``dp_rank`` this replica's rank in it.
        sync_grads: called before clipping; in DP it must *sum* the gradients over the DP group
            (losses are already normalised by the global mini-batch's token or sequence count).
        clip_grads: ``(module, max_norm) -> total norm``; a sharded model passes one that reduces
            the norm over its TP/PP shards. Defaults to ``torch.nn.utils.clip_grad_norm_``.

    Returns:
        This rank's share of the metrics: loss metrics are contributions that sum over DP ranks
        to the global value; ``actor/pg_clipfrac`` and ``actor/ppo_kl`` are token-weighted so
        that they sum too; ``actor/grad_norm`` is the (already global) clipped-before norm.
    """

    def micro_loss(micro: RolloutBatch, norm: Tensor, tokens: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        ids = (micro.prompt_ids, micro.prompt_mask, micro.response_ids, micro.response_mask)
        log_probs, entropy = response_log_probs(actor, *ids, temperature=cfg.temperature, with_entropy=True)
        return actor_loss(log_probs, micro, cfg, norm, tokens, entropy)

    trainee = PlainTrainee(
        "actor", actor, optim, micro_loss, cfg.micro_batch_size, dp, dp_rank, sync_grads, clip_grads
    )
    metrics = run_updates(batch, cfg, [trainee])
    metrics["actor/lr"] = float(optim.param_groups[0]["lr"])
    return metrics


def update_critic(
    critic: nn.Module,
    optim: torch.optim.Optimizer,
    batch: RolloutBatch,
    cfg: RLConfig,
    dp: int = 1,
    dp_rank: int = 0,
    sync_grads: GradHook | None = None,
    clip_grads: ClipHook | None = None,
) -> dict[str, float]:
    """PPO epochs over mini-batches of the clipped value loss; arguments as :func:`update_actor`."""

    def micro_loss(micro: RolloutBatch, norm: Tensor, tokens: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        ids = (micro.prompt_ids, micro.prompt_mask, micro.response_ids, micro.response_mask)
        return critic_loss(response_values(critic, *ids), micro, cfg, norm, tokens)

    trainee = PlainTrainee(
        "critic", critic, optim, micro_loss, cfg.micro_batch_size, dp, dp_rank, sync_grads, clip_grads
    )
    return run_updates(batch, cfg, [trainee])


def batch_metrics(batch: RolloutBatch, max_new_tokens: int) -> dict[str, Tensor]:
    """verl's data metrics: score, rewards, advantages, returns, response length (mean / max / clip ratio)."""
    mask = batch.response_mask
    lengths = mask.sum(-1).float()
    metrics = {
        "critic/score/mean": batch.need("scores").float().mean(),
        "critic/rewards/mean": batch.need("token_rewards").sum(-1).mean(),
        "critic/advantages/mean": masked_mean(batch.need("advantages"), mask),
        "critic/returns/mean": masked_mean(batch.need("returns"), mask),
        "response_length/mean": lengths.mean(),
        "response_length/max": lengths.max(),
        "response_length/clip_ratio": (lengths >= max_new_tokens).float().mean(),
    }
    if batch.values is not None:
        metrics["critic/values/mean"] = masked_mean(batch.values, mask)
    return metrics
