"""User reward functions, verl's way: ``compute_score(data_source, solution_str, ground_truth, extra_info)``.

:func:`load_reward_function` imports one from a file (``custom_reward_function.path=file.py`` plus
``custom_reward_function.name``) or a module (``package.module:function``) and checks its signature
before any process starts. It returns a float or a dict with a ``score`` key (the other numeric
keys become metrics). :class:`RewardFunction` scores samples without raising: a failure is kept
with the sample's index and data source, so every rank can report the same error after the
exchange instead of leaving its peers waiting. ``num_workers > 0`` scores in a process pool
(each worker imports the function itself), for slow rewards such as sandboxes and judges.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import multiprocessing
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from nereus_lightning.spec.errors import NereusConfigError

ARGUMENTS = ("data_source", "solution_str", "ground_truth", "extra_info")
BUILTIN = "nereus_lightning.rl.verifiers:default_compute_score"


@dataclass(frozen=True)
class RewardSpec:
    """Where a reward function lives: a ``.py`` file or an importable module, and the function's name."""

    path: str = BUILTIN
    name: str = "compute_score"

    def label(self) -> str:
        """``path:name`` as a user would write it."""
        return self.path if ":" in self.path else f"{self.path}:{self.name}"


def _import(spec: RewardSpec) -> Callable[..., Any]:
    path, name = spec.path, spec.name
    if ":" in path and not os.path.isfile(path):
        path, name = path.rsplit(":", 1)
    if path.endswith(".py") or os.path.sep in path:
        if not os.path.isfile(path):
            raise NereusConfigError(f"custom_reward_function.path: {path!r} does not exist")
        module_name = f"nereus_reward_{abs(hash(os.path.abspath(path)))}"
        loader = importlib.util.spec_from_file_location(module_name, path)
        if loader is None or loader.loader is None:
            raise NereusConfigError(f"custom_reward_function.path: {path!r} is not a Python file")
        module = importlib.util.module_from_spec(loader)
        sys.modules[module_name] = module
        try:
            loader.loader.exec_module(module)
        except Exception as exc:
            raise NereusConfigError(
                f"custom_reward_function.path: importing {path!r} failed: {type(exc).__name__}: {exc}"
            ) from exc
    else:
        try:
            module = importlib.import_module(path)
        except Exception as exc:
            raise NereusConfigError(
                f"custom_reward_function.path: cannot import module {path!r}: {type(exc).__name__}: {exc}"
            ) from exc
    fn = getattr(module, name, None)
    if not callable(fn):
        found = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))
        raise NereusConfigError(
            f"custom_reward_function.name: {path!r} has no function {name!r}; its functions: {found}"
        )
    return fn


def check_signature(fn: Callable[..., Any], label: str) -> None:
    """Refuse a reward function that cannot be called with verl's four keyword arguments."""
    try:
        inspect.signature(fn).bind(**{a: None for a in ARGUMENTS})
    except TypeError as exc:
        raise NereusConfigError(
            f"custom_reward_function.name: {label}{inspect.signature(fn)} cannot be called as "
            f"compute_score({', '.join(a + '=...' for a in ARGUMENTS)}) ({exc}); "
            "give it those four parameters"
        ) from exc
    except ValueError:
        pass  # callables without a signature: trust the call


def load_reward_function(spec: RewardSpec) -> Callable[..., Any]:
    """Import the function of ``spec`` and check its signature."""
    fn = _import(spec)
    check_signature(fn, spec.label())
    return fn


@dataclass(frozen=True)
class RewardInput:
    """What the reward sees of one sample; ``index`` is the sample's position in the step."""

    index: int
    data_source: str
    solution_str: str
    ground_truth: Any
    extra_info: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class RewardResult:
    """A sample's score and extra metrics, or the error its reward raised (``score`` is NaN then)."""

    score: float
    metrics: Mapping[str, float] = field(default_factory=dict)
    error: str | None = None


def _result(value: Any, item: RewardInput, label: str) -> RewardResult:
    if isinstance(value, Mapping):
        if "score" not in value:
            return RewardResult(
                math.nan, error=f"{label} returned a dict without a 'score' key: {sorted(value)}"
            )
        metrics = {k: float(v) for k, v in value.items() if k != "score" and isinstance(v, (int, float))}
        value = value["score"]
    else:
        metrics = {}
    if not isinstance(value, (int, float)):
        return RewardResult(math.nan, error=f"{label} returned {type(value).__name__}, not a float")
    return RewardResult(float(value), metrics)


def score_one(fn: Callable[..., Any], item: RewardInput, label: str) -> RewardResult:
    """Call ``fn`` on one sample; an exception becomes the result's ``error`` (naming the sample)."""
    try:
        value = fn(
            data_source=item.data_source,
            solution_str=item.solution_str,
            ground_truth=item.ground_truth,
            extra_info=dict(item.extra_info),
        )
    except Exception as exc:
        return RewardResult(
            math.nan,
            error=f"{label} raised on sample {item.index} (data_source {item.data_source!r}): "
            f"{type(exc).__name__}: {exc}",
        )
    return _result(value, item, label)


_WORKER_FN: Callable[..., Any] | None = None
_WORKER_LABEL = ""


def _init_worker(spec: RewardSpec) -> None:
    global _WORKER_FN, _WORKER_LABEL
    _WORKER_FN, _WORKER_LABEL = load_reward_function(spec), spec.label()


def _score_in_worker(item: RewardInput) -> RewardResult:
    assert _WORKER_FN is not None
    return score_one(_WORKER_FN, item, _WORKER_LABEL)


class RewardFunction:
    """A reward function: a :class:`RewardSpec` (inline or in ``num_workers`` processes) or a callable."""

    def __init__(self, reward: RewardSpec | Callable[..., Any], num_workers: int = 0) -> None:
        if num_workers < 0:
            raise NereusConfigError(f"reward.num_workers: must be >= 0, got {num_workers}")
        if isinstance(reward, RewardSpec):
            self.spec: RewardSpec | None = reward
            self.fn = load_reward_function(reward)
            self.label = reward.label()
        else:
            if num_workers:
                raise NereusConfigError(
                    "reward.num_workers: a reward passed as a Python object scores in the rank's "
                    "own process; "
                    "give custom_reward_function.path for a worker pool"
                )
            self.spec, self.fn = None, reward
            self.label = getattr(reward, "__qualname__", type(reward).__name__)
            check_signature(reward, self.label)
        self.num_workers = num_workers
        self._pool: ProcessPoolExecutor | None = None

    def __call__(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        """One result per item, in order."""
        if self.num_workers == 0 or len(items) <= 1:
            return [score_one(self.fn, item, self.label) for item in items]
        if (
            self._pool is None
        ):  # spawned: workers import the function themselves, not the parent's torch state
            assert self.spec is not None  # __init__ refuses workers for a reward given as a Python object
            self._pool = ProcessPoolExecutor(
                self.num_workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker,
                initargs=(self.spec,),
            )
        chunk = max(1, len(items) // (4 * self.num_workers))
        return list(self._pool.map(_score_in_worker, items, chunksize=chunk))

    def close(self) -> None:
        """Stop the worker pool, if any."""
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:  # a pool does not travel to spawned ranks; each builds its own
        return {**self.__dict__, "_pool": None}
