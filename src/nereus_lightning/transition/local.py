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

A sharded model-stage whose shard degree alone changes (``plan.rows.recut_in_place``) skips all of
this: its local DAG is one re-cut per replica (:func:`_recut`).

A unit is handled as its GPU tuple here (its layout is the phase's: current, T_sub or target),
and the phases work on whole columns of them (every unit's pieces in one list, unit-major), so
that a layout change that treats every replica alike costs a few passes over those lists.
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Callable, Container, Iterator, Mapping, Sequence
from functools import lru_cache
from itertools import accumulate, chain, compress, repeat
from operator import itemgetter, ne, not_
from typing import NamedTuple

import numpy as np

from nereus_lightning.plan.layout import Candidate, Layout
from nereus_lightning.plan.rows import recut_in_place
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.transition.dag import Memory, Node, Primitive, Units, gpu_chunks, no_transfers
from nereus_lightning.transition.lanes import (
    Step,
    StepLanes,
    drop_sources_step,
    group,
    merge_step,
    numbered,
    one_per_lane,
)
from nereus_lightning.transition.pieces import Geometry, extend_transfers, recut_transfers
from nereus_lightning.transition.tsub import (
    Pattern,
    all_subs,
    common_layout,
    merge_pattern,
    placed,
    split_pattern,
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
    nodes = group(name, steps, {}, first_id) if batch else one_per_lane(name, steps, first_id)
    return numbered(nodes, first_id)


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
    if recut_in_place(geo.model, current, target):
        return [_recut(geo, memory_of(a), memory_of(b), current, target)]
    s = common_layout(a, b)
    cur_units, tgt_units = gpu_chunks(current.gpus, a.size), gpu_chunks(target.gpus, b.size)
    # Every target unit's strided slots (a T_sub target unit is its own).
    strided = tgt_units if b == s else all_subs(b, s, len(tgt_units))(target.gpus)
    tiling = tile_current_units(a, s, current, cur_units, strided)
    slots = choose_target_slots(b, s, tgt_units, strided, tiling.where, current, target)
    reuse = decide_reuse(slots.flat, tiling)
    candidates: list[Gpus] = []  # T_sub units an Extend may copy: those of the split units
    if reuse.missing:
        candidates = tiling.pieces.of_units(reuse.split_units)
    extends = plan_extends(candidates, reuse.reused, reuse.missing, cluster.gpus_per_node)
    kept = reuse.reused.union(filter(tiling.where.__contains__, extends.sources))
    # A unit with a reused piece is split; a spare one only if an Extend reads one of its pieces.
    splitting = reuse.split_units
    if not reuse.reused:
        splitting = [i for i in reuse.split_units if not kept.isdisjoint(tiling.pieces.row(i))]
    mem = _UnitMemory(memory_of(a), memory_of(s), memory_of(b))
    made_by: dict[Gpus, int] = {}  # T_sub unit or slot -> the lane that made it
    steps = _splits(0, made_by, geo, a, s, cur_units, splitting, tiling, kept, mem)
    unused = [cur_units[i] for i in sorted(set(range(len(cur_units))).difference(splitting))]
    # Current units that neither stay nor feed anything go first (release before acquire).
    steps += _destroys(_lanes_after(steps, len(unused)), Step.DROP_UNITS, a, unused, None, mem.a)
    extend_steps, readers = _extends(_next_lane(steps), made_by, geo, s, extends, reuse.missing, mem.s)
    steps += extend_steps
    last = max(extends.steps, default=Step.FIRST_EXTEND - 1)
    # Sources that are not part of the target go after the Extends that read them (the last copy
    # of the state is never dropped before it has been copied).
    dropped = sorted(kept - reuse.reused, key=tiling.where.__getitem__)
    deps = [((made_by[t],) if t in made_by else ()) + tuple(readers.get(t, ())) for t in dropped]
    steps += _destroys(_lanes_after(steps, len(dropped)), drop_sources_step(last), s, dropped, deps, mem.s)
    steps += _merges(_next_lane(steps), merge_step(last), geo, s, b, tgt_units, slots, made_by, readers, mem)
    return steps


def _recut(geo: Geometry, mem_a: float, mem_b: float, current: Candidate, target: Candidate) -> StepLanes:
    """Every replica re-cut to the target's shard degree in place, one lane each: a Split to a larger
    degree (it acquires the GPUs it adds), a Merge to a smaller one (it releases the GPUs it drops).
    A GPU in both cuts ends holding ``mem_b`` and holds its new rows beside its old ones while they
    move; a GPU added receives ``mem_b``, one dropped frees ``mem_a``."""
    a, b = current.layout, target.layout
    grows = b.shard > a.shard
    olds = gpu_chunks(current.gpus, a.size)
    news = gpu_chunks(target.gpus, b.size)
    touched = news if grows else olds  # every GPU of the re-cut, per replica
    kept = set(current.gpus).intersection(target.gpus)
    net = [mem_b - mem_a if g in kept else (mem_b if grows else -mem_a) for g in chain.from_iterable(touched)]
    buffers = [min(mem_a, mem_b) if g in kept else 0.0 for g in chain.from_iterable(touched)]
    return StepLanes(
        Step.SPLIT,  # the only step of this local DAG
        Primitive.SPLIT if grows else Primitive.MERGE,
        range(len(olds)),
        Units(a, olds),
        Units(b, news),
        [()] * len(olds),
        Memory(chain.from_iterable(touched), net, buffers),
        recut_transfers,
        tuple((geo, a, b, old, new) for old, new in zip(olds, news, strict=True)),
    )


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


class Rows(NamedTuple):
    """``k`` T_sub units for each of some units, unit-major (``flat[i * k + j]``: the ``j``-th of
    unit ``i``), and their positions in that unit: ``tiles`` for the units where they are not
    ``default``."""

    flat: list[Gpus]
    tiles: dict[int, Tiles]
    default: Tiles
    k: int

    def row(self, i: int) -> list[Gpus]:
        """The T_sub units of unit ``i``."""
        return self.flat[i * self.k : (i + 1) * self.k]

    def tiles_of(self, i: int) -> Tiles:
        """The positions of unit ``i``'s T_sub units in it."""
        return self.tiles.get(i, self.default)

    def of_units(self, units: Sequence[int]) -> list[Gpus]:
        """The T_sub units of ``units`` (indices, ascending), in order."""
        if len(units) * self.k == len(self.flat):  # all of them
            return self.flat
        return list(chain.from_iterable(map(self.row, units)))


class Tiling(NamedTuple):
    """The T_sub units (*pieces*) each current unit would split into, and each piece's index in
    ``pieces.flat``."""

    pieces: Rows
    where: dict[Gpus, int]


def tile_current_units(
    a: Layout, s: Layout, current: Candidate, units: list[Gpus], slot_list: Sequence[Gpus]
) -> Tiling:
    """Phase 1: each current unit's T_sub units (``units``: the current units' GPUs): the target's
    slots (``slot_list``) when they tile the unit exactly (then Merge or nothing follows in place),
    else the position-wise split (``sub_positions``)."""
    by_position = sub_positions(a, s)
    k = len(by_position)
    # Position-wise, unit-major (a unit of layout T_sub is its own).
    pieces = list(units) if a == s else all_subs(a, s, len(units))(current.gpus)
    where = dict(zip(pieces, range(len(pieces)), strict=True))
    tiles: dict[int, Tiles] = {}
    not_slots = set(pieces).difference(slot_list) if k > 1 else set()
    if not_slots:  # the units with such a piece may lie on slots another way
        off_slots = sorted({where[t] // k for t in not_slots})
        for i, row, tile in _slot_tilings(a, current.gpus, off_slots, slot_list):
            pieces[i * k : (i + 1) * k] = row
            tiles[i] = tile
        where = dict(zip(pieces, range(len(pieces)), strict=True))
    return Tiling(Rows(pieces, tiles, by_position, k), where)


def _slot_tilings(
    a: Layout, gpus: Gpus, units: list[int], slot_list: Sequence[Gpus]
) -> Iterator[tuple[int, list[Gpus], Tiles]]:
    """Per unit ``i`` of ``units`` (indices of the layout-``a`` units on ``gpus``) that the slots tile
    exactly: ``i``, its slots in the order of their first GPU in it, and their positions in it.

    Units are mostly alike: the units whose GPUs at the positions of the first tiling found are
    slots have that tiling (slots are disjoint, and these cover them), found at once
    (:func:`_alike`); the others are looked at GPU by GPU (:func:`_slots_tiling`).
    """
    slot_at = {g: slot for slot in slot_list for g in slot}
    alike: dict[int, list[Gpus]] = {}
    for i in units:
        if i in alike:
            continue
        u = gpus[i * a.size : (i + 1) * a.size]
        row, tile = _slots_tiling(u, slot_at)
        if not row:
            continue
        yield i, row, tile
        if not alike:
            alike = _alike(gpus, a.size, units, tile, set(slot_list))
            yield from ((j, parts, tile) for j, parts in alike.items() if j > i)


def _slots_tiling(u: Gpus, slot_at: Mapping[int, Gpus]) -> tuple[list[Gpus], Tiles]:
    """The slots on the GPUs ``u`` in the order of their first GPU there and their positions in ``u``,
    if they tile ``u`` exactly (else none): slots are disjoint, so they do iff they cover its GPUs
    and no more."""
    on_slots = list(dict.fromkeys(map(slot_at.get, u, repeat(()))))  # (): in no slot
    if () in on_slots or sum(map(len, on_slots)) != len(u):
        return [], ()
    return on_slots, positions(on_slots, {g: x for x, g in enumerate(u)})


def _alike(
    gpus: Gpus, size: int, units: Sequence[int], tile: Tiles, exists: Container[Gpus]
) -> dict[int, list[Gpus]]:
    """Per unit of ``units`` (indices of the ``size``-GPU units on ``gpus``) whose GPUs at the positions
    of each part of ``tile`` (parts of one size) form parts that all are in ``exists``: those parts.
    All units at once (:func:`_unit_parts`)."""
    every = len(units) * size == len(gpus)  # (units ascend: then they are every unit)
    parts = (_every_unit_parts(tile, size, len(units)) if every else _unit_parts(tile, size, units))(gpus)
    fits = list(map(exists.__contains__, parts))
    k = len(tile)
    if all(fits):
        return {i: parts[j * k : (j + 1) * k] for j, i in enumerate(units)}
    return {i: parts[j * k : (j + 1) * k] for j, i in enumerate(units) if all(fits[j * k : (j + 1) * k])}


def _unit_parts(tile: Tiles, size: int, units: Sequence[int]) -> Callable[[Gpus], list[Gpus]]:
    """A function from GPUs of ``size``-GPU units to the parts at ``tile``'s positions (parts of one
    size) in each of ``units`` (indices), unit-major: one itemgetter."""
    at = np.asarray(units)[:, None] * size + np.fromiter(chain.from_iterable(tile), dtype=np.int64)
    take = itemgetter(*at.ravel().tolist())
    if at.size == 1:
        return lambda gpus: [(take(gpus),)]
    return lambda gpus: gpu_chunks(take(gpus), len(tile[0]))


@lru_cache(maxsize=256)
def _every_unit_parts(tile: Tiles, size: int, count: int) -> Callable[[Gpus], list[Gpus]]:
    """:func:`_unit_parts` of the first ``count`` units (positions only: made once per shape)."""
    return _unit_parts(tile, size, range(count))


def positions(parts: Sequence[Gpus], at: Mapping[int, int]) -> Tiles:
    """The positions of each of ``parts``' GPUs in their unit (``at``: GPU -> position)."""
    return tuple(tuple(map(at.__getitem__, t)) for t in parts)


def choose_target_slots(
    b: Layout,
    s: Layout,
    tgt_units: list[Gpus],
    strided: list[Gpus],
    where: dict[Gpus, int],
    current: Candidate,
    target: Candidate,
) -> Rows:
    """Phase 2: per target unit, the T_sub units its Merge fuses: its strided slots (``strided``,
    unit-major; the unit itself if it is a T_sub unit) when all exist or the unit holds none of
    this model-stage's GPUs now, else the ones :func:`_slots_of` finds.

    Units are mostly alike: the units whose GPUs at the positions of the first T_sub units found
    that all exist are T_sub units too get those, found at once (:func:`_alike`): they are what
    :func:`_slots_of` finds there (they exist, cover the unit and stand where the others stood:
    strided slots first, the rest by their first GPU).
    """
    by_position = sub_positions(b, s)
    k = len(by_position)
    flat, tiles = list(strided), {}
    absent = [j for j, t in enumerate(strided) if t not in where]
    todo = sorted({j // k for j in absent}) if k > 1 else absent
    held = set(current.gpus) if todo else set()
    if held.isdisjoint(chain.from_iterable(map(tgt_units.__getitem__, todo))):
        todo = []  # none of them holds a GPU of this model-stage now
    sub_at: dict[int, Gpus] = {}  # the T_sub unit each current GPU would be part of (made on first need)
    alike: dict[int, list[Gpus]] = {}
    for i in todo:
        v = tgt_units[i]
        if i in alike or held.isdisjoint(v):
            continue
        if not sub_at:
            sub_at = {g: t for t in where for g in t}
        row = strided[i * k : (i + 1) * k]
        found = _slots_of(v, row, b, s, where, sub_at)
        if found is not row:
            flat[i * k : (i + 1) * k] = found
            tiles[i] = positions(found, {g: x for x, g in enumerate(v)})
            if not alike and all(map(where.__contains__, found)):
                alike = _alike(target.gpus, b.size, todo, tiles[i], where)
                for j, parts in alike.items():
                    flat[j * k : (j + 1) * k] = parts
                    tiles[j] = tiles[i]
    return Rows(flat, tiles, by_position, k)


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
    lowest = 0  # the queues before it are empty (they never refill)
    for _ in range((len(inside) - len(covered)) // s.size):
        slot = []
        for q in range(s.size):
            if not queues[q]:  # take from the first queue that has a GPU left
                while not queues[lowest]:
                    lowest += 1
                q = lowest
            slot.append(queues[q].pop())
        row.append(tuple(slot))
    return row


class Reuse(NamedTuple):
    """Which slots exist already (``reused``), which must be made by Extend (``missing``, in
    order), and which current units are split (``split_units``, indices in order)."""

    reused: set[Gpus]
    missing: list[Gpus]
    split_units: list[int]


def decide_reuse(slots: list[Gpus], tiling: Tiling) -> Reuse:
    """Phase 3: a slot that is a T_sub unit of a current unit is reused (that unit is split);
    if none is, just enough current units are split to have a source per missing slot."""
    exists = list(map(tiling.where.__contains__, slots))
    reused = set(compress(slots, exists))
    missing = list(compress(slots, map(not_, exists)))
    pieces = tiling.pieces
    if len(reused) == len(pieces.flat):  # every piece is reused (a piece is one only once)
        split_units = list(range(len(pieces.flat) // pieces.k))
    else:
        split_units = sorted({tiling.where[t] // pieces.k for t in reused})
    if missing and not split_units:
        units = len(pieces.flat) // pieces.k
        split_units = list(range(min(units, -(-len(missing) // pieces.k))))
    return Reuse(reused, missing, split_units)


class PlannedExtends(NamedTuple):
    """The Extends filling the missing slots, as columns: each one's source unit, the index of the
    Extend that makes that source (None: a T_sub unit of a current unit) and its step."""

    sources: list[Gpus]
    made_by: list[int | None]
    steps: list[int]


def plan_extends(
    candidates: list[Gpus], reused: set[Gpus], missing: list[Gpus], gpus_per_node: int
) -> PlannedExtends:
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
    node_of = [t[0] // gpus_per_node for t in candidates]  # per candidate
    pools: dict[int, list[int]] = defaultdict(list)  # per node: its candidates, then its slots made
    for k, node in enumerate(node_of):
        pools[node].append(k)
    remote: _RemoteSources | None = None  # (made on first need)
    tail: dict[int, int] = {}  # per node without candidates: its newest slot (the next source there)
    sources: list[Gpus] = []
    made_by: list[int | None] = []
    steps: list[int] = []
    first = int(Step.FIRST_EXTEND)
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
                load[si] += 1
            else:
                remote = remote or _RemoteSources(node_of, fresh)
                si = remote.pick(load)  # (counts its load)
                tail[node] = n_cand + j
        if si < n_cand:
            sources.append(candidates[si])
            made_by.append(None)
            steps.append(first)
        else:
            made = si - n_cand
            sources.append(missing[made])
            made_by.append(made)
            steps.append(steps[made] + 1)
    return PlannedExtends(sources, made_by, steps)


class _RemoteSources:
    """The candidate a node without candidates copies from: the least-loaded one (reused first,
    then the lower index) of the node that has sent least so far.

    Per node its candidates in a heap by (load, fresh, index), and the nodes in a heap by (sends,
    their best candidate), both updated at each pick; a load that grew by a local Extend only
    makes a stale top, re-keyed when found (keys only grow).
    """

    def __init__(self, node_of: list[int], fresh: list[bool]) -> None:
        """``node_of``: each candidate's node; ``fresh``: whether it is not reused (by index)."""
        self.of_node: dict[int, list[tuple[int, bool, int]]] = defaultdict(list)
        for k, node in enumerate(node_of):
            self.of_node[node].append((0, fresh[k], k))
        for heap in self.of_node.values():
            heapq.heapify(heap)
        self.nodes = [(0, heap[0], node) for node, heap in self.of_node.items()]
        heapq.heapify(self.nodes)

    def pick(self, load: list[int]) -> int:
        """The best candidate now, counted as one more send of its node and one more load of it."""
        while True:
            n_sent, best, node = self.nodes[0]
            heap = self.of_node[node]
            while heap[0][0] != load[heap[0][2]]:  # its load grew since (a local Extend): re-key it
                _, is_fresh, k = heap[0]
                heapq.heapreplace(heap, (load[k], is_fresh, k))
            if best == heap[0]:
                break
            heapq.heapreplace(self.nodes, (n_sent, heap[0], node))
        _, is_fresh, k = best
        load[k] += 1
        heapq.heapreplace(heap, (load[k], is_fresh, k))
        heapq.heapreplace(self.nodes, (n_sent + 1, heap[0], node))
        return k


def _splits(
    first: int,
    made_by: dict[Gpus, int],
    geo: Geometry,
    a: Layout,
    s: Layout,
    cur_units: list[Gpus],
    splitting: list[int],
    tiling: Tiling,
    kept: set[Gpus],
    mem: _UnitMemory,
) -> list[StepLanes]:
    """Step SPLIT: each current unit in ``splitting`` (indices) into its T_sub units (a full split
    keeps every GPU), each followed by the Destroys (step DROP_PIECES) of its T_sub units nothing
    uses."""
    if a == s or not splitting:
        return []
    rows, whole = tiling.pieces, [cur_units[i] for i in splitting]
    k, pieces = rows.k, rows.of_units(splitting)  # k per unit
    tiles = [rows.tiles_of(i) for i in splitting] if rows.tiles else [rows.default] * len(whole)
    # Lane numbers: each Split, then the Destroys of its pieces nothing uses (usually none).
    drops: list[tuple[int, int, Gpus]] = []
    if kept.issuperset(pieces):
        split_ids = list(range(first, first + len(whole)))
    else:
        unused = [[t for t in rows.row(i) if t not in kept] for i in splitting]
        split_ids = list(accumulate((1 + len(ts) for ts in unused[:-1]), initial=first))
        drops = [
            (split, split + 1 + x, t)
            for split, ts in zip(split_ids, unused, strict=True)
            for x, t in enumerate(ts)
        ]
    made_by.update(zip(pieces, np.repeat(split_ids, k).tolist(), strict=True))
    args, buffers = _patterned(whole, tiles, lambda t: split_pattern(geo, a, s, t))
    splits = StepLanes(
        Step.SPLIT,
        Primitive.SPLIT,
        split_ids,
        Units(a, whole),
        Units(s, pieces),
        [()] * len(whole),
        Memory(chain.from_iterable(whole), mem.s - mem.a, buffers),
        placed,
        args,
    )
    return [
        splits,
        *_destroys(
            [lane for _, lane, _ in drops],
            Step.DROP_PIECES,
            s,
            [t for _, _, t in drops],
            [(split,) for split, _, _ in drops],
            mem.s,
        ),
    ]


def _patterned(
    units: list[Gpus], tiles: list[Tiles], pattern_of: Callable[[Tiles], tuple[Pattern, tuple[int, ...]]]
) -> tuple[tuple[tuple[Gpus, Pattern], ...], np.ndarray]:
    """Each Split's or Merge's lane arguments (its unit's GPUs and the pattern of its ``tiles``) and
    their transfer buffers, in order; units are mostly alike, so each pattern is made once (the tiles
    are a few objects, told apart by identity before their values are compared)."""
    ids = list(map(id, tiles))
    distinct = dict(zip(ids, tiles, strict=True))  # each tile object, in order of first use
    patterns = {t: pattern_of(t) for t in set(distinct.values())}
    if len(patterns) == 1:  # every unit alike
        ((pattern, buf),) = patterns.values()
        return tuple(zip(units, repeat(pattern))), np.tile(np.asarray(buf, dtype=np.float64), len(units))
    made = [patterns[t] for t in distinct.values()]
    index = dict(zip(distinct, range(len(made)), strict=True))
    at = list(map(index.__getitem__, ids))  # per unit: the index of its tile's pattern in made
    args = tuple(zip(units, map([pattern for pattern, _ in made].__getitem__, at), strict=True))
    return args, np.asarray([buf for _, buf in made], dtype=np.float64)[at].ravel()


def _destroys(
    ids: Sequence[int],
    step: int,
    layout: Layout,
    units: list[Gpus],
    deps: Sequence[tuple[int, ...]] | None,
    mem: float,
) -> list[StepLanes]:
    """Lanes ``ids``: Destroy each of ``units`` (of ``layout``, ``mem`` bytes per GPU) after its
    ``deps`` (None: nothing); no step if there are none."""
    if not units:
        return []
    return [
        StepLanes(
            step,
            Primitive.DESTROY,
            ids,
            Units(layout, units),
            Units(layout),
            [()] * len(units) if deps is None else deps,
            Memory(chain.from_iterable(units), -mem),
            no_transfers,
            ((),) * len(units),
        )
    ]


def _extends(
    first: int,
    made_by: dict[Gpus, int],
    geo: Geometry,
    s: Layout,
    extends: PlannedExtends,
    slots: list[Gpus],
    mem_s: float,
) -> tuple[list[StepLanes], dict[Gpus, list[int]]]:
    """The Extends onto ``slots`` (lanes from ``first``, one step per chain depth), each after
    whatever made its source; and per source the Extends reading it (lane numbers)."""
    deps = [
        (first + made,) if made is not None else ((made_by[source],) if source in made_by else ())
        for source, made in zip(extends.sources, extends.made_by, strict=True)
    ]
    readers: dict[Gpus, list[int]] = defaultdict(list)
    for lane, source in enumerate(extends.sources, first):
        readers[source].append(lane)
    by_step: dict[int, list[int]] = defaultdict(list)  # step -> the Extends at it
    for j, step in enumerate(extends.steps):
        by_step[step].append(j)
    made_by.update(zip(slots, range(first, first + len(slots)), strict=True))
    out = []
    for step, js in sorted(by_step.items()):
        every = len(js) == len(slots)  # (one step: its columns are the Extends')
        sources = extends.sources if every else [extends.sources[j] for j in js]
        targets = slots if every else [slots[j] for j in js]
        out.append(
            StepLanes(
                step,
                Primitive.EXTEND,
                range(first, first + len(slots)) if every else [first + j for j in js],
                Units(s, sources),
                Units(s, targets),
                deps if every else [deps[j] for j in js],
                Memory(chain.from_iterable(targets), mem_s),
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
    slots: Rows,
    made_by: dict[Gpus, int],
    readers: dict[Gpus, list[int]],
    mem: _UnitMemory,
) -> list[StepLanes]:
    """Merge each target unit from its row of slots, after what made them and every Extend
    reading them; a T_sub target unit sitting exactly on its one slot is done already."""
    if b == s:  # one slot per target unit
        todo = list(compress(range(len(tgt_units)), map(ne, slots.flat, tgt_units)))
        if not todo:
            return []
    else:
        todo = list(range(len(tgt_units)))
    every = len(todo) == len(tgt_units)
    units = tgt_units if every else [tgt_units[i] for i in todo]
    rows = gpu_chunks(slots.flat, slots.k) if every else [slots.row(i) for i in todo]
    tiles = [slots.tiles_of(i) for i in todo] if slots.tiles else [slots.default] * len(todo)
    if made_by or readers:
        deps = _made_or_read(rows, made_by, readers)
    else:  # nothing was made or read before: the Merges wait for nothing
        deps = [()] * len(todo)
    args, buffers = _patterned(units, tiles, lambda t: merge_pattern(geo, s, b, t))
    return [
        StepLanes(
            step,
            Primitive.MERGE,
            range(first, first + len(todo)),
            Units(s, slots.flat if every else chain.from_iterable(rows)),
            Units(b, units),
            deps,
            Memory(chain.from_iterable(units), mem.b - mem.s, buffers),
            placed,
            args,
        )
    ]


def _made_or_read(
    rows: Sequence[Sequence[Gpus]], made_by: dict[Gpus, int], readers: dict[Gpus, list[int]]
) -> list[tuple[int, ...]]:
    """Per row of slots, the lanes that made a slot of it or read one (ascending)."""
    made, read = made_by.get, readers.get
    out = []
    for row in rows:
        lanes = [lane for lane in map(made, row) if lane is not None]
        for t in row:
            lanes += read(t, ())
        out.append(tuple(sorted(set(lanes))) if len(lanes) > 1 else tuple(lanes))
    return out
