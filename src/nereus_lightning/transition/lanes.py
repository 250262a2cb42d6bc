"""The primitive calls of a local DAG (*lanes*), and the grouping pass that makes them nodes.

The local planner (``transition.local``) emits a model-stage's lanes in order, each at a
:class:`Step` of its local DAG; a lane depends on lanes of earlier steps only. :func:`group` makes
them one :class:`LocalNode` per lane, or (batched) one per step in step order with that step's lanes
in order: both orders are topological. :func:`numbered` gives local nodes their ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import IntEnum
from itertools import chain
from typing import NamedTuple

from nereus_lightning.transition.dag import MemEffect, Node, Primitive, TransferRecipe, Unit


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
    """The step of the Merges: after the sources they might share GPUs with are gone."""
    return last_extend + 2


class Lane(NamedTuple):
    """One primitive call of a local DAG: ``deps`` are the indices of earlier lanes."""

    step: int
    op: Primitive
    sources: tuple[Unit, ...]
    targets: tuple[Unit, ...]
    deps: tuple[int, ...]
    mem: tuple[MemEffect, ...]
    transfers: TransferRecipe


class LocalNode(NamedTuple):
    """A node of one model-stage's local DAG before it has an id: one lane, or a step's lanes
    (alike: as many sources, targets and memory effects each) concatenated; ``deps`` are indices
    of earlier local nodes."""

    op: Primitive
    model_stage: str
    sources: tuple[Unit, ...]
    targets: tuple[Unit, ...]
    deps: tuple[int, ...]
    mem: tuple[MemEffect, ...]
    recipes: tuple[TransferRecipe, ...]


def group(name: str, lanes: Sequence[Lane], batch: bool) -> list[LocalNode]:
    """The local nodes of model-stage ``name``: one per lane, or with ``batch`` one per step."""
    if not batch:
        return [LocalNode(x.op, name, x.sources, x.targets, x.deps, x.mem, (x.transfers,)) for x in lanes]
    steps = sorted({x.step for x in lanes})
    node_of_step = {step: i for i, step in enumerate(steps)}
    by_step: dict[int, list[Lane]] = {step: [] for step in steps}
    for x in lanes:
        by_step[x.step].append(x)
    out = []
    for step in steps:
        members = by_step[step]
        deps = {node_of_step[lanes[d].step] for x in members for d in x.deps}
        out.append(
            LocalNode(
                members[0].op,
                name,
                tuple(chain.from_iterable(x.sources for x in members)),
                tuple(chain.from_iterable(x.targets for x in members)),
                tuple(sorted(deps)),
                tuple(chain.from_iterable(x.mem for x in members)),
                tuple(x.transfers for x in members),
            )
        )
    return out


def numbered(nodes: Sequence[LocalNode], first_id: int = 0) -> list[Node]:
    """``nodes`` as DAG nodes with ids from ``first_id`` (deps shifted alike, no resource deps)."""
    return [
        Node(
            first_id + i,
            n.op,
            n.model_stage,
            n.sources,
            n.targets,
            tuple(first_id + d for d in n.deps),
            n.mem,
            (),
            n.recipes,
        )
        for i, n in enumerate(nodes)
    ]
