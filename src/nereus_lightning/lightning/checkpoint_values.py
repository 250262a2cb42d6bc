"""The values a resume takes from a checkpoint's ``nereus_meta.json``, checked before any is used.

A value no run could have saved (a step of 1e30, a loop counter that disagrees with the step, a plan
whose layout does not add up or names negative GPUs, a prompt-stream position below zero) is refused
with a :class:`CheckpointError` naming the file and the field, so a damaged or forged file fails before
training instead of giving a run that silently does nothing or something else.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from nereus_lightning.spec.errors import CheckpointError

#: The largest count (steps, samples, loop progress) a checkpoint may hold: 10^12.
MAX_COUNT = 10**12
#: GPU ids and layout sizes a plan may name: below 2^20.
MAX_GPUS = 1 << 20
_PROGRESS_KEYS = ("ready", "completed", "started", "processed", "_batches_that_stepped")
_MANUAL = "epoch_loop.manual_optimization.optim_step_progress"
_AUTOMATIC = "epoch_loop.automatic_optimization.optim_progress"


def _bad(meta: Path, field: str, value: Any, what: str) -> CheckpointError:
    """The error for ``field`` of ``meta`` holding ``value``, which is not ``what``."""
    return CheckpointError(
        f"{meta}: {field}: {value!r} is not {what}; the file is damaged or was edited: resume from another "
        "checkpoint"
    )


def count(meta: Path, field: str, value: Any, low: int = 0, high: int = MAX_COUNT) -> int:
    """``value`` if it is a whole number in ``[low, high]``, else an error naming ``field``."""
    if not (isinstance(value, int) and not isinstance(value, bool) and low <= value <= high):
        raise _bad(meta, field, value, f"a whole number in [{low}, {high:.0e}]")
    return value


def check_values(checkpoint: Mapping[str, Any], meta: Path) -> None:
    """Check every value of the checkpoint dict a resume uses (raises naming ``meta`` and the field)."""
    step = count(meta, "checkpoint.global_step", checkpoint.get("global_step"))
    count(meta, "checkpoint.epoch", checkpoint.get("epoch", 0))
    _check_loops(checkpoint.get("loops"), step, meta)
    callbacks = checkpoint.get("callbacks") or {}
    if not isinstance(callbacks, Mapping):
        raise _bad(meta, "checkpoint.callbacks", type(callbacks).__name__, "a mapping")
    nereus = callbacks.get("NereusCallback")
    if isinstance(nereus, Mapping) and isinstance(nereus.get("controller"), Mapping):
        check_plan_state(
            nereus["controller"].get("plan"), meta, "checkpoint.callbacks.NereusCallback.controller.plan"
        )
    data = checkpoint.get("nereus_data")
    if isinstance(data, Mapping) and isinstance(data.get("stream"), Mapping):
        for key, value in data["stream"].items():
            if key in ("position", "size", "seed"):
                count(meta, f"checkpoint.nereus_data.stream.{key}", value)


def _check_loops(loops: Any, step: int, meta: Path) -> None:
    """Every progress counter of Lightning's loops in range, and the optimizer steps equal to ``step``."""
    if loops is None:
        return
    fit = loops.get("fit_loop") if isinstance(loops, Mapping) else None
    if not isinstance(fit, Mapping):
        raise _bad(meta, "checkpoint.loops.fit_loop", type(fit).__name__, "Lightning's fit-loop state")
    _walk_counts(fit, meta, "checkpoint.loops.fit_loop")
    manual = _total_completed(fit.get(_MANUAL))
    automatic = _total_completed((fit.get(_AUTOMATIC) or {}).get("optimizer", {}).get("step"))
    if manual is not None and manual + (automatic or 0) != step:
        raise CheckpointError(
            f"{meta}: checkpoint.loops.fit_loop['{_MANUAL}'].total.completed is {manual}, but "
            f"checkpoint.global_step is {step} (Lightning resumes its step count from the first); the file "
            "is "
            "damaged or was edited: resume from another checkpoint"
        )


def _walk_counts(node: Mapping[str, Any], meta: Path, field: str) -> None:
    """Every progress key under ``node`` holds a count (:func:`count`)."""
    for key, value in node.items():
        where = f"{field}[{key!r}]" if "." in str(key) else f"{field}.{key}"
        if isinstance(value, Mapping):
            _walk_counts(value, meta, where)
        elif key in _PROGRESS_KEYS:
            count(meta, where, value)


def _total_completed(progress: Any) -> int | None:
    """``progress["total"]["completed"]`` when present."""
    if isinstance(progress, Mapping) and isinstance(progress.get("total"), Mapping):
        value = progress["total"].get("completed")
        return value if isinstance(value, int) else None
    return None


def check_plan_state(plan: Any, meta: Path, field: str) -> None:
    """A plan as the controller stores it: per model-stage a name, its layout and its GPUs, adding up."""
    from nereus_lightning.control.state import plan_to_state
    from nereus_lightning.plan.layout import ZERO_STAGES, Plan

    if plan is None:
        return
    if isinstance(plan, Plan):  # a record (its constructor checked the layout); its GPU ids still are
        plan = plan_to_state(plan)
    if not isinstance(plan, list):
        raise _bad(meta, field, type(plan).__name__, "a list of model-stages")
    for i, stage in enumerate(plan):
        where = f"{field}[{i}]"
        if not isinstance(stage, Mapping) or not isinstance(stage.get("name"), str):
            raise _bad(meta, where, stage, "a model-stage with a name")
        tp, pp, dp, _ = (
            count(meta, f"{where}.{key}", stage.get(key), 1, MAX_GPUS)
            for key in ("tp", "pp", "dp", "micro_batch")
        )
        shard = count(meta, f"{where}.shard", stage.get("shard", 1), 1, MAX_GPUS)  # 1 before ZeRO
        count(meta, f"{where}.zero", stage.get("zero", 0), 0, max(ZERO_STAGES))
        gpus = stage.get("gpus")
        if not isinstance(gpus, list):
            raise _bad(meta, f"{where}.gpus", gpus, "a list of GPU ids")
        for j, gpu in enumerate(gpus):
            count(meta, f"{where}.gpus[{j}]", gpu, 0, MAX_GPUS - 1)
        size = dp * shard * tp * pp
        if len(gpus) != size or len(set(gpus)) != len(gpus):
            raise _bad(
                meta,
                f"{where}.gpus",
                gpus,
                f"{size} distinct GPU ids (dp {dp} x shard {shard} x tp {tp} x pp {pp})",
            )
        if not isinstance(stage.get("recompute", False), bool):
            raise _bad(meta, f"{where}.recompute", stage.get("recompute"), "true or false")
