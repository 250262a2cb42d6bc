"""The local DAG of one model-stage: Split -> Destroy -> Extend -> Merge through ``T_sub``.

``T_sub`` is the largest layout both the current and the target layouts split into
(``gcd`` of the TP and of the PP degrees; ``min`` for powers of two). Every current unit that
contributes is split into ``T_sub`` units on its own GPUs; each target unit is seen as ``k``
``T_sub`` *slots* (the GPU tuples its Merge will fuse). A ``T_sub`` unit that already sits exactly
on a slot is reused; every other slot is filled by Extend from a ``T_sub`` unit (on the same node
if one exists, else across nodes once per node, then chained inside the node); ``T_sub`` units
left over are destroyed, sources only after the Extends that read them (so the last copy of the
model-stage's state survives). Slot ``j`` of a layout-``X`` unit takes positions
``(p' * k_pp + j_pp, t' * k_tp + j_tp)``, so each GPU of a Merge already holds the TP chunk and
the blocks its target shard needs (``models.sharding``: chunk ``r`` of ``k * tp`` lies inside chunk
``r // k`` of ``tp``) and Merge copies nothing unless layer ranges do not nest.

The planner runs in phases, each a function below:

1. :func:`tile_current_units`: the T_sub units each current unit would split into;
2. :func:`choose_target_slots`: the T_sub units each target unit is merged from;
3. :func:`decide_reuse`: which slots exist already, which are missing, which units split;
4. :func:`plan_extends`: a source for every missing slot;
5. emit the lanes, step by step (``lanes.Step``): Splits (and the Destroys of unused pieces),
   Destroys of unused units, Extends, Destroys of used sources, Merges.

A unit is handled as its GPU tuple here (its layout is the phase's: current, T_sub or target);
:class:`Unit` objects are made only for the lanes.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from itertools import chain, repeat
from typing import NamedTuple

from nereus_lightning.plan.layout import Candidate, Layout
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.transition.dag import NO_TRANSFERS, Node, Primitive, TransferRecipe, Unit, gpu_chunks
from nereus_lightning.transition.lanes import Lane, Step, drop_sources_step, group, merge_step, numbered
from nereus_lightning.transition.pieces import Geometry, extend_transfers
from nereus_lightning.transition.tsub import (
    common_layout,
    merge_pattern,
    placed,
    split_pattern,
    splitter,
    sub_positions,
    uniform_effects,
)

Gpus = tuple[int, ...]  # a unit, by its GPUs


def local_dag(
    name: str,
    geo: Geometry,
    memory_of: Callable[[Layout], float],
    current: Candidate,
    target: Candidate,
    cluster: ClusterSpec,
    first_id: int = 0,
    *,
    batch: bool = False,
) -> list[Node]:
    """The nodes of one model-stage's local DAG; ids count from ``first_id``, deps are earlier ids.

    With ``batch``, one node per step of the local DAG carries that step for every replica at
    once (its lanes: the Splits, the Destroys of unused pieces, of unused units, the Extends of
    one chain depth, the Destroys of sources, the Merges); its deps are the union of its lanes'.
    """
    return numbered(group(name, local_lanes(geo, memory_of, current, target, cluster), batch), first_id)


def local_lanes(
    geo: Geometry,
    memory_of: Callable[[Layout], float],
    current: Candidate,
    target: Candidate,
    cluster: ClusterSpec,
) -> list[Lane]:
    """The primitive calls of one model-stage's local DAG, in order (see the module docstring)."""
    a, b = current.layout, target.layout
    if a == b and current.gpus == target.gpus:
        return []
    s = common_layout(a, b)
    cur_units, tgt_units = gpu_chunks(current.gpus, a.size), gpu_chunks(target.gpus, b.size)
    strided = [splitter(b, s)(v) for v in tgt_units]  # per target unit: its strided slots
    tiling = tile_current_units(a, s, cur_units, tgt_units if b == s else list(chain.from_iterable(strided)))
    slots = choose_target_slots(b, s, tgt_units, strided, tiling.where, set(current.gpus))
    reuse = decide_reuse(a, s, slots, tiling)
    candidates = [t for i in reuse.split_units for t in tiling.subs[i]] if reuse.missing else []
    extends = plan_extends(candidates, reuse.reused, reuse.missing, cluster.gpus_per_node)
    kept = reuse.reused.union(e.source for e in extends if e.source in tiling.where)
    splitting = [i for i in reuse.split_units if not kept.isdisjoint(tiling.subs[i])]
    mem = _UnitMemory(memory_of(a), memory_of(s), memory_of(b))
    lanes: list[Lane] = []
    made_by: dict[Gpus, int] = {}  # T_sub unit or slot -> the lane that made it
    if a != s:
        _emit_splits(lanes, made_by, geo, a, s, [(cur_units[i], i) for i in splitting], tiling, kept, mem)
    unused = set(range(len(cur_units))).difference(splitting)
    _emit_unit_drops(lanes, a, [cur_units[i] for i in sorted(unused)], mem.a)
    readers = _emit_extends(lanes, made_by, geo, s, extends, reuse.missing, mem.s)
    last = max((e.step for e in extends), default=Step.FIRST_EXTEND - 1)
    dropped = sorted(kept - reuse.reused, key=tiling.where.__getitem__)
    _emit_source_drops(lanes, drop_sources_step(last), s, dropped, made_by, readers, mem.s)
    rows = zip(tgt_units, slots, strict=True)
    _emit_merges(lanes, merge_step(last), geo, s, b, rows, made_by, readers, mem)
    return lanes


class _UnitMemory(NamedTuple):
    """Per-GPU resident bytes of one unit: current (``a``), T_sub (``s``) and target (``b``) layout."""

    a: float
    s: float
    b: float


class Tiling(NamedTuple):
    """The T_sub units each current unit would split into (``subs``, per unit), where each lies
    (``where``: T_sub unit -> (unit index, index among its T_sub units)), and whether the unit
    splits at the position-wise T_sub units (``sub_positions``) rather than at target slots."""

    subs: list[Sequence[Gpus]]
    where: dict[Gpus, tuple[int, int]]
    position_wise: list[bool]


def tile_current_units(a: Layout, s: Layout, cur_units: list[Gpus], slot_list: list[Gpus]) -> Tiling:
    """Phase 1: each current unit's T_sub units: the target's slots (``slot_list``: the target units
    if they are T_sub units, else their strided slots) when they tile the unit exactly (then Merge
    or nothing follows in place), else the position-wise split."""
    if a == s:  # each current unit is a T_sub unit
        where = {u: (i, 0) for i, u in enumerate(cur_units)}
        return Tiling([(u,) for u in cur_units], where, [True] * len(cur_units))
    slot_at = {g: slot for slot in slot_list for g in slot}
    pick = splitter(a, s)
    subs: list[Sequence[Gpus]] = []
    where: dict[Gpus, tuple[int, int]] = {}
    position_wise = []
    for i, u in enumerate(cur_units):
        by_position = pick(u)
        # Slots are disjoint, so they tile ``u`` exactly iff they cover its GPUs and no more.
        tiles = list(dict.fromkeys(slot_at.get(g, ()) for g in u))  # (): in no slot
        if tiles != by_position and (() in tiles or sum(map(len, tiles)) != len(u)):
            tiles = by_position
        subs.append(tiles)
        position_wise.append(tiles == by_position)
        where.update((t, (i, j)) for j, t in enumerate(tiles))
    return Tiling(subs, where, position_wise)


def choose_target_slots(
    b: Layout,
    s: Layout,
    tgt_units: list[Gpus],
    strided: list[list[Gpus]],
    where: dict[Gpus, tuple[int, int]],
    held: set[int],
) -> list[list[Gpus]]:
    """Phase 2: per target unit, the T_sub units its Merge fuses: its strided slots (the unit
    itself if it is a T_sub unit) when all exist or the unit holds none of this model-stage's
    GPUs now, else the ones :func:`_slots_of` finds."""
    rows = [[v] for v in tgt_units] if b == s else strided
    sub_at: dict[int, Gpus] = {}  # the T_sub unit each current GPU would be part of (made on first need)
    out = []
    for v, row in zip(tgt_units, rows, strict=True):
        if held.isdisjoint(v) or all(t in where for t in row):
            out.append(row)
            continue
        if not sub_at:
            sub_at = {g: t for t in where for g in t}
        out.append(_slots_of(v, row, b, s, where, sub_at))
    return out


def _slots_of(
    v: Gpus,
    strided: list[Gpus],
    b: Layout,
    s: Layout,
    where: dict[Gpus, tuple[int, int]],
    sub_at: dict[int, Gpus],
) -> list[Gpus]:
    """The T_sub units the target unit on GPUs ``v`` is merged from (``strided``: its strided slots;
    handed back when every one exists or none can).

    First the T_sub units lying exactly on a strided slot (Merge copies nothing there), then any
    other T_sub unit inside ``v``'s GPUs (Merge copies the pieces its GPUs lack), then new slots for
    Extend on the rest, each GPU at the sub-position whose shard contains its target shard where
    possible.
    """
    row = [t for t in strided if t in where]
    if len(row) == len(strided) or (not row and sub_at.keys().isdisjoint(v)):
        return strided
    inside = set(v)
    covered = {g for t in row for g in t}
    for g in v:
        t = sub_at.get(g)
        if t is not None and g not in covered and inside.issuperset(t):
            row.append(t)
            covered.update(t)
    if len(covered) == len(inside):
        return row
    k_tp, k_pp = b.tp // s.tp, b.pp // s.pp
    queues: list[list[int]] = [[] for _ in range(s.size)]
    for x, g in enumerate(v):
        if g not in covered:
            pi, ti = divmod(x, b.tp)
            queues[(pi // k_pp) * s.tp + ti // k_tp].append(g)
    for _ in range((len(inside) - len(covered)) // s.size):
        slot = []
        for q in range(s.size):
            src = queues[q] if queues[q] else next(qq for qq in queues if qq)
            slot.append(src.pop())
        row.append(tuple(slot))
    return row


class Reuse(NamedTuple):
    """Which slots exist already (``reused``), which must be made by Extend (``missing``, in
    order), and which current units are split (``split_units``, indices in order)."""

    reused: set[Gpus]
    missing: list[Gpus]
    split_units: list[int]


def decide_reuse(a: Layout, s: Layout, slots: list[list[Gpus]], tiling: Tiling) -> Reuse:
    """Phase 3: a slot that is a T_sub unit of a current unit is reused (that unit is split);
    if none is, just enough current units are split to have a source per missing slot."""
    flat = list(chain.from_iterable(slots))
    reused = {t for t in flat if t in tiling.where}
    missing = [t for t in flat if t not in tiling.where]
    split_units = sorted({tiling.where[t][0] for t in reused})
    if missing and not split_units:
        k = len(sub_positions(a, s))
        split_units = list(range(min(len(tiling.subs), -(-len(missing) // k))))
    return Reuse(reused, missing, split_units)


class PlannedExtend(NamedTuple):
    """The Extend filling one missing slot: its source unit, the index of the Extend that makes
    that source (None: a T_sub unit of a current unit) and its step."""

    source: Gpus
    made_by: int | None
    step: int


def plan_extends(
    candidates: list[Gpus], reused: set[Gpus], missing: list[Gpus], gpus_per_node: int
) -> list[PlannedExtend]:
    """Phase 4: a source for every missing slot, in slot order.

    On a node with candidates (T_sub units of the split units) or slots made there already: the
    least-loaded of them, reused ones on ties. Else, the first slot of a node takes the
    least-loaded candidate of the node that has sent least so far (spreading the copies over
    NICs), reused ones first, then the lower index; each later slot of that node chains from the
    slot made before it there.
    """
    n_cand = len(candidates)
    fresh = [t not in reused for t in candidates] + [True] * len(missing)  # by source index
    load = [0] * len(fresh)  # source index: candidates 0..n_cand-1, then slot j as n_cand + j
    pools: dict[int, list[int]] = defaultdict(list)  # per node: its candidates, then its slots made
    for k, t in enumerate(candidates):
        pools[t[0] // gpus_per_node].append(k)
    remote = _RemoteSources(candidates, fresh, gpus_per_node)
    tail: dict[int, int] = {}  # per node without candidates: its newest slot (the next source there)
    out: list[PlannedExtend] = []
    for j, slot in enumerate(missing):
        node = slot[0] // gpus_per_node
        si = tail.get(node)
        if si is not None:
            tail[node] = n_cand + j
        else:
            pool = pools.get(node)
            if pool:
                si = min(pool, key=lambda i: (load[i], fresh[i]))
                pool.append(n_cand + j)
            else:
                si = remote.pick(load)
                tail[node] = n_cand + j
            load[si] += 1
        if si < n_cand:
            out.append(PlannedExtend(candidates[si], None, Step.FIRST_EXTEND))
        else:
            made = si - n_cand
            out.append(PlannedExtend(missing[made], made, out[made].step + 1))
    return out


class _RemoteSources:
    """The candidate a node without candidates copies from: by (sends of its node, its load,
    fresh, index), kept as a lazy heap (keys only grow: a stale top is re-keyed and pushed back)."""

    def __init__(self, candidates: list[Gpus], fresh: list[bool], gpus_per_node: int) -> None:
        self.node_of = [t[0] // gpus_per_node for t in candidates]
        self.sent: dict[int, int] = defaultdict(int)
        self.heap = [(0, 0, fresh[k], k) for k in range(len(candidates))]
        heapq.heapify(self.heap)

    def pick(self, load: list[int]) -> int:
        """The best candidate now (counted as one more send of its node)."""
        heap, sent, node_of = self.heap, self.sent, self.node_of
        while True:
            n_sent, n_load, is_fresh, k = heap[0]
            if n_sent == sent[node_of[k]] and n_load == load[k]:
                break
            heapq.heapreplace(heap, (sent[node_of[k]], load[k], is_fresh, k))
        sent[node_of[k]] += 1
        return k


def _emit_splits(
    lanes: list[Lane],
    made_by: dict[Gpus, int],
    geo: Geometry,
    a: Layout,
    s: Layout,
    units: list[tuple[Gpus, int]],
    tiling: Tiling,
    kept: set[Gpus],
    mem: _UnitMemory,
) -> None:
    """Step SPLIT: each of ``units`` (GPUs, index) into its T_sub units (a full split keeps every
    GPU), each followed by the Destroys (step DROP_PIECES) of its T_sub units nothing uses."""
    net = mem.s - mem.a
    for u, i in units:
        subs = tiling.subs[i]
        if tiling.position_wise[i]:
            tiles = sub_positions(a, s)
        else:
            at = {g: x for x, g in enumerate(u)}
            tiles = tuple(tuple(at[g] for g in t) for t in subs)
        pattern, buf = split_pattern(geo, a, s, tiles)
        split = len(lanes)
        effects = tuple(zip(u, repeat(net), buf))
        lanes.append(
            Lane(
                Step.SPLIT,
                Primitive.SPLIT,
                (Unit(a, u),),
                tuple(Unit(s, t) for t in subs),
                (),
                effects,
                TransferRecipe(placed, (u, pattern)),
            )
        )
        for t in subs:
            made_by[t] = split
            if t not in kept:
                lanes.append(
                    Lane(
                        Step.DROP_PIECES,
                        Primitive.DESTROY,
                        (Unit(s, t),),
                        (),
                        (split,),
                        uniform_effects(t, -mem.s),
                        NO_TRANSFERS,
                    )
                )


def _emit_unit_drops(lanes: list[Lane], a: Layout, units: list[Gpus], mem_a: float) -> None:
    """Step DROP_UNITS: Destroy the current units that neither stay nor feed anything (release
    before acquire)."""
    for u in units:
        lanes.append(
            Lane(
                Step.DROP_UNITS,
                Primitive.DESTROY,
                (Unit(a, u),),
                (),
                (),
                uniform_effects(u, -mem_a),
                NO_TRANSFERS,
            )
        )


def _emit_extends(
    lanes: list[Lane],
    made_by: dict[Gpus, int],
    geo: Geometry,
    s: Layout,
    extends: list[PlannedExtend],
    slots: list[Gpus],
    mem_s: float,
) -> dict[Gpus, list[int]]:
    """The Extends onto ``slots``, each after whatever made its source; returns per source the
    Extends reading it (lane indices)."""
    first = len(lanes)
    readers: dict[Gpus, list[int]] = defaultdict(list)
    for j, (e, slot) in enumerate(zip(extends, slots, strict=True)):
        if e.made_by is not None:
            deps: tuple[int, ...] = (first + e.made_by,)
        else:
            deps = (made_by[e.source],) if e.source in made_by else ()
        readers[e.source].append(first + j)
        effects = tuple(zip(slot, repeat(mem_s), repeat(0.0)))
        recipe = TransferRecipe(extend_transfers, (geo, s, e.source, slot))
        lanes.append(
            Lane(e.step, Primitive.EXTEND, (Unit(s, e.source),), (Unit(s, slot),), deps, effects, recipe)
        )
    made_by.update(zip(slots, range(first, first + len(slots)), strict=True))
    return readers


def _emit_source_drops(
    lanes: list[Lane],
    step: int,
    s: Layout,
    dropped: list[Gpus],
    made_by: dict[Gpus, int],
    readers: dict[Gpus, list[int]],
    mem_s: float,
) -> None:
    """Destroy the sources that are not part of the target after the Extends that read them (the
    last copy of the state is never dropped before it has been copied)."""
    for t in dropped:
        deps = ((made_by[t],) if t in made_by else ()) + tuple(readers.get(t, ()))
        lanes.append(
            Lane(step, Primitive.DESTROY, (Unit(s, t),), (), deps, uniform_effects(t, -mem_s), NO_TRANSFERS)
        )


def _emit_merges(
    lanes: list[Lane],
    step: int,
    geo: Geometry,
    s: Layout,
    b: Layout,
    rows: Iterable[tuple[Gpus, list[Gpus]]],
    made_by: dict[Gpus, int],
    readers: dict[Gpus, list[int]],
    mem: _UnitMemory,
) -> None:
    """Merge each target unit from its slots, after what made them and every Extend reading them;
    a T_sub target unit sitting exactly on its one slot is done already."""
    net = mem.b - mem.s
    for v, row in rows:
        if b == s and row[0] == v:
            continue
        at = {g: x for x, g in enumerate(v)}
        tiles = tuple(tuple(at[g] for g in t) for t in row)
        pattern, buf = merge_pattern(geo, s, b, tiles)
        deps = {made_by[t] for t in row if t in made_by}.union(*(readers.get(t, ()) for t in row))
        effects = tuple(zip(v, repeat(net), buf))
        lanes.append(
            Lane(
                step,
                Primitive.MERGE,
                tuple(Unit(s, t) for t in row),
                (Unit(b, v),),
                tuple(sorted(deps)),
                effects,
                TransferRecipe(placed, (v, pattern)),
            )
        )
