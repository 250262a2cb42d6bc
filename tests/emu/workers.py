"""Functions the gloo pool runs on every rank (module-level so they pickle by reference)."""

from __future__ import annotations

import torch

from nereus_lightning.emu import (
    Counters,
    Unit,
    create_unit,
    destroy,
    execute,
    extend,
    gather_logical_state,
    merge,
    registry,
    split,
)
from nereus_lightning.plan.layout import Layout
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.testing.tiny import SMALL, rel_err, tiny_model

COUNTERS = Counters(
    optimizer_step=3, update_count=3, policy_version=2, stage_version=1, sample_position=96, seed=1234
)


def tiny(kind: str = "llama", layers: int = 4, seed: int = 0, **fields):
    """A tiny fp32 causal LM with random weights (same on every rank) and a random full AdamW state.

    The shared test models at the EMU tests' small shape, ``fields`` overriding it; "qwen2" with 2 KV
    heads (TP 4 refused). The weights come from ``seed``, the AdamW state from ``seed + 1``.
    """
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2} if kind == "qwen2" else {}
    model = tiny_model(kind, seed=seed, **{**SMALL, "num_hidden_layers": layers, **heads, **fields})
    gen = torch.Generator().manual_seed(seed + 1)
    optim = {
        name: {
            "exp_avg": torch.randn(p.shape, generator=gen),
            "exp_avg_sq": torch.rand(p.shape, generator=gen),
            "step": torch.tensor(3.0),
        }
        for name, p in model.named_parameters()
    }
    return model.config, model, optim


def start(kind: str, layout: Layout, ranks: tuple[int, ...], stage: str = "actor_train", trains: bool = True):
    """A fresh registry with one unit of ``stage``."""
    registry().clear()
    config, model, optim = tiny(kind)
    create_unit(
        stage,
        config,
        model,
        layout,
        ranks,
        trains=trains,
        full_optim=optim if trains else None,
        counters=COUNTERS,
    )
    return config, model, optim


def chain(rank: int, world: int, kind: str):
    """(TP2,PP2)x1 -> Split -> (TP1,PP2)x2 -> Destroy -> Extend -> Split -> Merge -> (TP2,PP1)x2 -> Merge ->
    (TP4,PP1)x1.

    Returns, after every primitive, the differences of the gathered state from the start, and the reports.
    """
    config, model, optim = start(kind, Layout(2, 2), (0, 1, 2, 3))
    before = gather_logical_state("actor_train", dst=0)
    initial = []
    if rank == 0:
        expected = {n: p.detach() for n, p in model.named_parameters()}
        initial = [n for n in expected if not torch.equal(before.params[n], expected[n])]
        initial += [n for n in optim if not torch.equal(before.optim[n]["exp_avg"], optim[n]["exp_avg"])]
    stage = "actor_train"
    steps = []

    def run(op):
        report = execute(op)
        after = gather_logical_state(stage, dst=0)
        steps.append((op.kind, before.differences(after) if rank == 0 else None, report))
        return op

    s = run(split(stage, Unit(Layout(2, 2), (0, 1, 2, 3)), Layout(1, 2)))
    a, b = s.targets
    run(destroy(stage, b))
    e = run(extend(stage, a, [b.gpus]))
    units = []
    for unit in (e.source, *e.targets):
        units += run(split(stage, unit, Layout(1, 1))).targets
    by_rank = {u.gpus[0]: u for u in units}
    m1 = run(merge(stage, [by_rank[0], by_rank[1]], Layout(2, 1), schema=registry().schema(stage)))
    m2 = run(merge(stage, [by_rank[2], by_rank[3]], Layout(2, 1), schema=registry().schema(stage)))
    run(merge(stage, [m1.target, m2.target], Layout(4, 1) if kind != "qwen2" else Layout(2, 2)))
    live = [str(u) for u in registry().live(stage)]
    return initial, [(kind, diff) for kind, diff, _ in steps], [r for _, _, r in steps], live


def pp_and_tp_pairs(rank: int, world: int, kind: str):
    """Every single-step Split and Merge on 4 ranks between
    (TP2,PP2), (TP1,PP4), (TP4,PP1) and their halves.
    """
    out = []
    stage = "actor_train"
    for big, small in (
        (Layout(1, 4), Layout(1, 2)),
        (Layout(4, 1), Layout(2, 1)),
        (Layout(2, 2), Layout(1, 1)),
        (Layout(1, 4), Layout(1, 1)),
    ):
        if kind == "qwen2" and big.tp == 4:
            continue  # 2 KV heads
        start(kind, big, (0, 1, 2, 3))
        before = gather_logical_state(stage, dst=0)
        op = split(stage, Unit(big, (0, 1, 2, 3)), small)
        execute(op)
        mid = gather_logical_state(stage, dst=0)
        back = merge(stage, op.targets, big, schema=registry().schema(stage))
        report = execute(back)
        after = gather_logical_state(stage, dst=0)
        diffs = (before.differences(mid), before.differences(after)) if rank == 0 else (None, None)
        out.append((str(big), str(small), *diffs, back.target.gpus, report.payload_sent))
    return out


def _names_bytes(emu) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, _, t in emu.tensors():
        out[name] = out.get(name, 0) + t.numel() * t.element_size()
    return out


def byte_counts(rank: int, world: int):
    """Bytes each primitive moves, next to the minimum its definition implies (per rank)."""
    stage = "actor_train"
    reg = registry()
    out: dict[str, dict] = {}

    # Extend: one copy of the unit's state (plus 48 B of counters per position) per new replica.
    start("gqa_tied", Layout(2, 1), (0, 1))
    src = Unit(Layout(2, 1), (0, 1))
    own = reg.local(stage, src).nbytes() if rank in (0, 1) else 0
    report = execute(extend(stage, src, [(2, 3)]))
    got = reg.local(stage, Unit(Layout(2, 1), (2, 3))).nbytes() if rank in (2, 3) else 0
    out["extend"] = dict(own=own, got=got, report=report)

    start("llama", Layout(1, 1), (0,))
    own = reg.local(stage, Unit(Layout(1, 1), (0,))).nbytes() if rank == 0 else 0
    report = execute(extend(stage, Unit(Layout(1, 1), (0,)), [(1,), (2,), (3,)]))
    out["extend3"] = dict(own=own, report=report)

    # Split: each rank receives exactly what it lacks (TP split: new minus old; PP split: the new stages'
    # tensors).
    for name, kind, layers, big, small in (
        ("split_tp", "gqa_tied", 4, Layout(2, 2), Layout(1, 2)),
        ("split_pp_uneven", "llama", 6, Layout(1, 4), Layout(1, 2)),
        ("split_both", "qwen2", 4, Layout(2, 2), Layout(1, 1)),
    ):
        registry().clear()
        config, model, optim = tiny(kind, layers)
        unit = Unit(big, (0, 1, 2, 3))
        create_unit(stage, config, model, big, unit.gpus, trains=True, full_optim=optim, counters=COUNTERS)
        old = _names_bytes(reg.local(stage, unit))
        op = split(stage, unit, small)
        report = execute(op)
        mine = next(u for u in op.targets if rank in u.gpus)
        new = _names_bytes(reg.local(stage, mine))
        if big.tp == small.tp:
            lacked = sum(b for n, b in new.items() if n not in old)
        else:
            lacked = sum(new.values()) - sum(b for n, b in old.items() if n in new)
        out[name] = dict(lacked=lacked, report=report)

    # Merge: nothing moves in the cheapest order; a forced order moves exactly what the ranks lack.
    for name, order in (("merge_chosen", None), ("merge_forced", (0, 2, 1, 3))):
        start("llama", Layout(1, 2), (0, 2))
        execute(extend(stage, Unit(Layout(1, 2), (0, 2)), [(1, 3)]))
        units = registry().live(stage)
        old = _names_bytes(reg.local(stage, next(u for u in units if rank in u.gpus)))
        op = merge(stage, units, Layout(2, 2), ranks=order, schema=reg.schema(stage))
        report = execute(op)
        new = _names_bytes(reg.local(stage, op.target))
        lacked = sum(b for n, b in new.items() if n not in old)
        out[name] = dict(lacked=lacked, report=report, ranks=op.target.gpus)
    return out


def bad_inputs(rank: int, world: int):
    """Each bad op raises the same NereusConfigError on every rank, and the state stays as it was."""
    stage = "actor_train"
    out = {}

    def attempt(label, fn):
        try:
            fn()
        except NereusConfigError as exc:
            out[label] = str(exc)
        else:
            out[label] = None

    registry().clear()
    config, model, optim = tiny("llama")
    attempt("tp_heads", lambda: create_unit(stage, config, model, Layout(3, 1), (0, 1, 2), trains=True))
    config, model, optim = tiny("qwen2")
    attempt("tp_kv_heads", lambda: create_unit(stage, config, model, Layout(4, 1), (0, 1, 2, 3)))

    # A merge to TP4 of a model with 2 KV heads is refused before anything moves.
    start("qwen2", Layout(1, 1), (0,))
    execute(extend(stage, Unit(Layout(1, 1), (0,)), [(1,), (2,), (3,)]))
    before = gather_logical_state(stage, dst=0)
    units = registry().live(stage)
    attempt("merge_kv_heads", lambda: execute(merge(stage, units, Layout(4, 1))))
    out["merge_kv_heads_intact"] = registry().live(stage) == units
    after = gather_logical_state(stage, dst=0)
    out["merge_kv_heads_state"] = before.differences(after) if rank == 0 else []

    # PP larger than the number of layers (2 layers, PP 4).
    registry().clear()
    config, model, optim = tiny("llama", layers=2)
    create_unit(stage, config, model, Layout(1, 1), (0,), trains=True, full_optim=optim)
    execute(extend(stage, Unit(Layout(1, 1), (0,)), [(1,), (2,), (3,)]))
    attempt("pp_layers", lambda: execute(merge(stage, registry().live(stage), Layout(1, 4))))
    attempt("split_factor", lambda: split(stage, Unit(Layout(2, 1), (0, 1)), Layout(3, 1)))

    # Overlap with another model-stage's live unit; destroying the last copy.
    registry().clear()
    config, model, optim = tiny("llama")
    create_unit("actor_train", config, model, Layout(2, 1), (0, 1), trains=True)
    create_unit("critic_train", config, model if rank == 2 else None, Layout(1, 1), (2,), trains=True)
    attempt("overlap", lambda: execute(extend("critic_train", Unit(Layout(1, 1), (2,)), [(1,)])))
    attempt("overlap_create", lambda: create_unit("ref_infer", config, model, Layout(1, 1), (0,)))
    out["overlap_live"] = [str(u) for u in registry().live("critic_train")]
    attempt("last_copy", lambda: execute(destroy("critic_train", Unit(Layout(1, 1), (2,)))))
    out["last_copy_live"] = [str(u) for u in registry().live("critic_train")]
    attempt(
        "colocated_ok",
        lambda: execute(
            extend("critic_train", Unit(Layout(1, 1), (2,)), [(1,)]), colocate_with=("actor_train",)
        ),
    )
    attempt("destroy_ok", lambda: execute(destroy("critic_train", Unit(Layout(1, 1), (2,)))))
    out["final_live"] = [str(u) for u in registry().live("critic_train")]
    return out


def dcp_oracle(rank: int, world: int, path: str):
    """Save under layout A with DCP, reshard A -> B with our primitives, load B from DCP: compare shard by
    shard.
    """
    from nereus_lightning.emu import EMU
    from nereus_lightning.emu.dcp_state import load_state, save_state

    stage = "actor_train"
    reg = registry()
    results = []
    cases = (
        ("split_tp", "gqa_tied", 4, Layout(2, 2), lambda u: [split(stage, u, Layout(1, 2))]),
        ("split_all", "qwen2", 4, Layout(2, 2), lambda u: [split(stage, u, Layout(1, 1))]),
        ("split_pp_uneven", "llama", 6, Layout(1, 4), lambda u: [split(stage, u, Layout(1, 2))]),
        ("merge_tp4", "gqa_tied", 4, Layout(1, 1), lambda u: [merge(stage, reg.live(stage), Layout(4, 1))]),
        ("merge_pp4", "llama", 6, Layout(1, 1), lambda u: [merge(stage, reg.live(stage), Layout(1, 4))]),
        ("merge_tp2pp2", "qwen2", 4, Layout(1, 1), lambda u: [merge(stage, reg.live(stage), Layout(2, 2))]),
    )
    for label, kind, layers, layout, ops in cases:
        registry().clear()
        config, model, optim = tiny(kind, layers)
        ranks = tuple(range(layout.size))
        create_unit(stage, config, model, layout, ranks, trains=True, full_optim=optim, counters=COUNTERS)
        if layout.size == 1:  # A = four replicas
            execute(extend(stage, Unit(layout, ranks), [(1,), (2,), (3,)]))
        where = f"{path}/{label}"
        save_state(stage, where)
        for op in ops(Unit(layout, ranks)):
            execute(op)
        mine = next(u for u in reg.live(stage) if rank in u.gpus)
        ours = reg.local(stage, mine)
        oracle = EMU.empty(stage, reg.schema(stage), mine, rank, trains=True)
        for _, _, t in oracle.tensors():
            t.fill_(-7.0)  # so that a shard DCP did not fill cannot pass by chance
        load_state(oracle, where)
        ours_t = {(n, k): t for n, k, t in ours.tensors()}
        theirs = {(n, k): t for n, k, t in oracle.tensors()}
        bad = [f"{n}.{k}" for (n, k), t in ours_t.items() if not torch.equal(t, theirs[(n, k)])]
        results.append(
            (
                label,
                str(mine),
                len(ours_t),
                ours_t.keys() == theirs.keys(),
                bad,
                oracle.counters == ours.counters,
            )
        )
    return results


def forward_after_transitions(rank: int, world: int, kind: str):
    """Logits of models/ ShardedCausalLM replicas built on the moved shards, vs the full model, after each
    step.
    """
    from nereus_lightning.models.groups import ReplicaComm, replica_groups
    from nereus_lightning.models.pipeline import forward_logits
    from nereus_lightning.models.sharded import ShardedCausalLM

    stage = "actor_train"
    config, model, _ = start(kind, Layout(2, 2), (0, 1, 2, 3))
    tied = bool(getattr(config, "tie_word_embeddings", False))
    ids = torch.randint(0, config.vocab_size, (2, 7), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        expected = model(ids).logits
    errors = []

    def check(label):
        units = registry().live(stage)
        replica_groups([u.gpus for u in units], units[0].layout, tied=tied)  # world-collective, same order
        mine = next(u for u in units if rank in u.gpus)
        emu = registry().local(stage, mine)
        sharded = ShardedCausalLM(config, ReplicaComm.of(mine.gpus, mine.layout, tied=tied), emu.params)
        with torch.no_grad():
            logits = forward_logits(sharded, ids, where="all")
        err = rel_err(logits, expected)
        errors.append((label, str(mine), err))

    check("start")
    s = split(stage, Unit(Layout(2, 2), (0, 1, 2, 3)), Layout(1, 2))
    execute(s)
    check("split")
    for unit in s.targets:
        execute(split(stage, unit, Layout(1, 1)))
    by_rank = {u.gpus[0]: u for u in registry().live(stage)}
    execute(merge(stage, [by_rank[0], by_rank[1]], Layout(2, 1)))
    execute(merge(stage, [by_rank[2], by_rank[3]], Layout(2, 1)))
    check("merge")
    return errors


def run_local_dags(rank: int, world: int, kind: str, trains: bool):
    """Execute transition.local_dag's nodes through from_node + execute; per node: state diff and bytes vs the
    node's.
    """
    from dataclasses import replace

    from nereus_lightning.emu import from_node
    from nereus_lightning.plan.layout import Candidate
    from nereus_lightning.spec.cluster import CLUSTER_PRESETS
    from nereus_lightning.spec.model import ModelSpec
    from nereus_lightning.transition.local import local_dag
    from nereus_lightning.transition.pieces import geometry

    stage = "actor_train"
    cases = (
        (Candidate(Layout(2, 2), 1, (0, 1, 2, 3)), Candidate(Layout(2, 1), 2, (0, 1, 2, 3))),
        (Candidate(Layout(2, 2), 1, (0, 1, 2, 3)), Candidate(Layout(4, 1), 1, (0, 1, 2, 3))),
        (Candidate(Layout(1, 2), 2, (0, 1, 2, 3)), Candidate(Layout(1, 4), 1, (0, 1, 2, 3))),
        (Candidate(Layout(2, 1), 1, (0, 1)), Candidate(Layout(2, 1), 2, (0, 1, 2, 3))),
        (Candidate(Layout(1, 1), 4, (0, 1, 2, 3)), Candidate(Layout(2, 2), 1, (0, 1, 2, 3))),
        (Candidate(Layout(1, 2), 1, (0, 1)), Candidate(Layout(2, 1), 1, (2, 3))),
    )
    out = []
    for current, target in cases:
        registry().clear()
        config, model, optim = tiny(kind)
        geo = geometry(replace(ModelSpec.from_hf_config(config), dtype="float32"), False)
        first = current.replica_gpus(0)
        create_unit(
            stage,
            config,
            model,
            current.layout,
            first,
            trains=trains,
            full_optim=optim if trains else None,
            counters=COUNTERS,
        )
        if current.dp > 1:
            execute(
                extend(
                    stage,
                    Unit(current.layout, first),
                    [current.replica_gpus(i) for i in range(1, current.dp)],
                )
            )
        before = gather_logical_state(stage, dst=0)
        nodes = local_dag(stage, geo, lambda layout: 0.0, current, target, CLUSTER_PRESETS["cpu4"])
        rows = []
        for node in nodes:
            report = execute(from_node(node))
            brain = sum(t.bytes for t in node.transfers if t.src_gpu != t.dst_gpu and t.dst_gpu == rank)
            body = report.payload_received - (
                Counters.size() * 8 if node.op.value == "extend" and report.payload_received else 0
            )
            rows.append((node.op.value, brain, body))
        after = gather_logical_state(stage, dst=0)
        live = sorted(u for u in registry().live(stage))
        wanted = sorted(Unit(target.layout, target.replica_gpus(i)) for i in range(target.dp))
        out.append(
            (
                str(current.layout),
                str(target.layout),
                rows,
                before.differences(after) if rank == 0 else [],
                live == wanted,
            )
        )
    return out


def disjoint_ops_without_bystanders(rank: int, world: int):
    """Ranks 0-1 extend one model-stage while ranks 2-3 split another; neither pair calls the other's op."""
    registry().clear()
    config, model, optim = tiny("llama")
    create_unit(
        "actor_train", config, model, Layout(1, 1), (0,), trains=True, full_optim=optim, counters=COUNTERS
    )
    create_unit("critic_train", config, model, Layout(2, 1), (2, 3), trains=True, full_optim=optim)
    if rank in (0, 1):
        report = execute(extend("actor_train", Unit(Layout(1, 1), (0,)), [(1,)]))
    else:
        report = execute(split("critic_train", Unit(Layout(2, 1), (2, 3)), Layout(1, 1)))
    # Bring every registry up to date (non-members only record), then check both states on all ranks.
    if rank in (0, 1):
        execute(split("critic_train", Unit(Layout(2, 1), (2, 3)), Layout(1, 1)))
    else:
        execute(extend("actor_train", Unit(Layout(1, 1), (0,)), [(1,)]))
    actor = gather_logical_state("actor_train", dst=0)
    critic = gather_logical_state("critic_train", dst=0)
    if rank != 0:
        return report, None
    want = {n: p.detach() for n, p in model.named_parameters()}
    wrong = [
        n
        for n in want
        if not torch.equal(actor.params[n], want[n]) or not torch.equal(critic.params[n], want[n])
    ]
    return report, (actor.replicas, critic.replicas, wrong, actor.counters == COUNTERS)
