"""The global transition DAG: local DAGs plus resource edges, found by one ordered replay.

The union of the local DAGs is replayed with a priority list scheduler (releases first: Destroy,
then Merge; then generation -> inference -> training, workflow order, local order). Two
model-stages are *peers* when they run concurrently (same stage, disjoint GPUs) under both plans
(``TransitionContext.peers``); a pair colocated under either plan runs in turn there, so its
units may share a GPU meanwhile. An acquisition is *blocked* while a peer still holds one of its
GPUs, or while the memory bound of a GPU would pass the cap. When it can go, it gets a resource
edge from every release it relied on, so ANY execution of the final DAG is safe:

* GPU disjointness: an Extend of X onto GPU g depends on every Destroy by which a peer left g
  (and that peer never comes back to g: peers are disjoint in the target).
* Memory: on a GPU whose worst case (resident + every node's growth) fits, no edge is needed.
  On a tight GPU each acquisition depends on every earlier node on that GPU that freed memory,
  and is admitted only if ``resident + growth of all earlier acquisitions + its own growth - those
  frees`` fits. Any set of started nodes is then bounded by the check of its last acquisition.

A Destroy that depends on the blocked acquisition never runs before it (the replay respects
dependencies), so the edges keep the graph acyclic. If nothing can run while acquisitions are
blocked, no releasing Destroy exists: :class:`InfeasiblePlanError` names the stuck acquisitions.
An acquisition that cannot fit on a tight GPU even after every other node there has freed all it
frees is reported before the replay (no order could admit it; the replay would end stuck on it).
"""

from __future__ import annotations

import heapq
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import replace
from functools import lru_cache, reduce
from itertools import chain, compress, repeat
from operator import add, gt, itemgetter, or_

from nereus_lightning.plan.layout import Layout, Plan
from nereus_lightning.plan.memory import boundary_state_bytes, memory_cap
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import InfeasiblePlanError, NereusConfigError
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.spec.workload import ModelStage, Workload
from nereus_lightning.transition.dag import Node, Primitive, TransitionContext, TransitionDAG, memory_growth
from nereus_lightning.transition.lanes import LocalLanes
from nereus_lightning.transition.local import local_lanes
from nereus_lightning.transition.pieces import geometry
from nereus_lightning.transition.tsub import common_layout

_OP_RANK = {Primitive.DESTROY: 0, Primitive.MERGE: 1, Primitive.SPLIT: 2, Primitive.EXTEND: 3}
GB = 1e9
_FIRST = itemgetter(0)  # a memory effect's GPU
_GPUS = itemgetter(1)  # a Unit's GPUs


def build_transition(
    current: Plan, target: Plan, models: Mapping[str, ModelSpec], cluster: ClusterSpec, workload: Workload
) -> TransitionDAG:
    """The global transition DAG from ``current`` to ``target`` (cached per argument tuple).

    Args:
        current: the plan the job runs now.
        target: the plan to move to (the same model-stages).
        models: ModelSpec per model role (``actor``, ``critic``, ``reference``, ``reward``).
        cluster: GPUs, links and memory.
        workload: its algorithm names the model-stages and their stages.

    Raises:
        NereusConfigError: the plans or ``models`` do not match the workload.
        InfeasiblePlanError: no safe order exists (the message names the stuck acquisition),
            or a plan does not fit in GPU memory.
    """
    return _build(current, target, tuple(sorted(models.items())), cluster, workload)


@lru_cache(maxsize=128)
def _build(
    current: Plan,
    target: Plan,
    models: tuple[tuple[str, ModelSpec], ...],
    cluster: ClusterSpec,
    workload: Workload,
) -> TransitionDAG:
    ctx, now = _context(current, target, dict(models), cluster, workload)
    peers_now = _held_by_peers(ctx, now)
    batched = batchable(ctx, peers_now)
    lanes = {name: _local(ctx, name) for name in ctx.current}
    parts = {name: calls.nodes(name in batched) for name, calls in lanes.items()}
    nodes = _numbered(parts)
    growth = memory_growth(nodes, cluster.num_gpus)
    tight = _tight(ctx, growth)
    if tight:
        careful = [not tight.isdisjoint(map(_FIRST, n.mem)) for n in nodes]
        # Per lane the same memory effects as per replica: no need to rebuild to find these.
        base = ctx.current_memory or resident_memory(ctx.current, ctx)
        _never_fits(nodes, careful, tight, base, memory_cap(cluster))
        # A model-stage touching a GPU that may overflow needs per-replica memory ordering:
        # rebuild it per replica (the growth per GPU is the same either way).
        wide = {n.model_stage for n, c in zip(nodes, careful, strict=True) if c and n.model_stage in batched}
        if wide:
            parts.update({name: lanes[name].nodes(False) for name in wide})
            nodes = _numbered(parts)
    order = _order_with_resource_edges(nodes, ctx, growth, tight, peers_now)
    dag = TransitionDAG(order, ctx, global_order=True)
    dag._growth = ((cluster.num_gpus, *(n.mem for n in order)), growth)  # validate reuses it
    return dag


def make_context(
    current: Plan, target: Plan, models: Mapping[str, ModelSpec], cluster: ClusterSpec, workload: Workload
) -> TransitionContext:
    """Check the inputs and collect what every later step needs (unit memory per layout)."""
    return _context(current, target, models, cluster, workload)[0]


def _context(
    current: Plan, target: Plan, models: Mapping[str, ModelSpec], cluster: ClusterSpec, workload: Workload
) -> tuple[TransitionContext, dict[str, set[int]]]:
    """:func:`make_context`, and per model-stage with peers the GPUs its peers hold now."""
    stages = {ms.name: ms for ms in workload.stages}
    for label, plan in (("current", current), ("target", target)):
        for name in plan:
            if name not in stages:
                raise NereusConfigError(
                    f"{label} plan: model-stage {name!r} is not in the {workload.algorithm} workflow "
                    f"{list(stages)}"
                )
    if set(current) != set(target):
        raise NereusConfigError(
            f"target plan: model-stages {sorted(set(target))} differ from the current plan's "
            f"{sorted(set(current))}; "
            "a transition moves existing model-stages only"
        )
    for name in current:
        role = stages[name].model
        if role not in models:
            raise NereusConfigError(
                f"models: no ModelSpec for role {role!r} (needed by {name}); pass models[{role!r}]"
            )
    unit_memory: dict[tuple[str, Layout], float] = {}
    known: dict[tuple[str, bool, Layout], float] = {}  # model-stages of one role share their layouts
    goal = dict(target.items())
    for name, cand in current.items():
        ms = stages[name]
        a, b = cand.layout, goal[name].layout
        for layout in (a, b, common_layout(a, b)):
            key = (ms.model, ms.trains, layout)
            if key not in known:
                known[key] = boundary_state_bytes(models[ms.model], ms.trains, layout)
            unit_memory[(name, layout)] = known[key]
    ctx = TransitionContext(current, target, stages, dict(models), cluster, workload, unit_memory)
    resident = _check_plan("current", current, ctx)
    _check_plan("target", target, ctx, per_gpu=False)
    ctx = replace(ctx, current_memory=tuple(resident))
    return ctx, _peer_gpus(ctx)


def resident_memory(plan: Plan, ctx: TransitionContext) -> list[float]:
    """Resident state bytes per GPU (index = GPU id) under ``plan``."""
    mem = [0.0] * ctx.cluster.num_gpus
    for name, cand in plan.items():
        per_gpu = ctx.memory_of(name, cand.layout)
        if per_gpu:  # idle generation/inference weights are offloaded: nothing resident
            for g in cand.gpus:
                mem[g] += per_gpu
    return mem


def _check_plan(label: str, plan: Plan, ctx: TransitionContext, per_gpu: bool = True) -> list[float]:
    """GPU ids exist and resident state fits (model-stages of one stage may share GPUs: they then
    run in turn); returns the resident state per GPU (or, without ``per_gpu``, ``[]`` when the sum
    of every model-stage's unit memory fits anyway)."""
    n = ctx.cluster.num_gpus
    for name, cand in plan.items():
        if min(cand.gpus) < 0 or max(cand.gpus) >= n:
            bad = next(g for g in cand.gpus if not 0 <= g < n)
            raise NereusConfigError(f"{label} plan: {name} uses GPU {bad}, outside the pool 0..{n - 1}")
    cap = memory_cap(ctx.cluster)
    if not per_gpu and sum(ctx.memory_of(name, c.layout) for name, c in plan.items()) <= cap:
        return []  # no GPU can hold more than all model-stages together
    mem = resident_memory(plan, ctx)
    top = max(mem)
    if top > cap:
        g = mem.index(top)
        holders = [name for name, c in plan.items() if g in c.gpus]
        raise InfeasiblePlanError(
            f"{label} plan does not fit on GPU {g}: {top / GB:.1f} GB resident ({', '.join(holders)}) "
            f"> cap {cap / GB:.1f} GB"
        )
    return mem


def _peer_gpus(ctx: TransitionContext) -> dict[str, set[int]]:
    """Per model-stage with peers, the GPUs its peers hold under the current plan."""
    gpus = {name: c.gpus for name, c in ctx.current.items()}
    return {
        name: set(chain.from_iterable(map(gpus.__getitem__, peers)))
        for name, peers in ctx.peers.items()
        if peers
    }


def union_of_local_dags(ctx: TransitionContext, batched: Collection[str] = ()) -> list[Node]:
    """Every model-stage's local DAG in workflow order, ids global (deps local only).

    Model-stages in ``batched`` get one node per step for all their replicas (``local_dag(batch=True)``).
    """
    return _numbered({name: _local(ctx, name).nodes(name in batched) for name in ctx.current})


def _local(ctx: TransitionContext, name: str) -> LocalLanes:
    """The primitive calls of model-stage ``name``'s local DAG."""
    ms = ctx.stages[name]
    geo = geometry(ctx.models[ms.model], ms.trains)
    memory_of = lambda layout: ctx.memory_of(name, layout)  # noqa: E731
    return local_lanes(name, geo, memory_of, ctx.current[name], ctx.target[name], ctx.cluster)


def _numbered(parts: Mapping[str, list[Node]]) -> list[Node]:
    """The local DAGs (each numbered contiguously) concatenated in order, ids and deps shifted in place."""
    nodes: list[Node] = []
    for part in parts.values():
        shift = len(nodes) - part[0].id if part else 0  # a part numbered before keeps its ids apart
        if shift:
            for n in part:
                n.id += shift
                if n.deps:
                    n.deps = [d + shift for d in n.deps]
        nodes += part
    return nodes


def batchable(ctx: TransitionContext, peers_now: Mapping[str, set[int]] | None = None) -> set[str]:
    """Model-stages whose acquisitions no peer can block: their target GPUs hold no unit of a
    peer now (peers only move onto their own target GPUs, disjoint from theirs).

    Their nodes never wait in the global order (unless memory is tight, see ``_build``), so one
    node per step for all replicas orders exactly as well as one per replica, and the releases
    other model-stages wait for still always come. ``peers_now`` is ``_held_by_peers(ctx)`` if known.
    """
    if peers_now is None:
        peers_now = _held_by_peers(ctx)
    return {name for name in ctx.current if name not in peers_now}


def _held_by_peers(ctx: TransitionContext, now: Mapping[str, set[int]] | None = None) -> dict[str, set[int]]:
    """The GPUs peers hold now, for each model-stage whose target holds one of them.

    ``now``: per model-stage with peers, the GPUs they hold now, if known (``_peer_gpus``).
    """
    if now is None:
        now = _peer_gpus(ctx)
    target = dict(ctx.target.items())
    return {name: held for name, held in now.items() if not held.isdisjoint(target[name].gpus)}


def _tight(ctx: TransitionContext, growth: list[float]) -> set[int]:
    """GPUs whose resident state plus every node's growth there may pass the memory cap."""
    cap = memory_cap(ctx.cluster)
    base = ctx.current_memory or resident_memory(ctx.current, ctx)
    if max(map(add, base, growth), default=0.0) <= cap:
        return set()
    return set(compress(range(len(growth)), map(gt, map(add, base, growth), repeat(cap))))


def _ids(mask: int) -> list[int]:
    """The set bits of ``mask``, ascending (one step per set bit)."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _never_fits(
    nodes: list[Node], careful: list[bool], tight: set[int], base: Sequence[float], cap: float
) -> None:
    """Raise at once if an acquisition cannot fit even after every other node on its GPU freed
    all it ever frees (the replay would block it forever and stop with it stuck).

    A node on GPU g needs ``base + grown + grow - freed`` there; ``grown >= 0`` and ``freed`` is at
    most what the other nodes free on g, so this bound failing means no order can admit it.
    """
    # Per GPU as lists: indexing one is cheaper than hashing a GPU id into a set or dict.
    is_tight = [False] * len(base)
    for g in tight:
        is_tight[g] = True
    frees = [0.0] * len(base)
    grows: list[tuple[Node, int, float, float]] = []  # (node, gpu, growth, own free) on tight GPUs
    for n in compress(nodes, careful):
        for g, net, transient in n.mem:
            if is_tight[g]:
                if net < 0:
                    free, grow = transient - net, transient
                else:
                    free, grow = transient, net + transient
                if free > 0:
                    frees[g] += free
                if grow > 0:
                    grows.append((n, g, grow, free))
    stuck: dict[tuple[int, tuple[int, ...]], tuple[Node, int, float]] = {}  # per (node, unit)
    unit_at: dict[int, tuple[int, ...]] = {}  # the unit holding each GPU of the last stuck node
    last: Node | None = None
    for n, g, grow, own in grows:
        need = base[g] + grow - (frees[g] - own)
        if need > cap:
            if n is not last:  # a batched node: tell its lanes apart by their units
                last, unit_at = n, {}
                for u in n.targets or n.sources:
                    unit_at.update(dict.fromkeys(u.gpus, u.gpus))
            stuck.setdefault((id(n), unit_at.get(g, (g,))), (n, g, need))
    if stuck:
        lines = "; ".join(
            f"{n.op.value} of {n.model_stage} onto {list(unit)}: GPU {g} "
            f"would need {need / GB:.1f} GB > cap {cap / GB:.1f} GB"
            for (_, unit), (n, g, need) in list(stuck.items())[:4]
        )
        raise InfeasiblePlanError(
            f"no safe transition order: {len(stuck)} acquisition(s) cannot fit in memory even after every "
            f"other node on their GPUs has freed its memory; stuck: {lines}. Choose a target that leaves "
            "these GPUs free or frees memory first"
        )


def _order_with_resource_edges(
    nodes: list[Node],
    ctx: TransitionContext,
    growth: list[float] | None = None,
    tight: set[int] | None = None,
    peers_now: Mapping[str, set[int]] | None = None,
) -> list[Node]:
    """Replay ``nodes`` in priority order, adding resource edges; return them renumbered.

    ``growth`` is ``memory_growth(nodes, num_gpus)``, ``tight`` its ``_tight`` GPUs and
    ``peers_now`` is ``_held_by_peers(ctx)`` when the caller has them already.
    """
    stages: Mapping[str, ModelStage] = ctx.stages
    current = dict(ctx.current.items())
    peers = ctx.peers
    if peers_now is None:
        peers_now = _held_by_peers(ctx)
    target = dict(ctx.target.items())
    # Per model-stage whose Extends may wait: the GPUs of its target that its peers hold now.
    # Only these *contested* GPUs can block an acquisition or give it a resource edge. Extend
    # acquires GPUs of its own target only and peers are disjoint in the target, so a peer holds
    # such a GPU until it releases it, once: per contested GPU the peers still holding it (more
    # than one only where those peers are colocated now) and the releases (bit i: node i) so far.
    wait: dict[str, dict[int, set[str]]] = {}
    gone_of: dict[str, dict[int, int]] = {}
    watchers: dict[str, list[str]] = defaultdict(list)  # per peer holding a contested GPU: who waits
    for name, others in peers_now.items():
        contested = others.intersection(target[name].gpus)
        wait[name], gone_of[name] = {}, {}
        for other in peers[name]:
            theirs = contested.intersection(current[other].gpus)
            if theirs:
                watchers[other].append(name)
                for g in theirs:
                    wait[name].setdefault(g, set()).add(other)
    cap = memory_cap(ctx.cluster)
    n_gpus = ctx.cluster.num_gpus
    base = ctx.current_memory or resident_memory(ctx.current, ctx)
    if growth is None:
        growth = memory_growth(nodes, n_gpus)
    if tight is None:
        tight = _tight(ctx, growth)
    # Nodes that touch a tight GPU: only they need memory bookkeeping.
    careful = [not tight.isdisjoint(map(_FIRST, n.mem)) for n in nodes] if tight else [False] * len(nodes)

    grown: dict[int, float] = defaultdict(float)
    freed: dict[int, float] = defaultdict(float)
    # Executed nodes that freed memory per tight GPU, as a bit mask (bit i: node i).
    freers: dict[int, int] = defaultdict(int)
    succs: list[list[int]] = [[] for _ in nodes]
    indeg = [0] * len(nodes)
    for n in nodes:
        if n.deps:
            indeg[n.id] = len(n.deps)
            for d in n.deps:
                succs[d].append(n.id)
    # Priority (op rank, stage index, plan position, id) packed into one int: cheaper to compare.
    size, n_ms = len(nodes), len(current)
    rank = {name: stages[name].stage_index * n_ms + i for i, name in enumerate(current)}
    n_ranks = max(rank.values(), default=0) + 1
    keys = [(_OP_RANK[n.op] * n_ranks + rank[n.model_stage]) * size + n.id for n in nodes]
    heap = [keys[i] for i, d in enumerate(indeg) if d == 0]
    heapq.heapify(heap)
    extend, destroy, split = Primitive.EXTEND, Primitive.DESTROY, Primitive.SPLIT

    def blocked_by_peer(ms: str, gpus: tuple[int, ...]) -> str:
        held = wait[ms]
        for other in peers[ms]:  # the first peer (plan order) holding one, at its first such GPU
            g = next((g for g in gpus if other in held.get(g, ())), None)
            if g is not None:
                return f"GPU {g} is still held by {other} (same {stages[other].stage} stage)"
        raise AssertionError("a held GPU without a holder")  # pragma: no cover

    def blocked_by_memory(n: Node) -> str | None:
        for g, net, transient in n.mem:
            if g not in tight:
                continue
            grow = (net if net > 0 else 0.0) + transient
            if grow > 0 and base[g] + grown[g] + grow - freed[g] > cap:
                need = base[g] + grown[g] + grow - freed[g]
                return f"GPU {g} would need {need / GB:.1f} GB > cap {cap / GB:.1f} GB"
        return None

    order: list[Node] = []
    stuck: list[tuple[Node, str]] = []
    while True:
        progressed = False
        while heap:
            nid = heapq.heappop(heap) % size
            n = nodes[nid]
            ms = n.model_stage
            why = None
            peer_checked = n.op is extend and ms in wait
            if peer_checked:
                gpus = n.acquired_gpus
                if not wait[ms].keys().isdisjoint(gpus):
                    why = blocked_by_peer(ms, gpus)
            if why is None and careful[nid]:
                why = blocked_by_memory(n)
            if why:
                stuck.append((n, why))
                continue
            extra = 0  # the releases this node relied on, as a bit mask
            if peer_checked:
                gone = gone_of[ms]
                if gone:
                    relied = gone.keys() & gpus
                    if relied:
                        extra = reduce(or_, set(map(gone.__getitem__, relied)))
            elif ms in watchers and (n.op is destroy or n.op is split):
                # The contested GPUs a Destroy releases, or a Split does not keep.
                left = set(chain.from_iterable(map(_GPUS, n.sources)))
                if n.op is split:
                    left.difference_update(chain.from_iterable(map(_GPUS, n.targets)))
                for waiter in watchers[ms]:
                    held, gone = wait[waiter], gone_of[waiter]
                    for g in left.intersection(held):
                        holders = held[g]
                        if ms in holders:
                            holders.discard(ms)
                            gone[g] = gone.get(g, 0) | 1 << nid
                            if not holders:
                                del held[g]
            if careful[nid]:
                for g, net, transient in n.mem:
                    if g not in tight:
                        continue
                    grow = (net if net > 0 else 0.0) + transient
                    if grow > 0:
                        extra |= freers[g]
                    grown[g] += grow
                    free = (-net if net < 0 else 0.0) + transient
                    if free > 0:
                        freed[g] += free
                        freers[g] |= 1 << nid
            if extra:
                for d in n.deps:
                    extra &= ~(1 << d)
                extra &= ~(1 << nid)
                n.resource_deps = _ids(extra)
            order.append(n)
            progressed = True
            for s in succs[nid]:
                indeg[s] -= 1
                if indeg[s] == 0:
                    heapq.heappush(heap, keys[s])
        if not stuck:
            break
        if not progressed:
            lines = "; ".join(
                f"{n.op.value} of {n.model_stage} onto {list((n.targets or n.sources)[0].gpus)}: {why}"
                for n, why in stuck[:4]
            )
            raise InfeasiblePlanError(
                f"no safe transition order: {len(stuck)} acquisition(s) blocked and no release can run; "
                f"stuck: {lines}. Choose a target that leaves these GPUs free or frees memory first"
            )
        for n, _ in stuck:
            heapq.heappush(heap, keys[n.id])
        stuck = []
    if len(order) != len(nodes):  # pragma: no cover - a bug in the local DAGs, not bad input
        raise RuntimeError(f"transition replay ran {len(order)} of {len(nodes)} nodes")
    renumber = [0] * len(order)
    for i, n in enumerate(order):
        renumber[n.id] = i
    at = renumber.__getitem__
    for i, n in enumerate(order):
        n.id = i
        if n.resource_deps:
            n.resource_deps = sorted(map(at, n.resource_deps))
            n.deps = sorted(set(map(at, n.deps)).union(n.resource_deps))
        else:
            n.resource_deps = []
            if n.deps:
                n.deps = sorted(set(map(at, n.deps)))
    return order
