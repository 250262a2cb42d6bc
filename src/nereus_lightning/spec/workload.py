"""`Workload` and the RL workflow: which model-stages exist and which run at the same time."""

from __future__ import annotations

from dataclasses import dataclass

from nereus_lightning.spec.errors import require

ALGORITHMS = ("ppo", "grpo", "remax")
STAGES = ("generation", "inference", "training")


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


def _ms(name: str, model: str, stage: str) -> ModelStage:
    return ModelStage(name, model, stage, trains=stage == "training")


# Model-stages in one stage run concurrently (disjoint GPUs); stages run one after another and
# may share GPUs. The order of this tuple is the tie-break order generation -> inference -> training.
WORKFLOWS: dict[str, tuple[ModelStage, ...]] = {
    "ppo": (
        _ms("actor_gen", "actor", "generation"),
        _ms("actor_infer", "actor", "inference"),
        _ms("ref_infer", "reference", "inference"),
        _ms("critic_infer", "critic", "inference"),
        _ms("reward_infer", "reward", "inference"),
        _ms("actor_train", "actor", "training"),
        _ms("critic_train", "critic", "training"),
    ),
    "grpo": (
        _ms("actor_gen", "actor", "generation"),
        _ms("actor_infer", "actor", "inference"),
        _ms("ref_infer", "reference", "inference"),
        _ms("reward_infer", "reward", "inference"),
        _ms("actor_train", "actor", "training"),
    ),
    "remax": (
        _ms("actor_gen", "actor", "generation"),
        _ms("actor_greedy_gen", "actor", "generation"),
        _ms("actor_infer", "actor", "inference"),
        _ms("ref_infer", "reference", "inference"),
        _ms("reward_infer", "reward", "inference"),
        _ms("actor_train", "actor", "training"),
    ),
}


def workflow(algorithm: str) -> tuple[ModelStage, ...]:
    """The model-stages of ``algorithm`` in tie-break order."""
    require(algorithm in WORKFLOWS, "workload.algorithm", f"{algorithm!r} is not one of {list(WORKFLOWS)}")
    return WORKFLOWS[algorithm]


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
    reward_model: bool = True  # False: rewards come from a Python function (no reward_infer model-stage)

    def __post_init__(self) -> None:
        require(
            self.algorithm in ALGORITHMS,
            "workload.algorithm",
            f"{self.algorithm!r} is not one of {list(ALGORITHMS)}",
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
