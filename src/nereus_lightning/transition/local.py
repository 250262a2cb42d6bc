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
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from itertools import repeat
from operator import itemgetter

from nereus_lightning.plan.layout import Candidate, Layout
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.transition.dag import Node, Primitive, Unit, gpu_chunks
from nereus_lightning.transition.lanes import LocalLanes
from nereus_lightning.transition.pieces import Geometry, Transfer, extend_transfers
from nereus_lightning.transition.tsub import (
    Pattern,
    all_subs,
    common_layout,
    consecutive,
    merge_pattern,
    placed,
    split_pattern,
    splitter,
    sub_gpus,
    sub_positions,
    uniform_effects,
    unit_and_index,
)

_FIRST = itemgetter(0)
_LAST = itemgetter(-1)
_new = tuple.__new__  # builds a NamedTuple without its (slow) Python-level __new__

#: Whether Split may keep only the T_sub units the transition uses (less memory and traffic) or
#: makes all of them, as the paper's Split(EMU, T_sub) -> k EMUs and ``emu.ops.validate_op`` do.
PARTIAL_SPLIT = False

#: Whether regular plans take bulk paths (whole GPU lists at once, at C speed) where every unit
#: is decided alike: all position-wise T_sub units are slots, all target units sit in place, all
#: target units merge the T_sub units on their consecutive GPUs, a full Split leaves nothing to
#: destroy. Both settings give the same lanes (``tests/transition/test_fast_paths.py``).
BULK_SHORTCUTS = True

#: Whether a model-stage that keeps its layout, and whose new units touch none of the GPUs it holds
#: now, takes the direct path (kept units by set lookups, no slots, no Merges) instead of the
#: general one; both give the same lanes (``tests/transition/test_fast_paths.py``).
SAME_LAYOUT_SHORTCUT = True


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
    return local_lanes(name, geo, memory_of, current, target, cluster).nodes(batch, first_id)


def local_lanes(
    name: str,
    geo: Geometry,
    memory_of: Callable[[Layout], float],
    current: Candidate,
    target: Candidate,
    cluster: ClusterSpec,
) -> LocalLanes:
    """The primitive calls of one model-stage's local DAG (see :func:`local_dag`), to be made into
    nodes per replica or per step (:meth:`LocalLanes.nodes`) without planning them again."""
    out = LocalLanes(name)
    a, b = current.layout, target.layout
    if a == b and current.gpus == target.gpus:
        return out
    s = common_layout(a, b)
    pick_a = splitter(a, s)
    # Units as GPU tuples (a Unit is made only for the units a node names).
    cur_units = gpu_chunks(current.gpus, a.size)
    tgt_units = gpu_chunks(target.gpus, b.size)

    # T_sub units each current unit would split into, indexed by their GPU tuple: the target's
    # strided slots when they tile the unit exactly (then Merge or nothing follows in place),
    # else the position-wise split.
    split_into: list[Sequence[tuple[int, ...]]] = []  # per current unit: its T_sub units
    by_position: set[int] = set()  # current units split position-wise (tiles ``sub_position(a, s)``)
    where: dict[tuple[int, ...], tuple[int, int]] = {}
    strided: list[list[tuple[int, ...]]] = []  # per target unit, its strided T_sub slots (once asked)

    strided_gpus: list[tuple[int, ...]] = []  # their GPUs, flat (once asked)

    def strided_rows() -> list[list[tuple[int, ...]]]:
        if not strided and tgt_units:  # ``pick_b`` of every target unit, at C speed
            flat = gpu_chunks(
                strided_gpus[0] if strided_gpus else sub_gpus(b, s, len(tgt_units))(target.gpus), s.size
            )
            strided.extend(map(list, gpu_chunks(flat, len(flat) // len(tgt_units))))
        return strided

    n_cur = len(cur_units)
    exact = False  # the position-wise T_sub units are exactly the target's units, in order
    if a == s and a != b and n_cur and BULK_SHORTCUTS:
        # Every current unit in place on a target unit's slots (strided, or else consecutive, as
        # ``_slots_of`` would take them), each used: Merges only.
        # (units of one size are equal lists iff their GPUs are equal sequences)
        strided_gpus.append(sub_gpus(b, s, len(tgt_units))(target.gpus))
        if strided_gpus[0] == current.gpus:
            _add_merges(
                out, geo, s, b, sub_positions(b, s), cur_units, tgt_units, memory_of(b) - memory_of(s)
            )
            return out
        if current.gpus == target.gpus and set(sub_positions(b, s)).isdisjoint(
            consecutive(b.size, s.size)
        ):  # (no strided slot is a current unit)
            chunk_tiles = consecutive(b.size, s.size)
            _add_merges(out, geo, s, b, chunk_tiles, cur_units, tgt_units, memory_of(b) - memory_of(s))
            return out
    if a == s:
        split_into = list(zip(cur_units))
        where = dict(zip(cur_units, unit_and_index(n_cur, 1), strict=True))
    else:
        k = len(sub_positions(a, s))
        # Every unit's position-wise T_sub units at once (C speed); when each is a slot, every
        # unit is tiled by them in this order and the per-unit loop below has nothing to decide.
        if (
            b == s
            and BULK_SHORTCUTS
            and not PARTIAL_SPLIT
            and sub_gpus(a, s, n_cur)(current.gpus) == target.gpus
        ):
            # Every position-wise T_sub unit is a target unit, in order: full Splits in place, nothing else.
            _add_splits(out, geo, a, s, cur_units, tgt_units, memory_of(s) - memory_of(a))
            return out
        subs_all = all_subs(a, s, n_cur)(current.gpus)
        if b == s:  # the target's units are the slots
            exact = subs_all == tgt_units
            all_slots = exact or set(tgt_units).issuperset(subs_all)
        else:
            all_slots = set(itertools.chain.from_iterable(strided_rows())).issuperset(subs_all)
        if all_slots and BULK_SHORTCUTS:
            split_into = list(gpu_chunks(subs_all, k))
            by_position = set(range(n_cur))
            where = dict(zip(subs_all, unit_and_index(n_cur, k), strict=True))
        else:
            # the slot each target GPU lies in (if b == s the target's units are the slots)
            slot_list = tgt_units if b == s else list(itertools.chain.from_iterable(strided_rows()))
            slot_at = dict(
                zip(
                    itertools.chain.from_iterable(slot_list),
                    itertools.chain.from_iterable(map(repeat, slot_list, repeat(s.size))),
                    strict=True,
                )
            )
            for i, u in enumerate(cur_units):
                # Slots are disjoint, so they tile ``u`` exactly iff they cover its GPUs and no more.
                cover = list(map(slot_at.get, u, repeat(())))  # (): in no slot (a slot is never empty)
                unit_tiles = list(dict.fromkeys(cover))
                by_pick = pick_a(u)
                if unit_tiles == by_pick:
                    by_position.add(i)
                elif () in unit_tiles or sum(map(len, unit_tiles)) != len(u):
                    unit_tiles = by_pick
                    by_position.add(i)
                split_into.append(unit_tiles)
                k = len(unit_tiles)
                where.update(zip(unit_tiles, zip(repeat(i, k), range(k), strict=True), strict=True))
    sub_at: dict[int, tuple[int, ...]] = {}  # the T_sub unit each current GPU would be part of

    def sub_at_of() -> dict[int, tuple[int, ...]]:  # made on first need (many plans never ask)
        if not sub_at and where:
            sub_at.update({g: t for t in where for g in t})
        return sub_at

    # Per target unit, the T_sub units its Merge fuses (reused in place or to be extended).
    same = False  # one layout, and no new unit touches a GPU this model-stage holds now
    in_place = False  # every target unit is a T_sub unit sitting where one is now
    chunked = False  # every target unit merges the T_sub units on its consecutive GPUs
    if a == b and SAME_LAYOUT_SHORTCUT:
        n_held = len(current.gpus)
        if BULK_SHORTCUTS and target.gpus[:n_held] == current.gpus:
            # Every current unit stays in place, the new ones come after (e.g. DP grows): no
            # lookups (target units are disjoint, so none after is a current unit).
            new = tgt_units[n_cur:]
            same = set(current.gpus).isdisjoint(target.gpus[n_held:])
        else:
            new = list(itertools.filterfalse(where.__contains__, tgt_units))
            same = set(current.gpus).isdisjoint(itertools.chain.from_iterable(new))
    if same:  # each target unit is kept in place or extended onto: nothing to merge
        slots: list[list[tuple[int, ...]]] = []
        if len(tgt_units) - len(new) == len(where):  # every current unit stays
            reused = set(where)  # (the dict's hashes: no tuple hashed again)
        else:
            reused = set(filter(where.__contains__, tgt_units))
        missing = new
    elif b == s:  # each target unit is one slot: reused in place when a T_sub unit sits exactly on it
        if BULK_SHORTCUTS and (exact or all(map(where.__contains__, tgt_units))):  # in place: no merge
            slots = []  # each target unit is its own slot, reused: none is read below
            in_place = True
        else:
            held = set(current.gpus)  # (every GPU of a current unit lies in one of its T_sub units)
            slots = [
                [v] if v in where or held.isdisjoint(v) else _slots_of(v, [v], b, s, where, sub_at_of)
                for v in tgt_units
            ]
    else:
        chunks: list[tuple[int, ...]] = []
        if (
            BULK_SHORTCUTS
            and not any(map(where.__contains__, itertools.chain.from_iterable(strided_rows())))
            and all(map(where.__contains__, chunks := gpu_chunks(target.gpus, s.size)))
        ):
            # No strided slot exists but each target unit is tiled by T_sub units in GPU order
            # (e.g. TP2 units merged pairwise into TP4): ``_slots_of`` takes exactly those.
            slots = list(map(list, gpu_chunks(chunks, b.size // s.size)))
            chunked = True
        elif BULK_SHORTCUTS and all(map(where.__contains__, itertools.chain.from_iterable(strided))):
            slots = list(strided)  # every strided slot exists (the same row objects)
        else:
            held = set(current.gpus)
            if BULK_SHORTCUTS and held.isdisjoint(target.gpus):  # moved away: Extend onto every slot
                slots = list(strided_rows())
            else:  # (``_slots_of`` hands back the strided slots of a unit holding none of ``held``)
                slots = [
                    row
                    if all(map(where.__contains__, row)) or held.isdisjoint(v)
                    else _slots_of(v, row, b, s, where, sub_at_of)
                    for v, row in zip(tgt_units, strided_rows(), strict=True)
                ]
    if in_place:
        reused, missing = set(tgt_units), []
    elif not same:
        flat = list(itertools.chain.from_iterable(slots))
        if all(map(where.__contains__, flat)):  # every slot exists (C speed)
            reused, missing = set(flat), []
        else:
            reused = set(filter(where.__contains__, flat))
            missing = list(itertools.filterfalse(where.__contains__, flat))
    if len(reused) == len(where):  # every T_sub unit stays: every current unit is split
        split_units = list(range(n_cur))
    else:
        split_units = sorted(set(map(_FIRST, map(where.__getitem__, reused))))
    if missing and not split_units:
        # Nothing stays in place: split just enough current units to have one source per slot.
        k = len(sub_positions(a, s))
        split_units = list(range(min(len(cur_units), -(-len(missing) // k))))

    # Plan the Extends first, so that Split keeps only the T_sub units that are used: the slot's
    # node first (chaining inside the node), then the least-loaded source, reused ones on ties.
    gpn = cluster.gpus_per_node
    if not missing:
        candidates = []
    elif len(split_units) == n_cur and a == s:  # every current unit, unsplit, in order
        candidates = list(cur_units)
    else:
        candidates = [t for i in split_units for t in split_into[i]]
    # Sources by index: candidates 0..C-1, then the slots in ``missing`` order (C + j is made by
    # Extend j); lists indexed by it avoid hashing GPU tuples in the loop.
    n_cand, n_slots = len(candidates), len(missing)
    node_of = list(map(operator.floordiv, map(_FIRST, candidates), repeat(gpn)))
    slot_nodes = list(map(operator.floordiv, map(_FIRST, missing), repeat(gpn)))
    uniform = True  # every candidate alike fresh (or reused)
    if not reused or reused.isdisjoint(candidates):
        fresh = [True] * (n_cand + n_slots)  # slots are never reused
    elif len(reused) == len(where) or reused.issuperset(candidates):  # (candidates are T_sub units)
        fresh = [False] * n_cand + [True] * n_slots
    else:
        fresh = [t not in reused for t in candidates] + [True] * n_slots
        uniform = False
    cand_run = _run_length(node_of)  # > 0: each node's candidates are consecutive, as many on each
    local: dict[int, list[int]] = {}  # node -> its candidates (indices), grouped at C speed

    def pools() -> dict[int, list[int]]:
        if not local:
            for node, same_node in itertools.groupby(range(n_cand), node_of.__getitem__):
                pool = local.get(node)
                if pool is None:
                    local[node] = list(same_node)
                else:
                    pool += same_node
        return local

    # The Extends (source, slot), in order; per Extend its step (chain depth: 3 reads a T_sub unit,
    # 4 a slot made by a depth-3 Extend, ...) and the index of the Extend making its source.
    ext_srcs: list[tuple[int, ...]] = []
    ext_slots: list[tuple[int, ...]] = list(missing)
    ext_steps: list[int] = []
    ext_made: list[int | None] = []
    chain_run = 0  # > 0: the slots come in runs of this length, one run per node, chained in bulk
    picks: Iterator[int] | None = None
    slot_node_set = set(slot_nodes)
    cand_nodes = node_of[::cand_run] if cand_run else node_of
    if n_cand and slot_node_set.isdisjoint(cand_nodes) and fresh[:n_cand] == sorted(fresh[:n_cand]):
        # No slot on a candidate's node: only the remote picks load candidates, so (the heap being
        # sorted to start with) each node is picked once per round, least loaded candidate first.
        n_picks = len(slot_node_set)
        if uniform and cand_run:  # node q's candidates are q * cand_run + (0, 1, ...): round r picks
            # every node's (r % cand_run)-th, in node order
            picked: list[int] = []
            for r in range(-(-n_picks // (n_cand // cand_run))):
                picked += range(r % cand_run, n_cand, cand_run)
            del picked[n_picks:]
        else:
            picked = _remote_picks(list(pools().values()), fresh, n_picks)
        run = _run_length(slot_nodes)
        if run:
            # Each node's slots are consecutive (``run`` of them): its first reads the node's
            # pick, each other the slot before it; slices do it for every node at once.
            chain_run = run
            head_srcs = list(map(candidates.__getitem__, picked))
            ext_srcs = list(
                itertools.chain.from_iterable(
                    zip(head_srcs, *[missing[i::run] for i in range(run - 1)], strict=True)
                )
            )
            ext_made = list(
                itertools.chain.from_iterable(
                    zip(repeat(None, n_picks), *[range(i, n_slots, run) for i in range(run - 1)], strict=True)
                )
            )
            ext_steps = list(range(3, 3 + run)) * n_picks
            slot_nodes = []  # done
        picks = iter(picked)
    load = [0] * (n_cand + n_slots)
    # Across nodes: the source whose node has sent least so far (spread over NICs), then by load.
    sent: dict[int, int] = defaultdict(int)
    remote: list[tuple[int, int, bool, int]] = []  # a lazy heap (indices are unique), made on first need
    heappop, heappush, local_get = heapq.heappop, heapq.heappush, (pools() if slot_nodes else local).get
    # A node without candidates chains its Extends: the newest is the only one no Extend reads
    # yet (its pool's least loaded, every other read once), so it is the next source there.
    tail: dict[int, int] = {}
    tail_get = tail.get
    for j, node in enumerate(slot_nodes):
        si = tail_get(node)
        if si is not None:  # (extends' loads matter only in their node's chain: not kept)
            tail[node] = n_cand + j
            made = si - n_cand
            ext_srcs.append(missing[made])
            ext_made.append(made)
            ext_steps.append(ext_steps[made] + 1)
            continue
        pool = local_get(node)
        if pool:
            si = min(pool, key=lambda i: (load[i], fresh[i])) if len(pool) > 1 else pool[0]
            pool.append(n_cand + j)
        elif picks is not None:
            si = next(picks)
            tail[node] = n_cand + j
        else:
            if not remote:
                remote = [(0, 0, fresh[k], k) for k in range(n_cand)]
            top = remote[0]
            while top[0] != sent[node_of[top[3]]] or top[1] != load[top[3]]:
                _, _, r, k = heappop(remote)
                heappush(remote, (sent[node_of[k]], load[k], r, k))
                top = remote[0]
            si = top[3]
            sent[node_of[si]] += 1
            tail[node] = n_cand + j
        load[si] += 1
        if si < n_cand:
            ext_srcs.append(candidates[si])
            ext_made.append(None)
            ext_steps.append(3)
        else:
            made = si - n_cand
            ext_srcs.append(missing[made])
            ext_made.append(made)
            ext_steps.append(ext_steps[made] + 1)
    # T_sub units that stay or feed an Extend (a subset of ``where``)
    kept = reused if len(reused) == len(where) else reused.union(filter(where.__contains__, ext_srcs))

    add = out.add

    mem_a, mem_s, mem_b = memory_of(a), memory_of(s), memory_of(b)
    destroy = Primitive.DESTROY
    made_by: dict[tuple[int, ...], int] = {}  # T_sub unit gpus -> node that created it
    if len(kept) == len(where):  # every T_sub unit is used (``kept`` is a subset of ``where``)
        splitting = split_units
    else:
        splitting = [i for i in split_units if not kept.isdisjoint(split_into[i])]
    kept_units = splitting
    if a != s:
        # Units of one model-stage mostly split alike: pattern, buffers and net effects per tiling.
        by_tiles: dict[tuple[tuple[int, ...], ...], tuple[Pattern, tuple[float, ...], tuple[int, ...]]] = {}
        positions = range(a.size)
        picked_a = sub_positions(a, s)
        split = Primitive.SPLIT
        if not PARTIAL_SPLIT and splitting and by_position.issuperset(splitting):
            # Every unit splits position-wise: one pattern, the lanes' parts made in bulk.
            if len(splitting) == n_cur:  # all of them, in order
                units, subs_of = cur_units, split_into
            else:
                units = [cur_units[i] for i in splitting]
                subs_of = [split_into[i] for i in splitting]
            flat_subs = list(itertools.chain.from_iterable(subs_of))
            k = len(picked_a)  # every unit splits into all its position-wise T_sub units
            if BULK_SHORTCUTS and (len(kept) == len(where) or kept.issuperset(flat_subs)):
                # No unused T_sub unit to destroy: in bulk. Who made a T_sub unit matters only
                # to an Extend, a Destroy of a source or a Merge reading it.
                first = _add_splits(out, geo, a, s, units, flat_subs, mem_s - mem_a)
                if ext_slots or len(kept) != len(reused) or not (same or in_place):
                    made_by.update(
                        zip(
                            flat_subs,
                            itertools.chain.from_iterable(
                                map(repeat, range(first, out.next_id()), repeat(k))
                            ),
                            strict=True,
                        )
                    )
            else:  # per unit, each followed by the Destroys of its unused T_sub units
                pattern, buf = split_pattern(geo, a, s, picked_a)
                unit_nets = [mem_s - mem_a] * a.size  # a full split keeps every GPU
                lanes = zip(
                    repeat(0),
                    repeat(split),
                    zip(map(_new, repeat(Unit), zip(repeat(a), units))),
                    zip(*[map(_new, repeat(Unit), zip(repeat(s), flat_subs))] * k, strict=True),
                    map(partial, repeat(placed), units, repeat(pattern)),  # built when read
                    repeat(()),
                    # per lane its GPUs' effects (one flat pass when the lanes are all units in order)
                    zip(
                        *[zip(current.gpus, itertools.cycle(unit_nets), itertools.cycle(buf))] * a.size,
                        strict=True,
                    )
                    if units is cur_units
                    else map(tuple, map(zip, units, repeat(unit_nets), repeat(buf))),
                )
                for lane, subs in zip(lanes, subs_of, strict=True):
                    nid = out.append(lane)
                    for t in subs:
                        made_by[t] = nid
                        if t not in kept:
                            add(1, destroy, (_new(Unit, (s, t)),), (), (), (nid,), uniform_effects(t, -mem_s))
            splitting = []  # done
        all_kept = len(kept) == len(where)  # no T_sub unit to destroy
        last_tiles: tuple[tuple[int, ...], ...] = ()
        last_pick: Callable[[tuple[int, ...]], object] = _FIRST
        for i in splitting:
            # A partial Split keeps only the used T_sub units (the unit's other GPUs just send and
            # free their shard); a full one (the paper's) makes all of them, the unused dropped next.
            u = cur_units[i]
            subs = [t for t in split_into[i] if t in kept] if PARTIAL_SPLIT else split_into[i]
            if i in by_position and not PARTIAL_SPLIT:  # the position-wise split: tiles known
                tiles = picked_a
            elif last_tiles and last_pick(u) == tuple(itertools.chain.from_iterable(subs)):
                tiles = last_tiles  # units mostly split alike: the positions of the unit before
            else:
                at = dict(zip(u, positions, strict=True)).__getitem__
                tiles = last_tiles = tuple(tuple(map(at, t)) for t in subs)
                last_pick = itemgetter(*itertools.chain.from_iterable(tiles))
            known = by_tiles.get(tiles)
            if known is None:
                pattern, buf = split_pattern(geo, a, s, tiles)
                stays = {x for t in tiles for x in t}
                gpu_nets = [mem_s - mem_a if x in stays else -mem_a for x in positions]
                known = by_tiles[tiles] = (pattern, tuple(gpu_nets), buf)
            pattern, nets, buf = known
            nid = add(
                0,
                split,
                (_new(Unit, (a, u)),),
                tuple([_new(Unit, (s, t)) for t in subs]),
                partial(placed, u, pattern),  # built when read
                (),
                tuple(zip(u, nets, buf, strict=True)),
            )
            if all_kept:
                made_by.update(zip(subs, repeat(nid)))
                continue
            for t in subs:
                made_by[t] = nid
                if t not in kept:
                    add(1, destroy, (_new(Unit, (s, t)),), (), (), (nid,), uniform_effects(t, -mem_s))
    # Current units that neither stay nor feed anything go first (release before acquire).
    if len(kept_units) != n_cur:  # (``kept_units`` holds distinct indices)
        keep_units = set(kept_units)
        for i, u in enumerate(cur_units):
            if i not in keep_units:
                add(2, destroy, (_new(Unit, (a, u)),), (), (), (), uniform_effects(u, -mem_a))

    extend = Primitive.EXTEND
    first = out.next_id()  # the Extends' lane ids: first, first + 1, ...

    reading: dict[tuple[int, ...], list[int]] = {}  # source -> the Extends reading it (lane ids)

    def reading_index() -> dict[tuple[int, ...], list[int]]:
        """``reading``, indexed on first need (many plans never ask)."""
        if not reading and ext_srcs:
            for j, src in enumerate(ext_srcs, first):
                if src in reading:
                    reading[src].append(j)
                else:
                    reading[src] = [j]
        return reading

    def readers_of(t: tuple[int, ...]) -> list[int]:
        """The Extends reading unit ``t`` (lane ids)."""
        return reading_index().get(t) or []

    if ext_slots:
        # A source made by an Extend or a Split is waited for; the units, transfers and memory
        # effects are made in bulk.
        slot_units = tuple(map(_new, repeat(Unit), zip(repeat(s), ext_slots)))
        if chain_run:  # runs of chained slots: the head's source, then the slot before
            run, n_heads = chain_run, n_slots // chain_run
            # a chained Extend reads the unit the one before made (the same Unit object)
            src_units = tuple(
                itertools.chain.from_iterable(
                    zip(
                        map(_new, repeat(Unit), zip(repeat(s), head_srcs)),
                        *[slot_units[i::run] for i in range(run - 1)],
                        strict=True,
                    )
                )
            )
            if not made_by:
                head_deps: list[tuple[int, ...]] = [()] * n_heads
            elif all(map(made_by.__contains__, head_srcs)):
                head_deps = list(zip(map(made_by.__getitem__, head_srcs)))
            else:
                head_deps = [(made_by[t],) if t in made_by else () for t in head_srcs]
            deps_of = list(
                itertools.chain.from_iterable(
                    zip(
                        head_deps,
                        *[zip(range(first + i, first + n_slots, run)) for i in range(run - 1)],
                        strict=True,
                    )
                )
            )
        elif made_by:
            deps_of = [
                (first + m,) if m is not None else ((made_by[src],) if src in made_by else ())
                for m, src in zip(ext_made, ext_srcs, strict=True)
            ]
        else:
            deps_of = [() if m is None else (first + m,) for m in ext_made]
        if not chain_run:
            src_units = tuple(map(_new, repeat(Unit), zip(repeat(s), ext_srcs)))
        if not (same or in_place):  # only a Merge asks who made a slot
            made_by.update(zip(ext_slots, range(first, first + len(ext_slots)), strict=True))
        out.add_many(
            ext_steps,
            extend,
            src_units,
            slot_units,
            deps_of,
            tuple(zip(itertools.chain.from_iterable(ext_slots), repeat(mem_s), repeat(0.0))),
            (1, 1, s.size),
            partial(extend_transfers, geo, s),
            ext_srcs,
            ext_slots,
        )
    last = max(ext_steps, default=2)

    # Sources that are not part of the target: drop them after the Extends that read them
    # (the last copy of the state is never dropped before it has been copied).
    if len(kept) != len(reused):  # (``reused`` is a subset of ``kept``)
        dropped = sorted(kept - reused, key=where.__getitem__)
        out.add_many(
            last + 1,
            destroy,
            tuple(map(_new, repeat(Unit), zip(repeat(s), dropped))),
            (),
            _drop_deps(dropped, made_by, reading_index()),
            tuple(zip(itertools.chain.from_iterable(dropped), repeat(-mem_s), repeat(0.0))),
            (1, 0, s.size),
            _no_transfers,
            dropped,
        )

    if same or in_place:
        return out
    # Merge each target unit from its slots; a T_sub target unit sitting exactly on one slot is done.
    b_is_s = b == s
    positions = range(b.size)
    merge = Primitive.MERGE
    picked_b = sub_positions(b, s)
    merged: dict[tuple[tuple[int, ...], ...], tuple[Pattern, tuple[int, ...]]] = {}
    strided_known: tuple[Pattern, tuple[int, ...]] | None = None
    merge_known: tuple[Pattern, tuple[int, ...]] | None  # a target unit's (Merge pattern, buffers)
    net_b = mem_b - mem_s
    rows = strided if strided else [None] * len(tgt_units)

    def merge_deps(rows: list[list[tuple[int, ...]]], flat: list[tuple[int, ...]]) -> list:
        """Per Merge (of ``rows``, flat ``flat``): what made its inputs and every Extend reading them."""
        if ext_slots:
            return [
                sorted({made_by[t] for t in row if t in made_by}.union(*map(readers_of, row))) for row in rows
            ]
        if not made_by:
            return [()] * len(rows)
        made = list(map(made_by.get, flat, repeat(-1)))  # -1: made by none (lane ids are >= 0)
        if -1 in made:
            return [sorted({made_by[t] for t in row if t in made_by}) for row in rows]
        return list(map(sorted, map(set, gpu_chunks(made, len(flat) // len(rows)))))

    if not b_is_s and all(map(operator.is_, slots, rows)):
        # Every target unit merges its strided slots: in bulk.
        flat = list(itertools.chain.from_iterable(slots))
        _add_merges(out, geo, s, b, picked_b, flat, tgt_units, net_b, last + 2, merge_deps(slots, flat))
        tgt_units, rows, slots = [], [], []  # done
    elif chunked:
        # Every target unit merges the T_sub units on its consecutive GPUs: in bulk.
        chunk_deps = merge_deps(slots, chunks)
        _add_merges(
            out, geo, s, b, consecutive(b.size, s.size), chunks, tgt_units, net_b, last + 2, chunk_deps
        )
        tgt_units, rows, slots = [], [], []  # done
    for v, row, row_strided in zip(tgt_units, slots, rows, strict=True):
        if b_is_s and row[0] == v:
            continue
        if row is row_strided:  # the strided slots (``_slots_of`` hands the list back): tiles known
            tiles = picked_b
        else:
            at = dict(zip(v, positions, strict=True)).__getitem__
            tiles = tuple(tuple(map(at, t)) for t in row)
        if tiles is picked_b and strided_known is not None:  # the common case: no hashing
            merge_known = strided_known
        else:
            merge_known = merged.get(tiles)
            if merge_known is None:
                merge_known = merged[tiles] = merge_pattern(geo, s, b, tiles)
            if tiles is picked_b:
                strided_known = merge_known
        pattern, buf = merge_known
        # A Merge consumes its inputs: after whatever created them and every Extend that reads them.
        deps = {made_by[t] for t in row if t in made_by} if made_by else set()
        if ext_slots:
            deps = deps.union(*map(readers_of, row))
        add(
            last + 2,
            merge,
            tuple([_new(Unit, (s, t)) for t in row]),
            (_new(Unit, (b, v)),),
            partial(placed, v, pattern),  # built when read
            sorted(deps),
            tuple(zip(v, repeat(net_b), buf)),
        )
    return out


def _add_splits(
    out: LocalLanes,
    geo: Geometry,
    a: Layout,
    s: Layout,
    units: list[tuple[int, ...]],
    subs: list[tuple[int, ...]],
    net: float,
) -> int:
    """Every unit of ``units`` split position-wise into its T_sub units (``subs``, flat), as lanes
    in bulk (no deps); returns the first lane's id."""
    pattern, buf = split_pattern(geo, a, s, sub_positions(a, s))
    first = out.next_id()
    out.add_many(
        0,
        Primitive.SPLIT,
        tuple(map(_new, repeat(Unit), zip(repeat(a), units))),
        tuple(map(_new, repeat(Unit), zip(repeat(s), subs))),
        [()] * len(units),
        # a full split keeps every GPU
        tuple(zip(itertools.chain.from_iterable(units), repeat(net), itertools.cycle(buf))),
        (1, len(subs) // len(units) if units else 0, a.size),
        placed,
        units,
        [pattern] * len(units),
    )
    return first


def _add_merges(
    out: LocalLanes,
    geo: Geometry,
    s: Layout,
    b: Layout,
    tiles: tuple[tuple[int, ...], ...],
    subs: Iterable[tuple[int, ...]],
    units: list[tuple[int, ...]],
    net: float,
    step: int = 4,
    deps: list | None = None,
) -> None:
    """Every target unit of ``units`` merged in place from its T_sub units (``subs``, flat; at
    ``tiles``, the same positions for each), as lanes in bulk at ``step`` (``deps`` per lane; none
    if not given)."""
    pattern, buf = merge_pattern(geo, s, b, tiles)
    out.add_many(
        step,
        Primitive.MERGE,
        tuple(map(_new, repeat(Unit), zip(repeat(s), subs))),
        tuple(map(_new, repeat(Unit), zip(repeat(b), units))),
        [()] * len(units) if deps is None else deps,
        tuple(zip(itertools.chain.from_iterable(units), repeat(net), itertools.cycle(buf))),
        (len(tiles), 1, b.size),
        placed,
        units,
        [pattern] * len(units),
    )


def _drop_deps(
    dropped: list[tuple[int, ...]],
    made_by: dict[tuple[int, ...], int],
    reading: dict[tuple[int, ...], list[int]],
) -> list[list[int]]:
    """Per source to drop: the lane that made it (if any), then the Extends reading it."""
    made = list(map(made_by.get, dropped, repeat(-1)))  # -1: made by none (lane ids are >= 0)
    reads = list(map(reading.get, dropped, repeat([])))
    if -1 in made:
        return [([m] if m != -1 else []) + r for m, r in zip(made, reads, strict=True)]
    return list(map(operator.add, map(list, zip(made)), reads))  # [made] + readers, at C speed


def _no_transfers(_unit: tuple[int, ...]) -> list[Transfer]:
    """A Destroy's transfers: none."""
    return []


def _remote_picks(pools: list[list[int]], fresh: list[bool], count: int) -> list[int]:
    """The first ``count`` remote sources when only remote picks load candidates (``pools``: the
    candidates per node; ``fresh`` by index, non-decreasing): the least-sent node first, then the
    least-loaded source, reused ones first, then the lower index. Every node has sent ``r`` in
    round ``r`` and each node's r-th source is its ``(fresh, index)``-sorted candidates round-robin."""
    queues = [sorted(pool, key=fresh.__getitem__) for pool in pools]
    out: list[int] = []
    r = 0
    while len(out) < count:
        picked = [q[r % len(q)] for q in queues]
        out += map(
            _LAST,
            sorted(zip([r // len(q) for q in queues], map(fresh.__getitem__, picked), picked, strict=True)),
        )
        r += 1
    return out[:count]


def _run_length(keys: list[int]) -> int:
    """``L`` when ``keys`` are runs of ``L`` equal keys, each key in one run only; else 0."""
    if not keys:
        return 0
    heads = keys[:: len(keys) // len(set(keys))]
    run = len(keys) // len(heads)
    if len(heads) * run != len(keys) or len(set(heads)) != len(heads):
        return 0
    return run if all(keys[i::run] == heads for i in range(1, run)) else 0


def _slots_of(
    v: tuple[int, ...],
    strided: list[tuple[int, ...]],
    b: Layout,
    s: Layout,
    where: dict[tuple[int, ...], tuple[int, int]],
    sub_at_of: Callable[[], dict[int, tuple[int, ...]]],
) -> list[tuple[int, ...]]:
    """The ``T_sub`` units the target unit on GPUs ``v`` is merged from (``strided``: its strided
    slots; handed back as is when every one exists or none can).

    First the T_sub units (of split current units) lying exactly on a strided slot (Merge copies
    nothing there), then any other T_sub unit inside ``v``'s GPUs (Merge copies the pieces its
    GPUs lack), then new slots for Extend on the rest, each GPU at the sub-position whose shard
    contains its target shard where possible.
    """
    row = [t for t in strided if t in where]
    if len(row) == len(strided):
        return strided  # every strided slot already exists
    sub_at = sub_at_of()
    if not row and sub_at.keys().isdisjoint(v):
        return strided  # nothing of this model-stage inside: Extend onto the strided slots
    inside = set(v)
    covered = {g for t in row for g in t}
    if len(covered) < len(inside):
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
