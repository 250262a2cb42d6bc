"""The transition DAG: one node per primitive call on one model-stage, with its explicit transfers.

An executor runs the nodes one-to-one: a node is ready when every node in ``deps`` has finished;
ready nodes may run concurrently. A *batched* node (``width > 1``) carries the same primitive for
several independent replicas of its model-stage (its *lanes*, :meth:`Node.lanes`): ``sources``,
``targets``, ``mem`` and ``transfers`` are the lanes' concatenated, and its lanes may run
concurrently too. ``sources`` are the units the primitive reads (and, except for
Extend, consumes); ``targets`` the units it creates. A unit is a layout and its GPUs in
``Candidate`` order (index ``pp_rank * tp + tp_rank``). The transfers of a node are exactly what
it sends; they price the node (``transition.critical_path``) and the executor checks its bytes against them.

A node holds its units as :class:`Units` (one layout, each unit as its GPU tuple) and its memory
effects as :class:`Memory` (columns): the brain works on GPU tuples and makes no object per unit;
iterating them gives :class:`Unit` objects and ``(gpu, net, transient)`` triples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar, overload

import numpy as np

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
Gpus = tuple[int, ...]  # a unit, by its GPUs


class Units(Sequence[Unit]):
    """Units of one ``layout``, each as its GPU tuple (``gpus[i]``): a node's sources or targets.

    Immutable. Indexing or iterating gives :class:`Unit` objects; a slice gives ``Units``.
    """

    __slots__ = ("layout", "gpus")

    def __init__(self, layout: Layout, gpus: Iterable[Gpus] = ()) -> None:
        object.__setattr__(self, "layout", layout)
        object.__setattr__(self, "gpus", tuple(gpus))

    layout: Layout
    gpus: tuple[Gpus, ...]

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Units are immutable (tried to set {name})")

    def __len__(self) -> int:
        return len(self.gpus)

    @overload
    def __getitem__(self, index: int) -> Unit: ...
    @overload
    def __getitem__(self, index: slice) -> Units: ...
    def __getitem__(self, index: int | slice) -> Unit | Units:
        if isinstance(index, slice):
            return Units(self.layout, self.gpus[index])
        return Unit(self.layout, self.gpus[index])

    def __iter__(self) -> Iterator[Unit]:
        return (Unit(self.layout, g) for g in self.gpus)

    def lane(self, k: int, width: int) -> Units:
        """The units of lane ``k`` of ``width`` alike lanes."""
        return self.take((k,), width)

    def take(self, ks: Sequence[int], width: int) -> Units:
        """The units of lanes ``ks`` (ascending) of ``width`` alike lanes (all of them: itself)."""
        if len(ks) == width:
            return self
        n = len(self.gpus) // width
        if ks[-1] - ks[0] + 1 == len(ks):  # consecutive lanes (ks ascend): one slice
            return Units(self.layout, self.gpus[ks[0] * n : (ks[-1] + 1) * n])
        return Units(self.layout, [g for k in ks for g in self.gpus[k * n : (k + 1) * n]])

    def all_gpus(self) -> Iterator[int]:
        """Every GPU of every unit, in order."""
        return chain.from_iterable(self.gpus)

    def gpus_of(self, ks: Sequence[int], width: int) -> list[int]:
        """Every GPU of the units of lanes ``ks`` of ``width`` alike lanes, in order."""
        if len(ks) == width:
            return list(chain.from_iterable(self.gpus))
        n = len(self.gpus) // width
        if n == 1:  # a unit per lane
            return list(chain.from_iterable(map(self.gpus.__getitem__, ks)))
        return [g for k in ks for unit in self.gpus[k * n : (k + 1) * n] for g in unit]

    def by_lane(self, width: int) -> Sequence[Sequence[int]]:
        """Every GPU of each lane's units, lane by lane (``width`` alike lanes)."""
        n = len(self.gpus) // width
        if n == 1:  # a unit per lane
            return self.gpus
        return [list(chain.from_iterable(self.gpus[k * n : (k + 1) * n])) for k in range(width)]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Units):
            return NotImplemented
        return self.gpus == other.gpus and (not self.gpus or self.layout == other.layout)

    def __hash__(self) -> int:
        return hash(self.gpus)

    def __repr__(self) -> str:
        return f"Units({self.layout}, {list(self.gpus)})"


#: A node's memory effect on one GPU: ``(gpu, net, transient)``: ``net`` bytes it leaves allocated
#: (negative: freed) once it ends, ``transient`` buffer bytes it holds only while it runs.
MemEffect = tuple[int, float, float]


class Memory(Sequence[MemEffect]):
    """A node's memory effects as columns (numpy arrays): on each of ``gpus`` (in order) it leaves
    ``net[i]`` bytes allocated once it ends (negative: freed) and holds ``transient[i]`` buffer bytes
    while it runs. A ``net`` given as one number holds on every GPU (a primitive whose units are alike
    on all their GPUs); a re-cut of the shard degree gives one per GPU (its old and new GPUs differ).

    Immutable (read-only arrays); items are ``(gpu, net, transient)`` triples (:data:`MemEffect`).
    """

    __slots__ = ("gpus", "net", "transient")

    def __init__(
        self, gpus: Iterable[int], net: float | Iterable[float], transient: Iterable[float] | None = None
    ) -> None:
        ids = _frozen(np.fromiter(gpus, dtype=np.int64) if not isinstance(gpus, np.ndarray) else gpus)
        object.__setattr__(self, "gpus", ids)
        object.__setattr__(self, "net", _column(net, len(ids), "net"))
        object.__setattr__(
            self, "transient", _column(0.0 if transient is None else transient, len(ids), "transient")
        )

    gpus: np.ndarray
    net: np.ndarray
    transient: np.ndarray

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Memory is immutable (tried to set {name})")

    def __len__(self) -> int:
        return len(self.gpus)

    @overload
    def __getitem__(self, index: int) -> MemEffect: ...
    @overload
    def __getitem__(self, index: slice) -> Memory: ...
    def __getitem__(self, index: int | slice) -> MemEffect | Memory:
        if isinstance(index, slice):
            return Memory(self.gpus[index], self.net[index], self.transient[index])
        return (int(self.gpus[index]), float(self.net[index]), float(self.transient[index]))

    def __iter__(self) -> Iterator[MemEffect]:
        return zip(self.gpus.tolist(), self.net.tolist(), self.transient.tolist(), strict=True)

    def lane(self, k: int, width: int) -> Memory:
        """The effects of lane ``k`` of ``width`` alike lanes."""
        return self.take((k,), width)

    def take(self, ks: Sequence[int], width: int) -> Memory:
        """The effects of lanes ``ks`` (ascending) of ``width`` alike lanes (all of them: itself)."""
        if len(ks) == width:
            return self
        n = len(self.gpus) // width
        if ks[-1] - ks[0] + 1 == len(ks):  # consecutive lanes (ks ascend): views, read-only already
            lo, hi = ks[0] * n, (ks[-1] + 1) * n
            part = object.__new__(Memory)
            object.__setattr__(part, "gpus", self.gpus[lo:hi])
            object.__setattr__(part, "net", self.net[lo:hi])
            object.__setattr__(part, "transient", self.transient[lo:hi])
            return part
        at = (np.asarray(ks)[:, None] * n + np.arange(n)).ravel()
        return Memory(self.gpus[at], self.net[at], self.transient[at])  # copies: made read-only

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Memory):
            return NotImplemented
        return all(np.array_equal(getattr(self, f), getattr(other, f)) for f in self.__slots__)

    def __hash__(self) -> int:
        return hash((self.gpus.tobytes(), self.net.tobytes()))

    def __repr__(self) -> str:
        return f"Memory({self.gpus.tolist()}, net={self.net.tolist()}, transient={self.transient.tolist()})"


def _column(values: float | Iterable[float], size: int, what: str) -> np.ndarray:
    """``values`` as a read-only float column of ``size`` (one number: repeated)."""
    if isinstance(values, (int, float)):
        column = np.empty(size)  # (empty + fill: np.full's Python wrapper costs twice as much)
        column.fill(values)
        column.flags.writeable = False
        return column
    column = values if isinstance(values, np.ndarray) else np.fromiter(values, dtype=np.float64)
    if len(column) != size:
        raise ValueError(f"{len(column)} {what} sizes for {size} GPUs")
    return _frozen(column.astype(np.float64, copy=False))


def _frozen(array: np.ndarray) -> np.ndarray:
    """``array`` made read-only (a view where it was writable elsewhere)."""
    if array.flags.writeable:
        array = array.view()
        array.flags.writeable = False
    return array


class Effects(NamedTuple):
    """Memory effects of many nodes as one table (numpy columns, node by node in order):
    ``node[i]`` is the position of effect ``i``'s node in that order."""

    node: np.ndarray
    gpu: np.ndarray
    net: np.ndarray
    transient: np.ndarray

    @classmethod
    def of(cls, mems: Sequence[Memory]) -> Effects:
        """The table of ``mems`` (one per node, in order)."""
        counts = [len(m.gpus) for m in mems]
        if not mems:
            return cls(*(np.zeros(0, dtype=t) for t in (np.int64, np.int64, np.float64, np.float64)))
        return cls(
            np.repeat(np.arange(len(mems)), counts),
            np.concatenate([m.gpus for m in mems]),
            np.concatenate([m.net for m in mems]),
            np.concatenate([m.transient for m in mems]),
        )

    def growth(self, num_gpus: int) -> np.ndarray:
        """Per GPU: what the effects may add if nothing were freed (positive nets plus buffers)."""
        return np.bincount(self.gpu, np.maximum(self.net, 0.0) + self.transient, minlength=num_gpus)


_T = TypeVar("_T")


def gpu_chunks(gpus: Sequence[_T], size: int) -> list[tuple[_T, ...]]:
    """``gpus`` cut into consecutive tuples of ``size`` (e.g. a candidate's units, in order; or
    units into groups)."""
    return list(zip(*[iter(gpus)] * size, strict=True))


def no_transfers() -> tuple[Transfer, ...]:
    """A Destroy's transfers: none."""
    return ()


def acquired_gpus(op: Primitive, sources: Iterable[int], targets: Iterable[int]) -> tuple[int, ...]:
    """GPUs a call of ``op`` reading units on ``sources`` and creating units on ``targets`` (their GPUs)
    newly places state on: Extend's targets, and those of a Split's or Merge's targets no source holds
    (a re-cut to a larger shard degree)."""
    if op is Primitive.EXTEND:
        return tuple(targets)
    if op is Primitive.DESTROY:
        return ()
    had = set(sources)
    return tuple(g for g in targets if g not in had)


def acquires_some(op: Primitive, sources: Units, targets: Units) -> bool:
    """Whether a call of ``op`` reading ``sources`` and making ``targets`` (of one or more alike lanes)
    may newly place state on a GPU (:func:`acquired_gpus`): an Extend, or a Split or Merge whose
    targets span more GPUs than its sources (a re-cut to a larger shard degree)."""
    if op is Primitive.EXTEND:
        return True
    if op is Primitive.DESTROY:
        return False
    return len(targets) * targets.layout.size > len(sources) * sources.layout.size


def releases_some(op: Primitive, sources: Units, targets: Units) -> bool:
    """Whether a call of ``op`` reading ``sources`` and making ``targets`` (of one or more alike lanes)
    may leave a GPU (:func:`released_gpus`): a Destroy of something, or a Split or Merge whose targets
    span fewer GPUs than its sources (a Split's units lie on its source's GPUs; a re-cut to a smaller
    shard degree keeps some of them)."""
    if op is Primitive.DESTROY:
        return len(sources) > 0
    if op is Primitive.EXTEND:
        return False
    return len(targets) * targets.layout.size < len(sources) * sources.layout.size


def released_gpus(op: Primitive, sources: Iterable[int], targets: Iterable[int]) -> tuple[int, ...]:
    """GPUs a call of ``op`` reading units on ``sources`` and creating units on ``targets`` (their
    GPUs) leaves: Destroy's, and those of a Split's or Merge's sources that no target keeps (a Split to
    units on fewer GPUs; a re-cut to a smaller shard degree)."""
    if op is Primitive.DESTROY:
        return tuple(sources)
    if op is Primitive.EXTEND:
        return ()
    keep = set(targets)
    return tuple(g for g in sources if g not in keep)


class Node(NamedTuple):
    """One primitive call on one model-stage, or (batched) one per lane; immutable.

    A batched node's lanes are alike (the same number of sources, targets and memory effects
    each): ``sources``, ``targets`` and ``mem`` are theirs concatenated. ``deps`` are earlier
    node ids, ``resource_deps`` those of them the global order added. Lane ``k``'s transfers are
    ``make_transfers(*lane_args[k])``, made when read: the build and the validation read only
    memory effects (an Extend's list is for the cost model and the executor).
    """

    id: int
    op: Primitive
    model_stage: str
    sources: Units
    targets: Units
    deps: tuple[int, ...]
    mem: Memory
    resource_deps: tuple[int, ...]
    make_transfers: Callable[..., Sequence[Transfer]]
    lane_args: tuple[tuple[Any, ...], ...]

    @property
    def width(self) -> int:
        """How many independent replicas (lanes) this node carries (1: an ordinary node)."""
        return len(self.lane_args)

    def lanes(self) -> tuple[Node, ...]:
        """One ordinary node per lane (same id, op, model-stage and deps; ``(self,)`` if width 1)."""
        width = len(self.lane_args)
        if width == 1:
            return (self,)
        return tuple(
            self._replace(
                sources=self.sources.lane(k, width),
                targets=self.targets.lane(k, width),
                mem=self.mem.lane(k, width),
                lane_args=(args,),
            )
            for k, args in enumerate(self.lane_args)
        )

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        """Every point-to-point copy this node makes (``src_gpu == dst_gpu``: a local copy)."""
        make = self.make_transfers
        return tuple(chain.from_iterable(make(*args) for args in self.lane_args))

    @property
    def bytes(self) -> int:
        """Total bytes this node moves between GPUs."""
        return sum(t.bytes for t in self.transfers if t.src_gpu != t.dst_gpu)

    @property
    def acquired_gpus(self) -> tuple[int, ...]:
        """GPUs this node newly places state of its model-stage on (:func:`acquired_gpus`)."""
        if not acquires_some(self.op, self.sources, self.targets):
            return ()
        return acquired_gpus(self.op, self.sources.all_gpus(), self.targets.all_gpus())

    @property
    def released_gpus(self) -> tuple[int, ...]:
        """GPUs whose unit of this model-stage the node drops (:func:`released_gpus`)."""
        if not releases_some(self.op, self.sources, self.targets):
            return ()
        return released_gpus(self.op, self.sources.all_gpus(), self.targets.all_gpus())

    @property
    def gpus(self) -> tuple[int, ...]:
        """Every GPU the node touches."""
        return tuple(dict.fromkeys(chain(self.sources.all_gpus(), self.targets.all_gpus())))

    def __repr__(self) -> str:
        return f"Node({self})"

    def __str__(self) -> str:
        if self.width > 1:  # a batched node: its size, not every unit
            return (
                f"#{self.id} {self.op.value}({self.model_stage}: {self.width} lanes, "
                f"{len(self.sources)} -> {len(self.targets)} units; {self.bytes / 1e9:.3g} GB)"
            )
        src = ", ".join(map(str, self.sources))
        dst = ", ".join(map(str, self.targets))
        return f"#{self.id} {self.op.value}({self.model_stage}: {src} -> {dst}; {self.bytes / 1e9:.3g} GB)"


class HasMemory(Protocol):
    """Anything with memory effects (a node, a local node, a step's lanes)."""

    @property
    def mem(self) -> Memory: ...


def memory_growth(nodes: Iterable[HasMemory], num_gpus: int) -> np.ndarray:
    """Per GPU: the bytes all ``nodes`` together may add there if nothing were ever freed
    (positive net allocations plus transfer buffers); resident bytes plus this bound any order."""
    return Effects.of([n.mem for n in nodes]).growth(num_gpus)


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
    # Resident bytes per GPU under ``current`` (a read-only array; empty: not found).
    current_memory: np.ndarray = field(default_factory=lambda: np.zeros(0), compare=False)

    def memory_of(self, model_stage: str, layout: Layout) -> float:
        """Per-GPU bytes one unit of ``model_stage`` under ``layout`` keeps resident."""
        return self.unit_memory[(model_stage, layout)]

    @cached_property
    def peers(self) -> dict[str, tuple[str, ...]]:
        """Per model-stage, those concurrent with it under both plans: they never share a GPU
        during the transition (``plan.overlap.transition_peers``)."""
        return transition_peers(self.current, self.target, {n: ms.stage for n, ms in self.stages.items()})


@dataclass(frozen=True, eq=False)
class TransitionDAG:
    """Nodes in a topological order (``nodes[i].id == i``; every dep is an earlier id); immutable."""

    nodes: tuple[Node, ...]
    context: TransitionContext
    global_order: bool = True  # False for the per-component baseline (no resource edges)

    @cached_property
    def effects(self) -> Effects:
        """The memory effects of every node, as one table in node order."""
        return Effects.of([n.mem for n in self.nodes])

    def memory_growth(self) -> np.ndarray:
        """:func:`memory_growth` of the nodes."""
        return self.effects.growth(self.context.cluster.num_gpus)

    @cached_property
    def cost(self) -> float:
        """``L_tran`` in seconds on the context's cluster."""
        from nereus_lightning.transition.critical_path import transition_cost

        return transition_cost(self, self.context.cluster)

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
