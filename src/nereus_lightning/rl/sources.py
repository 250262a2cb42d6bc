"""Where an RL step's prompts come from and how its samples are scored: a user's data or a built-in task.

Both kinds of source answer the same :class:`PromptSource` questions, so the RL module does not
care which it has: the step's prompts (the same on every rank), the generation budget, the scores
of a slice of samples (each rank scores its own slice, so each sample is scored once in the whole
job) and a resumable state.

- :class:`DataSource`: prompts from parquet/jsonl files (:mod:`nereus_lightning.rl.data`), scored
  by a ``compute_score`` reward function (:mod:`nereus_lightning.rl.reward_function`) on the
  decoded response.
- :class:`TaskSource`: a built-in or hand-written task object (``prompts(step, n, k)``,
  ``score(prompt_ids, response_ids)``, ``max_response_len(step)``, ``tokenizer``), e.g. the
  embedded default's repeat task, scored on token ids.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from nereus_lightning.rl.data import Prompt, PromptData, PromptStream
from nereus_lightning.rl.reward_function import (
    RewardFunction,
    RewardInput,
    RewardResult,
    RewardSpec,
)
from nereus_lightning.spec.errors import NereusConfigError, require


@dataclass(frozen=True)
class Sample:
    """One response to score: its position in the step (``index``), its prompt and its token ids."""

    index: int
    prompt: Prompt
    response_ids: tuple[int, ...]


class PromptSource(Protocol):
    """What the RL module asks of its prompts and rewards."""

    tokenizer: Any

    def prompts(self, step: int, num_prompts: int) -> list[Prompt]:
        """The step's prompts (advances a data stream)."""
        ...

    def max_response_len(self, step: int) -> int:
        """Generation budget at ``step``."""
        ...

    def mean_prompt_len(self) -> float:
        """Mean prompt length in tokens (what the planner prices)."""
        ...

    def score(self, samples: Sequence[Sample]) -> list[RewardResult]:
        """One result per sample, never raising (errors are kept in the results)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """Resumable state (JSON types)."""
        ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        ...


def decode(tokenizer: Any, ids: Sequence[int]) -> str:
    """The response text a reward reads: special tokens (eos, pad) dropped."""
    return tokenizer.decode(list(ids), skip_special_tokens=True)


class DataSource:
    """Prompts from a :class:`~nereus_lightning.rl.data.PromptStream`, scored by a reward function."""

    def __init__(
        self, stream: PromptStream, tokenizer: Any, reward: RewardFunction, max_response_length: int
    ) -> None:
        require(
            max_response_length >= 1,
            "data.max_response_length",
            f"must be >= 1, got {max_response_length}",
        )
        self.stream = stream
        self.tokenizer = tokenizer
        self.reward = reward
        self.max_response_length = max_response_length

    def prompts(self, step: int, num_prompts: int) -> list[Prompt]:
        """The next ``num_prompts`` prompts of the stream."""
        return self.stream.take(num_prompts)

    def max_response_len(self, step: int) -> int:
        """``data.max_response_length``."""
        return self.max_response_length

    def mean_prompt_len(self) -> float:
        """Mean over the data's prompts."""
        prompts = self.stream.data.prompts
        return sum(len(p.ids) for p in prompts) / len(prompts)

    def score(self, samples: Sequence[Sample]) -> list[RewardResult]:
        """``compute_score(data_source, solution_str, ground_truth, extra_info)`` of every sample."""
        return self.reward(
            [
                RewardInput(
                    s.index,
                    s.prompt.data_source,
                    decode(self.tokenizer, s.response_ids),
                    s.prompt.ground_truth,
                    s.prompt.extra_info,
                )
                for s in samples
            ]
        )

    def state_dict(self) -> dict[str, Any]:
        """The stream's position."""
        return {"stream": self.stream.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore the stream's position."""
        self.stream.load_state_dict(state["stream"])


class TaskSource:
    """A task object (prompts by step, scores over token ids) as a :class:`PromptSource`."""

    def __init__(self, task: Any) -> None:
        missing = [m for m in ("prompts", "score", "max_response_len", "tokenizer") if not hasattr(task, m)]
        if missing:
            raise NereusConfigError(
                f"task: {type(task).__name__} lacks {missing}; a task needs prompts(step, n, k), "
                "score(prompt_ids, response_ids), max_response_len(step) and tokenizer "
                "(or use data.train_files with a reward function)"
            )
        self.task = task
        self.tokenizer = task.tokenizer

    def prompts(self, step: int, num_prompts: int) -> list[Prompt]:
        """The task's prompts of ``step``, indexed by their position in the step."""
        ids, _ = self.task.prompts(step, num_prompts, 1)
        return [Prompt(index=i, ids=tuple(p)) for i, p in enumerate(ids)]

    def max_response_len(self, step: int) -> int:
        """The task's budget at ``step``."""
        return int(self.task.max_response_len(step))

    def mean_prompt_len(self) -> float:
        """Mean over the first step's prompts."""
        ids, _ = self.task.prompts(0, 8, 1)
        return sum(len(p) for p in ids) / max(len(ids), 1)

    def score(self, samples: Sequence[Sample]) -> list[RewardResult]:
        """The task's score of every sample (a failure is kept with the sample's index)."""
        out = []
        for s in samples:
            try:
                out.append(RewardResult(float(self.task.score(list(s.prompt.ids), list(s.response_ids)))))
            except Exception as exc:
                out.append(
                    RewardResult(
                        math.nan,
                        error=f"{type(self.task).__name__}.score raised on sample {s.index}: "
                        f"{type(exc).__name__}: {exc}",
                    )
                )
        return out

    def state_dict(self) -> dict[str, Any]:
        """A task draws its prompts by step: nothing to keep."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Nothing to restore."""


def builtin_reward_covers(data: PromptData) -> None:
    """Refuse, before training, data whose sources have no built-in reward (when no custom one is set)."""
    from nereus_lightning.rl.verifiers import BUILTIN_BY_SOURCE

    uncovered = sorted(
        {
            p.data_source
            for p in data.prompts
            if not any(n in p.data_source.lower() for n, _ in BUILTIN_BY_SOURCE)
        }
    )
    if uncovered:
        raise NereusConfigError(
            f"custom_reward_function.path: no built-in reward for data_source {uncovered} "
            f"(built in: sources containing {[n for n, _ in BUILTIN_BY_SOURCE]}); write "
            "compute_score(data_source, solution_str, ground_truth, extra_info) in a file and set "
            "custom_reward_function.path=that_file.py"
        )


def reward_function(
    spec: RewardSpec | Callable[..., Any] | None,
    data: PromptData,
    num_workers: int = 0,
    timeout_s: float | None = None,
) -> RewardFunction:
    """The reward of ``spec`` (a spec or a callable), else the data source's built-in one (checks data)."""
    if spec is None:
        builtin_reward_covers(data)
        spec = RewardSpec()
    return RewardFunction(spec, num_workers, timeout_s)
