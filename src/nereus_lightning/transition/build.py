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

Memory is judged on the lanes' effects before any grouping (they are the same in every
grouping). The replay works on the local nodes (``lanes.LocalNode``, by their index in the
union): the lanes no peer can make wait batched per step; the others batched only with the lanes
of their step that wait for the same peer releases after the same nodes (``_wait_keys``: they
run alike in the replay), one by one where that is unclear; a model-stage on a tight GPU one by
one (memory is admitted per call). The DAG's nodes are made once, in the replay's order, where
alike calls of one model-stage that wait for exactly the same nodes become one batched node.
Built DAGs are immutable and cached (:func:`clear_cache` empties the cache).

A sharded model-stage (``Layout.shard > 1``) whose shard degree alone changes, each replica onto a
superset or a subset of its GPUs (:func:`~nereus_lightning.plan.rows.recut_in_place`), is re-cut in
place: one Split (a larger degree; it acquires the GPUs it adds) or Merge (a smaller one; it releases
the GPUs it drops) per replica, priced by the row moves the body executes
(:func:`~nereus_lightning.transition.pieces.recut_transfers`). Any other sharded model-stage that
changes moves as its shard groups (:func:`~nereus_lightning.plan.layout.moving_shard_groups`):
``shard`` ZeRO-0 replicas of ``Layout(tp, pp)`` per replica, each holding its whole ``(tp, pp)``
pieces, which is how the body holds the state while it transfers it (its row blocks gathered
first), priced and validated at the whole pieces' memory: a transition whose whole state does not
fit is reported infeasible. A sharded model-stage that stays keeps its row blocks (and their memory)
throughout.
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Hashable, Mapping, Sequence
from functools import lru_cache

import numpy as np

from nereus_lightning.plan.layout import Layout, Plan, moving_shard_groups
from nereus_lightning.plan.memory import boundary_state_bytes, memory_cap
from nereus_lightning.plan.rows import recut_stages
from nereus_lightning.spec.cluster import ClusterSpec
from nereus_lightning.spec.errors import InfeasiblePlanError, NereusConfigError
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.spec.workload import Workload
from nereus_lightning.transition.dag import (
    Effects,
    Node,
    Primitive,
    TransitionContext,
    TransitionDAG,
    acquired_gpus,
    acquires_some,
    memory_growth,
    released_gpus,
    releases_some,
)
from nereus_lightning.transition.lanes import (
    LocalNode,
    StepLanes,
    group,
    numbered,
    one_per_lane,
    waiting_lanes,
)
from nereus_lightning.transition.local import local_lanes
from nereus_lightning.transition.pieces import geometry
from nereus_lightning.transition.tsub import common_layout

_OP_RANK = {Primitive.DESTROY: 0, Primitive.MERGE: 1, Primitive.SPLIT: 2, Primitive.EXTEND: 3}
GB = 1e9


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
            or a plan does not fit in GPU memory (with its state whole, for a sharded model-stage that
            moves as its shard groups: the message names their layouts).
    """
    try:
        return _cached_build(current, target, tuple(sorted(models.items())), cluster, workload)
    except InfeasiblePlanError as err:
        recut = _recut(current, target, models, workload)
        sharded = [
            f"{name} {cand.layout} -> {target[name].layout}"
            for name, cand in current.items()
            if not cand.same_units(target[name])
            and max(cand.layout.shard, target[name].layout.shard) > 1
            and name not in recut
        ]
        if not sharded:
            raise
        raise InfeasiblePlanError(
            f"{err}. ZeRO-sharded model-stages move as their shard groups, each holding its state whole "
            f"while it moves (their row blocks are re-cut in place only where the shard degree alone "
            f"changes): {'; '.join(sharded)}"
        ) from err


def clear_cache() -> None:
    """Forget the DAGs :func:`build_transition` has cached."""
    _cached_build.cache_clear()


@lru_cache(maxsize=128)
def _cached_build(
    current: Plan,
    target: Plan,
    models: tuple[tuple[str, ModelSpec], ...],
    cluster: ClusterSpec,
    workload: Workload,
) -> TransitionDAG:
    ctx = _context(current, target, dict(models), cluster, workload)
    contested = _contested(ctx)
    lanes = {name: _local_lanes(ctx, name) for name in ctx.current}
    every = [(name, x) for name, steps in lanes.items() for x in steps]  # memory effects in any grouping
    growth = memory_growth([x for _, x in every], cluster.num_gpus)
    tight = _tight(ctx, growth)
    careful: set[str] = set()  # model-stages whose calls are admitted one by one (memory)
    if tight:
        _never_fits(every, tight, ctx.current_memory, memory_cap(cluster))
        # A model-stage touching a GPU that may overflow needs per-replica memory ordering.
        careful = {name for name, steps in lanes.items() if any(_touches(x, tight) for x in steps)}
    waiting = {
        name: waiting_lanes(lanes[name], set().union(*held.values()))
        for name, held in contested.items()
        if name not in careful
    }
    peers = {p for name in waiting for p in ctx.peers[name]}
    left_by = {p: _left_by(p, lanes[p], p in careful, waiting.get(p, {})) for p in peers}
    waits = {
        name: _wait_keys(contested[name], lanes_waiting, left_by) for name, lanes_waiting in waiting.items()
    }
    nodes = _union(lanes, careful, waits)
    order, resource = _order_with_resource_edges(nodes, ctx, growth, tight, contested)
    return TransitionDAG(_numbered_in_order(nodes, order, resource), ctx, global_order=True)


def make_context(
    current: Plan, target: Plan, models: Mapping[str, ModelSpec], cluster: ClusterSpec, workload: Workload
) -> TransitionContext:
    """Check the inputs and collect what every later step needs (unit memory per layout)."""
    return _context(current, target, models, cluster, workload)


def _context(
    current: Plan, target: Plan, models: Mapping[str, ModelSpec], cluster: ClusterSpec, workload: Workload
) -> TransitionContext:
    """:func:`make_context`."""
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
    current, target = moving_shard_groups(current, target, _recut(current, target, models, workload))
    unit_memory: dict[tuple[str, Layout], float] = {}
    for name, cand in current.items():
        ms = stages[name]
        a, b = cand.layout, target[name].layout
        for layout in (a, b, common_layout(a, b)):
            unit_memory[(name, layout)] = boundary_state_bytes(models[ms.model], ms.trains, layout)
    ctx = TransitionContext(current, target, stages, dict(models), cluster, workload, unit_memory)
    resident = _check_plan("current", current, ctx)
    _check_plan("target", target, ctx, per_gpu=False)
    resident.flags.writeable = False
    return TransitionContext(current, target, stages, ctx.models, cluster, workload, unit_memory, resident)


def _recut(
    current: Plan, target: Plan, models: Mapping[str, ModelSpec], workload: Workload
) -> frozenset[str]:
    """The model-stages re-cut to another shard degree in place
    (:func:`~nereus_lightning.plan.rows.recut_stages`)."""
    role = {ms.name: ms.model for ms in workload.stages}
    return recut_stages(current, target, {n: models[role[n]] for n in current})


def resident_memory(plan: Plan, ctx: TransitionContext) -> np.ndarray:
    """Resident state bytes per GPU (index = GPU id) under ``plan``."""
    mem = np.zeros(ctx.cluster.num_gpus)
    for name, cand in plan.items():
        per_gpu = ctx.memory_of(name, cand.layout)
        if per_gpu:  # idle generation/inference weights are offloaded: nothing resident
            mem[np.fromiter(cand.gpus, dtype=np.int64, count=len(cand.gpus))] += per_gpu  # (no GPU twice)
    return mem


def _check_plan(label: str, plan: Plan, ctx: TransitionContext, per_gpu: bool = True) -> np.ndarray:
    """GPU ids exist and resident state fits (model-stages of one stage may share GPUs: they then
    run in turn); returns the resident state per GPU (or, without ``per_gpu``, nothing when the sum
    of every model-stage's unit memory fits anyway)."""
    n = ctx.cluster.num_gpus
    ranges = [sorted(c.gpus) for _, c in plan.items()]  # (sorting ints: the quickest min and max)
    if any(r[0] < 0 or r[-1] >= n for r in ranges):
        name, bad = next((name, g) for name, c in plan.items() for g in c.gpus if not 0 <= g < n)
        raise NereusConfigError(f"{label} plan: {name} uses GPU {bad}, outside the pool 0..{n - 1}")
    cap = memory_cap(ctx.cluster)
    if not per_gpu and sum(ctx.memory_of(name, c.layout) for name, c in plan.items()) <= cap:
        return np.zeros(0)  # no GPU can hold more than all model-stages together
    mem = resident_memory(plan, ctx)
    g = int(mem.argmax())
    top = float(mem[g])
    if top > cap:
        holders = [name for name, c in plan.items() if g in c.gpus]
        raise InfeasiblePlanError(
            f"{label} plan does not fit on GPU {g}: {top / GB:.1f} GB resident ({', '.join(holders)}) "
            f"> cap {cap / GB:.1f} GB"
        )
    return mem


def _contested(ctx: TransitionContext) -> dict[str, dict[str, set[int]]]:
    """Per model-stage whose target holds GPUs its peers hold now (*contested* GPUs): per such peer
    (in plan order), those it holds."""
    out = {}
    for name, peers in ctx.peers.items():
        mine = set(ctx.target[name].gpus) if peers else set()
        held = {other: mine.intersection(ctx.current[other].gpus) for other in peers}
        if any(held.values()):
            out[name] = {other: gpus for other, gpus in held.items() if gpus}
    return out


def union_of_local_dags(ctx: TransitionContext) -> list[Node]:
    """Every model-stage's local DAG in workflow order, one node per replica-level call, ids
    global (deps local only)."""
    lanes = {name: _local_lanes(ctx, name) for name in ctx.current}
    return numbered(_union(lanes, set(lanes), {}))


def _local_lanes(ctx: TransitionContext, name: str) -> list[StepLanes]:
    """The primitive calls of model-stage ``name``'s local DAG."""
    ms = ctx.stages[name]
    geo = geometry(ctx.models[ms.model], ms.trains)
    return local_lanes(
        geo, lambda layout: ctx.memory_of(name, layout), ctx.current[name], ctx.target[name], ctx.cluster
    )


def _touches(x: StepLanes, gpus: set[int]) -> bool:
    """Whether a lane of ``x`` has a memory effect on one of ``gpus``."""
    return not gpus.isdisjoint(x.mem.gpus.tolist())


def _union(
    lanes: Mapping[str, list[StepLanes]],
    careful: Collection[str],
    waits: Mapping[str, Mapping[int, Hashable]],
) -> list[LocalNode]:
    """Every model-stage's local nodes in order, deps as indices of the union: one per lane for
    the ``careful`` model-stages, else grouped (``lanes.group``; ``waits``: the waiting lanes)."""
    out: list[LocalNode] = []
    for name, steps in lanes.items():
        if name in careful:
            out += one_per_lane(name, steps, len(out))
        else:
            out += group(name, steps, waits.get(name, {}), len(out))
    return out


def _left_by(
    name: str, steps: Sequence[StepLanes], careful: bool, waiting: Collection[int]
) -> dict[int, Hashable] | None:
    """The call by which model-stage ``name`` leaves each GPU it leaves: its lane where that lane
    has a node of its own (``careful``: all; else those ``waiting``), else its step; None if it
    leaves a GPU twice. A call is named by a string (its hash is kept: the wait keys hash it per GPU)."""
    out: dict[int, Hashable] = {}
    count = 0
    for x in steps:
        if not _leaves_some(x):
            continue
        n = len(x.ids)
        alone = [k for k, lane in enumerate(x.ids) if careful or lane in waiting]
        parts = [([k], f"{name} lane {x.ids[k]}") for k in alone]
        apart = set(alone)
        shared = [k for k in range(n) if k not in apart]
        if shared:
            parts.append((shared, f"{name} step {int(x.step)}"))
        for ks, call in parts:
            gpus = released_gpus(x.op, x.sources.gpus_of(ks, n), x.targets.gpus_of(ks, n))
            out.update(dict.fromkeys(gpus, call))
            count += len(gpus)
    return out if len(out) == count else None


def _leaves_some(x: StepLanes) -> bool:
    """Whether a lane of ``x`` may leave a GPU (:func:`~nereus_lightning.transition.dag.releases_some`)."""
    return releases_some(x.op, x.sources, x.targets)


def _wait_keys(
    contested: Mapping[str, set[int]],
    waiting: Mapping[int, Collection[int]],
    left_by: Mapping[str, Mapping[int, Hashable] | None],
) -> dict[int, Hashable]:
    """Per waiting lane of a model-stage (with the contested GPUs it lands on; ``contested``: per peer,
    those it holds, :func:`_contested`), what it waits for besides its deps: the calls by which its
    peers leave those GPUs (``_left_by``; None: never). Each lane waits alone where a GPU is held by
    more than one peer or left twice."""
    onto = set().union(*waiting.values())
    release: dict[int, Hashable] = {}
    held = 0
    for other, gpus in contested.items():
        theirs = onto.intersection(gpus)
        calls = left_by[other]
        if theirs and calls is None:
            return {lane: ("alone", lane) for lane in waiting}
        release.update(zip(theirs, map(calls.get, theirs), strict=True))  # type: ignore[union-attr]
        held += len(theirs)
    if held != len(release):
        return {lane: ("alone", lane) for lane in waiting}
    calls_made = frozenset(release.values())
    if len(calls_made) == 1:  # one call leaves them all: a lane waits for it if it lands on one of them
        return {lane: calls_made if gpus else frozenset() for lane, gpus in waiting.items()}
    return {lane: frozenset(map(release.__getitem__, gpus)) for lane, gpus in waiting.items()}


def _tight(ctx: TransitionContext, growth: np.ndarray) -> set[int]:
    """GPUs whose resident state plus every node's growth there may pass the memory cap."""
    over = ctx.current_memory + growth > memory_cap(ctx.cluster)
    return set(np.flatnonzero(over).tolist())


def _never_fits(
    parts: Sequence[tuple[str, StepLanes]], tight: set[int], base: np.ndarray, cap: float
) -> None:
    """Raise at once if an acquisition cannot fit even after every other call on its GPU freed
    all it ever frees (the replay would block it forever and stop with it stuck).

    A call on GPU g needs ``base + grown + grow - freed`` there; ``grown >= 0`` and ``freed`` is at
    most what the other calls free on g, so this bound failing means no order can admit it.
    """
    eff = Effects.of([x.mem for _, x in parts])
    on_tight = np.isin(eff.gpu, sorted(tight))
    grow = np.maximum(eff.net, 0.0) + eff.transient
    free = np.maximum(-eff.net, 0.0) + eff.transient
    frees = np.bincount(eff.gpu[on_tight], free[on_tight], minlength=len(base))
    need = np.asarray(base)[eff.gpu] + grow - (frees[eff.gpu] - free)
    at = np.flatnonzero(on_tight & (grow > 0) & (need > cap)).tolist()
    if not at:
        return
    stuck: dict[tuple[int, tuple[int, ...]], tuple[int, int, float]] = {}  # per (part, unit): the first
    unit_at: dict[int, dict[int, tuple[int, ...]]] = {}  # per part: the unit on each of its GPUs
    for i, g, needed in zip(eff.node[at].tolist(), eff.gpu[at].tolist(), need[at].tolist(), strict=True):
        if i not in unit_at:
            units = parts[i][1].targets or parts[i][1].sources
            unit_at[i] = {x: u for u in units.gpus for x in u}
        stuck.setdefault((i, unit_at[i].get(g, (g,))), (i, g, needed))
    lines = "; ".join(
        f"{parts[i][1].op.value} of {parts[i][0]} onto {list(unit)}: GPU {g} "
        f"would need {needed / GB:.1f} GB > cap {cap / GB:.1f} GB"
        for (_, unit), (i, g, needed) in list(stuck.items())[:4]
    )
    raise InfeasiblePlanError(
        f"no safe transition order: {len(stuck)} acquisition(s) cannot fit in memory even after every "
        f"other node on their GPUs has freed its memory; stuck: {lines}. Choose a target that leaves "
        "these GPUs free or frees memory first"
    )


class _PeerWaits:
    """Per model-stage whose target holds GPUs its peers hold now (*contested* GPUs): per peer, the
    contested GPUs it still holds, and the releases of contested GPUs so far (node, GPUs).

    An acquisition (an Extend, or a Split to a larger shard degree: :func:`acquired_gpus`) takes GPUs of
    its own target only and peers are disjoint in the target, so a peer holds such a GPU until it
    releases it, once (more than one peer holds it only where those
    peers are colocated now)."""

    def __init__(self, ctx: TransitionContext, contested: Mapping[str, Mapping[str, set[int]]]) -> None:
        self.ctx = ctx
        self.still: dict[str, dict[str, set[int]]] = {}  # waiter -> peer -> contested GPUs it holds
        self.gone: dict[str, list[tuple[int, set[int]]]] = {}  # waiter -> (node, contested GPUs it left)
        self.watchers: dict[str, list[str]] = {}  # peer -> the model-stages waiting for its GPUs
        self.onto: dict[int, tuple[int, ...]] = {}  # per node asked about: the GPUs it acquires
        for name, held in contested.items():
            self.still[name] = {other: set(gpus) for other, gpus in held.items()}
            self.gone[name] = []
            for other in held:
                self.watchers.setdefault(other, []).append(name)

    def _onto(self, i: int, n: LocalNode) -> tuple[int, ...]:
        """The GPUs node ``n`` (node ``i``) acquires (found once: a blocked node is asked again)."""
        gpus = self.onto.get(i)
        if gpus is None:
            if n.op is Primitive.EXTEND:
                gpus = tuple(n.target_gpus())
            elif acquires_some(n.op, n.lanes.sources, n.lanes.targets):
                gpus = acquired_gpus(n.op, n.source_gpus(), n.target_gpus())
            else:
                gpus = ()
            self.onto[i] = gpus
        return gpus

    def blocked(self, i: int, n: LocalNode) -> str | None:
        """Why ``n`` (node ``i``) must wait (a peer still holds one of the GPUs it acquires), or None."""
        still = self.still.get(n.model_stage) if n.op is not Primitive.DESTROY else None
        gpus = self._onto(i, n) if still else ()
        if not still or not gpus:
            return None
        for other in self.ctx.peers[n.model_stage]:  # the first peer (plan order) holding one
            theirs = still.get(other)
            if theirs and not theirs.isdisjoint(gpus):
                g = next(g for g in gpus if g in theirs)
                return f"GPU {g} is still held by {other} (same {self.ctx.stages[other].stage} stage)"
        return None

    def relied_on(self, i: int, n: LocalNode) -> int:
        """The releases (mask) of the contested GPUs ``n`` (node ``i``) acquires."""
        gone = self.gone.get(n.model_stage) if n.op is not Primitive.DESTROY else None
        mask = 0
        if gone:
            gpus = self._onto(i, n)
            for index, left in gone:
                if not left.isdisjoint(gpus):
                    mask |= 1 << index
        return mask

    def release(self, n: LocalNode, index: int) -> None:
        """Note the contested GPUs node ``index`` (a Destroy, Split or Merge) leaves."""
        waiters = self.watchers.get(n.model_stage)
        if not waiters:
            return
        left = released_gpus(n.op, n.source_gpus(), n.target_gpus())
        for waiter in waiters:
            theirs = self.still[waiter].get(n.model_stage, set())
            hit = theirs.intersection(left)
            if hit:
                theirs -= hit
                self.gone[waiter].append((index, hit))


class _MemoryBook:
    """Memory on the tight GPUs as the replay admits nodes: resident bytes, growth of every node
    admitted so far, what they freed, and which nodes freed (bit i: node i)."""

    def __init__(self, base: np.ndarray, tight: set[int], cap: float) -> None:
        at = sorted(tight)
        self.base = dict(zip(at, base[at].tolist(), strict=True))  # resident bytes of each tight GPU
        self.tight, self.cap = tight, cap
        self.grown = dict.fromkeys(tight, 0.0)
        self.freed = dict.fromkeys(tight, 0.0)
        self.freers = dict.fromkeys(tight, 0)

    def blocked(self, n: LocalNode) -> str | None:
        """Why ``n`` must wait (it would pass the cap on a tight GPU), or None."""
        for g, net, transient in n.mem:
            if g in self.tight:
                grow = max(net, 0.0) + transient
                need = self.base[g] + self.grown[g] + grow - self.freed[g]
                if grow > 0 and need > self.cap:
                    return f"GPU {g} would need {need / GB:.1f} GB > cap {self.cap / GB:.1f} GB"
        return None

    def admit(self, n: LocalNode, index: int) -> int:
        """Count node ``index``'s growth and frees; returns the freeing nodes its growth relied on (mask)."""
        relied = 0
        for g, net, transient in n.mem:
            if g in self.tight:
                grow, free = max(net, 0.0) + transient, max(-net, 0.0) + transient
                if grow > 0:
                    relied |= self.freers[g]
                self.grown[g] += grow
                if free > 0:
                    self.freed[g] += free
                    self.freers[g] |= 1 << index
        return relied


def _order_with_resource_edges(
    nodes: Sequence[LocalNode],
    ctx: TransitionContext,
    growth: np.ndarray,
    tight: set[int],
    contested: Mapping[str, Mapping[str, set[int]]],
) -> tuple[list[int], dict[int, list[int]]]:
    """Replay ``nodes`` in priority order (see the module docstring): the order (node indices) and
    each node's resource deps (indices; ``growth`` and ``tight`` from :func:`_tight`, ``contested``
    from :func:`_contested`)."""
    peers = _PeerWaits(ctx, contested)
    memory = _MemoryBook(ctx.current_memory, tight, memory_cap(ctx.cluster))
    careful = [bool(tight) and not tight.isdisjoint(n.mem.gpus.tolist()) for n in nodes]
    succs: list[list[int]] = [[] for _ in nodes]
    indeg = [len(n.deps) for n in nodes]
    for i, n in enumerate(nodes):
        for d in n.deps:
            succs[d].append(i)
    keys = _priorities(nodes, ctx)
    size = len(nodes)
    order: list[int] = []
    resource: dict[int, list[int]] = {}
    ready = [i for i, d in enumerate(indeg) if d == 0]
    while ready:  # one pass runs all it can; the acquisitions stuck in it retry if it ran anything
        heap = [keys[i] for i in ready]
        heapq.heapify(heap)
        ran, stuck = len(order), []
        while heap:
            i = heapq.heappop(heap) % size
            n = nodes[i]
            why = peers.blocked(i, n) or (memory.blocked(n) if careful[i] else None)
            if why:
                stuck.append((i, why))
                continue
            relied = peers.relied_on(i, n)
            if _leaves_some(n.lanes):
                peers.release(n, i)
            if careful[i]:
                relied |= memory.admit(n, i)
            if relied:  # (a node needs no resource edge to itself or its deps)
                for d in (*n.deps, i):
                    relied &= ~(1 << d)
                if relied:
                    resource[i] = _bits(relied)
            order.append(i)
            for j in succs[i]:
                indeg[j] -= 1
                if indeg[j] == 0:
                    heapq.heappush(heap, keys[j])
        if stuck and len(order) == ran:
            _raise_stuck(nodes, stuck)
        ready = [i for i, _ in stuck]
    if len(order) != len(nodes):  # pragma: no cover - a bug in the local DAGs, not bad input
        raise RuntimeError(f"transition replay ran {len(order)} of {len(nodes)} nodes")
    return order, resource


def _bits(mask: int) -> list[int]:
    """The set bits of ``mask``, ascending."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def _priorities(nodes: Sequence[LocalNode], ctx: TransitionContext) -> list[int]:
    """Per node its replay priority (op rank, stage, plan position, index) packed into one int,
    plus the index: ``key % len(nodes)`` is the node."""
    n_ms, size = len(ctx.current.items()), len(nodes)
    rank = {name: ctx.stages[name].stage_index * n_ms + i for i, name in enumerate(ctx.current)}
    n_ranks = max(rank.values(), default=0) + 1
    return [(_OP_RANK[n.op] * n_ranks + rank[n.model_stage]) * size + i for i, n in enumerate(nodes)]


def _raise_stuck(nodes: Sequence[LocalNode], stuck: list[tuple[int, str]]) -> None:
    """No release can run and these acquisitions are blocked: say which (the first unit of each
    call, alike calls together) and why."""
    lines = "; ".join(
        f"{n.op.value} of {n.model_stage} onto {_first_units(n)}: {why}"
        for n, why in ((nodes[i], why) for i, why in stuck[:4])
    )
    calls = sum(nodes[i].width for i, _ in stuck)
    raise InfeasiblePlanError(
        f"no safe transition order: {calls} acquisition(s) blocked and no release can run; "
        f"stuck: {lines}. Choose a target that leaves these GPUs free or frees memory first"
    )


def _first_units(n: LocalNode) -> str:
    """The GPUs of the first unit each lane of ``n`` makes (or reads, if it makes none)."""
    units = n.targets or n.sources
    return ", ".join(str(list(gpus)) for gpus in units.gpus[:: len(units) // n.width])


def _numbered_in_order(
    nodes: Sequence[LocalNode], order: list[int], resource: Mapping[int, list[int]]
) -> tuple[Node, ...]:
    """The DAG's nodes: ``nodes`` in ``order``, numbered by position, deps (local and resource)
    mapped; nodes of one step of a model-stage that wait for exactly the same nodes become one.

    Such a batched node stands where the first of them did: it waits for what each of them did,
    and whatever waited for one of them now waits for all (a subset of the executions the nodes
    allowed apart, so no less safe; still a topological order).
    """
    group_of: dict[int, int] = {}  # node index -> the position of the node carrying it
    groups: list[list[int]] = []  # per position: the nodes it carries, in order
    waits: list[tuple[tuple[int, ...], tuple[int, ...]]] = []  # per position: (local, resource) deps
    alike: dict[Hashable, int] = {}
    for i in order:
        n = nodes[i]
        local = tuple(sorted({group_of[d] for d in n.deps}))
        extra = tuple(sorted({group_of[d] for d in resource[i]}.difference(local))) if i in resource else ()
        at = alike.setdefault((n.model_stage, id(n.lanes), local, extra), len(groups))
        if at == len(groups):
            groups.append([])
            waits.append((local, extra))
        groups[at].append(i)
        group_of[i] = at
    out = []
    for at, carried in enumerate(groups):
        local, extra = waits[at]
        first = nodes[carried[0]]
        lanes = None if len(carried) == 1 else sorted(k for i in carried for k in nodes[i].ks)
        out.append(first.node(at, tuple(sorted(local + extra)), extra, lanes))  # lanes in the step's order
    return tuple(out)
