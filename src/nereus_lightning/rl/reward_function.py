"""User reward functions, verl's way: ``compute_score(data_source, solution_str, ground_truth, extra_info)``.

:func:`load_reward_function` imports one from a file (``custom_reward_function.path=file.py`` plus
``custom_reward_function.name``) or a module (``package.module:function``) and checks its signature
before any process starts. It returns a float or a dict with a ``score`` key (the other numeric
keys become metrics). :class:`RewardFunction` scores samples without raising: a failure is kept
with the sample's index and data source, so every rank can report the same error after the
exchange instead of leaving its peers waiting. ``num_workers > 0`` scores in a process pool
(each worker imports the function itself), for slow rewards such as sandboxes and judges;
``timeout_s`` bounds each sample (a hung one fails the step naming it), and slow scoring logs its
progress.
"""

from __future__ import annotations

import inspect
import logging
import math
import multiprocessing
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from nereus_lightning.rl.plugins import import_source
from nereus_lightning.spec.errors import NereusConfigError

log = logging.getLogger(__name__)

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
    module = import_source(path, "custom_reward_function.path")
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
#: Seconds of scoring on a rank after which (and then every as many seconds) it logs its progress.
PROGRESS_EVERY_S = 30.0


def _init_worker(spec: RewardSpec) -> None:
    global _WORKER_FN, _WORKER_LABEL
    _WORKER_FN, _WORKER_LABEL = load_reward_function(spec), spec.label()


def _score_in_worker(item: RewardInput) -> RewardResult:
    assert _WORKER_FN is not None
    return score_one(_WORKER_FN, item, _WORKER_LABEL)


def _ready(_: int) -> bool:
    """A worker's answer once it has started and imported the reward."""
    return _WORKER_FN is not None


def _where(item: RewardInput) -> str:
    return f"sample {item.index} (data_source {item.data_source!r})"


class _Progress:
    """What a rank's scoring has done: samples finished, and since when each running one runs."""

    def __init__(self, total: int, label: str) -> None:
        self.total, self.label, self.done = total, label, 0
        self.started = time.monotonic()
        self.running: dict[int, tuple[RewardInput, float]] = {}
        self._next = self.started + PROGRESS_EVERY_S

    def report(self) -> None:
        """Log the progress when it is due (every :data:`PROGRESS_EVERY_S` seconds of slow scoring)."""
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + PROGRESS_EVERY_S
        slowest = min(self.running.values(), key=lambda r: r[1], default=None)
        running = f"; {_where(slowest[0])} running for {now - slowest[1]:.0f} s" if slowest else ""
        log.warning(
            "reward %s: %d of %d samples scored on this rank after %.0f s%s",
            self.label,
            self.done,
            self.total,
            now - self.started,
            running,
        )


def _timed_out(item: RewardInput, label: str, timeout_s: float) -> str:
    return (
        f"{label} did not return within reward.timeout_s={timeout_s:g} s on {_where(item)}; "
        "fix the reward, or raise reward.timeout_s"
    )


class RewardFunction:
    """A reward function: a :class:`RewardSpec` (inline or in ``num_workers`` processes) or a callable.

    ``timeout_s`` bounds each sample's scoring: a sample that takes longer gets an error naming it (the
    step fails with it), its worker process is killed (a spec scores in at least one process then; a
    callable is left running on a daemon thread). A rank scoring for longer than :data:`PROGRESS_EVERY_S`
    logs its progress and the sample it waits for.
    """

    def __init__(
        self, reward: RewardSpec | Callable[..., Any], num_workers: int = 0, timeout_s: float | None = None
    ) -> None:
        if num_workers < 0:
            raise NereusConfigError(f"reward.num_workers: must be >= 0, got {num_workers}")
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
            raise NereusConfigError(
                f"reward.timeout_s: must be > 0 seconds (or null: no limit), got {timeout_s!r}"
            )
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
        self.timeout_s = None if timeout_s is None else float(timeout_s)
        self._pool: Any = None

    def __call__(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        """One result per item, in order."""
        if not items:
            return []
        if self.spec is not None and (self.num_workers or self.timeout_s is not None):
            return self._in_processes(items)
        if self.timeout_s is not None:
            return self._on_threads(items)
        progress = _Progress(len(items), self.label)
        out = []
        for item in items:
            progress.running = {item.index: (item, time.monotonic())}
            out.append(score_one(self.fn, item, self.label))
            progress.done += 1
            progress.report()
        return out

    def _in_processes(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        """Score in the worker processes, at most one sample per worker at a time, each within the timeout."""
        workers = max(self.num_workers, 1)
        if (
            self._pool is None
        ):  # spawned: workers import the function themselves, not the parent's torch state
            ctx = multiprocessing.get_context("spawn")
            self._pool = ctx.Pool(workers, initializer=_init_worker, initargs=(self.spec,))
            self._pool.map(_ready, range(workers), chunksize=1)  # started: their start is not a sample's time
        results: dict[int, RewardResult] = {}
        progress = _Progress(len(items), self.label)
        waiting = list(enumerate(items))[::-1]
        running: dict[int, tuple[Any, float]] = {}
        finished = threading.Event()
        while waiting or running:
            while waiting and len(running) < workers:
                i, item = waiting.pop()
                future = self._pool.apply_async(
                    _score_in_worker,
                    (item,),
                    callback=lambda _: finished.set(),
                    error_callback=lambda _: finished.set(),
                )
                running[i] = (future, time.monotonic())
            finished.wait(1.0)
            finished.clear()
            for i, (future, started) in list(running.items()):
                if future.ready():
                    results[i] = future.get()
                    del running[i]
                    progress.done += 1
                elif self.timeout_s is not None and time.monotonic() - started > self.timeout_s:
                    return self._abandon(items, results, _timed_out(items[i], self.label, self.timeout_s))
            progress.running = {items[i].index: (items[i], t) for i, (_, t) in running.items()}
            progress.report()
        return [results[i] for i in range(len(items))]

    def _abandon(
        self, items: Sequence[RewardInput], results: dict[int, RewardResult], error: str
    ) -> list[RewardResult]:
        """Kill the workers (one is stuck); every sample not scored gets ``error``."""
        self.close()
        return [results.get(i, RewardResult(math.nan, error=error)) for i in range(len(items))]

    def _on_threads(self, items: Sequence[RewardInput]) -> list[RewardResult]:
        """A callable within the timeout: each sample on a daemon thread (left behind if it never returns)."""
        assert self.timeout_s is not None
        progress = _Progress(len(items), self.label)
        out: list[RewardResult] = []
        for n, item in enumerate(items):
            box: list[RewardResult] = []
            thread = threading.Thread(target=self._score_into, args=(item, box), daemon=True)
            started = time.monotonic()
            progress.running = {item.index: (item, started)}
            thread.start()
            while thread.is_alive() and time.monotonic() - started <= self.timeout_s:
                thread.join(min(1.0, self.timeout_s))
                progress.report()
            if not box:
                error = _timed_out(item, self.label, self.timeout_s)
                return out + [RewardResult(math.nan, error=error)] * (len(items) - n)
            out.append(box[0])
            progress.done += 1
        return out

    def _score_into(self, item: RewardInput, box: list[RewardResult]) -> None:
        """Score ``item`` into ``box`` (on a thread of :meth:`_on_threads`)."""
        box.append(score_one(self.fn, item, self.label))

    def close(self) -> None:
        """Stop the worker processes, if any (killed: one may be stuck in a reward)."""
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None

    def __getstate__(self) -> dict[str, Any]:  # a pool does not travel to spawned ranks; each builds its own
        return {**self.__dict__, "_pool": None}
