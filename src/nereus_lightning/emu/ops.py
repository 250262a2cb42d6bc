"""The four primitives as data: one small frozen dataclass per call (an :data:`Op`), over units.

A transition DAG node maps to one of these; :func:`nereus_lightning.emu.primitives.execute` runs
it. Building one validates everything that can be checked without a registry (degrees, rank
counts, disjointness); pure Python, no torch. Units, the :class:`Primitive` kinds and the Split
geometry are the brain's (``plan.units``); a unit's ``gpus`` are the ranks that hold it.

- :class:`Split`: one unit -> k units of a smaller layout on the same ranks, in
  ``plan.units.sub_positions`` order (the ranks that pool their shards are neighbours).
- :class:`Merge`: k units of one layout -> one larger unit on their ranks (the inverse mapping
  by default, which moves nothing when the shards already nest); with one source unit, a
  re-ranking of it onto the same ranks in another order.
- :class:`Extend`: one unit -> the same unit plus copies on disjoint rank tuples (same positions).
- :class:`Destroy`: drop one unit.
- :class:`Recut`: a sharded unit's row blocks re-cut to another shard degree in place (a Split to a
  larger degree on more ranks, a Merge to a smaller one on fewer; ``emu.recut``).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from nereus_lightning.emu.schema import StateSchema
from nereus_lightning.emu.transfer_plan import (
    element_count,
    merged_holdings,
    position_holdings,
    reshard_plan,
    unit_holdings,
)
from nereus_lightning.plan.layout import Layout
from nereus_lightning.plan.units import Primitive, Unit, merged_gpus, split_units
from nereus_lightning.spec.errors import require

if TYPE_CHECKING:
    from nereus_lightning.transition.dag import Node


@dataclass(frozen=True)
class Split:
    """Split ``source`` into ``targets`` (smaller layout, same ranks)."""

    kind: ClassVar[Primitive] = Primitive.SPLIT
    model_stage: str
    source: Unit
    targets: tuple[Unit, ...]

    @property
    def sources(self) -> tuple[Unit, ...]:
        """The units consumed."""
        return (self.source,)


@dataclass(frozen=True)
class Merge:
    """Merge replicated ``sources`` into ``target`` (larger layout on the union of their ranks)."""

    kind: ClassVar[Primitive] = Primitive.MERGE
    model_stage: str
    sources: tuple[Unit, ...]
    target: Unit

    @property
    def targets(self) -> tuple[Unit, ...]:
        """The units produced."""
        return (self.target,)


@dataclass(frozen=True)
class Extend:
    """Copy ``source`` onto the disjoint rank tuples of ``targets`` (same layout); ``source`` stays."""

    kind: ClassVar[Primitive] = Primitive.EXTEND
    model_stage: str
    source: Unit
    targets: tuple[Unit, ...]

    @property
    def sources(self) -> tuple[Unit, ...]:
        """The unit copied (it stays alive)."""
        return (self.source,)


@dataclass(frozen=True)
class Destroy:
    """Drop replica ``source`` and free its memory."""

    kind: ClassVar[Primitive] = Primitive.DESTROY
    model_stage: str
    source: Unit

    @property
    def sources(self) -> tuple[Unit, ...]:
        """The unit dropped."""
        return (self.source,)

    @property
    def targets(self) -> tuple[Unit, ...]:
        """Nothing is produced."""
        return ()


@dataclass(frozen=True)
class Recut:
    """Re-cut the sharded ``source`` to ``target``: the same model cut and ZeRO stage, another shard
    degree, each replica on a superset of the source's ranks (a Split of the rows) or a subset (a Merge)."""

    model_stage: str
    source: Unit
    target: Unit

    @property
    def kind(self) -> Primitive:
        """A Split to a larger shard degree, a Merge to a smaller one."""
        return Primitive.SPLIT if self.target.layout.shard > self.source.layout.shard else Primitive.MERGE

    @property
    def sources(self) -> tuple[Unit, ...]:
        """The unit consumed."""
        return (self.source,)

    @property
    def targets(self) -> tuple[Unit, ...]:
        """The unit produced."""
        return (self.target,)


Op = Split | Merge | Extend | Destroy | Recut


def _factor(big: int, small: int, field: str) -> int:
    require(
        small >= 1 and big % small == 0 and (big // small) & (big // small - 1) == 0,
        field,
        f"{small} must divide {big} by a power of two",
    )
    return big // small


def split(model_stage: str, source: Unit, layout: Layout) -> Split:
    """Split ``source`` into ``tp/layout.tp * pp/layout.pp`` units of ``layout`` on its ranks."""
    a = _factor(source.layout.tp, layout.tp, "split.layout.tp")
    b = _factor(source.layout.pp, layout.pp, "split.layout.pp")
    require(a * b > 1, "split.layout", f"{layout} is not smaller than {source.layout}")
    return Split(model_stage, source, split_units(source, layout))


def canonical_merge_ranks(sources: Sequence[Unit], layout: Layout) -> tuple[int, ...]:
    """The inverse of :func:`split`'s mapping (``plan.units.merged_gpus``), checked."""
    small = sources[0].layout
    a = _factor(layout.tp, small.tp, "merge.layout.tp")
    b = _factor(layout.pp, small.pp, "merge.layout.pp")
    require(
        len(sources) == a * b,
        "merge.sources",
        f"{len(sources)} units given, {small} -> {layout} needs {a * b}",
    )
    return merged_gpus(sources, layout)


def merge(
    model_stage: str,
    sources: Sequence[Unit],
    layout: Layout,
    ranks: Sequence[int] | None = None,
    schema: StateSchema | None = None,
    trains: bool = True,
) -> Merge:
    """Merge ``sources`` (one layout, disjoint ranks) into one unit of ``layout`` on their ranks.

    ``ranks`` fixes the target order; without it the order that moves the fewest bytes is chosen
    (the canonical inverse of Split, or a greedy assignment when ``schema`` says it is cheaper).
    """
    sources = tuple(sources)
    require(len(sources) >= 2, "merge.sources", f"need at least two units, got {len(sources)}")
    small = sources[0].layout
    require(
        all(u.layout == small for u in sources),
        "merge.sources",
        f"units differ in layout: {[str(u) for u in sources]}",
    )
    pool = [r for u in sources for r in u.gpus]
    require(len(set(pool)) == len(pool), "merge.sources", f"units share ranks: {[str(u) for u in sources]}")
    canonical = canonical_merge_ranks(sources, layout)
    if ranks is None:
        ranks = (
            canonical
            if schema is None
            else _cheapest_order(model_stage, schema, sources, layout, canonical, trains)
        )
    ranks = tuple(ranks)
    require(
        sorted(ranks) == sorted(pool),
        "merge.ranks",
        f"{ranks} must be exactly the source ranks {sorted(pool)}",
    )
    return Merge(model_stage, sources, Unit(layout, ranks))


def _cheapest_order(
    model_stage: str,
    schema: StateSchema,
    sources: tuple[Unit, ...],
    layout: Layout,
    canonical: tuple[int, ...],
    trains: bool,
) -> tuple[int, ...]:
    held = merged_holdings(*(unit_holdings(schema, u.layout, u.gpus) for u in sources))

    def cost(order: tuple[int, ...]) -> int:
        plan = reshard_plan(Merge(model_stage, sources, Unit(layout, order)), schema, trains)
        return sum(plan.payload_bytes(schema, trains).values())

    # Greedy: each target position takes the free rank that already holds most of its shard.
    free = sorted(held)
    greedy: list[int] = []
    for index in range(layout.size):
        want = position_holdings(schema, layout, index)
        best = min(free, key=lambda r: (_missing(schema, want, held[r]), r))
        greedy.append(best)
        free.remove(best)
    return min((canonical, tuple(greedy)), key=cost)


def _missing(schema: StateSchema, want: dict, have: dict) -> int:
    total = 0
    for name, (lo, hi) in want.items():
        h = have.get(name)
        covered = 0 if h is None else max(0, min(hi, h[1]) - max(lo, h[0]))
        total += element_count(schema, name, 0, (hi - lo) - covered) if hi - lo > covered else 0
    return total


def extend(model_stage: str, source: Unit, new_ranks: Sequence[Sequence[int]]) -> Extend:
    """Copy ``source`` onto each rank tuple of ``new_ranks`` (disjoint from it and from each other)."""
    targets = tuple(Unit(source.layout, r) for r in new_ranks)
    require(len(targets) >= 1, "extend.new_ranks", "give at least one rank tuple")
    used = list(source.gpus) + [r for t in targets for r in t.gpus]
    require(
        len(set(used)) == len(used),
        "extend.new_ranks",
        f"{[t.gpus for t in targets]} overlap each other or {source}",
    )
    return Extend(model_stage, source, targets)


def destroy(model_stage: str, source: Unit) -> Destroy:
    """Drop ``source``."""
    return Destroy(model_stage, source)


def validate_op(op: Op) -> None:
    """Check an op built directly (e.g. from a DAG node): degrees, rank partitions, disjointness."""
    if isinstance(op, Recut):
        was, now = op.source.layout, op.target.layout
        old, new = set(op.source.gpus), set(op.target.gpus)
        require(
            (was.tp, was.pp, was.zero) == (now.tp, now.pp, now.zero)
            and was.zero > 0
            and (old < new or new < old),
            "recut",
            f"{op.source} -> {op.target} is not a re-cut of the shard degree onto a superset or subset",
        )
    elif isinstance(op, Split):
        require(bool(op.targets), "split.targets", "need units of one layout")
        small = op.targets[0].layout
        require(all(u.layout == small for u in op.targets), "split.targets", "need units of one layout")
        a = _factor(op.source.layout.tp, small.tp, "split.layout.tp")
        b = _factor(op.source.layout.pp, small.pp, "split.layout.pp")
        require(
            len(op.targets) == a * b > 1,
            "split.targets",
            f"{len(op.targets)} units for {op.source.layout} -> {small}",
        )
        ranks = [r for u in op.targets for r in u.gpus]
        require(
            sorted(ranks) == sorted(op.source.gpus),
            "split.targets",
            f"{ranks} must partition {op.source.gpus}",
        )
    elif isinstance(op, Merge) and len(op.sources) == 1:
        # A re-ranking (the transition brain emits it when a target unit holds its T_sub unit's
        # ranks in another order): same layout, same ranks, shards moved to their new positions.
        source = op.sources[0]
        require(
            op.target.layout == source.layout and sorted(op.target.gpus) == sorted(source.gpus),
            "merge.sources",
            f"one source unit ({source}) only re-ranks onto the same layout and ranks, not {op.target}",
        )
    elif isinstance(op, Merge):
        merge(op.model_stage, op.sources, op.target.layout, ranks=op.target.gpus)
    elif isinstance(op, Extend):
        extend(op.model_stage, op.source, [u.gpus for u in op.targets])
        require(
            all(u.layout == op.source.layout for u in op.targets),
            "extend.targets",
            "copies keep the source layout",
        )


def from_node(node: Node, rank_of: Mapping[int, int] | None = None) -> Op:
    """The op of a ``transition.dag.Node`` (GPU ids mapped to global ranks by ``rank_of``; the node's
    own units by default).

    A batched node (``node.width > 1``) is one op per lane: ``emu.executor.ops_of(node)``.
    """
    require(
        node.width == 1,
        "node",
        f"node #{node.id} carries {node.width} replicas; use emu.executor.ops_of(node)",
    )
    sources, targets = ranked(node.sources, rank_of), ranked(node.targets, rank_of)
    op: Op
    if node.op is not Primitive.DESTROY and sources[0].layout.shard != targets[0].layout.shard:
        op = Recut(node.model_stage, sources[0], targets[0])
    elif node.op is Primitive.SPLIT:
        op = Split(node.model_stage, sources[0], targets)
    elif node.op is Primitive.MERGE:
        op = Merge(node.model_stage, sources, targets[0])
    elif node.op is Primitive.EXTEND:
        op = Extend(node.model_stage, sources[0], targets)
    else:
        op = Destroy(node.model_stage, sources[0])
    validate_op(op)
    return op


def ranked(units: Iterable[Unit], rank_of: Mapping[int, int] | None) -> tuple[Unit, ...]:
    """``units`` with their GPU ids mapped to global ranks by ``rank_of`` (as they are without it)."""
    if rank_of is None:
        return tuple(units)
    return tuple(Unit(u.layout, (rank_of[g] for g in u.gpus)) for u in units)
