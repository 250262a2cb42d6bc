"""The prompt sources of an RL module: the user's data (tokenizer from the model folder) or a built-in task.

Everything here is checked where the module is built, in the launching process, before any rank
starts: missing files and columns, a reward that does not import or has the wrong signature, a
model folder without prompt data.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nereus_lightning.lightning.roles import is_model_folder, load_tokenizer
from nereus_lightning.rl.data import DataConfig, PromptData, PromptStream
from nereus_lightning.rl.reward_function import RewardFunction, RewardSpec
from nereus_lightning.rl.sources import (
    DataSource,
    PromptSource,
    TaskSource,
    builtin_reward_covers,
    reward_function,
)
from nereus_lightning.rl.tasks import TASKS, make_task
from nereus_lightning.spec.errors import NereusConfigError, require


@dataclass(frozen=True)
class JobSources:
    """The training source, the validation source (None without ``data.val_files``) and their tokenizer."""

    train: PromptSource
    val: DataSource | None
    tokenizer: Any
    val_data: PromptData | None = None


def reward_spec(value: Any) -> RewardSpec | None:
    """``custom_reward_function`` as given: None, ``"file.py"``,
    ``"module:function"``, a mapping or a spec.
    """
    if value is None or isinstance(value, RewardSpec):
        return value
    if isinstance(value, str):
        return RewardSpec(path=value)
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {"path", "name"})
        require(not unknown, "custom_reward_function", f"unknown key(s) {unknown}; keys: path, name")
        if value.get("path") is None:
            return None
        return RewardSpec(path=str(value["path"]), name=str(value.get("name") or "compute_score"))
    raise NereusConfigError(
        f"custom_reward_function: {type(value).__name__} is not a path, 'module:function' or {{path, name}}"
    )


def make_sources(
    task: Any,
    data: DataConfig | Mapping[str, Any] | None,
    reward: Any,
    reward_workers: int,
    actor: Any,
    seed: int,
    reward_timeout_s: float | None = None,
) -> JobSources:
    """The sources of a job: ``data.train_files`` with a reward function, or the built-in/hand-written
    ``task``.
    """
    config = DataConfig.of(data)
    spec = reward if callable(reward) else reward_spec(reward)
    if config.train_files is None:
        require(
            spec is None,
            "custom_reward_function.path",
            "a reward function scores prompt data; set data.train_files too",
        )
        builtin = isinstance(task, str) or type(task) in TASKS.values()
        require(
            not (builtin and is_model_folder(actor)),
            "data.train_files",
            f"the actor is a model folder ({actor}) but no prompt data is given; the built-in "
            "task speaks the byte tokenizer of the preset models. Set data.train_files "
            "(parquet/jsonl) and, where needed, custom_reward_function.path",
        )
        built = TaskSource(make_task(task, seed=seed))
        return JobSources(built, None, built.tokenizer)
    folder = config.tokenizer or (os.fspath(actor) if is_model_folder(actor) else None)
    if folder is None:
        raise NereusConfigError(
            "data.tokenizer: the actor is a preset, so there is no model folder to take the tokenizer from; "
            "set data.tokenizer=<folder with a tokenizer>"
        )
    tokenizer = load_tokenizer(folder)
    train = PromptData.load(config.train_files, tokenizer, config.prompt_key, config.max_prompt_length)
    val = (
        PromptData.load(
            config.val_files, tokenizer, config.prompt_key, config.max_prompt_length, key="data.val_files"
        )
        if config.val_files is not None
        else None
    )
    # One reward for both splits; the built-in one must cover the data sources of each.
    fn: RewardFunction = reward_function(spec, train, reward_workers, reward_timeout_s)
    if val is not None and spec is None:
        builtin_reward_covers(val)
    stream = PromptStream(train, shuffle=config.shuffle, seed=seed)
    source = DataSource(stream, tokenizer, fn, config.max_response_length)
    val_source = (
        DataSource(PromptStream(val, shuffle=False), tokenizer, fn, config.max_response_length)
        if val is not None
        else None
    )
    return JobSources(source, val_source, tokenizer, val)
