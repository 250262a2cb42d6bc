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
from collections.abc import Callable, Sequence
from itertools import chain, compress, repeat
from typing import NamedTuple

from nereus_lightning.plan.layout import Candidate, Layout
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.transition.dag import MemEffect, Node, Primitive, gpu_chunks, no_transfers, units_of
from nereus_lightning.transition.lanes import Step, StepLanes, drop_sources_step, group, merge_step, numbered
from nereus_lightning.transition.pieces import Geometry, extend_transfers
from nereus_lightning.transition.tsub import (
    Pattern,
    all_subs,
    common_layout,
    merge_pattern,
    placed,
    split_pattern,
    splitter,
    sub_positions,
)

Gpus = tuple[int, ...]  # a unit, by its GPUs
Tiles = tuple[tuple[int, ...], ...]  # the positions of a unit's parts in it


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
    steps = local_lanes(geo, memory_of, current, target, cluster)
    return numbered(group(name, steps, batch, first_id), first_id)


def local_lanes(
    geo: Geometry,
    memory_of: Callable[[Layout], float],
    current: Candidate,
    target: Candidate,
    cluster: ClusterSpec,
) -> list[StepLanes]:
    """The primitive calls of one model-stage's local DAG, by step (see the module docstring)."""
    a, b = current.layout, target.layout
    if a == b and current.gpus == target.gpus:
        return []
    s = common_layout(a, b)
    s = a if s == a else b if s == b else s  # an equal layout as the same object: units compare fast
    cur_units, tgt_units = gpu_chunks(current.gpus, a.size), gpu_chunks(target.gpus, b.size)
    pick = splitter(b, s)
    strided = [pick(v) for v in tgt_units]  # per target unit: its strided slots (itself if b == s)
    tiling = tile_current_units(a, s, current, list(chain.from_iterable(strided)))
    slots = choose_target_slots(b, s, tgt_units, strided, tiling.where, set(current.gpus))
    reuse = decide_reuse(slots, tiling)
    candidates = [t for i in reuse.split_units for t in tiling.subs[i]] if reuse.missing else []
    extends = plan_extends(candidates, reuse.reused, reuse.missing, cluster.gpus_per_node)
    kept = reuse.reused.union(e.source for e in extends if e.source in tiling.where)
    splitting = [i for i in reuse.split_units if not kept.isdisjoint(tiling.subs[i])]
    mem = _UnitMemory(memory_of(a), memory_of(s), memory_of(b))
    made_by: dict[Gpus, int] = {}  # T_sub unit or slot -> the lane that made it
    steps = _splits(0, made_by, geo, a, s, [(cur_units[i], i) for i in splitting], tiling, kept, mem)
    unused = [cur_units[i] for i in sorted(set(range(len(cur_units))).difference(splitting))]
    # Current units that neither stay nor feed anything go first (release before acquire).
    steps.append(_destroys(_lanes_after(steps, len(unused)), Step.DROP_UNITS, a, unused, None, mem.a))
    extend_steps, readers = _extends(_next_lane(steps), made_by, geo, s, extends, reuse.missing, mem.s)
    steps += extend_steps
    last = max((e.step for e in extends), default=Step.FIRST_EXTEND - 1)
    # Sources that are not part of the target go after the Extends that read them (the last copy
    # of the state is never dropped before it has been copied).
    dropped = sorted(kept - reuse.reused, key=tiling.where.__getitem__)
    deps = [((made_by[t],) if t in made_by else ()) + tuple(readers.get(t, ())) for t in dropped]
    steps.append(
        _destroys(_lanes_after(steps, len(dropped)), drop_sources_step(last), s, dropped, deps, mem.s)
    )
    steps.append(
        _merges(_next_lane(steps), merge_step(last), geo, s, b, tgt_units, slots, made_by, readers, mem)
    )
    return steps


def _next_lane(steps: list[StepLanes]) -> int:
    """The number the next lane gets."""
    return sum(len(x.ids) for x in steps)


def _lanes_after(steps: list[StepLanes], count: int) -> range:
    """The numbers of ``count`` lanes after those of ``steps``."""
    first = _next_lane(steps)
    return range(first, first + count)


class _UnitMemory(NamedTuple):
    """Per-GPU resident bytes of one unit: current (``a``), T_sub (``s``) and target (``b``) layout."""

    a: float
    s: float
    b: float


class Tiling(NamedTuple):
    """The ``k`` T_sub units each current unit would split into (``subs``, per unit), their
    positions in it (``tiles``), and each T_sub unit's index in them all (``where``: T_sub unit
    -> ``unit index * k + its index among the unit's``)."""

    subs: list[Sequence[Gpus]]
    tiles: list[Tiles]
    where: dict[Gpus, int]
    k: int

    def unit_of(self, t: Gpus) -> int:
        """The index of the current unit T_sub unit ``t`` is part of."""
        return self.where[t] // self.k


def tile_current_units(a: Layout, s: Layout, current: Candidate, slot_list: list[Gpus]) -> Tiling:
    """Phase 1: each current unit's T_sub units: the target's slots (``slot_list``) when they tile
    the unit exactly (then Merge or nothing follows in place), else the position-wise split
    (``sub_positions``)."""
    by_position = sub_positions(a, s)
    k = len(by_position)
    pieces = all_subs(a, s, len(current.gpus) // a.size)(current.gpus)  # position-wise, unit-major
    subs: list[Sequence[Gpus]] = [pieces[i : i + k] for i in range(0, len(pieces), k)]
    tiles = [by_position] * len(subs)
    is_slot = set(slot_list).__contains__
    slot_at: dict[int, Gpus] = {}  # made on first need
    for i, u in enumerate(gpu_chunks(current.gpus, a.size)):
        if k == 1 or all(map(is_slot, subs[i])):
            continue  # the slots on ``u`` are its position-wise T_sub units
        if not slot_at:
            slot_at = {g: slot for slot in slot_list for g in slot}
        # Slots are disjoint, so they tile ``u`` exactly iff they cover its GPUs and no more.
        on_slots = list(dict.fromkeys(map(slot_at.get, u, repeat(()))))  # (): in no slot
        if () not in on_slots and sum(map(len, on_slots)) == len(u):
            subs[i], tiles[i] = on_slots, positions_in(u, on_slots)
    where = {t: x for x, t in enumerate(chain.from_iterable(subs))}
    return Tiling(subs, tiles, where, k)


def positions_in(unit: Gpus, parts: Sequence[Gpus]) -> Tiles:
    """The positions in ``unit`` of each of ``parts``' GPUs."""
    at = {g: x for x, g in enumerate(unit)}
    return tuple(tuple(map(at.__getitem__, t)) for t in parts)


class TargetSlots(NamedTuple):
    """Per target unit, the T_sub units it is merged from (``rows``) and their positions in it
    (``tiles``)."""

    rows: list[list[Gpus]]
    tiles: list[Tiles]


def choose_target_slots(
    b: Layout,
    s: Layout,
    tgt_units: list[Gpus],
    strided: list[list[Gpus]],
    where: dict[Gpus, int],
    held: set[int],
) -> TargetSlots:
    """Phase 2: per target unit, the T_sub units its Merge fuses: its strided slots (``strided``;
    the unit itself if it is a T_sub unit) when all exist or the unit holds none of this
    model-stage's GPUs now, else the ones :func:`_slots_of` finds."""
    rows, tiles = list(strided), [sub_positions(b, s)] * len(strided)
    sub_at: dict[int, Gpus] = {}  # the T_sub unit each current GPU would be part of (made on first need)
    for i, (v, row) in enumerate(zip(tgt_units, strided, strict=True)):
        if held.isdisjoint(v) or all(map(where.__contains__, row)):
            continue
        if not sub_at:
            sub_at = {g: t for t in where for g in t}
        rows[i] = _slots_of(v, row, b, s, where, sub_at)
        if rows[i] is not row:
            tiles[i] = positions_in(v, rows[i])
    return TargetSlots(rows, tiles)


def _slots_of(
    v: Gpus,
    strided: list[Gpus],
    b: Layout,
    s: Layout,
    where: dict[Gpus, int],
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


def decide_reuse(slots: TargetSlots, tiling: Tiling) -> Reuse:
    """Phase 3: a slot that is a T_sub unit of a current unit is reused (that unit is split);
    if none is, just enough current units are split to have a source per missing slot."""
    flat = list(chain.from_iterable(slots.rows))
    exists = list(map(tiling.where.__contains__, flat))
    reused = set(compress(flat, exists))
    missing = [t for t, e in zip(flat, exists, strict=True) if not e]
    split_units = sorted({tiling.where[t] // tiling.k for t in reused})
    if missing and not split_units:
        split_units = list(range(min(len(tiling.subs), -(-len(missing) // tiling.k))))
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


def _splits(
    first: int,
    made_by: dict[Gpus, int],
    geo: Geometry,
    a: Layout,
    s: Layout,
    units: list[tuple[Gpus, int]],
    tiling: Tiling,
    kept: set[Gpus],
    mem: _UnitMemory,
) -> list[StepLanes]:
    """Step SPLIT: each of ``units`` (GPUs, index) into its T_sub units (a full split keeps every
    GPU), each followed by the Destroys (step DROP_PIECES) of its T_sub units nothing uses."""
    if a == s or not units:
        return []
    net = mem.s - mem.a
    patterns: dict[Tiles, tuple[Pattern, tuple[int, ...]]] = {}  # units mostly split alike
    split_ids: list[int] = []
    args: list[tuple[Gpus, Pattern]] = []
    effects: list[MemEffect] = []
    drop_ids: list[int] = []
    drops: list[Gpus] = []
    drop_deps: list[tuple[int, ...]] = []
    lane = first  # the next lane's number
    for u, i in units:
        tiles = tiling.tiles[i]
        if tiles not in patterns:
            patterns[tiles] = split_pattern(geo, a, s, tiles)
        pattern, buf = patterns[tiles]
        split, lane = lane, lane + 1
        split_ids.append(split)
        args.append((u, pattern))
        effects += zip(u, repeat(net), buf)
        made_by.update(zip(tiling.subs[i], repeat(split)))
        for t in tiling.subs[i]:
            if t not in kept:
                drop_ids.append(lane)
                lane += 1
                drops.append(t)
                drop_deps.append((split,))
    sources = units_of(a, [u for u, _ in units])
    targets = units_of(s, chain.from_iterable(tiling.subs[i] for _, i in units))
    splits = StepLanes(
        Step.SPLIT,
        Primitive.SPLIT,
        split_ids,
        sources,
        targets,
        [()] * len(units),
        tuple(effects),
        placed,
        tuple(args),
    )
    return [splits, _destroys(drop_ids, Step.DROP_PIECES, s, drops, drop_deps, mem.s)]


def _destroys(
    ids: Sequence[int],
    step: int,
    layout: Layout,
    units: list[Gpus],
    deps: Sequence[tuple[int, ...]] | None,
    mem: float,
) -> StepLanes:
    """Lanes ``ids``: Destroy each of ``units`` (of ``layout``, ``mem`` bytes per GPU) after its
    ``deps`` (None: nothing)."""
    effects = tuple(zip(chain.from_iterable(units), repeat(-mem), repeat(0.0)))
    return StepLanes(
        step,
        Primitive.DESTROY,
        ids,
        units_of(layout, units),
        (),
        [()] * len(units) if deps is None else deps,
        effects,
        no_transfers,
        ((),) * len(units),
    )


def _extends(
    first: int,
    made_by: dict[Gpus, int],
    geo: Geometry,
    s: Layout,
    extends: list[PlannedExtend],
    slots: list[Gpus],
    mem_s: float,
) -> tuple[list[StepLanes], dict[Gpus, list[int]]]:
    """The Extends onto ``slots`` (lanes from ``first``, one step per chain depth), each after
    whatever made its source; and per source the Extends reading it (lane numbers)."""
    deps = [
        (first + e.made_by,)
        if e.made_by is not None
        else ((made_by[e.source],) if e.source in made_by else ())
        for e in extends
    ]
    readers: dict[Gpus, list[int]] = defaultdict(list)
    by_step: dict[int, list[int]] = defaultdict(list)  # step -> the Extends at it
    for j, e in enumerate(extends):
        readers[e.source].append(first + j)
        by_step[e.step].append(j)
    made_by.update(zip(slots, range(first, first + len(slots)), strict=True))
    out = []
    for step, js in sorted(by_step.items()):
        sources, targets = [extends[j].source for j in js], [slots[j] for j in js]
        out.append(
            StepLanes(
                step,
                Primitive.EXTEND,
                [first + j for j in js],
                units_of(s, sources),
                units_of(s, targets),
                [deps[j] for j in js],
                tuple(zip(chain.from_iterable(targets), repeat(mem_s), repeat(0.0))),
                extend_transfers,
                tuple(zip(repeat(geo), repeat(s), sources, targets)),
            )
        )
    return out, readers


def _merges(
    first: int,
    step: int,
    geo: Geometry,
    s: Layout,
    b: Layout,
    tgt_units: list[Gpus],
    slots: TargetSlots,
    made_by: dict[Gpus, int],
    readers: dict[Gpus, list[int]],
    mem: _UnitMemory,
) -> StepLanes:
    """Merge each target unit from its row of slots, after what made them and every Extend
    reading them; a T_sub target unit sitting exactly on its one slot is done already."""
    rows = zip(tgt_units, slots.rows, slots.tiles, strict=True)
    todo = [(v, row, tiles) for v, row, tiles in rows if row[0] != v] if b == s else list(rows)
    net = mem.b - mem.s
    patterns: dict[Tiles, tuple[Pattern, tuple[int, ...]]] = {}  # units mostly merge alike
    args: list[tuple[Gpus, Pattern]] = []
    effects: list[MemEffect] = []
    deps: list[tuple[int, ...]] = []
    for v, row, tiles in todo:
        if tiles not in patterns:
            patterns[tiles] = merge_pattern(geo, s, b, tiles)
        pattern, buf = patterns[tiles]
        args.append((v, pattern))
        effects += zip(v, repeat(net), buf)
        made = {made_by[t] for t in row if t in made_by} if made_by else set()
        deps.append(tuple(sorted(made.union(*map(readers.get, row, repeat(()))))))
    return StepLanes(
        step,
        Primitive.MERGE,
        range(first, first + len(todo)),
        units_of(s, chain.from_iterable(row for _, row, _ in todo)),
        units_of(b, [v for v, _, _ in todo]),
        deps,
        tuple(effects),
        placed,
        tuple(args),
    )
