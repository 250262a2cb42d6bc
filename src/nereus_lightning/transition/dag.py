"""The transition DAG: one node per primitive call on one model-stage, with its explicit transfers.

An executor runs the nodes one-to-one: a node is ready when every node in ``deps`` has finished;
ready nodes may run concurrently. A *batched* node (``width > 1``) carries the same primitive for
several independent replicas of its model-stage (its *lanes*, :meth:`Node.lanes`): ``sources``,
``targets``, ``mem`` and ``transfers`` are the lanes' concatenated, and its lanes may run
concurrently too. ``sources`` are the units the primitive reads (and, except for
Extend, consumes); ``targets`` the units it creates. A unit is a layout and its GPUs in
``Candidate`` order (index ``pp_rank * tp + tp_rank``). The transfers of a node are exactly what
it sends; they price the node (``transition.cost``) and the executor checks its bytes against them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain, islice
from operator import itemgetter
from typing import TYPE_CHECKING, TypeVar

from nereus_lightning.plan.layout import Layout, Plan
from nereus_lightning.plan.overlap import transition_peers
from nereus_lightning.plan.units import Primitive, Unit
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.spec.workload import ModelStage, Workload
from nereus_lightning.transition.pieces import Transfer

if TYPE_CHECKING:
    from nereus_lightning.transition.validate import ValidationReport


# Unit and Primitive live in plan.units (shared with the body); the transition modules import them from here.
_GPUS = itemgetter(1)  # a Unit's gpus


_T = TypeVar("_T")


def gpu_chunks(gpus: Sequence[_T], size: int) -> list[tuple[_T, ...]]:
    """``gpus`` cut into consecutive tuples of ``size`` (e.g. a candidate's units, in order; or
    units into groups)."""
    return list(zip(*[iter(gpus)] * size, strict=True))


#: A node's memory effect on one GPU: ``(gpu, net, transient)``: ``net`` bytes it leaves allocated
#: (negative: freed) once it ends, ``transient`` buffer bytes it holds only while it runs.
MemEffect = tuple[int, float, float]


# A node's (or a lane's) transfers, or a zero-argument function making them when first read.
Transfers = Sequence[Transfer] | Callable[[], Sequence[Transfer]]


class LaneRuns:
    """The lanes of a batched node, ``(sources, targets, mem entries, transfers)`` each, kept as
    runs of alike lanes (``runs``: ``(lanes, sources, targets, mem entries)``) and per lane its
    transfers (or their function), given as a list or as a function making it: a node of many
    lanes costs a few entries until they are read."""

    __slots__ = ("runs", "_parts", "_width")

    def __init__(
        self,
        runs: list[tuple[int, int, int, int]],
        parts: Sequence[Transfers] | Callable[[], Sequence[Transfers]],
    ) -> None:
        self.runs = runs
        self._parts = parts
        self._width = sum(run[0] for run in runs)

    def __len__(self) -> int:
        return self._width

    def __iter__(self) -> Iterator[tuple[int, int, int, Transfers]]:
        parts = self._parts
        if callable(parts):
            parts = self._parts = parts()
        it = iter(parts)
        for count, ns, nt, nm in self.runs:
            for transfers in islice(it, count):
                yield ns, nt, nm, transfers


class Node:
    """One primitive call on one model-stage (treat as read-only once built).

    ``transfers`` may be given as a zero-argument function (Extend builds its list only when
    something reads it: the replay and validation need only ``mem``).
    """

    __slots__ = (
        "id",
        "op",
        "model_stage",
        "sources",
        "targets",
        "_transfers",
        "deps",
        "mem",
        "resource_deps",
        "_lanes",
    )

    def __init__(
        self,
        id: int,
        op: Primitive,
        model_stage: str,
        sources: tuple[Unit, ...],
        targets: tuple[Unit, ...],
        transfers: Transfers,
        deps: list[int] | None = None,
        mem: tuple[MemEffect, ...] = (),
        resource_deps: list[int] | None = None,
        lanes: LaneRuns | tuple[tuple[int, int, int, Transfers], ...] | None = None,
    ) -> None:
        self.id = id
        self.op = op
        self.model_stage = model_stage
        self.sources = sources
        self.targets = targets
        self._transfers = transfers if callable(transfers) else tuple(transfers)
        self.deps: list[int] = deps if deps is not None else []
        self.mem = mem
        self.resource_deps: list[int] = (
            resource_deps if resource_deps is not None else []
        )  # added by the global order
        # Per lane of a batched node: (sources, targets, mem entries, transfers or their function).
        self._lanes = lanes if lanes is not None and len(lanes) > 1 else None

    @property
    def width(self) -> int:
        """How many independent replicas (lanes) this node carries (1: an ordinary node)."""
        return len(self._lanes) if self._lanes is not None else 1

    def lanes(self) -> list[Node]:
        """One ordinary node per lane (same id, op, model-stage and deps; ``[self]`` if width 1)."""
        if self._lanes is None:
            return [self]
        out = []
        i = j = k = 0
        for ns, nt, nm, transfers in self._lanes:
            out.append(
                Node(
                    self.id,
                    self.op,
                    self.model_stage,
                    self.sources[i : i + ns],
                    self.targets[j : j + nt],
                    transfers,
                    self.deps,
                    self.mem[k : k + nm],
                    self.resource_deps,
                )
            )
            i, j, k = i + ns, j + nt, k + nm
        return out

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        """Every point-to-point copy this node makes (``src_gpu == dst_gpu``: a local copy)."""
        t = self._transfers
        if callable(t):
            t = self._transfers = tuple(t())
        return t

    def __repr__(self) -> str:
        return f"Node({self})"

    @property
    def bytes(self) -> int:
        """Total bytes this node moves between GPUs."""
        return sum(t.bytes for t in self.transfers if t.src_gpu != t.dst_gpu)

    @property
    def acquired_gpus(self) -> tuple[int, ...]:
        """GPUs this node newly places state of its model-stage on (Extend's targets)."""
        if self.op is not Primitive.EXTEND:
            return ()
        return (
            self.targets[0].gpus
            if len(self.targets) == 1
            else tuple(chain.from_iterable(map(_GPUS, self.targets)))
        )

    @property
    def released_gpus(self) -> tuple[int, ...]:
        """GPUs whose unit of this model-stage the node drops (Destroy; Split's GPUs it does not keep)."""
        if self.op is Primitive.DESTROY:
            return (
                self.sources[0].gpus
                if len(self.sources) == 1
                else tuple(chain.from_iterable(map(_GPUS, self.sources)))
            )
        if self.op is Primitive.SPLIT:
            keep = {g for t in self.targets for g in t.gpus}
            return tuple(g for u in self.sources for g in u.gpus if g not in keep)
        return ()

    @property
    def gpus(self) -> tuple[int, ...]:
        """Every GPU the node touches."""
        seen: dict[int, None] = {}
        for u in self.sources + self.targets:
            for g in u.gpus:
                seen[g] = None
        return tuple(seen)

    def __str__(self) -> str:
        if self._lanes is not None:  # a batched node: its size, not every unit
            return (
                f"#{self.id} {self.op.value}({self.model_stage}: {self.width} lanes, "
                f"{len(self.sources)} -> {len(self.targets)} units; {self.bytes / 1e9:.3g} GB)"
            )
        src = ", ".join(map(str, self.sources))
        dst = ", ".join(map(str, self.targets))
        return f"#{self.id} {self.op.value}({self.model_stage}: {src} -> {dst}; {self.bytes / 1e9:.3g} GB)"


def memory_growth(nodes: list[Node], num_gpus: int) -> list[float]:
    """Per GPU: the bytes all ``nodes`` together may add there if nothing were ever freed
    (positive net allocations plus transfer buffers); resident bytes plus this bound any order."""
    grow = [0.0] * num_gpus
    for n in nodes:
        for g, net, transient in n.mem:
            if net > 0:
                grow[g] += net + transient
            elif transient:
                grow[g] += transient
    return grow


@dataclass(frozen=True)
class TransitionContext:
    """What a DAG was built for: the two plans and what the model-stages are."""

    current: Plan
    target: Plan
    stages: Mapping[str, ModelStage]
    models: Mapping[str, ModelSpec]
    cluster: ClusterSpec
    workload: Workload
    unit_memory: Mapping[tuple[str, Layout], float]  # per-GPU resident bytes of one unit
    current_memory: tuple[float, ...] = ()  # resident bytes per GPU under ``current``

    def memory_of(self, model_stage: str, layout: Layout) -> float:
        """Per-GPU bytes one unit of ``model_stage`` under ``layout`` keeps resident."""
        return self.unit_memory[(model_stage, layout)]

    @cached_property
    def peers(self) -> dict[str, tuple[str, ...]]:
        """Per model-stage, those concurrent with it under both plans: they never share a GPU
        during the transition (``plan.overlap.transition_peers``)."""
        return transition_peers(self.current, self.target, {n: ms.stage for n, ms in self.stages.items()})


@dataclass(eq=False)
class TransitionDAG:
    """Nodes in a topological order (``nodes[i].id == i``; every dep is an earlier id)."""

    nodes: list[Node]
    context: TransitionContext
    global_order: bool = True  # False for the per-component baseline (no resource edges)
    _cost: float | None = field(default=None, repr=False)
    # memory_growth of ``nodes``, keyed by the ``mem`` tuples it was computed from (compared by
    # identity first, so a hit costs one pointer comparison per node).
    _growth: tuple[tuple[object, ...], list[float]] | None = field(default=None, repr=False)

    def memory_growth(self) -> list[float]:
        """:func:`memory_growth` of the nodes (cached while no node's ``mem`` changes)."""
        n_gpus = self.context.cluster.num_gpus
        key = (n_gpus, *(n.mem for n in self.nodes))
        if self._growth is None or self._growth[0] != key:
            self._growth = (key, memory_growth(self.nodes, n_gpus))
        return self._growth[1]

    @property
    def cost(self) -> float:
        """``L_tran`` in seconds on the context's cluster (cached)."""
        if self._cost is None:
            from nereus_lightning.transition.cost import transition_cost

            self._cost = transition_cost(self, self.context.cluster)
        return self._cost

    @property
    def total_bytes(self) -> int:
        """Bytes moved between GPUs by all nodes."""
        return sum(n.bytes for n in self.nodes)

    @property
    def resource_edges(self) -> int:
        """How many edges the global ordering added to the local DAGs."""
        return sum(len(n.resource_deps) for n in self.nodes)

    def counts(self) -> dict[str, int]:
        """Nodes per primitive."""
        out = {p.value: 0 for p in Primitive}
        for n in self.nodes:
            out[n.op.value] += 1
        return out

    def validate(self) -> ValidationReport:
        """Shorthand for :func:`transition.validate.validate`."""
        from nereus_lightning.transition.validate import validate

        return validate(self)

    def describe(self) -> str:
        """One line per node."""
        return "\n".join(f"{n}  deps={n.deps}" for n in self.nodes)
