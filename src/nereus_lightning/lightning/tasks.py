"""Task lookup for the RL modules: names resolve to the built-in tasks of :mod:`nereus_lightning.rl.tasks`.

A task gives ``prompts(step, num_prompts, samples_per_prompt) -> (prompt ids, group ids)``,
``score(prompt, response) -> float``, ``max_response_len(step) -> int`` and ``tokenizer``
(see :class:`~nereus_lightning.rl.tasks.DenseRepeatTask`, the ``"repeat"`` task).
"""

from __future__ import annotations

from typing import Any

from nereus_lightning.rl.tasks import TASKS
from nereus_lightning.rl.tasks import DenseRepeatTask as RepeatTask  # the name configs and users import
from nereus_lightning.spec.errors import NereusConfigError

__all__ = ["TASKS", "RepeatTask", "make_task"]


def make_task(task: Any, seed: int = 0) -> Any:
    """A task object from a name (``rl.tasks.TASKS``) or pass-through for objects already built."""
    if not isinstance(task, str):
        return task
    if task not in TASKS:
        raise NereusConfigError(f"task: unknown task {task!r}; choose one of {', '.join(sorted(TASKS))}")
    return TASKS[task](seed=seed)
