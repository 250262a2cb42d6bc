"""Built-in verifiable task of the embedded default, its resumable prompt sampler and its reward.

The repeat task: the prompt ``"5*b="`` asks for the symbol ``b`` five times. The reward is the
length of the correct prefix over ``count``, so partial answers earn partial credit; with
``require_eos`` the response must also stop right there (one more point, over ``count + 1``).
A curriculum raises ``count`` once the policy masters the current one and the generation budget
follows it, so responses grow as the policy learns (the embedded default's sequence-length
drift).

:class:`RepeatTask` (text prompts, :class:`PromptSampler`) is the one-process reference loop's.
:class:`DenseRepeatTask` is the token-level variant the Lightning modules and ``nereus-train``
train on (``TASKS["repeat"]``, built by name with :func:`make_task`): prompts by RL step, a dense
per-token credit a randomly initialised tiny model climbs within a few dozen steps.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nereus_lightning.rl.tokenizer import ByteTokenizer
from nereus_lightning.spec.errors import NereusConfigError, require

_PROMPT = re.compile(r"^(\d+)\*(.)=$", re.DOTALL)


def repeat_prompt(symbol: str, count: int) -> str:
    """The prompt text asking for ``symbol`` repeated ``count`` times."""
    # the symbol sits right before '=' so its distance to the answer does not depend on the digits
    return f"{count}*{symbol}="


def parse_repeat_prompt(prompt: str) -> tuple[str, int]:
    """``(symbol, count)`` of a repeat-task prompt; a clear error for anything else."""
    match = _PROMPT.match(prompt)
    if match is None:
        raise NereusConfigError(f"repeat task: prompt {prompt!r} is not of the form '<count>*<symbol>='")
    return match.group(2), int(match.group(1))


def repeat_reward(prompts: Sequence[str], responses: Sequence[str], require_eos: bool = False) -> list[float]:
    """Score of each response in [0, 1]: correct prefix length / count.

    With ``require_eos``: (correct prefix length + 1 if the response is exactly the target) /
    (count + 1); ``responses`` are the decoded texts up to (not including) eos, so a response
    equal to the target is one that stopped right after the last symbol.
    """
    require(
        len(prompts) == len(responses), "responses", f"{len(responses)} responses for {len(prompts)} prompts"
    )
    scores = []
    for prompt, response in zip(prompts, responses, strict=False):
        symbol, count = parse_repeat_prompt(prompt)
        prefix = 0
        while prefix < min(count, len(response)) and response[prefix] == symbol:
            prefix += 1
        if require_eos:
            scores.append((prefix + (response == symbol * count)) / (count + 1))
        else:
            scores.append(prefix / count)
    return scores


@dataclass(frozen=True)
class TaskPrompt:
    """One prompt of the stream: its global ``index`` (position in the stream) and its text."""

    index: int
    text: str


@dataclass(frozen=True)
class RepeatTask:
    """The repeat task's knobs.

    Attributes:
        alphabet: symbols a prompt may ask for.
        start_count: repeat count at step 0.
        max_count: the curriculum stops here.
        count_spread: prompts ask for a count drawn from ``[count - spread, count]``.
        raise_at: mean reward at or above which a step counts towards raising the count.
        patience: that many such steps in a row raise the count by one.
        require_eos: the response must stop (eos) right after the last symbol.
        slack: with ``require_eos``, tokens allowed beyond ``count + 1`` before generation is cut.
    """

    alphabet: str = "ab"
    start_count: int = 2
    max_count: int = 32
    count_spread: int = 0
    raise_at: float = 0.8
    patience: int = 3
    require_eos: bool = False
    slack: int = 1

    def __post_init__(self) -> None:
        require(len(self.alphabet) > 0, "task.alphabet", "must hold at least one symbol")
        require(
            all(len(c.encode()) == 1 and c not in "*=" for c in self.alphabet),
            "task.alphabet",
            f"{self.alphabet!r}: symbols must be single-byte characters other than '*' and '='",
        )
        require(
            1 <= self.start_count <= self.max_count,
            "task.start_count",
            f"need 1 <= start_count ({self.start_count}) <= max_count ({self.max_count})",
        )
        require(
            0 <= self.count_spread < self.start_count,
            "task.count_spread",
            f"must be in [0, start_count), got {self.count_spread}",
        )
        require(self.patience >= 1, "task.patience", f"must be >= 1, got {self.patience}")
        require(self.slack >= 0, "task.slack", f"must be >= 0, got {self.slack}")

    def reward(self, prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        """:func:`repeat_reward` with this task's ``require_eos``."""
        return repeat_reward(prompts, responses, self.require_eos)


class PromptSampler:
    """A seeded, resumable stream of repeat-task prompts with its curriculum.

    Prompt ``i`` depends only on ``(seed, i)`` and the curriculum's count when it is drawn, so the
    stream is the same whatever DP layout consumes it. ``state_dict`` (position, count, streak) is
    part of the run's logical state: save it with the checkpoint. Every rank must feed
    :meth:`observe` the same (globally reduced) mean reward so that curricula stay in step.
    """

    def __init__(self, task: RepeatTask | None = None, seed: int = 0) -> None:
        self.task = task or RepeatTask()
        self.seed = seed
        self.position = 0
        self.count = self.task.start_count
        self.streak = 0

    @property
    def max_new_tokens(self) -> int:
        """Generation budget for the current count: the symbols (plus eos and slack with ``require_eos``)."""
        return self.count + 1 + self.task.slack if self.task.require_eos else self.count

    def prompt_at(self, index: int) -> TaskPrompt:
        """The prompt at global stream position ``index`` under the current count."""
        rng = random.Random(f"nereus-repeat:{self.seed}:{index}")
        symbol = rng.choice(self.task.alphabet)
        count = self.count - rng.randint(0, self.task.count_spread)
        return TaskPrompt(index, repeat_prompt(symbol, count))

    def next_prompts(self, n: int) -> list[TaskPrompt]:
        """The next ``n`` prompts of the stream (advances the position)."""
        require(n >= 0, "n", f"must be >= 0, got {n}")
        prompts = [self.prompt_at(self.position + i) for i in range(n)]
        self.position += n
        return prompts

    def observe(self, mean_reward: float) -> bool:
        """Feed one step's mean reward; returns True when the count was raised."""
        self.streak = self.streak + 1 if mean_reward >= self.task.raise_at else 0
        if self.streak >= self.task.patience and self.count < self.task.max_count:
            self.count += 1
            self.streak = 0
            return True
        return False

    def state_dict(self) -> dict[str, Any]:
        """Position in the stream and curriculum state."""
        return {"seed": self.seed, "position": self.position, "count": self.count, "streak": self.streak}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; the seed must match the one this sampler was built with."""
        require(
            state.get("seed") == self.seed,
            "sampler.seed",
            f"checkpoint was drawn with seed {state.get('seed')}, this sampler has {self.seed}",
        )
        self.position = int(state["position"])
        self.count = int(state["count"])
        self.streak = int(state["streak"])


@dataclass
class DenseRepeatTask:
    """Token-level repeat task of the Lightning modules: prompt ``<bos>c:``, answer ``c`` x ``L``, then eos.

    ``c`` is a letter; the answer repeats it ``L`` times.

    ``L`` grows from ``start_len`` by one every ``grow_every`` steps up to ``max_len``: responses
    grow as training goes on (the sequence-length drift of the embedded default). The score is
    the mean over response tokens (eos excluded) of ``0.5 * [t == c] + 0.5 * closeness(t, c)``,
    where closeness falls linearly from 1 at ``c`` to 0 at 32 byte values away: a dense signal
    that a randomly initialised tiny model can climb.
    """

    letters: str = "abcd"
    start_len: int = 4
    max_len: int = 24
    grow_every: int = 10
    seed: int = 0
    tokenizer: ByteTokenizer = field(default_factory=ByteTokenizer)

    def target_len(self, step: int) -> int:
        """The answer length at ``step``."""
        return min(self.max_len, self.start_len + step // max(self.grow_every, 1))

    def max_response_len(self, step: int) -> int:
        """Generation budget at ``step`` (the answer, eos, and two tokens of slack)."""
        return self.target_len(step) + 3

    def prompts(
        self, step: int, num_prompts: int, samples_per_prompt: int = 1
    ) -> tuple[list[list[int]], list[int]]:
        """``num_prompts * samples_per_prompt`` prompts (samples of one prompt adjacent) and group ids."""
        rng = random.Random(self.seed * 7919 + step)
        out, groups = [], []
        for g in range(num_prompts):
            letter = rng.choice(self.letters)
            ids = [self.tokenizer.bos_token_id, *self.tokenizer.encode(f"{letter}:")]
            out.extend([list(ids) for _ in range(samples_per_prompt)])
            groups.extend([g] * samples_per_prompt)
        return out, groups

    def score(self, prompt: Sequence[int], response: Sequence[int], step: int | None = None) -> float:
        """Mean per-token credit in [0, 1] (0 for an empty response)."""
        letter = prompt[1]
        body = [t for t in response if t != self.tokenizer.eos_token_id]
        if not body:
            return 0.0
        credit = [0.5 * (t == letter) + 0.5 * max(0.0, 1.0 - abs(t - letter) / 32.0) for t in body]
        return sum(credit) / len(body)


# Tasks by name, as the Lightning modules and `nereus-train` ``task=...`` look them up.
TASKS: dict[str, Any] = {"repeat": DenseRepeatTask}


def make_task(task: Any, seed: int = 0) -> Any:
    """A task object from a name (:data:`TASKS`) or pass-through for objects already built."""
    if not isinstance(task, str):
        return task
    if task not in TASKS:
        raise NereusConfigError(f"task: unknown task {task!r}; choose one of {', '.join(sorted(TASKS))}")
    return TASKS[task](seed=seed)
