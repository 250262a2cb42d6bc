"""The primitive calls of a local DAG (*lanes*) by step, and the grouping pass that makes them nodes.

The local planner (``transition.local``) numbers a model-stage's lanes in the order it decides
them and emits them by :class:`Step` of its local DAG, one :class:`StepLanes` (columns: every lane
of the step) per step; a lane depends on lanes of earlier steps only. :func:`group` makes them
:class:`LocalNode` s: the lanes of a step that no same-stage peer can make wait
(:func:`waiting_lanes`) share one (batched) node; the others share one only with the lanes that
wait for the same peer releases after the same nodes (the global order then picks each node's
moment; ``build`` joins alike ones that wait for the same nodes afterwards). A per-replica local
DAG is one node per lane, in lane order (:func:`one_per_lane`). :func:`numbered` gives local nodes
ids.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Hashable, Mapping, Sequence
from enum import IntEnum
from typing import Any, NamedTuple

from nereus_lightning.transition.dag import Memory, Node, Primitive, Units, acquired_gpus, acquires_some
from nereus_lightning.transition.pieces import Transfer


class Step(IntEnum):
    """The steps of a local DAG, in order (an Extend chained onto another's slot is one step later)."""

    SPLIT = 0  # current units into T_sub units
    DROP_PIECES = 1  # the T_sub units a Split made that nothing uses
    DROP_UNITS = 2  # current units that neither stay nor feed an Extend
    FIRST_EXTEND = 3  # Extends reading a T_sub unit that exists; a chained one: its source's step + 1


def drop_sources_step(last_extend: int) -> int:
    """The step of the Destroys of Extend sources that are not part of the target: after every Extend."""
    return last_extend + 1


def merge_step(last_extend: int) -> int:
    """The step of the Merges: after every unit they read has been made and read."""
    return last_extend + 2


class StepLanes(NamedTuple):
    """Every lane of one step of a local DAG, by columns.

    The lanes are alike: as many sources, targets and memory effects each (``sources``,
    ``targets`` and ``mem`` are theirs concatenated). ``ids`` are the lanes' numbers (ascending),
    ``deps`` per lane the numbers of the lanes it waits for; lane ``k``'s transfers are
    ``make_transfers(*lane_args[k])``.
    """

    step: int
    op: Primitive
    ids: Sequence[int]
    sources: Units
    targets: Units
    deps: Sequence[tuple[int, ...]]
    mem: Memory
    make_transfers: Callable[..., Sequence[Transfer]]
    lane_args: tuple[tuple[Any, ...], ...]


class LocalNode(NamedTuple):
    """A node of one model-stage's local DAG before it has an id: lanes ``ks`` (positions in
    ``lanes.ids``) of one step; ``deps`` are indices of earlier local nodes. Its units, memory
    effects and transfer arguments are the step's, taken when read."""

    model_stage: str
    lanes: StepLanes
    ks: tuple[int, ...]
    deps: tuple[int, ...]

    @property
    def op(self) -> Primitive:
        """The primitive its lanes call."""
        return self.lanes.op

    @property
    def width(self) -> int:
        """How many lanes this node carries."""
        return len(self.ks)

    @property
    def sources(self) -> Units:
        """The units its lanes read."""
        return self.lanes.sources.take(self.ks, len(self.lanes.ids))

    @property
    def targets(self) -> Units:
        """The units its lanes make."""
        return self.lanes.targets.take(self.ks, len(self.lanes.ids))

    def source_gpus(self) -> list[int]:
        """Every GPU of the units its lanes read, in order."""
        return self.lanes.sources.gpus_of(self.ks, len(self.lanes.ids))

    def target_gpus(self) -> list[int]:
        """Every GPU of the units its lanes make, in order."""
        return self.lanes.targets.gpus_of(self.ks, len(self.lanes.ids))

    @property
    def mem(self) -> Memory:
        """Its lanes' memory effects."""
        return self.lanes.mem.take(self.ks, len(self.lanes.ids))

    def node(
        self,
        id: int,
        deps: tuple[int, ...],
        resource_deps: tuple[int, ...] = (),
        ks: Sequence[int] | None = None,
    ) -> Node:
        """This node numbered ``id``, after ``deps`` (of which ``resource_deps`` the global order
        added); with ``ks``, carrying those lanes of its step instead of its own."""
        x, n = self.lanes, len(self.lanes.ids)
        ks = self.ks if ks is None else ks
        return Node(
            id,
            x.op,
            self.model_stage,
            x.sources.take(ks, n),
            x.targets.take(ks, n),
            deps,
            x.mem.take(ks, n),
            resource_deps,
            x.make_transfers,
            x.lane_args if len(ks) == n else tuple([x.lane_args[k] for k in ks]),
        )


def waiting_lanes(steps: Sequence[StepLanes], contested: set[int]) -> dict[int, Collection[int]]:
    """The lanes a same-stage peer can make wait: those acquiring a ``contested`` GPU (one a peer holds
    now; :func:`~nereus_lightning.transition.dag.acquired_gpus`) and every lane after one of them; each
    with the contested GPUs it lands on."""
    waiting: dict[int, Collection[int]] = {}
    for x in sorted(steps, key=lambda x: x.step):
        if acquires_some(x.op, x.sources, x.targets):
            onto_by_lane = x.targets.by_lane(len(x.ids))
            if x.op is not Primitive.EXTEND:  # a re-cut to a larger shard degree
                had_by_lane = x.sources.by_lane(len(x.ids))
                onto_by_lane = [
                    acquired_gpus(x.op, *gpus) for gpus in zip(had_by_lane, onto_by_lane, strict=True)
                ]
            for lane, onto in zip(x.ids, onto_by_lane, strict=True):
                if not contested.isdisjoint(onto):
                    waiting[lane] = contested.intersection(onto)
        if waiting:  # (none before the first Extend onto a contested GPU)
            for lane, deps in zip(x.ids, x.deps, strict=True):
                if not waiting.keys().isdisjoint(deps):
                    waiting.setdefault(lane, ())
    return waiting


def group(
    name: str, steps: Sequence[StepLanes], waits: Mapping[int, Hashable], first: int = 0
) -> list[LocalNode]:
    """The local nodes of model-stage ``name``, deps mapped from lanes to nodes and counted from
    ``first`` (where the nodes will stand in a longer list).

    The lanes of a step not in ``waits`` share one (batched) node. A lane in ``waits`` shares a
    node with the lanes of its step that wait for the same (``waits[lane]``) after the same
    nodes: the global replay treats them alike. Nodes go by step, the batched one first, the
    others in the order of their first lanes (a topological order).
    """
    node_of: dict[int, int] = {}
    out: list[LocalNode] = []
    for x in sorted((x for x in steps if x.ids), key=lambda x: x.step):
        parts: list[Sequence[int]] = [range(len(x.ids))]
        if not waits.keys().isdisjoint(x.ids):  # by (what they wait for, after which nodes)
            by_key: dict[Hashable, list[int]] = {None: []}  # None: the lanes that do not wait
            for k, lane in enumerate(x.ids):
                key = (waits[lane], frozenset(map(node_of.__getitem__, x.deps[k]))) if lane in waits else None
                by_key.setdefault(key, []).append(k)
            parts = [ks for ks in by_key.values() if ks]
        for ks in parts:
            every = len(ks) == len(x.ids)
            lane_deps = x.deps if every else [x.deps[k] for k in ks]
            deps = {node_of[d] for lane in lane_deps for d in lane}  # (lanes wait for earlier steps)
            node_of.update(dict.fromkeys(x.ids if every else [x.ids[k] for k in ks], first + len(out)))
            out.append(LocalNode(name, x, tuple(ks), tuple(sorted(deps))))
    return out


def one_per_lane(name: str, steps: Sequence[StepLanes], first: int = 0) -> list[LocalNode]:
    """The local nodes of model-stage ``name``, one per lane, in lane order (the lanes numbered 0,
    1, ... without gaps), deps counted from ``first``."""
    out: list[LocalNode | None] = [None] * sum(len(x.ids) for x in steps)
    for x in steps:
        for k, lane in enumerate(x.ids):
            deps = tuple(first + d for d in x.deps[k]) if first else x.deps[k]
            out[lane] = LocalNode(name, x, (k,), deps)
    assert None not in out, "lane numbers must be 0, 1, ... without gaps"
    return out  # type: ignore[return-value]


def numbered(nodes: Sequence[LocalNode], first_id: int = 0) -> list[Node]:
    """``nodes`` as DAG nodes with ids from ``first_id`` (their deps counted so already, see
    :func:`group`; no resource deps)."""
    return [n.node(first_id + i, n.deps) for i, n in enumerate(nodes)]
