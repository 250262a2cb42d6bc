"""`Workload` and the RL workflow: which model-stages exist and which run at the same time."""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from nereus_lightning.spec.algorithms import AlgorithmSpec, algorithm_spec
from nereus_lightning.spec.errors import require

STAGES = ("generation", "inference", "training")


@dataclass(frozen=True)
class EngineMemory:
    """How a rollout engine holds GPU memory, as the planner prices it (see :class:`GenerationEngine`)."""

    reserves: bool  # a fixed share of each GPU it runs on, whatever its batch
    paged: bool  # a paged KV cache (a decode step reads each sequence's running context)


#: Rollout engines of the generation model-stages (``algorithm.rollout_engine``), by name; the body's
#: engines are those of :mod:`nereus_lightning.engines.registry` (a test pins the names equal).
ENGINES = {"hf": EngineMemory(reserves=False, paged=False), "vllm": EngineMemory(reserves=True, paged=True)}
#: vLLM's KV-cache block on CUDA, in tokens (what the planner prices when vLLM chooses the block size).
CUDA_BLOCK_SIZE = 16
#: The built-in static decoder's prompt region is a multiple of this many cache slots (the body's
#: ``engines.static.PROMPT_BUCKET``, mirrored: the brain imports no body module; a test pins them equal).
STATIC_PROMPT_BUCKET = 64


@dataclass(frozen=True)
class ModelStage:
    """One model in one stage, e.g. ``actor_train`` = the actor in the training stage."""

    name: str
    model: str  # "actor", "critic", "reference", "reward"
    stage: str  # one of STAGES
    trains: bool = False  # holds gradients and optimizer state

    @property
    def stage_index(self) -> int:
        """Position of the stage in an RL step (generation 0, inference 1, training 2)."""
        return STAGES.index(self.stage)


@dataclass(frozen=True)
class GenerationEngine:
    """The rollout engine of the generation model-stages, with the settings that decide its GPU memory.

    ``hf`` (the built-in engine) allocates the KV cache its batch needs. ``vllm`` takes
    ``gpu_memory_utilization`` of each GPU it runs on (weights, activations and a KV cache cut
    into ``block_size``-token blocks) whatever its batch, and decodes as many sequences at once as
    that cache holds; it admits sequences up to ``max_model_len`` tokens (None: vLLM's default,
    the model's context length) and needs room for one such sequence. The vLLM fields are vLLM's
    own ``LLM`` arguments; the built-in engine ignores them.
    """

    kind: str = "hf"
    gpu_memory_utilization: float = 0.5
    block_size: int | None = None  # None: vLLM's choice for the device (16 tokens on CUDA)
    max_model_len: int | None = None

    def __post_init__(self) -> None:
        require(
            self.kind in ENGINES, "algorithm.rollout_engine", f"{self.kind!r} is not one of {list(ENGINES)}"
        )
        require(
            0 < self.gpu_memory_utilization <= 1,
            "algorithm.vllm.gpu_memory_utilization",
            f"must be in (0, 1], got {self.gpu_memory_utilization}",
        )
        require(
            self.block_size is None or self.block_size >= 1,
            "algorithm.vllm.block_size",
            f"must be >= 1 or null (vLLM's choice), got {self.block_size}",
        )
        require(
            self.max_model_len is None or self.max_model_len >= 1,
            "algorithm.vllm.max_model_len",
            f"must be >= 1 or null (the model's context length), got {self.max_model_len}",
        )

    @classmethod
    def of(cls, kind: str, settings: Mapping[str, Any] | None = None) -> GenerationEngine:
        """Engine ``kind`` with the vLLM settings ``settings`` (``algorithm.vllm``; null: the default)."""
        given = dict(settings or {})
        valid = [f.name for f in fields(cls) if f.name != "kind"]
        unknown = sorted(set(given) - set(valid))
        require(not unknown, "algorithm.vllm", f"unknown setting(s) {unknown}; valid: {', '.join(valid)}")
        return cls(kind, **{k: v for k, v in given.items() if v is not None})

    @property
    def reserves(self) -> bool:
        """Whether the engine takes a fixed share of each GPU (vLLM) rather than what its batch needs."""
        return ENGINES[self.kind].reserves

    @property
    def paged(self) -> bool:
        """Whether the KV cache is paged (vLLM): a decode step reads each sequence's running context,
        not a cache preallocated for the whole rollout."""
        return ENGINES[self.kind].paged

    def cache_tokens(self, prompt_len: float, new_tokens: float) -> float:
        """KV-cache slots one sequence of ``prompt_len`` + ``new_tokens`` tokens holds.

        The built-in static decoder preallocates the whole rollout: the prompt region rounded up
        to :data:`STATIC_PROMPT_BUCKET` slots, then every new token but the last (never fed back).
        vLLM holds whole blocks of what the sequence has.
        """
        new = math.ceil(new_tokens)
        if not self.paged:
            return STATIC_PROMPT_BUCKET * math.ceil(prompt_len / STATIC_PROMPT_BUCKET) + max(new - 1, 0)
        block = self.block_size or CUDA_BLOCK_SIZE
        return math.ceil((prompt_len + new) / block) * block


def _ms(name: str, model: str, stage: str) -> ModelStage:
    return ModelStage(name, model, stage, trains=stage == "training")


def workflow(algorithm: str) -> tuple[ModelStage, ...]:
    """The model-stages of ``algorithm`` (a registered name or alias) in tie-break order.

    Model-stages in one stage run concurrently (disjoint GPUs); stages run one after another and
    may share GPUs. The order is the tie-break order generation -> inference -> training.
    """
    return _workflow(algorithm_spec(algorithm))


@functools.cache
def _workflow(spec: AlgorithmSpec) -> tuple[ModelStage, ...]:
    stages = (
        ("actor_gen", "actor", "generation", True),
        ("actor_greedy_gen", "actor", "generation", spec.greedy_baseline),
        ("actor_infer", "actor", "inference", True),
        ("ref_infer", "reference", "inference", True),
        ("critic_infer", "critic", "inference", spec.critic),
        ("reward_infer", "reward", "inference", True),
        ("actor_train", "actor", "training", True),
        ("critic_train", "critic", "training", spec.critic),
    )
    return tuple(_ms(name, model, stage) for name, model, stage, runs in stages if runs)


def stages_of(algorithm: str) -> dict[str, tuple[ModelStage, ...]]:
    """Model-stages grouped by stage, in execution order (the execution-overlap graph)."""
    grouped: dict[str, tuple[ModelStage, ...]] = {}
    for stage in STAGES:
        grouped[stage] = tuple(m for m in workflow(algorithm) if m.stage == stage)
    return grouped


@dataclass(frozen=True)
class Workload:
    """One RL step's shape: how many sequences of which lengths go through the workflow."""

    algorithm: str = "ppo"
    prompts_per_step: int = 256
    samples_per_prompt: int = 1
    prompt_len: float = 512  # mean prompt length (tokens; a mean of the task or data, or its bound)
    response_len: float = 1024.0  # mean response length (tokens)
    response_len_p95: float = 0.0  # 0: 1.2 x mean
    ppo_epochs: int = 1
    mini_batches: int = 1  # optimizer steps per epoch
    micro_batch_min: int = 1
    micro_batch_max: int = 16
    # Whether a reward model scores responses (a reward_infer model-stage); False: a Python function.
    # True here is the paper's workflow; nereus-plan and nereus-train set it from whether one is configured.
    reward_model: bool = True
    generation_engine: GenerationEngine = GenerationEngine()  # what the generation model-stages run on
    # Generation rounds per step: more than 1 under dynamic sampling (DAPO's filter_groups), which
    # generates the batch again until enough groups carry signal; the trainer reports the mean it sees.
    generation_rounds: float = 1.0

    def __post_init__(self) -> None:
        algorithm_spec(self.algorithm)  # an unknown name fails here, naming the known ones
        require(
            self.generation_rounds >= 1,
            "workload.generation_rounds",
            f"must be >= 1, got {self.generation_rounds}",
        )
        for field in (
            "prompts_per_step",
            "samples_per_prompt",
            "ppo_epochs",
            "mini_batches",
            "micro_batch_min",
        ):
            require(
                getattr(self, field) >= 1, f"workload.{field}", f"must be >= 1, got {getattr(self, field)}"
            )
        require(self.prompt_len >= 0, "workload.prompt_len", f"must be >= 0, got {self.prompt_len}")
        require(self.response_len > 0, "workload.response_len", f"must be positive, got {self.response_len}")
        require(
            self.response_len_p95 >= 0,
            "workload.response_len_p95",
            f"must be >= 0, got {self.response_len_p95}",
        )
        require(
            self.micro_batch_max >= self.micro_batch_min,
            "workload.micro_batch_max",
            f"{self.micro_batch_max} < micro_batch_min={self.micro_batch_min}",
        )
        if self.response_len_p95 == 0:
            object.__setattr__(self, "response_len_p95", 1.2 * self.response_len)
        require(
            self.response_len_p95 >= self.response_len,
            "workload.response_len_p95",
            f"{self.response_len_p95} is below the mean response_len={self.response_len}",
        )

    @property
    def sequences_per_step(self) -> int:
        """Sequences generated and trained on per step."""
        return self.prompts_per_step * self.samples_per_prompt

    @property
    def stages(self) -> tuple[ModelStage, ...]:
        """The model-stages of this workload's algorithm (without ``reward_infer`` for a function reward)."""
        stages = workflow(self.algorithm)
        return stages if self.reward_model else tuple(m for m in stages if m.model != "reward")
