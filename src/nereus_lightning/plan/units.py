"""Units, the four primitives over them, and Split/Merge geometry: one vocabulary for brain and body.

A :class:`Unit` is one replica (an EMU) of a model-stage: a :class:`Layout` on ``gpus``, listed
as a ``Candidate`` lists a replica's GPUs (index ``pp_rank * tp + tp_rank``). The brain plans on
the cluster's GPU ids; the body runs one process per GPU, rank ``r`` driving GPU ``r`` (its DAG
executor maps another numbering through ``rank_of``). :class:`Primitive` names the four calls
a transition DAG node (``transition.dag``) or an EMU op (``emu.ops``) makes on units.

Split geometry (written once, here): a unit of layout ``x`` splits into ``k_tp * k_pp`` units of
a smaller ``s`` (``k_tp = x.tp // s.tp``, ``k_pp = x.pp // s.pp``); position ``(pp, tp)`` of
``x`` joins sub-unit ``(pp % k_pp) * k_tp + tp % k_tp`` at position ``(pp // k_pp, tp // k_tp)``,
so the GPUs that pool their shards are neighbours. Merge's canonical order is its inverse.
:func:`sub_positions` is that map; the other functions are fast forms of it on GPU tuples.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from math import gcd
from operator import itemgetter
from typing import NamedTuple

from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import require


class Primitive(str, Enum):
    """The four EMU primitives (section 5.2 of the paper)."""

    SPLIT = "split"  # one unit -> k units of a smaller layout on the same GPUs (gather within groups)
    MERGE = "merge"  # k units -> one unit of a larger layout on their GPUs (only non-resident pieces move)
    EXTEND = "extend"  # copy one unit onto new GPUs, rank-aligned (the source stays)
    DESTROY = "destroy"  # drop one unit and free its GPUs (no transfers)

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class Position:
    """One GPU's place in a unit: its pipeline stage and TP rank."""

    pp_rank: int
    tp_rank: int


def position_of(layout: Layout, index: int) -> Position:
    """The position of index ``index`` of a unit (``pp_rank * tp + tp_rank``, as in ``Candidate``)."""
    pp_rank, tp_rank = divmod(index % (layout.pp * layout.tp), layout.tp)  # every shard rank alike
    return Position(pp_rank, tp_rank)


class _UnitFields(NamedTuple):
    layout: Layout
    gpus: tuple[int, ...]


class Unit(_UnitFields):
    """One replica (EMU) of a model-stage: ``layout`` on ``gpus`` (index ``pp_rank * tp + tp_rank``).

    A tuple: hashable, ordered, and cheap. Building one checks it (one GPU per position, none
    twice); the brain plans on GPU tuples and makes units only for the body (``transition.dag.Units``).
    """

    __slots__ = ()

    def __new__(cls, layout: Layout, gpus: Iterable[int]) -> Unit:
        gpus = tuple(map(int, gpus))
        if len(gpus) != layout.size:
            require(False, "unit.gpus", f"{len(gpus)} GPUs given for {layout} ({layout.size} needed)")
        if len(set(gpus)) != len(gpus):
            require(False, "unit.gpus", f"GPUs repeat in {gpus}")
        return super().__new__(cls, layout, gpus)

    def position(self, gpu: int) -> Position:
        """The (pp_rank, tp_rank) of ``gpu`` in this unit."""
        require(gpu in self.gpus, "rank", f"GPU {gpu} is not in unit {self}")
        return position_of(self.layout, self.gpus.index(gpu))

    def gpu_at(self, pp_rank: int, tp_rank: int) -> int:
        """The GPU at position (``pp_rank``, ``tp_rank``)."""
        return self.gpus[pp_rank * self.layout.tp + tp_rank]

    def __str__(self) -> str:
        return f"{self.layout}@{list(self.gpus)}"


@lru_cache(maxsize=1024)
def common_layout(a: Layout, b: Layout) -> Layout:
    """``T_sub``: the largest layout into which both ``a`` and ``b`` can be split."""
    return Layout(gcd(a.tp, b.tp), gcd(a.pp, b.pp))


@lru_cache(maxsize=1024)
def sub_positions(x: Layout, s: Layout) -> tuple[tuple[int, ...], ...]:
    """For each sub-unit ``j`` of a layout-``x`` unit split into ``s``: its positions as ``x`` indices."""
    k_tp, k_pp = x.tp // s.tp, x.pp // s.pp
    out = []
    for jp in range(k_pp):
        for jt in range(k_tp):
            out.append(
                tuple((pq * k_pp + jp) * x.tp + tq * k_tp + jt for pq in range(s.pp) for tq in range(s.tp))
            )
    return tuple(out)


def split_units(unit: Unit, s: Layout) -> tuple[Unit, ...]:
    """The ``s`` units a Split of ``unit`` makes, in :func:`sub_positions` order."""
    return tuple(Unit(s, gpus) for gpus in splitter(unit.layout, s)(unit.gpus))


def merged_gpus(units: Sequence[Unit], b: Layout) -> tuple[int, ...]:
    """The GPUs of the layout-``b`` unit that a canonical Merge of ``units`` (one layout, in
    :func:`sub_positions` order) makes: the inverse of :func:`split_units`."""
    out = [0] * b.size
    for positions, unit in zip(sub_positions(b, units[0].layout), units, strict=True):
        for x, gpu in zip(positions, unit.gpus, strict=True):
            out[x] = gpu
    return tuple(out)


@lru_cache(maxsize=1024)
def splitter(x: Layout, s: Layout) -> Callable[[tuple[int, ...]], list[tuple[int, ...]]]:
    """A function from a layout-``x`` unit's GPUs to its ``s`` sub-units' GPUs (``sub_positions`` order)."""
    positions = sub_positions(x, s)
    if len(positions) == 1:
        return lambda gpus: [gpus]
    flat = itemgetter(*(i for idx in positions for i in idx))
    size = s.size
    if size == 1:
        return lambda gpus: list(zip(flat(gpus)))  # single GPUs: C speed
    return lambda gpus: list(zip(*[iter(flat(gpus))] * size, strict=True))


@lru_cache(maxsize=1024)
def sub_gpus(x: Layout, s: Layout, units: int) -> Callable[[tuple[int, ...]], tuple[int, ...]]:
    """The GPUs of :func:`all_subs`'s sub-units, flat (a tuple: compared without making the units)."""
    positions = [u * x.size + i for u in range(units) for idx in sub_positions(x, s) for i in idx]
    if not positions:
        return lambda gpus: ()
    if positions == list(range(len(positions))):  # every GPU in order (e.g. TP2 -> TP1)
        return tuple
    return itemgetter(*positions) if len(positions) > 1 else (lambda gpus: (gpus[positions[0]],))


@lru_cache(maxsize=1024)
def all_subs(x: Layout, s: Layout, units: int) -> Callable[[tuple[int, ...]], list[tuple[int, ...]]]:
    """Like :func:`splitter` for ``units`` consecutive layout-``x`` units at once (unit-major)."""
    flat = sub_gpus(x, s, units)
    size = s.size
    if size == 1:
        return lambda gpus: list(zip(flat(gpus)))
    return lambda gpus: list(zip(*[iter(flat(gpus))] * size, strict=True))
