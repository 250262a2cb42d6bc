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

from collections import defaultdict
from collections.abc import Callable
from functools import lru_cache
from math import gcd

from nereus_lightning.plan.layout import Candidate, Layout
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.transition.dag import MemEffect, Node, Primitive, Unit
from nereus_lightning.transition.pieces import Geometry, Transfer, extend_transfers, gather_transfers


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


@lru_cache(maxsize=1024)
def _inverse(x: Layout, s: Layout) -> tuple[tuple[int, int], ...]:
    """For each position of ``x``: (sub-unit, index inside it)."""
    inv: list[tuple[int, int]] = [(0, 0)] * x.size
    for j, idx in enumerate(sub_positions(x, s)):
        for q, xi in enumerate(idx):
            inv[xi] = (j, q)
    return tuple(inv)


def _transient(transfers: list[Transfer]) -> dict[int, float]:
    """Send and receive buffers per GPU (every transfer is one contiguous buffer on each side)."""
    out: dict[int, float] = defaultdict(float)
    for t in transfers:
        out[t.src_gpu] += t.bytes
        if t.dst_gpu != t.src_gpu:
            out[t.dst_gpu] += t.bytes
    return out


def _effects(gpus: tuple[int, ...], net: float, transfers: list[Transfer]) -> tuple[MemEffect, ...]:
    buf = _transient(transfers)
    return tuple(MemEffect(g, net, buf.get(g, 0.0)) for g in gpus)


def local_dag(
    name: str,
    geo: Geometry,
    memory_of: Callable[[Layout], float],
    current: Candidate,
    target: Candidate,
    cluster: ClusterSpec,
) -> list[Node]:
    """The nodes of one model-stage's local DAG; ids and deps are local (0-based, deps earlier)."""
    a, b = current.layout, target.layout
    if a == b and current.gpus == target.gpus:
        return []
    s = common_layout(a, b)
    subs_a, subs_b = sub_positions(a, s), sub_positions(b, s)
    cur_units = [Unit(a, current.replica_gpus(i)) for i in range(current.dp)]
    tgt_units = [Unit(b, target.replica_gpus(i)) for i in range(target.dp)]

    # T_sub units each current unit would split into, indexed by their GPU tuple: the target's
    # strided slots when they tile the unit exactly (then Merge or nothing follows in place),
    # else the position-wise split.
    slot_at = {g: t for v in tgt_units for t in (tuple(v.gpus[x] for x in idx) for idx in subs_b) for g in t}
    split_into: list[list[tuple[int, ...]]] = []
    where: dict[tuple[int, ...], tuple[int, int]] = {}
    for i, u in enumerate(cur_units):
        mine = set(u.gpus)
        tiles = list(dict.fromkeys(slot_at[g] for g in u.gpus if g in slot_at))
        if a == s or not (sum(map(len, tiles)) == len(mine) and all(mine.issuperset(t) for t in tiles)):
            tiles = [tuple(u.gpus[x] for x in idx) for idx in subs_a]
        split_into.append(tiles)
        for j, t in enumerate(tiles):
            where[t] = (i, j)
    sub_at = {g: t for t in where for g in t}  # the T_sub unit each current GPU would be part of
    slots = [_slots_of(v, b, s, subs_b, where, sub_at) for v in tgt_units]  # per target unit, its Merge inputs
    reused = {t for row in slots for t in row if t in where}
    missing = [t for row in slots for t in row if t not in where]
    split_units = sorted({where[t][0] for t in reused})
    if missing and not split_units:
        # Nothing stays in place: split just enough current units to have one source per slot.
        k = len(subs_a)
        split_units = list(range(min(len(cur_units), -(-len(missing) // k))))

    nodes: list[Node] = []

    def add(op: Primitive, srcs, tgts, transfers, deps, mem) -> int:
        nodes.append(Node(len(nodes), op, name, tuple(srcs), tuple(tgts), tuple(transfers), list(deps), mem))
        return len(nodes) - 1

    mem_a, mem_s, mem_b = memory_of(a), memory_of(s), memory_of(b)
    made_by: dict[tuple[int, ...], int] = {}  # T_sub unit gpus -> node that created it
    sources: list[tuple[int, ...]] = []
    split_set = set(split_units)
    for i in split_units:
        u = cur_units[i]
        if a == s:
            sources.append(u.gpus)
            continue
        subs = split_into[i]
        index = {g: x for x, g in enumerate(u.gpus)}
        transfers: list[Transfer] = []
        for t in subs:
            for q, g in enumerate(t):
                transfers += gather_transfers(geo, a, u.gpus, index[g], s, q // s.tp, q % s.tp)
        nid = add(Primitive.SPLIT, [u], [Unit(s, t) for t in subs], transfers, [], _effects(u.gpus, mem_s - mem_a, transfers))
        for t in subs:
            made_by[t] = nid
            sources.append(t)
    # Current units that neither stay nor feed anything go first (release before acquire).
    for i, u in enumerate(cur_units):
        if i not in split_set:
            add(Primitive.DESTROY, [u], [], [], [], _effects(u.gpus, -mem_a, []))

    # Extend every missing slot: a source on the slot's node if any (chaining inside the node),
    # else the least-loaded source anywhere; ties keep the order of the list.
    node_of = cluster.node_of
    load: dict[tuple[int, ...], int] = {t: 0 for t in sources}
    local: dict[int, list[tuple[int, ...]]] = defaultdict(list)
    for t in sources:
        local[node_of(t[0])].append(t)
    readers: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for slot in missing:
        near = local.get(node_of(slot[0]))
        pool = near if near else sources
        src = min(pool, key=load.__getitem__)
        load[src] += 1
        transfers = extend_transfers(geo, s, src, slot)
        buf = _transient(transfers)
        mem = tuple(MemEffect(g, mem_s, buf.get(g, 0.0)) for g in slot) + tuple(
            MemEffect(g, 0.0, buf.get(g, 0.0)) for g in src if g not in slot
        )
        deps = [made_by[src]] if src in made_by else []
        nid = add(Primitive.EXTEND, [Unit(s, src)], [Unit(s, slot)], transfers, deps, mem)
        made_by[slot] = nid  # a slot is never a source of the list above, so its Destroy is never due
        readers[src].append(nid)
        load[slot] = 0
        local[node_of(slot[0])].append(slot)

    # Leftover T_sub units of split units: drop them (after the Extends that read them).
    for t in sources:
        if t not in reused:
            deps = ([made_by[t]] if t in made_by else []) + readers.get(t, [])
            add(Primitive.DESTROY, [Unit(s, t)], [], [], deps, _effects(t, -mem_s, []))

    # Merge each target unit from its slots; a T_sub target unit sitting exactly on one slot is done.
    for v, row in zip(tgt_units, slots):
        if b == s and row[0] == v.gpus:
            continue
        at = {g: (t, q) for t in row for q, g in enumerate(t)}
        transfers = []
        for x, g in enumerate(v.gpus):
            t, q = at[g]
            transfers += gather_transfers(geo, s, t, q, b, x // b.tp, x % b.tp)
        deps = sorted({made_by[t] for t in row if t in made_by})
        add(Primitive.MERGE, [Unit(s, t) for t in row], [v], transfers, deps, _effects(v.gpus, mem_b - mem_s, transfers))
    return nodes


def _slots_of(
    v: Unit,
    b: Layout,
    s: Layout,
    subs_b: tuple[tuple[int, ...], ...],
    where: dict[tuple[int, ...], tuple[int, int]],
    sub_at: dict[int, tuple[int, ...]],
) -> list[tuple[int, ...]]:
    """The ``T_sub`` units target unit ``v`` is merged from.

    First the T_sub units (of split current units) lying exactly on a strided slot (Merge copies
    nothing there), then any other T_sub unit inside ``v``'s GPUs (Merge copies the pieces its
    GPUs lack), then new slots for Extend on the rest, each GPU at the sub-position whose shard
    contains its target shard where possible.
    """
    inside = set(v.gpus)
    row: list[tuple[int, ...]] = []
    covered: set[int] = set()
    for idx in subs_b:
        t = tuple(v.gpus[x] for x in idx)
        if t in where:
            row.append(t)
            covered.update(t)
    if len(covered) < len(inside):
        for g in v.gpus:
            t = sub_at.get(g)
            if t is not None and g not in covered and inside.issuperset(t):
                row.append(t)
                covered.update(t)
    if len(covered) == len(inside):
        return row
    k_tp, k_pp = b.tp // s.tp, b.pp // s.pp
    queues: list[list[int]] = [[] for _ in range(s.size)]
    for x, g in enumerate(v.gpus):
        if g not in covered:
            p, t = divmod(x, b.tp)
            queues[(p // k_pp) * s.tp + t // k_tp].append(g)
    for _ in range((len(inside) - len(covered)) // s.size):
        slot = []
        for q in range(s.size):
            src = queues[q] if queues[q] else next(qq for qq in queues if qq)
            slot.append(src.pop(0))
        row.append(tuple(slot))
    return row

