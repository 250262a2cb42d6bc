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

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from itertools import chain, repeat
from operator import itemgetter
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, TypeVar

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


def units_of(layout: Layout, gpus: Iterable[tuple[int, ...]]) -> tuple[Unit, ...]:
    """A unit of ``layout`` on each of ``gpus`` (made as plain tuples: the checked constructor is a
    Python call per unit, and planners make thousands)."""
    return tuple(map(tuple.__new__, repeat(Unit), zip(repeat(layout), gpus)))


_T = TypeVar("_T")


def gpu_chunks(gpus: Sequence[_T], size: int) -> list[tuple[_T, ...]]:
    """``gpus`` cut into consecutive tuples of ``size`` (e.g. a candidate's units, in order; or
    units into groups)."""
    return list(zip(*[iter(gpus)] * size, strict=True))


#: A node's memory effect on one GPU: ``(gpu, net, transient)``: ``net`` bytes it leaves allocated
#: (negative: freed) once it ends, ``transient`` buffer bytes it holds only while it runs.
MemEffect = tuple[int, float, float]


def no_transfers() -> tuple[Transfer, ...]:
    """A Destroy's transfers: none."""
    return ()


def acquired_gpus(op: Primitive, targets: tuple[Unit, ...]) -> tuple[int, ...]:
    """GPUs a call of ``op`` creating ``targets`` newly places state on: Extend's targets."""
    if op is not Primitive.EXTEND:
        return ()
    return tuple(g for u in targets for g in u.gpus)


def released_gpus(op: Primitive, sources: tuple[Unit, ...], targets: tuple[Unit, ...]) -> tuple[int, ...]:
    """GPUs a call of ``op`` leaves: Destroy's, and those of Split's source that no target keeps."""
    if op is Primitive.DESTROY:
        return tuple(g for u in sources for g in u.gpus)
    if op is Primitive.SPLIT:
        keep = {g for t in targets for g in t.gpus}
        return tuple(g for u in sources for g in u.gpus if g not in keep)
    return ()


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
    sources: tuple[Unit, ...]
    targets: tuple[Unit, ...]
    deps: tuple[int, ...]
    mem: tuple[MemEffect, ...]
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
        ns, nt, nm = len(self.sources) // width, len(self.targets) // width, len(self.mem) // width
        return tuple(
            self._replace(
                sources=self.sources[k * ns : (k + 1) * ns],
                targets=self.targets[k * nt : (k + 1) * nt],
                mem=self.mem[k * nm : (k + 1) * nm],
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
        """GPUs this node newly places state of its model-stage on (Extend's targets)."""
        return acquired_gpus(self.op, self.targets)

    @property
    def released_gpus(self) -> tuple[int, ...]:
        """GPUs whose unit of this model-stage the node drops (Destroy; Split's GPUs it does not keep)."""
        return released_gpus(self.op, self.sources, self.targets)

    @property
    def gpus(self) -> tuple[int, ...]:
        """Every GPU the node touches."""
        return tuple(dict.fromkeys(g for u in self.sources + self.targets for g in u.gpus))

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
    """Anything with memory effects (a node, or a local node before it has an id)."""

    @property
    def mem(self) -> tuple[MemEffect, ...]: ...


def memory_growth(nodes: Iterable[HasMemory], num_gpus: int) -> list[float]:
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


@dataclass(frozen=True, eq=False)
class TransitionDAG:
    """Nodes in a topological order (``nodes[i].id == i``; every dep is an earlier id); immutable."""

    nodes: tuple[Node, ...]
    context: TransitionContext
    global_order: bool = True  # False for the per-component baseline (no resource edges)

    def memory_growth(self) -> list[float]:
        """:func:`memory_growth` of the nodes."""
        return memory_growth(self.nodes, self.context.cluster.num_gpus)

    @cached_property
    def cost(self) -> float:
        """``L_tran`` in seconds on the context's cluster."""
        from nereus_lightning.transition.cost import transition_cost

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
