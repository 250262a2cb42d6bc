"""Rank functions for the DAG-executor tests: a PPO-like job of five model-stages on four ranks."""

from __future__ import annotations

from dataclasses import replace
from functools import cache

import torch

from nereus_lightning.emu import (
    Counters,
    Extend,
    Unit,
    create_unit,
    execute,
    extend,
    gather_logical_state,
    registry,
    reshard_plan,
)
from nereus_lightning.emu.executor import calibration_observations, execute_dag, ops_of
from nereus_lightning.plan.layout import Plan
from nereus_lightning.spec.cluster import CLUSTER_PRESETS
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.model import ModelSpec
from nereus_lightning.spec.workload import Workload
from nereus_lightning.testing.tiny import rel_err
from nereus_lightning.transition import build_transition
from nereus_lightning.transition.pieces import geometry
from tests.emu.workers import tiny
from tests.helpers import cand, plan

PPO = Workload("ppo")
STAGES = {ms.name: ms for ms in PPO.stages}
CLUSTER = CLUSTER_PRESETS["cpu4"]
ROLES = ("actor", "critic", "reference", "reward")


# A: actor_gen TP2 x2, ref and critic inference on one GPU each, actor_train TP2, critic_train PP2.
# A -> B: Merge (actor_gen), Splits (both trainers), same-stage handover ref_infer -> GPU 1 while
# critic_infer leaves it (a resource edge). B -> A undoes it. C -> D: a re-ranking one-source Merge
# (critic_infer), Extends that overlap their source (actor_train: a local copy on GPU 2; actor_gen:
# GPU 0 sends one shard and receives the other), Extend + Merge into PP2, a resource edge.
PLANS = {
    "A": plan(
        actor_gen=cand(2, 1, (0, 1, 2, 3)),
        ref_infer=cand(1, 1, (0,)),
        critic_infer=cand(1, 1, (1,)),
        actor_train=cand(2, 1, (0, 1)),
        critic_train=cand(1, 2, (2, 3)),
    ),
    "B": plan(
        actor_gen=cand(4, 1, (0, 1, 2, 3)),
        ref_infer=cand(1, 1, (1,)),
        critic_infer=cand(1, 1, (2,)),
        actor_train=cand(1, 1, (0, 1)),
        critic_train=cand(1, 1, (2, 3)),
    ),
    "C": plan(
        actor_gen=cand(2, 1, (0, 2)),
        ref_infer=cand(1, 1, (1,)),
        critic_infer=cand(2, 1, (2, 3)),
        actor_train=cand(2, 1, (3, 2)),
        critic_train=cand(1, 1, (0,)),
    ),
    "D": plan(
        actor_gen=cand(2, 1, (3, 0)),
        ref_infer=cand(1, 2, (0, 1)),
        critic_infer=cand(2, 1, (3, 2)),
        actor_train=cand(2, 1, (1, 2)),
        critic_train=cand(1, 2, (3, 0)),
    ),
    # E -> F: three independent nodes all on rank 0 (concurrency within a rank): actor_gen doubles
    # by one batched Extend of two lanes (0 -> 2, 1 -> 3), ref_infer extends 0 -> 3, critic_train 0 -> 2.
    "E": plan(actor_gen=cand(1, 1, (0, 1)), ref_infer=cand(1, 1, (0,)), critic_train=cand(1, 1, (0,))),
    "F": plan(
        actor_gen=cand(1, 1, (0, 1, 2, 3)), ref_infer=cand(1, 1, (0, 3)), critic_train=cand(1, 1, (0, 2))
    ),
}


@cache
def role_model(role: str):
    """A tiny fp32 Llama per role, each with its own weights and AdamW state."""
    return tiny("llama", seed=10 + 2 * ROLES.index(role))


def models() -> dict[str, ModelSpec]:
    """The brain's ModelSpec per role (the tiny Llama, fp32)."""
    spec = replace(ModelSpec.from_hf_config(role_model("actor")[0]), dtype="float32")
    return dict.fromkeys(ROLES, spec)


def _colocated(name: str, names) -> tuple[str, ...]:
    return tuple(o for o in names if STAGES[o].stage != STAGES[name].stage)


def start(current: Plan, rank_of: dict[int, int] | None = None) -> None:
    """A fresh registry holding ``current``'s units (GPU ids mapped to ranks by ``rank_of``)."""
    registry().clear()
    ranks = (lambda gs: tuple(rank_of[g] for g in gs)) if rank_of else tuple
    for i, (name, c) in enumerate(current.items()):
        ms = STAGES[name]
        config, model, optim = role_model(ms.model)
        colo = _colocated(name, current)
        first = ranks(c.replica_gpus(0))
        counters = Counters(3, 3, 2, 1, 96, seed=100 + i)
        create_unit(
            name,
            config,
            model,
            c.layout,
            first,
            trains=ms.trains,
            full_optim=optim if ms.trains else None,
            counters=counters,
            colocate_with=colo,
        )
        if c.dp > 1:
            others = [ranks(c.replica_gpus(k)) for k in range(1, c.dp)]
            execute(extend(name, Unit(c.layout, first), others), colocate_with=colo)


def _extra_bytes(op, node_rank: int) -> int:
    """Bytes the body sends beyond the brain's pieces into
    ``node_rank``: counters (Extend) and AdamW steps.
    """
    reg = registry()
    schema, trains = reg.schema(op.model_stage), reg.trains[op.model_stage]
    if isinstance(op, Extend):
        target = next((u for u in op.targets if node_rank in u.gpus), None)
        if target is None:
            return 0
        index = target.gpus.index(node_rank)
        if op.source.gpus[index] == node_rank:
            return 0  # a local copy
        names = schema.stage_names(target.layout, index // target.layout.tp)
        return Counters.size() * 8 + (4 * len(names) if trains else 0)
    if op.kind == "destroy" or not trains:
        return 0
    return 4 * sum(1 for m in reshard_plan(op, schema, trains).moves if m.dst == node_rank and m.with_step)


def logits_errors(names, ids: torch.Tensor) -> list[tuple[str, str, float]]:
    """Per live unit this rank is in: relative max error of its ShardedCausalLM logits vs the full model."""
    from nereus_lightning.models.groups import ReplicaComm, replica_groups
    from nereus_lightning.models.pipeline import forward_logits
    from nereus_lightning.models.sharded import ShardedCausalLM

    rank = torch.distributed.get_rank()
    out = []
    for name in names:
        config, model, _ = role_model(STAGES[name].model)
        units = registry().live(name)
        replica_groups([u.gpus for u in units], units[0].layout)  # world-collective, same order everywhere
        mine = next((u for u in units if rank in u.gpus), None)
        if mine is None:
            continue
        with torch.no_grad():
            expected = model(ids).logits
            sharded = ShardedCausalLM(
                config, ReplicaComm.of(mine.gpus, mine.layout), registry().local(name, mine).params
            )
            logits = forward_logits(sharded, ids, where="all")
        out.append((name, str(mine), rel_err(logits, expected)))
    return out


def run_pair(rank: int, world: int, current: str, target: str, reversed_ranks: bool = False):
    """Execute the DAG current -> target; return what the test checks (state diffs on rank 0)."""
    rank_of = {g: world - 1 - g for g in range(world)} if reversed_ranks else None
    cur, tgt = PLANS[current], PLANS[target]
    start(cur, rank_of)
    before = {name: gather_logical_state(name, dst=0) for name in cur}
    dag = build_transition(cur, tgt, models(), CLUSTER, PPO)
    gpu = {v: k for k, v in rank_of.items()}[rank] if rank_of else rank
    # Before executing (the schemas do not change); a batched node: its lanes together.
    extras = [sum(_extra_bytes(op, rank) for op in ops_of(node, rank_of)) for node in dag.nodes]
    report = execute_dag(dag, rank_of=rank_of)
    reduced = report.reduce()
    after = {name: gather_logical_state(name, dst=0) for name in cur}
    ranks = (lambda gs: tuple(rank_of[g] for g in gs)) if rank_of else tuple
    live_ok = {
        name: sorted(registry().live(name))
        == sorted(Unit(c.layout, ranks(c.replica_gpus(i))) for i in range(c.dp))
        for name, c in tgt.items()
    }
    ids = torch.randint(0, 64, (2, 7), generator=torch.Generator().manual_seed(5))
    errors = logits_errors(list(tgt), ids)
    rows = []
    for node, record, extra in zip(dag.nodes, report.records, extras, strict=True):
        ms = STAGES[node.model_stage]
        brain_bpp = geometry(models()[ms.model], ms.trains).bytes_per_param
        schema = registry().schema(node.model_stage)  # the EMU's own per-element state bytes
        sizes = {schema.element_bytes(n, ms.trains) for n in schema.names}
        body_bpp = sizes.pop() if len(sizes) == 1 else sizes  # fp32: 4, training 3 x 4
        brain = sum(t.bytes for t in node.transfers if t.src_gpu != t.dst_gpu and t.dst_gpu == gpu)
        rows.append(
            (node.id, node.op.value, ms.trains, brain, brain_bpp, body_bpp, record.measured_bytes, extra)
        )
    summary = dict(
        counts=dag.counts(),
        resource_edges=dag.resource_edges,
        with_resource_deps=[n.id for n in dag.nodes if n.resource_deps],
        one_source_merges=sum(1 for n in dag.nodes if n.op.value == "merge" and len(n.sources) == 1),
        overlapping_extends=sum(
            1
            for n in dag.nodes
            if n.op.value == "extend" and set(n.sources[0].gpus) & {g for u in n.targets for g in u.gpus}
        ),
        node_bytes=[n.bytes for n in dag.nodes],
    )
    diffs = {name: before[name].differences(after[name]) for name in cur} if rank == 0 else {}
    replicas = {name: after[name].replicas for name in cur} if rank == 0 else {}
    return dict(
        summary=summary,
        diffs=diffs,
        replicas=replicas,
        live_ok=live_ok,
        errors=errors,
        rows=rows,
        local=report.node_observations(),
        reduced=reduced.node_observations(),
        fastest=reduced.node_observations(fastest=True),
        members=[r.ranks for r in reduced.records],
        in_flight=[(r.node_id, r.in_flight, r.lanes) for r in report.records if r.member],
        running=[r.running for r in report.records if r.member],
        widths=[n.width for n in dag.nodes],
        calibration=calibration_observations(dag, reduced),
        moving_nodes=sum(1 for n in dag.nodes if n.bytes > 0),
    )


def stale_registry(rank: int, world: int):
    """A DAG built for another current plan fails on every rank before anything moves."""
    start(PLANS["A"])
    before = {name: gather_logical_state(name, dst=0) for name in PLANS["A"]}
    units = {name: registry().live(name) for name in PLANS["A"]}
    dag = build_transition(PLANS["C"], PLANS["D"], models(), CLUSTER, PPO)
    try:
        execute_dag(dag)
    except NereusConfigError as exc:
        message = str(exc)
    else:
        message = None
    after = {name: gather_logical_state(name, dst=0) for name in PLANS["A"]}
    same = {name: registry().live(name) == units[name] for name in PLANS["A"]}
    diffs = {name: before[name].differences(after[name]) for name in PLANS["A"]} if rank == 0 else {}
    return message, same, diffs
