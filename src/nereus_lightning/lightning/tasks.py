"""Task lookup for the RL modules: names resolve to the built-in tasks of :mod:`nereus_lightning.rl`.

A task gives ``prompts(step, num_prompts, samples_per_prompt) -> (prompt ids, group ids)``,
``score(prompt, response) -> float``, ``max_response_len(step) -> int`` and ``tokenizer``.
Prompts depend only on ``(seed, step)``: the sampler's state is the step counter, so a resumed
run draws the same prompts as an uninterrupted one whatever its world size.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from nereus_lightning.rl.tokenizer import ByteTokenizer
from nereus_lightning.spec.errors import NereusConfigError


@dataclass
class RepeatTask:
    """Prompt ``<bos>c:`` for a letter ``c``; the answer is ``c`` repeated ``L`` times, then eos.

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


TASKS: dict[str, Any] = {"repeat": RepeatTask}


def make_task(task: Any, seed: int = 0) -> Any:
    """A task object from a name (``TASKS``) or pass-through for objects already built."""
    if not isinstance(task, str):
        return task
    try:
        from nereus_lightning.rl import tasks as rl_tasks  # the built-in tasks, when present

        registry = {**TASKS, **getattr(rl_tasks, "TASKS", {})}
    except ImportError:
        registry = dict(TASKS)
    if task not in registry:
        raise NereusConfigError(f"task: unknown task {task!r}; choose one of {', '.join(sorted(registry))}")
    return registry[task](seed=seed)
