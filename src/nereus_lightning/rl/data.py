"""Prompt data in verl's format: parquet or jsonl files of prompts with ground truths, tokenised once.

A row holds a prompt (``data.prompt_key``: a string, or a list of chat messages that goes through
the tokenizer's chat template with the generation prompt on), its ground truth (the
``reward_model.ground_truth`` struct field, as verl's preprocessing writes it, or a ``ground_truth``
column), and optionally ``data_source`` and ``extra_info``, which pass through to the reward.
Files are read with pyarrow. :class:`PromptStream` hands out prompts epoch by epoch in a seeded
order; its position is the whole of its state, so a resumed run, under any world size, uses every
prompt of an epoch exactly once.
"""

from __future__ import annotations

import json
import logging
import os
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nereus_lightning.spec.errors import NereusConfigError, require

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Prompt:
    """One prompt of a step: its position in the data (``index``), token ids and what the reward reads."""

    index: int
    ids: tuple[int, ...]
    ground_truth: Any = None
    data_source: str = ""
    extra_info: Mapping[str, Any] = field(default_factory=dict)


def _paths(files: str | Sequence[str], key: str) -> list[str]:
    paths = [files] if isinstance(files, str) else [str(f) for f in files]
    require(len(paths) > 0, key, "no file given; set one path or a list of paths (parquet or jsonl)")
    for path in paths:
        if not os.path.isfile(path):
            raise NereusConfigError(f"{key}: {path!r} does not exist (give parquet or jsonl files)")
        if not path.endswith((".parquet", ".jsonl", ".json")):
            raise NereusConfigError(f"{key}: {path!r} is neither .parquet nor .jsonl")
    return paths


def read_rows(files: str | Sequence[str], key: str = "data.train_files") -> list[dict[str, Any]]:
    """Every row of the parquet/jsonl ``files`` as a dict (pyarrow), in file order."""
    import pyarrow.json as pj
    import pyarrow.parquet as pq

    rows: list[dict[str, Any]] = []
    for path in _paths(files, key):
        try:
            table = pq.read_table(path) if path.endswith(".parquet") else pj.read_json(path)
        except Exception as exc:  # pyarrow's errors name the byte, not the file
            raise NereusConfigError(f"{key}: cannot read {path!r}: {exc}") from exc
        rows.extend(table.to_pylist())
    require(len(rows) > 0, key, f"{files} hold no rows")
    return rows


def _ground_truth(row: Mapping[str, Any]) -> Any:
    reward = row.get("reward_model")
    if isinstance(reward, Mapping) and "ground_truth" in reward:
        return reward["ground_truth"]
    return row.get("ground_truth")


def _extra_info(row: Mapping[str, Any]) -> dict[str, Any]:
    extra = row.get("extra_info")
    if isinstance(extra, str):  # jsonl writers sometimes store it as a JSON string
        try:
            extra = json.loads(extra)
        except json.JSONDecodeError:
            return {"text": extra}
    return dict(extra) if isinstance(extra, Mapping) else {}


def encode_prompt(tokenizer: Any, prompt: Any, key: str) -> list[int]:
    """Token ids of one prompt: chat messages through the chat template (generation prompt on), text as is."""
    if isinstance(prompt, str):
        return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
    if isinstance(prompt, Sequence) and all(isinstance(m, Mapping) and "content" in m for m in prompt):
        if getattr(tokenizer, "chat_template", None) is None:
            raise NereusConfigError(
                f"{key}: the prompts are chat messages but the tokenizer has no chat template; "
                "give a tokenizer with one (data.tokenizer=...) or plain-text prompts"
            )
        messages = [{"role": m.get("role", "user"), "content": m["content"]} for m in prompt]
        out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(out, Mapping):  # transformers 5 returns a BatchEncoding
            out = out["input_ids"]
        return list(out)
    raise NereusConfigError(
        f"{key}: a prompt must be a string or a list of {{role, content}} messages, "
        f"got {type(prompt).__name__}"
    )


@dataclass(frozen=True)
class PromptData:
    """Tokenised prompts of one split, with the reward's inputs; rows too long are dropped (and counted)."""

    prompts: tuple[Prompt, ...]
    filtered: int = 0

    def __len__(self) -> int:
        return len(self.prompts)

    @classmethod
    def load(
        cls,
        files: str | Sequence[str],
        tokenizer: Any,
        prompt_key: str = "prompt",
        max_prompt_length: int | None = None,
        key: str = "data.train_files",
    ) -> PromptData:
        """Read, tokenise and filter ``files`` (see the module docstring for the row format)."""
        rows = read_rows(files, key)
        if prompt_key not in rows[0]:
            raise NereusConfigError(
                f"data.prompt_key: no column {prompt_key!r} in {files}; its columns are {sorted(rows[0])}"
            )
        prompts, filtered = [], 0
        for index, row in enumerate(rows):
            ids = encode_prompt(tokenizer, row[prompt_key], f"{key} row {index}")
            if max_prompt_length is not None and len(ids) > max_prompt_length:
                filtered += 1
                continue
            prompts.append(
                Prompt(
                    index=index,
                    ids=tuple(ids),
                    ground_truth=_ground_truth(row),
                    data_source=str(row.get("data_source") or ""),
                    extra_info=_extra_info(row),
                )
            )
        if filtered:
            log.info(
                "%s: %d of %d prompts are longer than data.max_prompt_length=%s tokens and were dropped",
                key,
                filtered,
                len(rows),
                max_prompt_length,
            )
        require(
            len(prompts) > 0,
            "data.max_prompt_length",
            f"every prompt of {files} is longer than {max_prompt_length} tokens; raise it",
        )
        return cls(tuple(prompts), filtered)


class PromptStream:
    """Prompts epoch after epoch, each epoch a seeded permutation (or file order without ``shuffle``).

    ``position`` counts the prompts handed out so far and is the stream's whole state: epoch
    ``position // len(data)``, offset ``position % len(data)``. A step that crosses an epoch's end
    takes the rest of that epoch and the start of the next, so every prompt of each epoch is used
    exactly once, whatever the batch size or the world size that consumes the stream.
    """

    def __init__(self, data: PromptData, shuffle: bool = True, seed: int = 0) -> None:
        self.data = data
        self.shuffle = shuffle
        self.seed = seed
        self.position = 0
        self._order: tuple[int, list[int]] | None = None

    def _epoch_order(self, epoch: int) -> list[int]:
        if self._order is None or self._order[0] != epoch:
            order = list(range(len(self.data)))
            if self.shuffle:
                random.Random(f"nereus-data:{self.seed}:{epoch}").shuffle(order)
            self._order = (epoch, order)
        return self._order[1]

    @property
    def epoch(self) -> int:
        """The epoch the next prompt belongs to."""
        return self.position // len(self.data)

    def take(self, n: int) -> list[Prompt]:
        """The next ``n`` prompts (advances the position)."""
        out = []
        for _ in range(n):
            epoch, offset = divmod(self.position, len(self.data))
            out.append(self.data.prompts[self._epoch_order(epoch)[offset]])
            self.position += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        """Position, seed and the data's size (a resumed stream must see the same data)."""
        return {"position": self.position, "seed": self.seed, "size": len(self.data), "shuffle": self.shuffle}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; refuse a checkpoint drawn from other data or another seed."""
        require(
            int(state["size"]) == len(self.data) and int(state["seed"]) == self.seed,
            "data.train_files",
            f"the checkpoint's prompt stream had {state['size']} prompts and seed {state['seed']}; "
            f"this run has {len(self.data)} prompts and seed {self.seed}: resume with the same data and seed",
        )
        self.position = int(state["position"])


@dataclass(frozen=True)
class DataConfig:
    """The ``data.*`` keys of a job, as verl names them (``train_batch_size``: the ``prompts_per_step``)."""

    train_files: str | tuple[str, ...] | None = None
    val_files: str | tuple[str, ...] | None = None
    prompt_key: str = "prompt"
    tokenizer: str | None = None  # default: the actor's folder
    max_prompt_length: int = 1024
    max_response_length: int = 256
    shuffle: bool = True

    def __post_init__(self) -> None:
        for name in ("max_prompt_length", "max_response_length"):
            value = getattr(self, name)
            require(
                isinstance(value, int) and value >= 1,
                f"data.{name}",
                f"must be an integer >= 1, got {value!r}",
            )
        for name in ("train_files", "val_files"):
            files = getattr(self, name)
            if files is not None:
                _paths(files, f"data.{name}")  # missing files fail here, before any process starts
        require(
            self.val_files is None or self.train_files is not None,
            "data.val_files",
            "validation data needs training data too (set data.train_files)",
        )

    @classmethod
    def of(cls, value: DataConfig | Mapping[str, Any] | None) -> DataConfig:
        """A config from itself, a mapping of ``data.*`` keys (unknown keys listed) or None."""
        if value is None or isinstance(value, DataConfig):
            return value or cls()
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(value) - known - {"train_batch_size"})
        if unknown:
            raise NereusConfigError(f"data: unknown key(s) {unknown}; known keys: {sorted(known)}")
        fields_ = {k: v for k, v in value.items() if k in known}
        for name in ("train_files", "val_files"):
            files = fields_.get(name)
            if files is not None and not isinstance(files, str):
                fields_[name] = tuple(str(f) for f in files)
        return cls(**fields_)
