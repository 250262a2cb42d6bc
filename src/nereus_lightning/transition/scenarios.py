"""Random plan pairs for tests and benchmarks: PPO plans on 8 to 1,024 GPUs with chosen overlaps.

GPUs are cut into 8 equal blocks (one GPU per block on 8 GPUs). A plan gives each model-stage a
run of consecutive blocks (1, 2, 4 or 8 of them) and a layout that tiles it; model-stages of one
stage get disjoint runs. A case moves some model-stages so that a moved one lands on GPUs that
another model-stage holds now, of the requested *overlap kind*:

* ``same_model_cross_stage``: the same model in another stage (actor_gen onto actor_train),
* ``cross_model_same_stage``: another model in the same stage (critic_infer onto ref_infer),
* ``cross_model_cross_stage``: another model in another stage (critic_train onto actor_gen).

The GPU memory of the case's cluster is drawn between the plans' own peak and 1.6 times it, so
that co-residency during the transition is sometimes what decides.

:func:`random_colocated_case` adds *colocation*: in the current plan, the target or both, some
model-stages of one stage share one run of blocks (they run in turn there, ``plan.overlap``),
and the target is drawn independently of the current plan, so every kind of overlap mixes with it.

With ``sharded``, :func:`random_case` gives training model-stages ZeRO-sharded replicas too
(:func:`shard_training`): shard groups of the drawn replicas, at a random degree and ZeRO stage; and in
half of those cases a training model-stage that stays on its GPUs is re-cut to another shard degree in
place (:func:`recut_training`, ``plan.rows.recut_in_place``) where it has enough shard groups.
"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import dataclass, replace

from nereus_lightning.plan.layout import Candidate, Layout, Plan, moving_shard_groups
from nereus_lightning.plan.memory import MEMORY_HEADROOM, state_bytes_per_gpu
from nereus_lightning.plan.planner import job_models
from nereus_lightning.plan.rows import recut_in_place, recut_stages
from nereus_lightning.spec.cluster import CLUSTER_PRESETS, ClusterSpec
from nereus_lightning.spec.model import MODEL_PRESETS, ModelSpec
from nereus_lightning.spec.workload import ModelStage, Workload

OVERLAP_KINDS = ("same_model_cross_stage", "cross_model_same_stage", "cross_model_cross_stage")
BLOCKS = 8
_RUN_SIZES = {"generation": (2, 4, 8), "inference": (1, 2), "training": (1, 2, 4)}


@dataclass(frozen=True)
class TransitionCase:
    """One random transition: everything :func:`build_transition` takes, plus its overlap kinds."""

    current: Plan
    target: Plan
    models: dict[str, ModelSpec]
    cluster: ClusterSpec
    workload: Workload
    kind: str  # an overlap kind, or ``colocated current|target|both`` (:func:`random_colocated_case`)
    overlaps: frozenset[str]

    def args(self) -> tuple[Plan, Plan, dict[str, ModelSpec], ClusterSpec, Workload]:
        """The positional arguments of ``build_transition`` / ``per_component_baseline``."""
        return self.current, self.target, self.models, self.cluster, self.workload


def default_models(model: ModelSpec | None = None) -> dict[str, ModelSpec]:
    """The four PPO roles of one architecture (Llama-3.1-8B unless given), as ``plan.job_models`` maps
    them (critic and reward model its value model)."""
    return job_models(model or MODEL_PRESETS["llama3_8b"])


def overlap_kind(a: ModelStage, b: ModelStage) -> str:
    """The overlap kind of ``a`` landing on GPUs that ``b`` holds."""
    if a.model == b.model:
        return "same_model_cross_stage"
    return "cross_model_same_stage" if a.stage == b.stage else "cross_model_cross_stage"


def overlaps_of(current: Plan, target: Plan, workload: Workload) -> frozenset[str]:
    """Kinds of overlap in a transition: a model-stage's new GPUs held now by another model-stage."""
    stages = {ms.name: ms for ms in workload.stages}
    out = set()
    for name, cand in target.items():
        new = set(cand.gpus) - set(current[name].gpus)
        for other, cur in current.items():
            if other != name and new.intersection(cur.gpus):
                out.add(overlap_kind(stages[name], stages[other]))
    return frozenset(out)


def random_layout(rng: random.Random, model: ModelSpec, gpus: int, gpus_per_node: int) -> Layout:
    """A layout with power-of-two TP (inside a node, dividing the heads) and PP that tiles ``gpus``."""
    tps = [
        t
        for t in (1, 2, 4, 8)
        if t <= min(gpus, gpus_per_node) and model.num_kv_heads % t == 0 and gpus % t == 0
    ]
    tp = rng.choice(tps)
    pps = [p for p in (1, 2, 4) if p <= model.num_layers and gpus % (tp * p) == 0]
    return Layout(tp, rng.choice(pps))


def _candidate(
    rng: random.Random, model: ModelSpec, start: int, blocks: int, block: int, gpn: int
) -> Candidate:
    gpus = tuple(range(start * block, (start + blocks) * block))
    layout = random_layout(rng, model, len(gpus), gpn)
    return Candidate(layout, len(gpus) // layout.size, gpus)


def _place(rng: random.Random, sizes: list[int], taken: set[int]) -> list[int] | None:
    """Start blocks for runs of ``sizes`` blocks, disjoint from ``taken`` and each other."""
    starts = []
    used = set(taken)
    for size in sizes:
        options = [s for s in range(0, BLOCKS - size + 1) if not used.intersection(range(s, s + size))]
        if not options:
            return None
        s = rng.choice(options)
        starts.append(s)
        used.update(range(s, s + size))
    return starts


def random_plan(
    rng: random.Random,
    workload: Workload,
    models: dict[str, ModelSpec],
    num_gpus: int,
    gpus_per_node: int = 8,
) -> Plan:
    """A random plan with disjoint runs per stage (see the module docstring)."""
    block = max(1, num_gpus // BLOCKS)
    by_stage: dict[str, list[ModelStage]] = defaultdict(list)
    for ms in workload.stages:
        by_stage[ms.stage].append(ms)
    chosen: dict[str, Candidate] = {}
    for stage, members in by_stage.items():
        while True:
            sizes = [rng.choice(_RUN_SIZES[stage]) for _ in members]
            starts = _place(rng, sizes, set())
            if starts is not None:
                break
        for ms, size, start in zip(members, sizes, starts, strict=True):
            chosen[ms.name] = _candidate(rng, models[ms.model], start, size, block, gpus_per_node)
    return Plan.of({ms.name: chosen[ms.name] for ms in workload.stages})


def shard_training(rng: random.Random, plan: Plan, workload: Workload) -> Plan:
    """``plan`` with each training model-stage's replicas grouped, at random, into ZeRO-sharded replicas
    of a degree dividing their number (each drawn replica one shard group, the GPUs unchanged)."""
    stages = {ms.name: ms for ms in workload.stages}
    out = {}
    for name, c in plan.items():
        shard = rng.choice([d for d in (1, 2, 4) if c.dp % d == 0]) if stages[name].trains else 1
        if shard > 1:
            layout = Layout(c.layout.tp, c.layout.pp, shard, rng.choice((1, 2, 3)))
            c = Candidate(layout, c.dp // shard, c.gpus, c.micro_batch, c.recompute)
        out[name] = c
    return Plan.of(out)


def recut_training(
    rng: random.Random, current: Plan, target: Plan, workload: Workload, models: dict[str, ModelSpec]
) -> tuple[Plan, Plan]:
    """``current`` and ``target`` with one training model-stage that stays on its GPUs (at random, among
    those of four or more shard groups) re-cut in place: the same replicas, model cut and ZeRO stage on
    both sides, each replica holding ``d`` shard groups on all its GPUs on one side and ``d / 2`` on the
    first half of them on the other (a re-cut to a smaller degree, or to a larger one), ``lcm = d``
    dividing every row count. Both plans as they were when no model-stage qualifies."""
    stages = {ms.name: ms for ms in workload.stages}
    staying = [
        n for n, c in current.items() if stages[n].trains and c.gpus == target[n].gpus and _groups(c) >= 4
    ]
    if not staying:
        return current, target
    name = rng.choice(staying)
    c = current[name]
    degree = rng.choice([d for d in (4, 8) if _groups(c) % d == 0])
    zero, cut = rng.choice((1, 2, 3)), c.layout.model_size
    replicas = _groups(c) // degree
    whole = Candidate(Layout(c.layout.tp, c.layout.pp, degree, zero), replicas, c.gpus)
    half = tuple(g for r in range(replicas) for g in whole.replica_gpus(r)[: degree // 2 * cut])
    halved = Candidate(Layout(c.layout.tp, c.layout.pp, degree // 2, zero), replicas, half)
    a, b = (whole, halved) if rng.random() < 0.5 else (halved, whole)
    if not recut_in_place(models[stages[name].model], a, b):  # a degree whose rows are not all whole
        return current, target
    return current.replace(name, a), target.replace(name, b)


def _groups(c: Candidate) -> int:
    """How many whole model cuts (shard groups of ``Layout(tp, pp)``) lie on ``c``'s GPUs."""
    return len(c.gpus) // c.layout.model_size


def _blocks(c: Candidate, block: int) -> set[int]:
    return {g // block for g in c.gpus}


def _moved_target(
    rng: random.Random,
    current: Plan,
    workload: Workload,
    models: dict[str, ModelSpec],
    kind: str,
    num_gpus: int,
    gpn: int,
) -> Plan | None:
    block = max(1, num_gpus // BLOCKS)
    stages = {ms.name: ms for ms in workload.stages}
    names = list(current)
    if kind == "same_model_cross_stage":
        movers = [n for n in names if stages[n].model == "actor"]
        rng.shuffle(movers)
        movers = movers[: rng.randint(1, len(movers))]
    elif kind == "cross_model_same_stage":
        stage = rng.choice(
            [s for s in ("inference", "training") if sum(stages[n].stage == s for n in names) > 1]
        )
        movers = [n for n in names if stages[n].stage == stage]
        rng.shuffle(movers)
        movers = movers[: rng.randint(2, len(movers))]
    else:
        movers = rng.sample(names, rng.randint(1, 3))
    target = current.as_dict()
    fixed = [n for n in names if n not in movers]
    for name in movers:
        taken = set().union(
            *(_blocks(target[o], block) for o in fixed if stages[o].stage == stages[name].stage)
        )
        size = rng.choice(_RUN_SIZES[stages[name].stage])
        starts = _place(rng, [size], taken)
        if starts is None:
            return None
        target[name] = _candidate(rng, models[stages[name].model], starts[0], size, block, gpn)
        fixed.append(name)
    plan = Plan.of({n: target[n] for n in names})
    if kind not in overlaps_of(current, plan, workload):
        return None
    return plan


def _resident_peak(plan: Plan, workload: Workload, models: dict[str, ModelSpec]) -> float:
    stages = {ms.name: ms for ms in workload.stages}
    mem: dict[int, float] = defaultdict(float)
    for name, c in plan.items():
        ms = stages[name]
        per = state_bytes_per_gpu(models[ms.model], ms.trains, c.layout)
        for g in c.gpus:
            mem[g] += per
    return max(mem.values())


def random_case(
    rng: random.Random,
    kind: str,
    num_gpus: int,
    *,
    models: dict[str, ModelSpec] | None = None,
    workload: Workload | None = None,
    slack: tuple[float, float] = (1.0, 1.6),
    sharded: bool = False,
) -> TransitionCase:
    """A random PPO transition on ``num_gpus`` GPUs whose moves include overlap ``kind`` (``sharded``:
    with ZeRO-sharded training model-stages, :func:`shard_training`, half of the time one of them re-cut
    to another shard degree in place, :func:`recut_training`)."""
    if kind not in OVERLAP_KINDS:
        raise ValueError(f"kind {kind!r} is not one of {OVERLAP_KINDS}")
    models = models or default_models()
    workload = workload or Workload("ppo")
    gpn = min(8, num_gpus)
    for _ in range(1000):
        current = random_plan(rng, workload, models, num_gpus, gpn)
        target = _moved_target(rng, current, workload, models, kind, num_gpus, gpn)
        if target is not None:
            break
    else:  # pragma: no cover - the generator always finds one quickly
        raise RuntimeError(f"no {kind} case found on {num_gpus} GPUs")
    if sharded:
        current, target = shard_training(rng, current, workload), shard_training(rng, target, workload)
        if rng.random() < 0.5:
            current, target = recut_training(rng, current, target, workload, models)
    cluster = _case_cluster(rng, current, target, workload, models, num_gpus, gpn, slack)
    return TransitionCase(
        current, target, models, cluster, workload, kind, overlaps_of(current, target, workload)
    )


def _case_cluster(
    rng: random.Random,
    current: Plan,
    target: Plan,
    workload: Workload,
    models: dict[str, ModelSpec],
    num_gpus: int,
    gpn: int,
    slack: tuple[float, float],
) -> ClusterSpec:
    """An H200 cluster of ``num_gpus`` whose per-GPU memory is the resident peak of either plan
    times a random slack (so some cases are tight), all of it the allocator's (no reserved memory)."""
    stages = {ms.name: ms.model for ms in workload.stages}
    recut = recut_stages(current, target, {n: models[stages[n]] for n in current})
    moving = moving_shard_groups(current, target, recut)  # as transition.build moves sharded state
    peak = max(_resident_peak(plan, workload, models) for plan in moving)
    memory = peak / (1 - MEMORY_HEADROOM) * rng.uniform(*slack) * (1 + 1e-9)
    base = CLUSTER_PRESETS["paper_cluster3"]
    return replace(
        base,
        num_nodes=max(1, num_gpus // gpn),
        gpus_per_node=gpn,
        gpu_memory=memory,
        num_gpus=0,
        reserved_memory=0.0,
    )


def _colocate(
    rng: random.Random, plan: Plan, workload: Workload, models: dict[str, ModelSpec], num_gpus: int, gpn: int
) -> Plan:
    """``plan`` with two or more model-stages of one stage moved onto the run of the first of them."""
    block = max(1, num_gpus // BLOCKS)
    stages = {ms.name: ms for ms in workload.stages}
    shared = [
        s for s in ("generation", "inference", "training") if sum(m.stage == s for m in stages.values()) > 1
    ]
    stage = rng.choice(shared)
    names = [n for n in plan if stages[n].stage == stage]
    chosen = sorted(rng.sample(names, rng.randint(2, len(names))), key=names.index)
    first = plan[chosen[0]]
    start, blocks = min(first.gpus) // block, len(first.gpus) // block
    out = plan.as_dict()
    for name in chosen[1:]:
        out[name] = _candidate(rng, models[stages[name].model], start, blocks, block, gpn)
    return Plan.of(out)


def random_colocated_case(
    rng: random.Random,
    num_gpus: int,
    *,
    models: dict[str, ModelSpec] | None = None,
    workload: Workload | None = None,
    slack: tuple[float, float] = (1.0, 1.6),
) -> TransitionCase:
    """A random PPO transition whose current plan, target or both colocate some model-stages of a stage."""
    models = models or default_models()
    workload = workload or Workload("ppo")
    gpn = min(8, num_gpus)
    which = rng.choice(("current", "target", "both"))
    current = random_plan(rng, workload, models, num_gpus, gpn)
    target = random_plan(rng, workload, models, num_gpus, gpn)
    if which != "target":
        current = _colocate(rng, current, workload, models, num_gpus, gpn)
    if which != "current":
        target = _colocate(rng, target, workload, models, num_gpus, gpn)
    cluster = _case_cluster(rng, current, target, workload, models, num_gpus, gpn, slack)
    return TransitionCase(
        current,
        target,
        models,
        cluster,
        workload,
        f"colocated {which}",
        overlaps_of(current, target, workload),
    )
