"""Resource providers: where the controller learns which GPUs it may use at a given step."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from nereus_lightning.control.signals import as_pool
from nereus_lightning.spec.errors import NereusConfigError, require


@runtime_checkable
class ResourceProvider(Protocol):
    """Anything that answers "which GPUs are available at step ``step``?"."""

    def pool(self, step: int) -> tuple[int, ...]:
        """GPU ids available for ``step`` (sorted)."""
        ...


@dataclass(frozen=True)
class StaticResources:
    """A fixed pool (a count, or explicit GPU ids)."""

    gpus: int | tuple[int, ...]

    def pool(self, step: int) -> tuple[int, ...]:
        """The same pool at every step."""
        return as_pool(self.gpus)


def load_spot_trace(path: str | os.PathLike) -> tuple[tuple[int, ...], float]:
    """Read a spot-availability trace: ``{"metadata": {"gap_seconds": s}, "data": [n0, n1, ...]}``.

    Returns (counts per tick, seconds per tick).
    """
    try:
        with open(path) as f:
            raw = json.load(f)
        counts = tuple(int(n) for n in raw["data"])
        gap = float(raw.get("metadata", {}).get("gap_seconds", 300))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise NereusConfigError(
            f"trace.path: cannot read a spot trace from {os.fspath(path)!r} ({exc}); expected "
            '{"metadata": {"gap_seconds": 300}, "data": [counts...]}'
        ) from exc
    require(len(counts) > 0, "trace.path", f"{os.fspath(path)!r} holds no ticks")
    return counts, gap


def scale_count(count: float, max_count: float, min_gpus: int, max_gpus: int, granularity: int = 1) -> int:
    """Map an availability count in ``[0, max_count]`` linearly onto ``[min_gpus, max_gpus]``.

    The result is rounded down to a multiple of ``granularity`` (e.g. whole nodes) and never
    falls below ``min_gpus``.
    """
    require(max_count > 0, "trace.max_count", f"must be positive, got {max_count}")
    require(1 <= min_gpus <= max_gpus, "trace.min_gpus", f"need 1 <= min_gpus={min_gpus} <= max_gpus={max_gpus}")
    require(granularity >= 1, "trace.granularity", f"must be >= 1, got {granularity}")
    raw = min_gpus + (max_gpus - min_gpus) * min(max(count, 0.0), max_count) / max_count
    return max(min_gpus, int(math.floor(raw / granularity + 1e-9)) * granularity)


@dataclass(frozen=True)
class TraceResources:
    """A pool that follows a spot-availability trace.

    Step ``s`` reads tick ``start_tick + floor(s * ticks_per_step)`` (wrapping around the end), and
    the count is scaled onto ``[min_gpus, max_gpus]`` in multiples of ``granularity``.
    """

    counts: tuple[int, ...]
    min_gpus: int
    max_gpus: int
    ticks_per_step: float = 1.0
    start_tick: int = 0
    granularity: int = 1
    max_count: int = 0  # 0: the trace's maximum

    def __post_init__(self) -> None:
        require(len(self.counts) > 0, "trace.counts", "is empty")
        require(self.ticks_per_step > 0, "trace.ticks_per_step", f"must be positive, got {self.ticks_per_step}")
        require(self.start_tick >= 0, "trace.start_tick", f"must be >= 0, got {self.start_tick}")
        if self.max_count == 0:
            object.__setattr__(self, "max_count", max(max(self.counts), 1))

    @classmethod
    def from_file(cls, path: str | os.PathLike, min_gpus: int, max_gpus: int, **kwargs) -> TraceResources:
        """Build from a trace JSON file (see :func:`load_spot_trace`)."""
        counts, _ = load_spot_trace(path)
        return cls(counts, min_gpus, max_gpus, **kwargs)

    def tick(self, step: int) -> int:
        """The trace tick that step ``step`` reads."""
        return (self.start_tick + int(math.floor(step * self.ticks_per_step))) % len(self.counts)

    def num_gpus(self, step: int) -> int:
        """The scaled pool size at ``step``."""
        return scale_count(self.counts[self.tick(step)], self.max_count, self.min_gpus, self.max_gpus, self.granularity)

    def pool(self, step: int) -> tuple[int, ...]:
        """GPUs ``0 .. n-1`` for the scaled count ``n``."""
        return tuple(range(self.num_gpus(step)))


@dataclass(frozen=True)
class SequenceResources:
    """A pool given as one GPU count per step (the last count holds after the end)."""

    counts: Sequence[int]

    def pool(self, step: int) -> tuple[int, ...]:
        """GPUs ``0 .. counts[step]-1``."""
        require(len(self.counts) > 0, "resources.counts", "is empty")
        return tuple(range(self.counts[min(step, len(self.counts) - 1)]))


class SchedulerFileResources:
    """A JSON file that an external scheduler rewrites to announce the pool (and revocations).

    The file holds ``{"gpus": [0, 1, ...]}`` or ``{"num_gpus": n}``. It is re-read only when its
    modification time changes, so polling it every step is cheap.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = os.fspath(path)
        self._mtime: float | None = None
        self._pool: tuple[int, ...] = ()

    def pool(self, step: int) -> tuple[int, ...]:
        """The pool the scheduler announced most recently."""
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError as exc:
            raise NereusConfigError(
                f"resources.path: the scheduler file {self.path!r} is missing ({exc.strerror}); "
                'write {"gpus": [...]} or {"num_gpus": n} there'
            ) from exc
        if mtime != self._mtime:
            with open(self.path) as f:
                try:
                    raw = json.load(f)
                except ValueError as exc:
                    raise NereusConfigError(f"resources.path: {self.path!r} is not valid JSON ({exc})") from exc
            if "gpus" in raw:
                self._pool = as_pool(raw["gpus"])
            elif "num_gpus" in raw:
                self._pool = as_pool(int(raw["num_gpus"]))
            else:
                raise NereusConfigError(f'resources.path: {self.path!r} needs a "gpus" list or a "num_gpus" count')
            self._mtime = mtime
        return self._pool


class DeviceInventoryError(RuntimeError):
    """The local GPU inventory cannot be read; the message says why."""


class NvmlResources:
    """The local GPUs as NVML (nvidia-ml-py) or, failing that, ROCm's amdsmi reports them.

    GPUs whose NVML health query fails are left out of the pool. Without a driver the
    constructor raises :class:`DeviceInventoryError` with the reason instead of crashing later.
    """

    def __init__(self) -> None:
        reasons: list[str] = []
        for probe in (_nvml_gpus, _amdsmi_gpus):
            try:
                self._query = probe
                self._pool = probe()
                self.backend = probe.__name__.strip("_").replace("_gpus", "")
                return
            except DeviceInventoryError as exc:
                reasons.append(str(exc))
        raise DeviceInventoryError("no GPU inventory available: " + "; ".join(reasons))

    def pool(self, step: int) -> tuple[int, ...]:
        """GPU ids the driver reports as usable now."""
        try:
            self._pool = self._query()
        except DeviceInventoryError:
            pass  # keep the last known pool; a transient driver error is not a revocation
        return self._pool


def _nvml_gpus() -> tuple[int, ...]:
    try:
        import pynvml
    except ImportError as exc:
        raise DeviceInventoryError("nvidia-ml-py is not installed (pip install nvidia-ml-py)") from exc
    try:
        pynvml.nvmlInit()
        healthy = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            try:
                handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                pynvml.nvmlDeviceGetMemoryInfo(handle)
                healthy.append(i)
            except pynvml.NVMLError:
                continue
        return tuple(healthy)
    except pynvml.NVMLError as exc:
        raise DeviceInventoryError(f"NVML is unavailable ({exc}); no NVIDIA driver on this machine?") from exc


def _amdsmi_gpus() -> tuple[int, ...]:
    try:
        import amdsmi
    except ImportError as exc:
        raise DeviceInventoryError("amdsmi is not importable (ROCm not installed)") from exc
    try:
        amdsmi.amdsmi_init()
        return tuple(range(len(amdsmi.amdsmi_get_processor_handles())))
    except Exception as exc:  # amdsmi raises its own AmdSmiException hierarchy
        raise DeviceInventoryError(f"amdsmi failed ({exc})") from exc
