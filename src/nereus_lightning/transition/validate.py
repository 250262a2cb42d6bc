"""Validation of a transition DAG by replay.

Three checks, each independent of how the DAG was built:

1. **Sequential replay** in the DAG's own order (``dag.nodes``): every node finds its source units
   alive; every model-stage keeps at least one unit (a full copy of its state) at every moment;
   peers (model-stages concurrent under both plans) never share a GPU; per-GPU memory (resident units +
   the running node's transfer buffers) stays under ``plan.memory.memory_cap``; the end state is the target.
2. **Any order, GPUs**: an Extend of X onto GPU g must have, as an ancestor, every Destroy by which
   a peer of X leaves g. Then no topological order or concurrent run can overlap them.
3. **Adversarial concurrent replay** (when some GPU is tight, see below): every ready node starts
   at once and releases finish last (acquisitions finish first), the worst case for memory and
   GPU conflicts among the orders a concurrent executor may take.

Memory is replayed only on *tight* GPUs: a GPU that fits its resident state plus all growth of
every node on it (nothing ever freed) is safe in any order, so it needs no replay.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass
from functools import lru_cache, reduce
from operator import add, itemgetter, or_

from nereus_lightning.plan.layout import Candidate, Plan
from nereus_lightning.plan.memory import memory_cap
from nereus_lightning.transition.dag import Node, Primitive, TransitionDAG, Unit, gpu_chunks

GB = 1e9


@dataclass(frozen=True)
class ValidationReport:
    """The outcome of :func:`validate`; ``problems`` start with their kind (``memory``, ...)."""

    valid: bool
    problems: tuple[str, ...]
    peak_memory: float  # per-GPU bytes: replayed on GPUs that could overflow, worst-case bound elsewhere
    memory_cap: float

    def kinds(self) -> set[str]:
        """The kinds of the problems found."""
        return {p.split(":", 1)[0] for p in self.problems}

    def __bool__(self) -> bool:
        return self.valid


def validate(
    dag: TransitionDAG, *, random_orders: int = 0, seed: int = 0, max_problems: int = 8
) -> ValidationReport:
    """Check ``dag`` (see the module docstring); ``random_orders`` adds replays in random orders."""
    problems: list[str] = []
    problems += _structure(dag)
    if problems:
        return ValidationReport(False, tuple(problems[:max_problems]), 0.0, memory_cap(dag.context.cluster))
    mem = _Memory(dag)
    peers = _Peers(dag)
    peak = max(mem.bound_elsewhere, _replay(dag, dag.nodes, problems, "", mem, peers))
    problems += _any_order_gpus(dag, peers)
    if mem.tight:  # GPU conflicts in any order are covered by the static check above
        peak = max(peak, _adversarial(dag, problems, mem, peers))
    rng = random.Random(seed)
    for k in range(random_orders):
        peak = max(peak, _replay(dag, _random_order(dag, rng), problems, f" (random order {k})", mem, peers))
    return ValidationReport(not problems, tuple(problems[:max_problems]), peak, mem.cap)


class _Memory:
    """Which GPUs can overflow at all, and the memory effects the replays must follow there.

    A GPU whose resident state plus every node's growth on it (net allocations and transfer
    buffers, as if nothing were ever freed) fits under the cap is safe in every order; only the
    other, *tight* GPUs are replayed. ``bound_elsewhere`` is that worst case over the safe GPUs.
    """

    def __init__(self, dag: TransitionDAG) -> None:
        ctx = dag.context
        self.cap = memory_cap(ctx.cluster)
        self.base = list(ctx.current_memory) if ctx.current_memory else _resident(ctx.current, dag)
        worst = list(map(add, self.base, dag.memory_growth()))
        top = max(worst, default=0.0)
        self.tight = {g for g, w in enumerate(worst) if w > self.cap} if top > self.cap else set()
        tight = self.tight
        self.bound_elsewhere = (
            max((w for g, w in enumerate(worst) if g not in tight), default=0.0) if tight else top
        )
        self.effects: list[tuple[tuple[int, float, float], ...]] = (
            [tuple(e for e in n.mem if e[0] in tight) for n in dag.nodes] if tight else [()] * len(dag.nodes)
        )


class _Peers:
    """The peers of each model-stage (concurrent under both plans, ``TransitionContext.peers``:
    pairs colocated under either plan may share GPUs), and which model-stages can ever meet one.

    Only an Extend lands on GPUs, so the model-stages of a stage none of whose model-stages
    extends can never land on a GPU a peer holds, in any order: ``contested`` omits them, and
    the replays need not count their units per GPU.
    """

    def __init__(self, dag: TransitionDAG) -> None:
        ctx = dag.context
        self.stage = stage = {name: ctx.stages[name].stage for name in ctx.current}
        self.of = {a: list(ctx.peers[a]) for a in ctx.current}
        extends = {n.model_stage for n in dag.nodes if n.op is Primitive.EXTEND}
        landing = {stage[a] for a in extends if a in stage}
        self.contested = {a for a in ctx.current if self.of[a] and stage[a] in landing}


def _resident(plan: Plan, dag: TransitionDAG) -> list[float]:
    ctx = dag.context
    mem = [0.0] * ctx.cluster.num_gpus
    for name, c in plan.items():
        per = ctx.memory_of(name, c.layout)
        for g in c.gpus:
            mem[g] += per
    return mem


def _structure(dag: TransitionDAG) -> list[str]:
    out = []
    for i, n in enumerate(dag.nodes):
        if n.id != i:
            out.append(f"structure: node at position {i} has id {n.id}")
        deps = n.deps
        if deps and not (min(deps) >= 0 and max(deps) < i):
            bad = [d for d in deps if not 0 <= d < i]
            out.append(f"structure: {n} depends on {bad}, not earlier nodes (a cycle or a bad order)")
    return out


Shape = tuple[int, int]  # a unit's (tp, pp)


def _units(plan: Plan, shapes: dict[Shape, Shape]) -> dict[str, dict[tuple[int, ...], Shape]]:
    """The units of every model-stage of ``plan``: GPUs -> (tp, pp) (the one object ``shapes`` holds).

    Keyed by GPU tuple (hashing a ``Layout`` is slow): two live units of one model-stage never
    sit on the same GPU tuple, and a DAG that tries is caught as a unit that does not exist.
    """
    out = {}
    for name, c in plan.items():
        shape = (c.layout.tp, c.layout.pp)
        out[name] = dict.fromkeys(gpu_chunks(c.gpus, c.layout.size), shapes.setdefault(shape, shape))
    return out


_LAYOUT, _GPUS = itemgetter(0), itemgetter(1)  # a transition Unit is (layout, gpus)


def _shapes(units: tuple[Unit, ...], shapes: dict[Shape, Shape]) -> tuple[list[tuple[int, ...]], list[Shape]]:
    """The GPU tuples of ``units`` and their ``(tp, pp)`` (one lookup when they share a layout).

    A shared layout's (tp, pp) is the one object ``shapes`` holds for it, so comparing it with
    the live units' values is an identity check, not a tuple comparison per unit.
    """
    keys = list(map(_GPUS, units))
    lays = list(map(_LAYOUT, units))
    first = lays[0] if lays else None
    if first is not None and lays.count(first) == len(lays):  # identity first: C speed
        shape = (first.tp, first.pp)
        return keys, [shapes.setdefault(shape, shape)] * len(lays)
    return keys, [(x.tp, x.pp) for x in lays]


def _is_target(units: dict[tuple[int, ...], Shape], c: Candidate, shapes: dict[Shape, Shape]) -> bool:
    """Whether ``units`` equal the units of ``c`` (as dicts: GPUs -> (tp, pp)).

    A candidate's GPUs are distinct, so its units are: as many live units as it has, each of them
    alive with its shape, means the same dict, without building it.
    """
    shape = (c.layout.tp, c.layout.pp)
    shape = shapes.get(shape, shape)
    keys = gpu_chunks(c.gpus, c.layout.size)
    if len(units) != len(keys):
        return False
    if list(units) == keys:  # the same units in the same order (no hashing)
        return list(units.values()).count(shape) == len(keys)
    return list(map(units.get, keys)).count(shape) == len(keys)


class _Gpus:
    """Per-GPU memory and, for model-stages that may meet a peer, unit counts per GPU."""

    def __init__(self, dag: TransitionDAG, memory: _Memory, peers: _Peers) -> None:
        ctx = dag.context
        n = ctx.cluster.num_gpus
        self.ids = _gpu_ids(n)
        self.peers = peers.of
        self.count = {name: [0] * n for name in ctx.current if name in peers.contested}
        self.mem = memory.base[:]
        for name, c in ctx.current.items():
            if name in self.count:
                _shift(self.count[name], c.gpus, 1, _span(c.gpus, self.ids))

    def acquire(self, n: Node) -> list[str]:
        """Count ``n``'s new GPUs; name any a peer holds."""
        if n.model_stage not in self.count or n.op is not Primitive.EXTEND:
            return []
        gpus = n.acquired_gpus
        if not gpus:
            return []
        count = self.count[n.model_stage]
        for g in gpus:
            count[g] += 1
        at = itemgetter(*gpus, *gpus[:1])  # gathers the counts at ``gpus`` (a tuple, even of one GPU) in C
        if not any(any(at(self.count[other])) for other in self.peers[n.model_stage]):
            return []
        return [
            f"{n} lands on GPU {g} still held by {other}"
            for g in gpus
            for other in self.peers[n.model_stage]
            if self.count[other][g]
        ]

    def release(self, n: Node) -> None:
        """Uncount the GPUs ``n`` leaves."""
        if n.model_stage in self.count:
            gpus = n.released_gpus
            _shift(self.count[n.model_stage], gpus, -1, _span(gpus, self.ids))


@lru_cache(maxsize=8)
def _gpu_ids(num_gpus: int) -> tuple[int, ...]:
    """``tuple(range(num_gpus))``, made once per cluster size: :func:`_span` compares slices of it."""
    return tuple(range(num_gpus))


def _span(gpus: tuple[int, ...], ids: tuple[int, ...]) -> slice | None:
    """``gpus`` as a slice of a per-GPU list, if they step evenly upwards (as a TP group or a block does)."""
    if len(gpus) < 2:
        return None
    first, step = gpus[0], gpus[1] - gpus[0]
    if step <= 0 or first < 0:
        return None
    span = slice(first, first + step * len(gpus), step)
    return span if ids[span] == gpus else None  # (a slice past the last GPU comes out short)


def _shift(count: list[int], gpus: tuple[int, ...], by: int, span: slice | None) -> None:
    """Add ``by`` to ``count`` at each of ``gpus`` (``span``: the same GPUs as a slice, or None)."""
    if span is not None:
        held = count[span]
        if held.count(held[0]) == len(held):  # one count throughout (the usual: 0, or 1 unit): in C
            count[span] = [held[0] + by] * len(held)
            return
    for g in gpus:
        count[g] += by


def _replay(
    dag: TransitionDAG, order: list[Node], problems: list[str], label: str, memory: _Memory, peers: _Peers
) -> float:
    """Sequential replay in ``order``; returns the peak memory of the tight GPUs."""
    ctx = dag.context
    cap = memory.cap * (1 + 1e-9)
    shapes: dict[Shape, Shape] = {}
    alive = _units(ctx.current, shapes)
    gpus = _Gpus(dag, memory, peers)
    mem = gpus.mem
    effects = memory.effects
    peak = max((mem[g] for g in memory.tight), default=0.0)
    counted = gpus.count
    extend, merge = Primitive.EXTEND, Primitive.MERGE
    for n in order:
        ms = n.model_stage
        units = alive[ms]
        keys, lays = _shapes(n.sources, shapes)
        if list(map(units.get, keys)) != lays:
            missing = [u for u in n.sources if units.get(u.gpus) != (u.layout.tp, u.layout.pp)]
            problems.append(f"structure{label}: {n} reads units that do not exist: {missing}")
            return peak
        for g, net, transient in effects[n.id]:
            top = mem[g] + (net if net > 0 else 0.0) + transient
            if top > peak:
                peak = top
                if top > cap:
                    problems.append(
                        f"memory{label}: GPU {g} reaches {top / GB:.1f} GB > cap {cap / GB:.1f} GB during {n}"
                    )
            mem[g] += net
        op = n.op
        if op is not extend:
            deque(map(units.__delitem__, keys), maxlen=0)  # del units[key] for each key, in C
        keys, lays = _shapes(n.targets, shapes)
        clash = not units.keys().isdisjoint(keys)
        if clash:
            _report_clashes(n, units, problems, label)
        before = len(units)
        units.update(zip(keys, lays, strict=True))
        if not clash and len(units) != before + len(keys):  # a unit made twice by this node
            _report_clashes(n, {}, problems, label)
        if not units:
            problems.append(f"last copy{label}: {ms} has no unit left after {n}")
        if ms in counted:  # Extend acquires GPUs; Destroy and Split release some; Merge neither
            if op is extend:
                conflicts = gpus.acquire(n)
                if conflicts:
                    problems.extend(f"gpu conflict{label}: {p}" for p in conflicts)
            elif op is not merge:
                gpus.release(n)
    for name, c in ctx.target.items():
        if not _is_target(alive[name], c, shapes):
            problems.append(
                f"structure{label}: {name} ends with {sorted(alive[name].items())}, not the target"
            )
    return peak


def _report_clashes(n: Node, units: dict, problems: list[str], label: str) -> None:
    """Name each unit ``n`` creates on a GPU tuple that holds one (in ``units`` or made before by ``n``)."""
    seen: set[tuple[int, ...]] = set()
    for u in n.targets:
        if u.gpus in units or u.gpus in seen:
            problems.append(f"structure{label}: {n} creates {u} where a unit already is")
        seen.add(u.gpus)


def _ancestors(dag: TransitionDAG) -> list[int]:
    """Ancestor sets as bit masks."""
    anc: list[int] = []
    for n in dag.nodes:
        mask = 0
        for d in n.deps:
            mask |= anc[d] | (1 << d)
        anc.append(mask)
    return anc


def _any_order_gpus(dag: TransitionDAG, same_stage: _Peers) -> list[str]:
    peers, stage, watched = same_stage.of, same_stage.stage, same_stage.contested  # others never meet
    # Per stage, GPU: the nodes by which a model-stage of that stage leaves it (a bit mask); a
    # node belongs to one model-stage, so ``& nodes[b]`` keeps those of model-stage b.
    leaving: dict[str, dict[int, int]] = {}
    nodes: dict[str, int] = dict.fromkeys(watched, 0)
    for n in dag.nodes:
        if n.model_stage not in watched:
            continue
        bit = 1 << n.id
        nodes[n.model_stage] |= bit
        if n.op is Primitive.DESTROY or n.op is Primitive.SPLIT:
            mask, left = leaving.setdefault(stage[n.model_stage], {}), n.released_gpus
            if mask.keys().isdisjoint(left):  # the usual case: the first node to leave these GPUs
                mask.update(dict.fromkeys(left, bit))
            else:
                mask.update({g: mask.get(g, 0) | bit for g in left})
    anc: list[int] = []  # computed on first need
    out: list[str] = []
    peer_nodes: dict[str, int] = {}  # per model-stage: the nodes of its peers (a bit mask)
    if not leaving:
        return out
    for n in dag.nodes:
        if n.op is not Primitive.EXTEND or n.model_stage not in watched:
            continue
        leavers = leaving.get(stage[n.model_stage])
        if leavers is None:
            continue
        gpus = n.acquired_gpus
        # every node by which a peer leaves these GPUs: all must be ancestors
        theirs_all = peer_nodes.get(n.model_stage)
        if theirs_all is None:
            theirs_all = peer_nodes[n.model_stage] = reduce(or_, (nodes[p] for p in peers[n.model_stage]), 0)
        need = reduce(or_, filter(None, map(leavers.get, gpus)), 0) & theirs_all
        if not need:
            continue  # no peer leaves these GPUs: nothing to order
        if not anc:
            anc = _ancestors(dag)
        if not need & ~anc[n.id]:
            continue
        for g in gpus:
            for other in peers[n.model_stage]:
                theirs = leavers.get(g, 0) & nodes[other]  # the nodes by which ``other`` leaves g
                for d in (i for i in range(theirs.bit_length()) if theirs >> i & 1):  # in id order
                    if not anc[n.id] >> d & 1:
                        out.append(
                            f"gpu conflict: {n} may land on GPU {g} before {other} leaves it "
                            f"(#{d} is not ordered before it)"
                        )
                        break
    return out


def _adversarial(dag: TransitionDAG, problems: list[str], memory: _Memory, peers: _Peers) -> float:
    """Start every ready node at once; finish acquisitions before releases."""
    cap = memory.cap * (1 + 1e-9)
    gpus = _Gpus(dag, memory, peers)
    mem = gpus.mem
    effects = memory.effects
    peak = max((mem[g] for g in memory.tight), default=0.0)
    succs: list[list[int]] = [[] for _ in dag.nodes]
    indeg = [len(n.deps) for n in dag.nodes]
    for n in dag.nodes:
        for d in n.deps:
            succs[d].append(n.id)
    ready = [n.id for n in dag.nodes if not n.deps]
    running: list[int] = []
    releases: list[int] = []
    reported = 0
    while ready or running or releases:
        for nid in ready:
            n = dag.nodes[nid]
            for g, net, transient in effects[nid]:
                mem[g] += (net if net > 0 else 0.0) + transient
                if mem[g] > peak:
                    peak = mem[g]
                    if peak > cap and reported < 4:
                        reported += 1
                        problems.append(
                            f"memory (concurrent): GPU {g} reaches {peak / GB:.1f} GB > cap during {n}"
                        )
            for p in gpus.acquire(n)[:1]:
                if reported < 8:
                    reported += 1
                    problems.append(f"gpu conflict (concurrent): {p}")
            (releases if n.op is Primitive.DESTROY else running).append(nid)
        ready = []
        # Finish one node: an acquisition if any runs (keeps releases pending longest).
        nid = running.pop() if running else releases.pop()
        n = dag.nodes[nid]
        for g, net, transient in effects[nid]:
            mem[g] += net - transient - (net if net > 0 else 0.0)
        gpus.release(n)
        for s in succs[nid]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    return peak


def _random_order(dag: TransitionDAG, rng: random.Random) -> list[Node]:
    indeg = [len(n.deps) for n in dag.nodes]
    succs: list[list[int]] = [[] for _ in dag.nodes]
    for n in dag.nodes:
        for d in n.deps:
            succs[d].append(n.id)
    ready = [n.id for n in dag.nodes if not n.deps]
    out = []
    while ready:
        nid = ready.pop(rng.randrange(len(ready)))
        out.append(dag.nodes[nid])
        for s in succs[nid]:
            indeg[s] -= 1
            if indeg[s] == 0:
                ready.append(s)
    return out
