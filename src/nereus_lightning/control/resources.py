"""Resource providers: where the controller learns which GPUs it may use at a given step."""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

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
    require(
        1 <= min_gpus <= max_gpus, "trace.min_gpus", f"need 1 <= min_gpus={min_gpus} <= max_gpus={max_gpus}"
    )
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
        require(
            self.ticks_per_step > 0, "trace.ticks_per_step", f"must be positive, got {self.ticks_per_step}"
        )
        require(self.start_tick >= 0, "trace.start_tick", f"must be >= 0, got {self.start_tick}")
        if self.max_count == 0:
            object.__setattr__(self, "max_count", max(max(self.counts), 1))

    def tick(self, step: int) -> int:
        """The trace tick that step ``step`` reads."""
        return (self.start_tick + int(math.floor(step * self.ticks_per_step))) % len(self.counts)

    def num_gpus(self, step: int) -> int:
        """The scaled pool size at ``step``."""
        return scale_count(
            self.counts[self.tick(step)], self.max_count, self.min_gpus, self.max_gpus, self.granularity
        )

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
                    raise NereusConfigError(
                        f"resources.path: {self.path!r} is not valid JSON ({exc})"
                    ) from exc
            if "gpus" in raw:
                self._pool = as_pool(raw["gpus"])
            elif "num_gpus" in raw:
                self._pool = as_pool(int(raw["num_gpus"]))
            else:
                raise NereusConfigError(
                    f'resources.path: {self.path!r} needs a "gpus" list or a "num_gpus" count'
                )
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


class Exchange(Protocol):
    """The collectives a :class:`NodeInventory` gathers with (every rank calls each one in turn)."""

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank."""
        ...

    def gather(self, value: Any) -> list[Any]:
        """Every rank's ``value``, in rank order."""
        ...


def visible_gpus(cuda_visible_devices: str | None, count: int) -> tuple[int, ...]:
    """The driver's index of each of a node's first ``count`` GPUs as CUDA numbers them.

    ``CUDA_VISIBLE_DEVICES=2,3`` makes CUDA's GPU 0 the driver's GPU 2. UUID entries cannot be
    matched to NVML's indices here and are refused (give indices, or ``resources.counts``).
    """
    if cuda_visible_devices is None:
        return tuple(range(count))
    entries = [e.strip() for e in cuda_visible_devices.split(",") if e.strip()]
    if not all(e.isdigit() for e in entries):
        raise DeviceInventoryError(
            f"CUDA_VISIBLE_DEVICES={cuda_visible_devices!r}: the GPU inventory matches GPUs by index; "
            "give indices (CUDA_VISIBLE_DEVICES=0,1,...) or a fixed pool (resources.counts)"
        )
    return tuple(int(e) for e in entries[:count])


class NodeInventory:
    """Every node's usable GPUs as one pool, gathered through the job's ranks: once, then on change.

    At every step local rank 0 of each node asks ``local`` (its node's provider, by default
    :class:`NvmlResources`, which leaves out GPUs the driver cannot query). The answers are
    gathered onto every rank at the first step and afterwards only at a step where a node's
    answer changed (a one-flag reduction says whether one did), so a node whose GPUs are lost
    shows up as a pool change on rank 0's controller. GPU ``i`` of node ``n`` is pool GPU
    ``n * gpus_per_node + i``: the rank that runs on it.

    ``pool`` is collective: every rank calls it at the same steps, after :meth:`attach` (the
    :class:`~nereus_lightning.lightning.NereusCallback` does both).

    Args:
        local: builds the node's provider (called once, on local rank 0 of each node).
    """

    def __init__(self, local: Callable[[], ResourceProvider] = NvmlResources) -> None:
        self.local_factory = local
        self.gathers = 0  # how often the nodes' answers were gathered
        self._exchange: Exchange | None = None
        self._local: ResourceProvider | None = None
        self._node_rank = 0
        self._gpus_per_node = 1
        self._visible: tuple[int, ...] = ()
        self._mine: tuple[int, ...] | None = None  # this node's last answer (local rank 0)
        self._changes: list[tuple[int, tuple[int, ...]]] = []  # (step, pool) at every change
        self._asked = -1  # the latest step asked for

    def attach(self, exchange: Exchange, node_rank: int, local_rank: int, gpus_per_node: int) -> None:
        """Bind to this rank's place in the job; local rank 0 builds the node's provider."""
        require(gpus_per_node >= 1, "trainer.devices", f"must be >= 1, got {gpus_per_node}")
        self._exchange, self._node_rank, self._gpus_per_node = exchange, node_rank, gpus_per_node
        self._changes, self._mine, self._asked = [], None, -1
        if local_rank == 0:
            self._local = self.local_factory()
            self._visible = visible_gpus(os.environ.get("CUDA_VISIBLE_DEVICES"), gpus_per_node)

    def _node_pool(self, step: int) -> tuple[int, ...] | None:
        """This node's usable GPUs in CUDA's numbering, if this rank answers for the node."""
        if self._local is None:
            return None
        usable = set(self._local.pool(step))
        return tuple(i for i, gpu in enumerate(self._visible) if gpu in usable)

    def pool(self, step: int) -> tuple[int, ...]:
        """The job's usable GPUs at ``step`` (collective for a step later than any asked before)."""
        exchange = self._exchange
        if exchange is None:
            raise NereusConfigError(
                "resources: NodeInventory.pool before attach(): give it to NereusCallback"
            )
        if self._changes and step <= self._asked:
            return next((p for s, p in reversed(self._changes) if s <= step), self._changes[0][1])
        self._asked = step
        mine = self._node_pool(step)
        if self._changes and not exchange.any(mine != self._mine):
            return self._changes[-1][1]
        self._mine = mine
        answers = exchange.gather((self._node_rank, mine))
        self.gathers += 1
        gpn = self._gpus_per_node
        pool = tuple(sorted(node * gpn + i for node, gpus in answers if gpus is not None for i in gpus))
        if not self._changes or pool != self._changes[-1][1]:
            self._changes.append((step, pool))
        return pool
