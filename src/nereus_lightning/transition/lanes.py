"""The primitive calls of a local DAG (*lanes*) by step, and the grouping pass that makes them nodes.

The local planner (``transition.local``) numbers a model-stage's lanes in the order it decides
them and emits them by :class:`Step` of its local DAG, one :class:`StepLanes` (columns: every lane
of the step) per step; a lane depends on lanes of earlier steps only. :func:`group` makes them one
:class:`LocalNode` per lane in lane order, or (batched) one per step in step order: both orders
are topological. :func:`numbered` gives local nodes their ids.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from enum import IntEnum
from typing import Any, NamedTuple

from nereus_lightning.transition.dag import MemEffect, Node, Primitive, Unit
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
    sources: tuple[Unit, ...]
    targets: tuple[Unit, ...]
    deps: Sequence[tuple[int, ...]]
    mem: tuple[MemEffect, ...]
    make_transfers: Callable[..., Sequence[Transfer]]
    lane_args: tuple[tuple[Any, ...], ...]


class LocalNode(NamedTuple):
    """A node of one model-stage's local DAG before it has an id (fields as :class:`Node`'s;
    ``deps`` are indices of earlier local nodes)."""

    op: Primitive
    model_stage: str
    sources: tuple[Unit, ...]
    targets: tuple[Unit, ...]
    deps: tuple[int, ...]
    mem: tuple[MemEffect, ...]
    make_transfers: Callable[..., Sequence[Transfer]]
    lane_args: tuple[tuple[Any, ...], ...]


def group(name: str, steps: Sequence[StepLanes], batch: bool, first: int = 0) -> list[LocalNode]:
    """The local nodes of model-stage ``name``: one per lane (numbered as the lanes), or with
    ``batch`` one per step (in step order, deps mapped from lanes to their steps); deps count
    from ``first`` (where the nodes will stand in a longer list)."""
    steps = sorted((x for x in steps if x.ids), key=lambda x: x.step)
    if batch:
        node_of = {lane: first + i for i, x in enumerate(steps) for lane in x.ids}
        return [
            LocalNode(
                x.op,
                name,
                x.sources,
                x.targets,
                tuple(sorted({node_of[d] for deps in x.deps for d in deps})),
                x.mem,
                x.make_transfers,
                x.lane_args,
            )
            for x in steps
        ]
    out: list[LocalNode | None] = [None] * sum(len(x.ids) for x in steps)
    for x in steps:
        n = len(x.ids)
        ns, nt, nm = len(x.sources) // n, len(x.targets) // n, len(x.mem) // n
        for k, lane in enumerate(x.ids):
            out[lane] = LocalNode(
                x.op,
                name,
                x.sources[k * ns : k * ns + ns],
                x.targets[k * nt : k * nt + nt],
                tuple(first + d for d in x.deps[k]) if first else x.deps[k],
                x.mem[k * nm : k * nm + nm],
                x.make_transfers,
                x.lane_args[k : k + 1],
            )
    assert None not in out, "lane numbers must be 0, 1, ... without gaps"
    return out  # type: ignore[return-value]


def numbered(nodes: Sequence[LocalNode], first_id: int = 0) -> list[Node]:
    """``nodes`` as DAG nodes with ids from ``first_id`` (their deps counted so already, see
    :func:`group`; no resource deps)."""
    return [
        Node(
            first_id + i,
            n.op,
            n.model_stage,
            n.sources,
            n.targets,
            n.deps,
            n.mem,
            (),
            n.make_transfers,
            n.lane_args,
        )
        for i, n in enumerate(nodes)
    ]
