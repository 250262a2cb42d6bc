"""Validation of a transition DAG by replay: the oracle, independent of how the DAG was built.

Three checks, written for a reader to verify, not for speed:

1. **Sequential replay** in the DAG's own order (``dag.nodes``): every node finds its source units
   alive and creates its targets where no unit of its model-stage is; every model-stage keeps at
   least one unit (a full copy of its state) at every moment; peers (model-stages concurrent under
   both plans, ``TransitionContext.peers``) never hold a unit on the same GPU; per-GPU memory
   (resident units + the running node's transfer buffers) stays under ``plan.memory.memory_cap``;
   the end state is the target.
2. **Any order, GPUs**: an Extend of X onto GPU g must have, as an ancestor, every node by which a
   peer of X leaves g. Then no topological order or concurrent run can overlap them.
3. **Memory in any order**: a GPU whose resident bytes plus the growth of every node on it (net
   allocations and buffers, as if nothing were freed) fit is safe in every order. Unless every
   GPU is, an **adversarial concurrent replay**: every ready node starts at once and releases
   finish last (acquisitions finish first), the worst case for memory among the orders a
   concurrent executor may take.

``random_orders`` adds sequential replays in random topological orders.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from nereus_lightning.plan.layout import Candidate, Layout
from nereus_lightning.plan.memory import memory_cap
from nereus_lightning.transition.dag import (
    Effects,
    Gpus,
    Node,
    Primitive,
    TransitionDAG,
    Unit,
    acquires_some,
    gpu_chunks,
)

GB = 1e9


@dataclass(frozen=True)
class ValidationReport:
    """The outcome of :func:`validate`; ``problems`` start with their kind (``memory``, ...)."""

    valid: bool
    problems: tuple[str, ...]
    peak_memory: float  # per-GPU bytes: the most any replay reached on any GPU
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
    cap = memory_cap(dag.context.cluster)
    problems = _structure(dag)
    if problems:
        return ValidationReport(False, tuple(problems[:max_problems]), 0.0, cap)
    peak = _replay(dag, dag.nodes, problems, "")
    problems += _any_order_gpus(dag)
    if not _fits_in_any_order(dag):
        peak = max(peak, _concurrent_memory(dag, problems))
    rng = random.Random(seed)
    for k in range(random_orders):
        peak = max(peak, _replay(dag, _random_order(dag, rng), problems, f" (random order {k})"))
    return ValidationReport(not problems, tuple(problems[:max_problems]), peak, cap)


def _structure(dag: TransitionDAG) -> list[str]:
    """Ids are positions and every dep is an earlier node."""
    out = []
    for i, n in enumerate(dag.nodes):
        if n.id != i:
            out.append(f"structure: node at position {i} has id {n.id}")
        bad = [d for d in n.deps if not 0 <= d < i]
        if bad:
            out.append(f"structure: {n} depends on {bad}, not earlier nodes (a cycle or a bad order)")
    return out


def _resident(dag: TransitionDAG) -> np.ndarray:
    """Resident bytes per GPU before the transition (the context's, else the current plan's units)."""
    ctx = dag.context
    if len(ctx.current_memory):
        return np.asarray(ctx.current_memory, dtype=np.float64)
    mem = [0.0] * ctx.cluster.num_gpus
    for name, c in ctx.current.items():
        for g in c.gpus:
            mem[g] += ctx.memory_of(name, c.layout)
    return np.asarray(mem)


def _units(c: Candidate) -> dict[Layout, set[Gpus]]:
    """The units of ``c``: its layout and the GPU tuple of each unit."""
    return {c.layout: set(gpu_chunks(c.gpus, c.layout.size))}


def _replay(dag: TransitionDAG, order: Sequence[Node], problems: list[str], label: str) -> float:
    """Check 1 in ``order``; returns the peak memory of any GPU."""
    peak = _replay_memory(dag, order, problems, label)
    _replay_units(dag, order, problems, label)
    return peak


def _replay_memory(dag: TransitionDAG, order: Sequence[Node], problems: list[str], label: str) -> float:
    """Per-GPU memory in ``order``: resident units plus the running node's growth and buffers."""
    cap = memory_cap(dag.context.cluster) * (1 + 1e-9)
    base = _resident(dag)
    eff = dag.effects if order is dag.nodes else Effects.of([n.mem for n in order])
    # On its GPU while a node runs: what is resident, what every earlier effect there left, and
    # what this one adds (its growth and buffers).
    before = base[eff.gpu] + _earlier_sums(eff.gpu, eff.net)
    top = before + np.maximum(eff.net, 0.0) + eff.transient
    past = top > cap
    for i in np.unique(eff.node[past]).tolist()[:8] if past.any() else ():
        at = (eff.node == i) & past
        gpus, tops = eff.gpu[at].tolist(), top[at].tolist()
        over = [f"GPU {g} reaches {t / GB:.1f} GB" for g, t in zip(gpus, tops, strict=True)]
        problems.append(f"memory{label}: {', '.join(over[:2])} > cap {cap / GB:.1f} GB during {order[i]}")
    return float(max(base.max(initial=0.0), top.max(initial=0.0)))


def _earlier_sums(keys: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Per entry: the sum of the ``values`` of the entries before it with the same key."""
    by_key = keys.argsort(kind="stable")  # entries grouped by key, in their order inside a group
    grouped = keys[by_key]
    ordered = values[by_key]
    running = ordered.cumsum() - ordered  # sums of the entries before, over the grouped list
    starts = np.flatnonzero(np.concatenate(([True], grouped[1:] != grouped[:-1])))  # where a key begins
    first = np.repeat(starts, np.diff(starts, append=len(grouped)))  # where each entry's group starts
    out = np.empty_like(values)
    out[by_key] = running - running[first]
    return out


def _replay_units(dag: TransitionDAG, order: Sequence[Node], problems: list[str], label: str) -> None:
    """The units of every model-stage in ``order`` (per layout, each unit as its GPU tuple), and,
    for those with peers, who holds each GPU."""
    ctx = dag.context
    live = {name: _units(c) for name, c in ctx.current.items()}
    # per model-stage with peers (only peers can conflict) and GPU: how many of its units hold it
    count = {
        name: _held(ctx.current[name].gpus, ctx.cluster.num_gpus)
        for name, peers in ctx.peers.items()
        if peers
    }
    for n in order:
        units = live[n.model_stage]
        have = units.setdefault(n.sources.layout, set())
        if not have.issuperset(n.sources.gpus):
            missing = [Unit(n.sources.layout, g) for g in n.sources.gpus if g not in have]
            problems.append(f"structure{label}: {n} reads units that do not exist: {missing}")
            return
        if n.op is not Primitive.EXTEND:  # every other primitive consumes its sources
            have.difference_update(n.sources.gpus)
        made = set(n.targets.gpus)
        if len(made) < len(n.targets.gpus) or any(not s.isdisjoint(made) for s in units.values()):
            gpus = n.targets.gpus
            again = next(g for i, g in enumerate(gpus) if g in gpus[:i] or _live(units, g))
            where = Unit(n.targets.layout, again)
            problems.append(f"structure{label}: {n} creates {where} where a unit already is")
        same_layout = units.get(n.targets.layout)
        if same_layout:
            same_layout.update(made)
        else:
            units[n.targets.layout] = made
        if not any(units.values()):
            problems.append(f"last copy{label}: {n.model_stage} has no unit left after {n}")
        if n.model_stage in count:
            problems += _count_gpus(n, count, ctx.peers[n.model_stage], label)
    for name, c in ctx.target.items():
        ends = {layout: gpus for layout, gpus in live[name].items() if gpus}
        if ends != _units(c):
            problems.append(f"structure{label}: {name} ends with {ends}, not the target")


def _held(gpus: Gpus, num_gpus: int) -> list[int]:
    """Per GPU of the pool, how many times ``gpus`` lists it."""
    held = [0] * num_gpus
    for g in gpus:
        held[g] += 1
    return held


def _live(units: dict[Layout, set[Gpus]], gpus: Gpus) -> bool:
    """Whether a unit on ``gpus`` is alive (in any layout)."""
    return any(gpus in live for live in units.values())


def _count_gpus(n: Node, count: dict[str, list[int]], peers: tuple[str, ...], label: str) -> list[str]:
    """Move ``n``'s model-stage's per-GPU unit counts; name each GPU it newly holds that a peer holds."""
    made = list(n.targets.all_gpus())
    left = list(n.sources.all_gpus()) if n.op is not Primitive.EXTEND else []
    if made and left and sorted(made) == sorted(left):  # e.g. a Merge on its sources' GPUs
        return []  # no GPU changes hands
    held = count[n.model_stage]
    new = [g for g in made if not held[g]]  # GPUs it did not hold before
    for g in left:
        held[g] -= 1
    for g in made:
        held[g] += 1
    return [
        f"gpu conflict{label}: {n} lands on GPU {g} still held by {other}"
        for other in peers
        if any(map(count[other].__getitem__, new))  # (conflicts are rare: look closer only then)
        for g in new
        if count[other][g]
    ]


def _ancestors(dag: TransitionDAG) -> list[int]:
    """Per node, its ancestors as a bit mask (bit d: node d)."""
    anc: list[int] = []
    for n in dag.nodes:
        mask = 0
        for d in n.deps:
            mask |= anc[d] | (1 << d)
        anc.append(mask)
    return anc


def _any_order_gpus(dag: TransitionDAG) -> list[str]:
    """Check 2: every node acquiring a GPU a peer leaves (an Extend, a re-cut to a larger shard degree)
    comes after every node by which it leaves."""
    peers = dag.context.peers
    leaving: dict[str, list[tuple[int, set[int]]]] = {}  # model-stage -> (node id, the GPUs it leaves)
    for n in dag.nodes:
        left = set(n.released_gpus) if peers[n.model_stage] else set()
        if left:
            leaving.setdefault(n.model_stage, []).append((n.id, left))
    anc = _ancestors(dag) if leaving else []
    out = []
    for n in dag.nodes:
        onto = n.acquired_gpus if leaving and acquires_some(n.op, n.sources, n.targets) else ()
        if not onto:
            continue
        for other in peers[n.model_stage]:
            for i, left in leaving.get(other, ()):
                if not anc[n.id] >> i & 1 and not left.isdisjoint(onto):
                    out.append(
                        f"gpu conflict: {n} may land on GPU {min(left.intersection(onto))} before "
                        f"{other} leaves it (#{i} is not ordered before it)"
                    )
    return out


def _fits_in_any_order(dag: TransitionDAG) -> bool:
    """Whether every GPU fits its resident bytes plus the growth of every node on it (what all of
    them may add if nothing were freed): then no order, sequential or concurrent, passes the cap."""
    cap = memory_cap(dag.context.cluster) * (1 + 1e-9)
    return bool(np.all(_resident(dag) + dag.memory_growth() <= cap))


def _concurrent_memory(dag: TransitionDAG, problems: list[str]) -> float:
    """Check 3: start every ready node at once; finish acquisitions before releases. Returns the peak."""
    cap = memory_cap(dag.context.cluster) * (1 + 1e-9)
    nodes = dag.nodes
    mem = _resident(dag).tolist()
    peak = max(mem, default=0.0)
    succs: list[list[int]] = [[] for _ in nodes]
    for n in nodes:
        for d in n.deps:
            succs[d].append(n.id)
    indeg = [len(n.deps) for n in nodes]
    ready = [n.id for n in nodes if not n.deps]
    running: list[int] = []  # acquisitions and reshards
    releases: list[int] = []  # Destroys
    reported = 0
    while ready or running or releases:
        for i in ready:  # start: growth and buffers now
            for g, net, transient in nodes[i].mem:
                mem[g] += (net if net > 0 else 0.0) + transient
                if mem[g] > peak:
                    peak = mem[g]
                    if peak > cap and reported < 4:
                        reported += 1
                        problems.append(
                            f"memory (concurrent): GPU {g} reaches {peak / GB:.1f} GB > cap during {nodes[i]}"
                        )
            (releases if nodes[i].op is Primitive.DESTROY else running).append(i)
        ready = []
        i = running.pop() if running else releases.pop()  # finish one: frees and buffers go
        for g, net, transient in nodes[i].mem:
            mem[g] += net - transient - (net if net > 0 else 0.0)
        for j in succs[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
    return peak


def _random_order(dag: TransitionDAG, rng: random.Random) -> list[Node]:
    """A random topological order of the nodes."""
    indeg = [len(n.deps) for n in dag.nodes]
    succs: list[list[int]] = [[] for _ in dag.nodes]
    for n in dag.nodes:
        for d in n.deps:
            succs[d].append(n.id)
    ready = [n.id for n in dag.nodes if not n.deps]
    out = []
    while ready:
        i = ready.pop(rng.randrange(len(ready)))
        out.append(dag.nodes[i])
        for j in succs[i]:
            indeg[j] -= 1
            if indeg[j] == 0:
                ready.append(j)
    return out
