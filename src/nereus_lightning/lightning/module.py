"""RL LightningModules: PPO (actor, critic, reference, function reward; GAE), GRPO (group-normalised
advantages, no critic) and ReMax (greedy-rollout baseline).

The module builds the role models (full transformers modules) and owns the algorithm. With the
default EMU state backend (:mod:`nereus_lightning.lightning.emu_state`) the models seed each
model-stage's Elastic Model Units and are then released: every stage computes on sharded modules
built on its units' tensors. There is one way to sample and one way to score: rollouts go through
a :class:`~nereus_lightning.rl.rollout.RolloutEngine` (transformers ``generate`` over a
:class:`~nereus_lightning.models.generation.ShardedGenerator` of the generation unit, each sample
seeded by its global index), inference stages score with :mod:`nereus_lightning.rl.forward` over
the same adapter, and updates read the same response positions
(:func:`~nereus_lightning.rl.forward.response_span`) from :func:`~nereus_lightning.models.train_step`. *Where* each
model-stage runs comes from the strategy's current plan (:class:`NereusStrategy`): every stage
runs on its replicas' slice of the global batch (see :mod:`nereus_lightning.lightning.stages`)
and the results are gathered in global sample order before the next stage. Losses are
normalised by global token counts, so one update is the same under any DP layout up to
floating-point reduction order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from functools import partial
from typing import Any, ClassVar

import torch
from torch import Tensor
from typing_extensions import override

import lightning as L
from nereus_lightning.lightning.build import build_causal_lm, build_value_model, frozen_copy
from nereus_lightning.lightning.stages import (
    RowsJob,
    StageSlot,
    all_reduce_grads,
    chunk_bounds,
    data_parallel_plan,
    run_stages,
    run_stages_rows,
    slot_of,
)
from nereus_lightning.plan.layout import Plan
from nereus_lightning.rl import advantages as adv
from nereus_lightning.rl import losses
from nereus_lightning.rl.batch import RolloutBatch
from nereus_lightning.rl.forward import (
    position_ids_from_mask,
    response_log_probs,
    response_span,
    response_values,
)
from nereus_lightning.rl.reward import ModelReward
from nereus_lightning.rl.rollout import HFGenerateEngine, RolloutEngine, VLLMEngine, sample_seeds
from nereus_lightning.rl.tokenizer import pad_ids
from nereus_lightning.spec.errors import require


class _StepClock(torch.utils.data.IterableDataset):
    """An endless stream of ticks: prompts come from the task by RL step, not from the loader."""

    def __iter__(self):  # noqa: ANN204
        i = 0
        while True:
            yield torch.tensor(i)
            i += 1


class RLModule(L.LightningModule):
    """Shared machinery of the RL algorithms; subclasses set ``algorithm`` and the advantage rule.

    Args:
        actor: a model preset name (``spec.MODEL_PRESETS``), a transformers config dict, or a local folder.
        critic: same for the critic (PPO); ``None`` uses the actor's architecture. Built as a value
            model (transformers token classification with one label: a ``score`` head replaces the
            LM head, as verl's critic).
        reward_model: a reward model (preset, config dict or folder; a value model like the critic)
            scoring each response by its value at the last response token; ``None``: the task's Python reward.
        task: the prompt source and reward (see :mod:`nereus_lightning.rl.tasks`); a task object or a name.
        prompts_per_step, samples_per_prompt: global batch of one RL step.
        actor_lr, critic_lr: AdamW learning rates.
        kl_coef: KL-to-reference coefficient (in-reward penalty for PPO/ReMax, loss term for GRPO).
        clip_ratio, cliprange_value: PPO clipping.
        gamma, lam: GAE discount and lambda.
        temperature: sampling temperature (log-probs are of ``logits / temperature``, as verl).
        mini_batches, ppo_epochs: optimizer updates per RL step.
        seed: seeds weights and every sample's generator (``rl.rollout.sample_seeds`` of its global index).
        rollout_engine: ``"hf"``: transformers ``generate`` over the actor's generation units
            (:class:`~nereus_lightning.models.generation.ShardedGenerator`, TP and PP); ``"vllm"``:
            :class:`~nereus_lightning.rl.rollout.VLLMEngine` (needs vllm; a stub until its issue lands).
    """

    algorithm: ClassVar[str] = "ppo"
    uses_critic: ClassVar[bool] = True
    state_backend: str = "emu"  # where model-stage state lives; see :meth:`use_state`

    def __init__(
        self,
        actor: Any = "tiny_llama",
        critic: Any = None,
        reward_model: Any = None,
        task: Any = "repeat",
        prompts_per_step: int = 16,
        samples_per_prompt: int = 1,
        actor_lr: float = 3e-3,
        critic_lr: float = 3e-3,
        kl_coef: float = 0.0,
        kl_estimator: str = "low_var_kl",
        clip_ratio: float = 0.2,
        cliprange_value: float = 0.5,
        gamma: float = 1.0,
        lam: float = 0.95,
        temperature: float = 1.0,
        mini_batches: int = 1,
        ppo_epochs: int = 1,
        entropy_coef: float = 0.0,
        seed: int = 0,
        rollout_engine: str = "hf",
    ) -> None:
        super().__init__()
        require(prompts_per_step >= 1, "algorithm.prompts_per_step", f"must be >= 1, got {prompts_per_step}")
        require(
            mini_batches >= 1 and ppo_epochs >= 1,
            "algorithm.mini_batches",
            "mini_batches and ppo_epochs must be >= 1",
        )
        require(
            rollout_engine in ("hf", "vllm"),
            "algorithm.rollout_engine",
            f"{rollout_engine!r} is not one of 'hf' (transformers generate), 'vllm'",
        )
        self.save_hyperparameters(ignore=["task"])
        self.automatic_optimization = False
        from nereus_lightning.lightning.tasks import make_task

        self.task = make_task(task, seed=seed)
        self.tokenizer = self.task.tokenizer
        vocab = self.tokenizer.vocab_size
        pad = self.tokenizer.pad_token_id
        self.actor = build_causal_lm(actor, seed, vocab, pad)
        self.reference = frozen_copy(self.actor)
        self.critic = (
            build_value_model(critic if critic is not None else actor, seed + 1, vocab, pad)
            if self.uses_critic
            else None
        )
        require(
            reward_model is None or self.algorithm != "remax",
            "reward_model",
            "ReMax scores its greedy baseline with the task's Python reward; use algorithm=ppo or grpo with a reward model",
        )
        self.reward = (
            frozen_copy(build_value_model(reward_model, seed + 2, vocab, pad))
            if reward_model is not None
            else None
        )
        self.step_stats: dict[str, float] = {}
        self.units: Any = None
        self._adapters: dict[str, Any] = {}  # model-stage -> ShardedGenerator over this rank's unit
        self.last_rollout: RolloutBatch | None = None  # the last step's batch, every sample (for inspection)
        self.use_state(self.state_backend)
        from nereus_lightning.lightning.metrics import RunMetrics

        self.run_metrics = RunMetrics()

    def use_state(self, kind: str) -> None:
        """Hold model-stage state in ``"emu"`` units (default) or ``"full"`` (every rank keeps each full model).

        ``"emu"``: each model-stage's state lives in Elastic Model Units on the ranks its plan gives
        it (:class:`~nereus_lightning.lightning.emu_state.EMUStates`); ``"full"``: the earlier
        backend, every rank keeps the logical models and re-slices them per plan. Call before the
        first step.
        """
        require(kind in ("emu", "full"), "strategy.state", f"{kind!r} is not one of 'emu', 'full'")
        require(
            self.units is None or getattr(self.units, "plan", None) is None or kind == self.state_backend,
            "strategy.state",
            "the state backend cannot change once units exist",
        )
        self.state_backend = kind
        if kind == "emu":
            from nereus_lightning.lightning.control import job_workload, model_specs
            from nereus_lightning.lightning.emu_state import EMUStates

            lrs = {"actor": self.hparams.actor_lr, "critic": self.hparams.critic_lr}
            self.units = EMUStates(self.algorithm, lrs)
            self.units.specs_fn = lambda: model_specs(self)
            self.units.workload_fn = lambda: job_workload(self)
        else:
            from nereus_lightning.lightning.units import StageUnits

            self.units = StageUnits(self.algorithm)

    @property
    def emu_state(self) -> bool:
        """Whether model-stage state lives in EMUs."""
        return getattr(self.units, "kind", "full") == "emu"

    # ---- Lightning hooks -------------------------------------------------------------------
    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        groups = [{"params": list(self.actor.parameters()), "lr": self.hparams.actor_lr}]
        if self.critic is not None:
            groups.append({"params": list(self.critic.parameters()), "lr": self.hparams.critic_lr})
        return torch.optim.AdamW(groups, betas=(0.9, 0.95), weight_decay=0.0, eps=1e-8)

    @override
    def on_train_end(self) -> None:
        if self.emu_state and self.units.plan is not None:
            self.units.write_back(self.role_models(), dst=0)  # the caller's module gets the trained weights

    @override
    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(_StepClock(), batch_size=None)

    @override
    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        self.step_stats = self.rl_step(self.global_step)
        self.step_stats.update(self.run_metrics.update(self.step_stats))
        self.log_dict(self.step_stats, on_step=True, prog_bar=False, sync_dist=False, rank_zero_only=True)
        self.log("reward", self.step_stats["critic/score/mean"], prog_bar=True, rank_zero_only=True)
        self.log("resp_len", self.step_stats["response_length/mean"], prog_bar=True, rank_zero_only=True)

    # ---- the plan ------------------------------------------------------------------------
    def current_plan(self):  # noqa: ANN201
        """The strategy's plan, or every stage data-parallel over all ranks (plain Trainer)."""
        strategy = self.trainer.strategy if self._trainer is not None else None
        plan = getattr(strategy, "plan", None)
        if plan is not None:
            return plan
        world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
        return data_parallel_plan(self.algorithm, range(world))

    @property
    def rank(self) -> int:
        """This process's global rank."""
        return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    # ---- one RL step -----------------------------------------------------------------------
    def rl_step(self, step: int, plan: Plan | None = None, optimizer: Any = None) -> dict[str, float]:
        """Generate, score, compute advantages and update; returns the step's metrics (verl names).

        ``plan`` defaults to the strategy's; ``optimizer`` to the Lightning one (pass both to run
        a step outside a Trainer, e.g. in tests).
        """
        hp = self.hparams
        plan = plan if plan is not None else self.current_plan()
        self.units.ensure(plan, self.role_models(), self.rank)  # no-op unless the plan changed
        t0 = time.perf_counter()
        prompts, groups = self.task.prompts(step, hp.prompts_per_step, hp.samples_per_prompt)
        n = len(prompts)
        max_new = self.task.max_response_len(step)
        tok = self.tokenizer
        # Prompts left-padded to the global width: a sample's inputs do not depend on its replica.
        prompt_ids, prompt_mask = (t.to(self.device) for t in pad_ids(prompts, tok.pad_token_id, "left"))

        def gen(slot: StageSlot, greedy: bool = False) -> list[list[int]]:
            rows = slice(slot.start, slot.stop)
            out = self.rollout_engine(slot.stage).generate(
                prompt_ids[rows],
                prompt_mask[rows],
                max_new,
                do_sample=not greedy,
                temperature=hp.temperature,
                sample_seeds=None if greedy else sample_seeds(hp.seed, step, slot.indices),
            )
            lengths = out.response_mask.sum(-1).tolist()
            return [ids[:k] for ids, k in zip(out.response_ids.tolist(), lengths, strict=True)]

        jobs = {"actor_gen": gen}
        if self.algorithm == "remax":  # the greedy baseline, concurrently where its ranks are disjoint
            jobs["actor_greedy_gen"] = partial(gen, greedy=True)
        generated = run_stages(plan, jobs, self.rank, n)
        responses, greedy = generated["actor_gen"], generated.get("actor_greedy_gen")
        t_gen = time.perf_counter()
        scores = torch.tensor(
            [self.task.score(p, r) for p, r in zip(prompts, responses, strict=True)], dtype=torch.float32
        )
        width = max(1, max(len(r) for r in responses))
        response_ids, response_mask = (
            t.to(self.device) for t in pad_ids(responses, tok.pad_token_id, "right", width)
        )
        batch = RolloutBatch(
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            torch.arange(n, device=self.device),
            torch.as_tensor(groups, device=self.device),
        )

        inferred = self.infer(plan, batch)
        batch.old_log_probs = inferred["actor_infer"]
        batch.ref_log_probs = inferred["ref_infer"]
        batch.values = inferred.get("critic_infer")
        if "reward_infer" in inferred:  # the reward model's value at each response's last token
            scores = inferred["reward_infer"][:, 0]
        t_infer = time.perf_counter()

        mask = response_mask.float()
        metrics: dict[str, float] = {}
        advantages, returns, extra = self.compute_advantages(
            scores, mask, batch.old_log_probs, batch.ref_log_probs, batch.values, groups, greedy, prompts
        )
        batch.scores, batch.advantages, batch.returns = scores, advantages, returns
        metrics.update({k: float(v) for k, v in extra.items()})
        t_adv = time.perf_counter()
        self.last_rollout = batch
        metrics.update(self.update(plan, batch, optimizer))
        t_upd = time.perf_counter()

        lengths = mask.sum(-1)
        tokens = float(batch.attention_mask.sum())
        plens = prompt_mask.sum(-1).float()
        metrics.update(
            {
                "critic/score/mean": float(scores.mean()),
                "critic/rewards/mean": float(scores.mean()),
                "critic/advantages/mean": float(losses.masked_mean(advantages, mask)),
                "response_length/mean": float(lengths.mean()),
                "response_length/max": float(lengths.max()),
                "response_length/p95": float(torch.quantile(lengths, 0.95)),
                "prompt_length/mean": float(plens.mean()),
                "task/max_response_len": float(max_new),
                "timing_s/gen": t_gen - t0,
                "timing_s/infer": t_infer - t_gen,
                "timing_s/adv": t_adv - t_infer,
                "timing_s/update_actor": t_upd - t_adv,
                "timing_s/step": t_upd - t0,
                "perf/total_num_tokens": tokens,
                # verl: tokens per second per GPU (the GPUs this step's plan used)
                "perf/throughput": tokens
                / max(t_upd - t0, 1e-9)
                / max(len({g for _, c in plan.items() for g in c.gpus}), 1),
            }
        )
        return metrics

    def compute_advantages(
        self,
        scores: Tensor,
        mask: Tensor,
        old_lp: Tensor,
        ref_lp: Tensor,
        values: Tensor | None,
        groups: Sequence[int],
        greedy: list[list[int]] | None,
        prompts: Sequence[Sequence[int]],
    ) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        """PPO: in-reward KL penalty then GAE (whitened)."""
        hp = self.hparams
        rewards = adv.scores_to_token_rewards(scores, mask)
        rewards, kl_metrics = adv.apply_kl_penalty(rewards, old_lp, ref_lp, mask, hp.kl_coef, "kl")
        a, r = adv.gae_advantages(rewards, values, mask, hp.gamma, hp.lam, whiten=True)
        return a, r, kl_metrics

    def actor_loss(
        self, lp: Tensor, old_lp: Tensor, ref_lp: Tensor, a: Tensor, mask: Tensor
    ) -> tuple[Tensor, dict[str, Tensor]]:
        """Clipped policy loss (token-mean over ``mask``) plus optional entropy bonus / KL loss."""
        loss, m = losses.policy_loss(lp, old_lp, a, mask, clip_eps=self.hparams.clip_ratio)
        return loss, m

    def role_models(self) -> dict[str, torch.nn.Module | None]:
        """The logical model of each role."""
        return {
            "actor": self.actor,
            "reference": self.reference,
            "critic": self.critic,
            "reward": self.reward,
        }

    # ---- how a model-stage computes on this rank ------------------------------------------------
    def stage_model(self, model_stage: str, model: torch.nn.Module | None = None) -> torch.nn.Module:
        """The transformers-style model ``model_stage`` computes with here: a
        :class:`~nereus_lightning.models.generation.ShardedGenerator` over this rank's unit of the
        stage, or the logical ``model`` itself (the ``"full"`` state backend's Layout(1, 1) stages)."""
        unit = self.units.get(model_stage)
        if unit is None:
            require(
                model is not None, "model_stage", f"{model_stage}: no unit on rank {self.rank} and no model"
            )
            return model
        held = self._adapters.get(model_stage)
        if held is None or held.unit is not unit:  # a new plan built new units
            from nereus_lightning.models.generation import ShardedGenerator

            held = self._adapters[model_stage] = ShardedGenerator(unit)
        return held

    def rollout_engine(self, model_stage: str) -> RolloutEngine:
        """The rollout engine of a generation model-stage (``rollout_engine``: ``"hf"`` or ``"vllm"``)."""
        tok = self.tokenizer
        if self.hparams.rollout_engine == "vllm":
            return VLLMEngine(self.stage_model(model_stage, self.actor))
        return HFGenerateEngine(self.stage_model(model_stage, self.actor), tok.eos_token_id, tok.pad_token_id)

    def infer(self, plan: Plan, batch: RolloutBatch) -> dict[str, Tensor]:
        """The inference model-stages over the batch, each rank running those it holds units of (so
        model-stages on disjoint ranks run at once), then one exchange: ``[n, R]`` response
        log-probs (``actor_infer``, ``ref_infer``) or values (``critic_infer``), ``[n, 1]`` scores
        (``reward_infer``), for every sample on every rank."""
        jobs = []
        for stage, model in (
            ("actor_infer", self.actor),
            ("ref_infer", self.reference),
            ("critic_infer", self.critic),
            ("reward_infer", self.reward),
        ):
            if model is not None:
                role = self.stages_role(stage)
                width = 1 if role == "reward" else batch.response_ids.shape[-1]
                jobs.append(RowsJob(stage, width, partial(self._infer_slot, role, model, batch)))
        return run_stages_rows(plan, jobs, self.rank, len(batch), self.device)

    def _infer_slot(self, role: str, model: torch.nn.Module, batch: RolloutBatch, slot: StageSlot) -> Tensor:
        """One replica's rows of an inference model-stage (see :meth:`infer`)."""
        part = batch.select(slice(slot.start, slot.stop))
        net = self.stage_model(slot.stage, model)
        args = (part.prompt_ids, part.prompt_mask, part.response_ids, part.response_mask)
        with torch.no_grad():
            if role == "reward":
                return ModelReward(net)(*args).unsqueeze(-1)
            if role == "critic":
                return response_values(net, *args)
            return response_log_probs(net, *args, temperature=self.hparams.temperature)[0]

    # ---- training stage ------------------------------------------------------------------
    def update(self, plan: Plan, batch: RolloutBatch, optimizer: Any = None) -> dict[str, float]:
        """Actor (and critic) updates on this rank's slice; gradients summed over all replicas."""
        hp = self.hparams
        opt = optimizer if optimizer is not None else self.optimizers()
        raw = getattr(opt, "optimizer", opt)
        mask = batch.response_mask.float()
        minis = [(lo, hi) for lo, hi in _chunks(len(batch), hp.mini_batches)]
        sums: dict[str, float] = {}
        updates = 0
        for _epoch in range(hp.ppo_epochs):
            for lo, hi in minis:
                total_tokens = mask[lo:hi].sum().clamp_min(1.0)
                opt.zero_grad(set_to_none=True)
                part = {}
                for stage in ("actor_train", "critic_train"):
                    if stage not in plan:
                        continue
                    slot = slot_of(plan, stage, self.rank, hi - lo)
                    if not slot.active or slot.stop <= slot.start:
                        continue
                    rows = slice(lo + slot.start, lo + slot.stop)
                    weight = mask[rows].sum() / total_tokens  # local token-mean -> global token-mean
                    m, reporter = self._train_slice(stage, batch.select(rows), weight, slot.is_leader)
                    if reporter:
                        for k, val in m.items():
                            part[k] = part.get(k, 0.0) + float(val) * float(weight)
                last = _epoch == hp.ppo_epochs - 1 and (lo, hi) == minis[-1]
                if self.emu_state:
                    # Each training stage steps its own EMU-bound AdamW (grads summed over its replicas).
                    for stage in self.units.training_stages():
                        # samples consumed: counted once, in the first epoch over the batch
                        norm = self.units.apply_update(stage, samples=(hi - lo) if _epoch == 0 else 0)
                        if norm is not None and self.rank == plan[stage].gpus[0]:
                            part[f"{self.stages_role(stage)}/grad_norm"] = norm
                    if last:
                        opt.step()  # no gradients there: counts one Lightning step per RL step
                else:
                    params = [p for g in raw.param_groups for p in g["params"]]
                    all_reduce_grads(params)
                    grad_norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
                    sums["actor/grad_norm"] = sums.get("actor/grad_norm", 0.0) + float(grad_norm)
                    if last:
                        opt.step()  # counts one Lightning step per RL step
                    else:
                        raw.step()
                updates += 1
                for k, val in _sum_over_ranks(part).items():
                    sums[k] = sums.get(k, 0.0) + val
                if self.emu_state:
                    self.units.sync_weights()  # actor_train -> actor_gen / actor_infer, critic likewise
                else:
                    self.units.refresh("actor", self.actor)  # weight sync into the actor's other units
                    if self.critic is not None:
                        self.units.refresh("critic", self.critic)
        return {k: v / updates for k, v in sums.items()}

    def stages_role(self, model_stage: str) -> str:
        """The role model (``actor``, ``critic``, ...) ``model_stage`` runs."""
        from nereus_lightning.lightning.units import role_of

        return role_of(model_stage, self.algorithm) or model_stage

    def _train_slice(
        self, stage: str, part: RolloutBatch, weight: Tensor, leader: bool
    ) -> tuple[dict[str, Tensor], bool]:
        """Backward of one replica's slice into its gradients; returns (metrics, whether this rank reports them).

        Through this rank's unit: :func:`~nereus_lightning.models.train_step` (1F1B over the
        pipeline) with the response entries :func:`~nereus_lightning.rl.forward.response_span`
        picks; without one (``"full"`` backend, Layout(1, 1)): :mod:`nereus_lightning.rl.forward`
        on the logical model.
        """
        from nereus_lightning.lightning.units import StageUnits
        from nereus_lightning.models import MicroBatch, train_step

        hp = self.hparams
        unit = self.units.get(stage)
        mask = part.response_mask.float()
        span = response_span(part.prompt_ids.shape[-1], part.response_ids.shape[-1])
        args = (part.prompt_ids, part.prompt_mask, part.response_ids, part.response_mask)
        metrics: dict[str, Tensor] = {}

        if stage == "actor_train":
            model = self.actor

            def loss_of(lp: Tensor) -> Tensor:
                loss, m = self.actor_loss(lp, part.old_log_probs, part.ref_log_probs, part.advantages, mask)
                metrics.update(m)
                return loss * weight

            def full_forward() -> Tensor:
                return response_log_probs(model, *args, temperature=hp.temperature)[0]
        else:
            model = self.critic

            def loss_of(v: Tensor) -> Tensor:
                loss, m = losses.value_loss(v, part.values, part.returns, mask, hp.cliprange_value)
                metrics.update(m)
                return loss * weight

            def full_forward() -> Tensor:
                return response_values(model, *args)

        if unit is None:
            loss_of(full_forward()).backward()
            return metrics, leader
        ids, attn = part.sequences, part.attention_mask
        train_step(
            unit,
            [MicroBatch(ids, attn, position_ids_from_mask(attn))],
            lambda out, mb: loss_of(out[:, span]),
            temperature=hp.temperature,
        )
        if not self.emu_state:
            StageUnits.add_grads_to(unit, model)
        return metrics, unit.comm.is_last_stage and unit.comm.tp_rank == 0


def _chunks(n: int, parts: int) -> list[tuple[int, int]]:
    return [b for b in chunk_bounds(n, parts) if b[1] > b[0]]


def _sum_over_ranks(values: dict[str, float]) -> dict[str, float]:
    """Sum per-leader metric parts over the world (every rank gets the totals)."""
    if not torch.distributed.is_initialized():
        return values
    parts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, values)
    out: dict[str, float] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
    return out


class PPOModule(RLModule):
    """PPO: actor, critic, reference and a function reward; GAE advantages; clipped losses."""

    algorithm = "ppo"
    uses_critic = True


class GRPOModule(RLModule):
    """GRPO: several samples per prompt, group-normalised scores as advantages, KL as a loss term."""

    algorithm = "grpo"
    uses_critic = False

    def __init__(
        self, *args: Any, samples_per_prompt: int = 4, kl_coef: float = 0.001, **kwargs: Any
    ) -> None:
        require(
            samples_per_prompt >= 2,
            "algorithm.samples_per_prompt",
            f"GRPO needs >= 2 samples per prompt, got {samples_per_prompt}",
        )
        super().__init__(*args, samples_per_prompt=samples_per_prompt, kl_coef=kl_coef, **kwargs)

    @override
    def compute_advantages(self, scores, mask, old_lp, ref_lp, values, groups, greedy, prompts):  # noqa: ANN001, ANN201
        a, r = adv.grpo_advantages(scores, mask, groups)
        return a, r, {}

    @override
    def actor_loss(self, lp, old_lp, ref_lp, a, mask):  # noqa: ANN001, ANN201
        loss, m = losses.policy_loss(lp, old_lp, a, mask, clip_eps=self.hparams.clip_ratio)
        kl, km = losses.kl_loss(lp, ref_lp, mask, self.hparams.kl_estimator)
        m.update(km)
        return loss + self.hparams.kl_coef * kl, m


class ReMaxModule(RLModule):
    """ReMax: REINFORCE with the greedy response's reward as the baseline (no critic)."""

    algorithm = "remax"
    uses_critic = False

    @override
    def compute_advantages(self, scores, mask, old_lp, ref_lp, values, groups, greedy, prompts):  # noqa: ANN001, ANN201
        base = torch.tensor(
            [self.task.score(p, g) for p, g in zip(prompts, greedy, strict=True)], dtype=torch.float32
        )
        rewards = adv.scores_to_token_rewards(scores, mask)
        rewards, kl_metrics = adv.apply_kl_penalty(rewards, old_lp, ref_lp, mask, self.hparams.kl_coef, "kl")
        a, r = adv.remax_advantages(rewards, base, mask)
        kl_metrics["critic/baseline/mean"] = base.mean()
        return a, r, kl_metrics
