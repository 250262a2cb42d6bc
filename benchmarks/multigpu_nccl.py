"""Multi-GPU validation (issue 8): EMU checks, a PPO run with TP/DP changes, Extend/Split/Merge timing.

One rank per GPU on NCCL (NVLink multicast off, as the device tool's KINDS.md requires); without
GPUs the very same code runs on gloo/CPU. Three parts, every rank runs all of them (in the order
3, 1, 2: the big timed state first, while the GPUs are empty):

1. **EMU checks** on the backend: logits of ``models.ShardedCausalLM`` replicas equal the unsharded
   transformers model for every (TP, PP) layout that fits the world; the logical state (parameters,
   AdamW tensors, counters) is bit-identical after every primitive of a chain Split -> Destroy ->
   Extend -> Split -> Merge (PP) -> Merge (TP + PP), and the moved units still give the same logits.
2. **PPO run**: ``PPOModule.rl_step`` (what its ``training_step`` calls) on
   ``NereusStrategy.without_trainer`` for three steps under plans P0 (everything DP over all ranks)
   -> P1 (training TP 1 -> 2, DP N -> N/2) -> P2 (actor training DP N/2 -> 1; critic training
   TP 2 -> PP 2), beside a reference module that keeps P0: the metrics and the final parameters
   must agree, and every rank must hold the same ones.
3. **Timing** of the transition DAGs the brain builds (``transition.build_transition``), executed by
   ``emu.executor.execute_dag`` on a random training state (fp32 params + fp32 AdamW moments, the
   EMU's training state; 12 B/param) of an 8B actor and critic: Extend (4 -> 8 GPUs at N = 8, as in
   the paper; 2 -> 4 or 1 -> 2 at smaller N), Merge (TP t x 2 -> TP 2t) and Split (back). Barrier (and
   ``torch.cuda.synchronize``) around every timed DAG; the first run (communicator creation) and
   the median of the rest are printed beside the paper's 2.45 s and the brain's ``L_tran``.

Commands (N = 2, 4 or 8 GPUs of one host; ``$OUT`` is where the JSON goes)::

    torchrun --nproc-per-node 8 benchmarks/multigpu_nccl.py --out $OUT/multigpu_nccl_8.json
    torchrun --nproc-per-node 4 benchmarks/multigpu_nccl.py --out $OUT/multigpu_nccl_4.json
    bash benchmarks/multigpu_nccl.sh        # every visible GPU, plus a short nereus-train run
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 benchmarks/multigpu_nccl.py --quick   # CPU/gloo

``--quick`` shrinks the timed model (a few MB) and the repeats so that the CPU run takes seconds.
The JSON holds every check (name, passed, detail), the PPO metrics and the timing rows.
"""

from __future__ import annotations

import os

# NVLink multicast off before anything initialises NCCL (device tool KINDS.md).
os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ["TORCH_SYMM_MEM_DISABLE_MULTICAST"] = "1"
os.environ["NVSHMEM_DISABLE_NVLS"] = "1"

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from dataclasses import replace  # noqa: E402
from datetime import timedelta  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from nereus_lightning.testing.tiny import rel_err  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PAPER_EXTEND_4_TO_8_S = 2.45  # 8B actor + critic, 8 x H200 (the paper's Extend when doubling 4 -> 8 GPUs)
PAPER_SPLIT_MERGE_S = (15.7, 16.1)  # 8B Split/Merge resharding, 8-64 GPUs
NVLS_ENV = ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS")
CHAIN_LAYOUT = {2: (2, 1), 4: (2, 2), 8: (4, 2)}  # the chain's starting unit covers the world


# ---- process group ----------------------------------------------------------------------------------


def init(device: str) -> torch.device:
    """Join the torchrun world: NCCL with one GPU per rank when there are GPUs, else gloo on CPU."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    use_cuda = device == "cuda" or (
        device == "auto" and torch.cuda.is_available() and torch.cuda.device_count() >= local_world
    )
    timeout = timedelta(seconds=float(os.environ.get("NEREUS_PG_TIMEOUT", "900")))
    if use_cuda:
        dev = torch.device("cuda", local)
        torch.cuda.set_device(dev)
        dist.init_process_group("nccl", timeout=timeout, device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timeout)
    return dev


def sync(dev: torch.device) -> None:
    """Every rank here, every kernel done."""
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    dist.barrier()


def gathered(value: Any) -> list[Any]:
    """``value`` of every rank (all_gather_object)."""
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


class Checks:
    """Named pass/fail results; decided on rank 0 and agreed by every rank."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, name: str, passed: bool, detail: Any = None) -> None:
        """Record a check (call with the same name on every rank; rank 0's verdict is kept)."""
        verdict = [bool(passed), detail]
        obj = [verdict]
        dist.broadcast_object_list(obj, src=0)
        self.rows.append({"name": name, "passed": obj[0][0], "detail": obj[0][1]})
        if dist.get_rank() == 0:
            print(f"  {'ok  ' if obj[0][0] else 'FAIL'} {name}", flush=True)


# ---- tiny models (shared with the tests: nereus_lightning.testing.tiny) ----


def tiny_model(kind: str, dev: torch.device):
    """The tests' tiny fp32 model of ``kind`` on ``dev``, with a
    random full AdamW state (same on every rank).
    """
    from nereus_lightning.testing.tiny import tiny_config
    from nereus_lightning.testing.tiny import tiny_model as build

    config, model = tiny_config(kind), build(kind)
    gen = torch.Generator().manual_seed(1)
    optim = {
        name: {
            "exp_avg": torch.randn(p.shape, generator=gen).to(dev),
            "exp_avg_sq": torch.rand(p.shape, generator=gen).to(dev),
            "step": torch.tensor(3.0, device=dev),
        }
        for name, p in model.named_parameters()
    }
    return config, model.to(dev), optim


# ---- 1. EMU checks --------------------------------------------------------------------------------------


def fitting_layouts(world: int, heads: int = 8, kv_heads: int = 4, layers: int = 4) -> list[tuple[int, int]]:
    """(tp, pp) with tp * pp dividing the world and valid for the tiny models."""
    out = []
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if world % (tp * pp) == 0 and heads % tp == 0 and kv_heads % tp == 0 and pp <= layers:
                out.append((tp, pp))
    return out


def forward_equivalence(checks: Checks, dev: torch.device, tol: float) -> None:
    """Sharded replicas covering the world vs the unsharded model, per kind and layout."""
    from nereus_lightning.models import ReplicaComm, ShardedCausalLM, forward_logits, replica_groups
    from nereus_lightning.plan.layout import Layout

    rank, world = dist.get_rank(), dist.get_world_size()
    for kind in ("gqa_tied", "qwen2"):
        config, model, _ = tiny_model(kind, dev)
        tied = bool(config.tie_word_embeddings)
        for tp, pp in fitting_layouts(world):
            layout = Layout(tp, pp)
            size = layout.size
            replicas = [tuple(range(i * size, (i + 1) * size)) for i in range(world // size)]
            replica_groups(replicas, layout, tied=tied)  # every rank, same order
            index = rank // size
            comm = ReplicaComm.of(replicas[index], layout, rank, tied=tied)
            sharded = ShardedCausalLM.from_model(model, comm)
            gen = torch.Generator().manual_seed(100 + index)  # replicas see different batches
            ids = torch.randint(0, 256, (4, 12), generator=gen).to(dev)
            with torch.no_grad():
                ref = model(ids).logits
                logits = forward_logits(sharded, ids, where="all")
            worst = max(gathered(rel_err(logits, ref)))
            checks.add(f"forward/{kind}/tp{tp}pp{pp}", worst <= tol, {"max_rel_err": worst, "tol": tol})


def _logits_error(stage: str, config: Any, model: Any, dev: torch.device) -> float:
    """Worst relative logits error over the live units of ``stage`` (collective)."""
    from nereus_lightning.emu import registry
    from nereus_lightning.models import ReplicaComm, ShardedCausalLM, forward_logits, replica_groups

    rank = dist.get_rank()
    tied = bool(config.tie_word_embeddings)
    units = registry().live(stage)
    replica_groups([u.gpus for u in units], units[0].layout, tied=tied)
    mine = next((u for u in units if rank in u.gpus), None)
    err = 0.0
    if mine is not None:
        ids = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(5)).to(dev)
        emu = registry().local(stage, mine)
        sharded = ShardedCausalLM(config, ReplicaComm.of(mine.gpus, mine.layout, rank, tied=tied), emu.params)
        with torch.no_grad():
            err = rel_err(forward_logits(sharded, ids, where="all"), model(ids).logits)
    return max(gathered(err))


def state_chain(checks: Checks, dev: torch.device, tol: float) -> None:
    """Every primitive on real training state; the logical state must stay bit-identical."""
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

    rank, world = dist.get_rank(), dist.get_world_size()
    if world not in CHAIN_LAYOUT:
        checks.add("state/chain", False, f"world size {world} not in {sorted(CHAIN_LAYOUT)}")
        return
    stage = "actor_train"
    counters = Counters(3, 3, 2, 1, 96, seed=1234)
    tp0, pp0 = CHAIN_LAYOUT[world]
    big = Layout(tp0, pp0)
    for kind in ("gqa_tied", "qwen2"):
        registry().clear()
        config, model, optim = tiny_model(kind, dev)
        start = Unit(big, tuple(range(world)))
        create_unit(stage, config, model, big, start.gpus, trains=True, full_optim=optim, counters=counters)
        before = gather_logical_state(stage, dst=0)
        if rank == 0:  # the gathered start equals the model and optimizer we cut it from
            wrong = [
                n for n, p in model.named_parameters() if not torch.equal(before.params[n], p.detach().cpu())
            ]
            wrong += [
                n for n in optim if not torch.equal(before.optim[n]["exp_avg"], optim[n]["exp_avg"].cpu())
            ]
        checks.add(f"state/{kind}/create {big}", rank != 0 or not wrong, None if rank else wrong[:5])

        def step(label: str, op, logits: bool = False, before=before, kind=kind, config=config, model=model):  # noqa: ANN001, ANN202
            report = execute(op)
            after = gather_logical_state(stage, dst=0)
            diff = before.differences(after) if rank == 0 else []
            checks.add(f"state/{kind}/{label}", not diff, {"differences": diff[:5]})
            if logits:
                err = _logits_error(stage, config, model, dev)
                checks.add(f"state/{kind}/{label}/logits", err <= tol, {"max_rel_err": err, "tol": tol})
            return op, report

        half = Layout(tp0 // 2, pp0) if tp0 > 1 else Layout(tp0, pp0 // 2)
        s, _ = step(f"split {big}->{half}", split(stage, start, half))
        a, b = s.targets
        step(f"destroy {b}", destroy(stage, b))
        step(f"extend {a}->{b.gpus}", extend(stage, a, [b.gpus]), logits=True)
        one = Layout(1, 1)
        for unit in registry().live(stage):
            if unit.layout != one:
                step(f"split {unit}->{one}", split(stage, unit, one))
        by_rank = {u.gpus[0]: u for u in registry().live(stage)}
        schema = registry().schema(stage)
        for r in range(0, world, 2):
            label = f"merge ranks {r},{r + 1}->{Layout(1, 2)}"
            step(label, merge(stage, [by_rank[r], by_rank[r + 1]], Layout(1, 2), schema=schema))
        err = _logits_error(stage, config, model, dev)
        checks.add(f"state/{kind}/pp2 units/logits", err <= tol, {"max_rel_err": err, "tol": tol})
        m, _ = step(
            f"merge all->{big}", merge(stage, registry().live(stage), big, schema=schema), logits=True
        )
        live = registry().live(stage)
        checks.add(f"state/{kind}/final units", live == (m.target,), [str(u) for u in live])
    registry().clear()


# ---- 2. PPO run with TP and DP changes ------------------------------------------------------------------


def ppo_plans(world: int):
    """P0 (DP over all ranks), P1 (training TP 2, DP halved), P2
    (actor training DP 1, critic training PP 2).
    """
    from nereus_lightning.control import data_parallel_plan
    from nereus_lightning.plan.layout import Candidate, Layout, Plan

    ranks = tuple(range(world))
    p0 = data_parallel_plan("ppo", ranks)
    tp2 = Candidate(Layout(2, 1), world // 2, ranks)
    p1 = Plan.of(
        {name: (tp2 if name in ("actor_gen", "actor_train", "critic_train") else c) for name, c in p0.items()}
    )
    changes = {
        "actor_train": Candidate(Layout(2, 1), 1, (world - 2, world - 1)),
        "critic_train": Candidate(Layout(1, 2), world // 2, ranks),
    }
    p2 = Plan.of({name: changes.get(name, c) for name, c in p1.items()})
    return p0, p1, p2


def ppo_run(checks: Checks, dev: torch.device, steps: int, tol: float) -> dict[str, Any]:
    """Three RL steps under changing plans beside a reference that keeps P0."""
    from nereus_lightning.lightning import NereusStrategy, PPOModule
    from nereus_lightning.rl.tasks import DenseRepeatTask

    world = dist.get_world_size()
    p0, p1, p2 = ppo_plans(world)
    schedule = [p0, p1, p2][:steps] + [p2] * max(0, steps - 3)

    def describe(plan) -> dict[str, str]:  # noqa: ANN001
        return {n: f"dp{c.dp} x tp{c.layout.tp} pp{c.layout.pp} on {list(c.gpus)}" for n, c in plan.items()}

    def run(plans) -> tuple[list[dict[str, float]], Any, float]:  # noqa: ANN001
        torch.manual_seed(0)
        module = PPOModule(
            task=DenseRepeatTask(start_len=3, max_len=6, grow_every=2, seed=0), prompts_per_step=8, seed=3
        )
        module.to(dev)
        opt = module.configure_optimizers()
        strategy = NereusStrategy.without_trainer(module)
        t0 = time.perf_counter()
        metrics = []
        for i, plan in enumerate(plans):
            strategy.transition(plan)
            metrics.append(module.rl_step(i, strategy, opt))
        seconds = time.perf_counter() - t0
        # the logical state, gathered from the EMUs (checks every replica against the others)
        from nereus_lightning.emu import gather_logical_state

        named = []
        for stage in ("actor_train", "critic_train"):
            state = gather_logical_state(stage, dst=0)
            named += [(f"{stage}.{n}", p) for n, p in state.params.items()] if state is not None else []
        flat = torch.cat([p.detach().reshape(-1).cpu() for _, p in named]) if named else torch.zeros(0)
        bad = [n for n, p in named if not p.detach().isfinite().all()]
        return metrics, flat, seconds, bad

    ref_metrics, ref_params, ref_s, ref_bad = run([p0] * len(schedule))
    metrics, params, seconds, bad = run(schedule)
    checks.add("ppo/parameters finite", not bad and not ref_bad, {"elastic": bad[:5], "static": ref_bad[:5]})
    keys = ("actor/pg_loss", "critic/vf_loss", "critic/score/mean")
    worst = 0.0
    for a, b in zip(ref_metrics, metrics, strict=True):
        for k in keys:
            worst = max(worst, abs(a[k] - b[k]) / max(1.0, abs(a[k])))
    checks.add("ppo/metrics match the static-plan run", worst <= tol, {"max_rel_diff": worst, "tol": tol})
    same_shape = params.shape == ref_params.shape and params.numel() > 0
    rel = (
        float((params.double() - ref_params.double()).norm() / ref_params.double().norm())
        if same_shape
        else -1.0
    )
    checks.add(
        "ppo/parameters match the static-plan run",
        dist.get_rank() != 0 or 0 <= rel <= tol,
        {"rel_diff": rel, "tol": tol},
    )
    rank0 = dist.get_rank() == 0
    checks.add(
        "ppo/replicas agree (gather_logical_state)",
        not rank0 or params.numel() > 0,
        {"numel": params.numel()},
    )
    finite = all(v == v and abs(v) != float("inf") for m in metrics for v in m.values())
    checks.add("ppo/metrics finite", finite, None)
    tp_change = any(
        a[n].layout.tp != b[n].layout.tp
        for a, b in zip(schedule, schedule[1:], strict=False)
        for n, _ in a.items()
    )
    dp_change = any(
        a[n].dp != b[n].dp for a, b in zip(schedule, schedule[1:], strict=False) for n, _ in a.items()
    )
    checks.add("ppo/run has a TP change and a DP change", tp_change and dp_change, None)
    return {
        "plans": [describe(p) for p in schedule],
        "metrics": [{k: m[k] for k in (*keys, "response_length/mean", "timing_s/step")} for m in metrics],
        "reference_metrics": [{k: m[k] for k in keys} for m in ref_metrics],
        "seconds": seconds,
        "reference_seconds": ref_s,
    }


# ---- 3. timing of Extend, Merge and Split ---------------------------------------------------------------


def timing_model(quick: bool) -> Any:
    """The timed model's ModelSpec (fp32): Llama-3.1-8B, or a Llama of a few MB with --quick."""
    from nereus_lightning.spec import MODEL_PRESETS
    from nereus_lightning.spec.model import ModelSpec

    if quick:
        spec = ModelSpec("small-llama", 4, 256, 8, 4, 2048, 512, dtype="float32")
    else:
        spec = replace(MODEL_PRESETS["llama3_8b"], dtype="float32")
    return spec


def hf_config(spec: Any):
    """The transformers LlamaConfig of a ModelSpec (shapes only); a value model's config names
    ``LlamaForTokenClassification``, as ``lightning.roles.build_value_model`` marks a critic."""
    from transformers import LlamaConfig

    value = {"num_labels": spec.num_labels, "architectures": ["LlamaForTokenClassification"]}
    return LlamaConfig(
        hidden_size=spec.hidden,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_kv_heads,
        vocab_size=spec.vocab,
        tie_word_embeddings=spec.tie_embeddings,
        max_position_embeddings=4096,
        **(value if spec.num_labels else {}),
    )


def timing_setup(world: int, spec: Any, gpu_memory: float | None) -> tuple[Any, tuple[str, ...], int, str]:
    """Model (layers cut if a unit would not fit), the timed model-stages, the unit TP degree, and a note.

    N = 8: actor and critic, TP 2 units, 4 -> 8 GPUs (the paper's case). Fewer GPUs: the stages
    and TP that fit the half-world; an Extend needs the shard and one packed copy of it per GPU.
    """
    n_from = world // 2
    tp = 2 if gpu_memory is not None and n_from >= 2 else 1
    stages = ("actor_train", "critic_train")[: max(1, n_from // tp)]
    note = []
    if gpu_memory is not None:
        while 2 * 12 * spec.num_params / tp > 0.85 * gpu_memory and spec.num_layers > 1:
            spec = replace(spec, num_layers=spec.num_layers // 2, name=spec.name + " (half layers)")
        if "half" in spec.name:
            note.append(f"layers cut to {spec.num_layers} to fit one GPU")
    if len(stages) < 2:
        note.append("actor only (the critic does not fit the half-world)")
    return spec, stages, tp, "; ".join(note)


def doubling_plans(stages: tuple[str, ...], tp: int, n_from: int):
    """(start, doubled, merged): one TP-``tp`` unit per stage on ``n_from`` GPUs; + a copy on the next
    ``n_from``; merged to TP 2tp.
    """
    from nereus_lightning.plan.layout import Candidate, Layout, Plan

    start, doubled, merged = {}, {}, {}
    for i, name in enumerate(stages):
        gpus = tuple(range(i * tp, (i + 1) * tp))
        both = gpus + tuple(g + n_from for g in gpus)
        start[name] = Candidate(Layout(tp, 1), 1, gpus)
        doubled[name] = Candidate(Layout(tp, 1), 2, both)
        merged[name] = Candidate(Layout(2 * tp, 1), 1, both)
    return Plan.of(start), Plan.of(doubled), Plan.of(merged)


def random_units(plan: Any, specs: dict[str, Any], dev: torch.device) -> int:
    """Live units of ``plan`` with random training state (no model needed), each model-stage of its
    ModelSpec in ``specs``; returns this rank's bytes."""
    from nereus_lightning.emu import EMU, Counters, StateSchema, Unit, registry

    rank = dist.get_rank()
    registry().clear()
    held = 0
    gen = torch.Generator(device=dev).manual_seed(1000 + rank)
    for i, (name, cand) in enumerate(plan.items()):
        schema = StateSchema.of(hf_config(specs[name]))  # shapes from a meta-device model
        schema = replace(schema, dtypes=("float32",) * len(schema.names))
        registry().declare(name, schema, True)
        unit = Unit(cand.layout, cand.replica_gpus(0))
        emu = None
        if rank in unit.gpus:
            emu = EMU.empty(name, schema, unit, rank, trains=True, device=dev)
            emu.counters = Counters(3, 3, 2, 1, 96, seed=7 + i)
            for _, key, t in emu.tensors():
                if key == "step":
                    t.fill_(3.0)
                elif key == "exp_avg_sq":
                    t.uniform_(0, 1, generator=gen)
                else:
                    t.normal_(generator=gen)
            held += emu.nbytes()
        registry().add(name, unit, emu)
    return held


def timed_dag(dag: Any, dev: torch.device) -> tuple[float, Any]:
    """Wall seconds of ``execute_dag(dag)`` between barriers (max over ranks), and the reduced report."""
    from nereus_lightning.emu.executor import execute_dag

    sync(dev)
    t0 = time.perf_counter()
    report = execute_dag(dag)
    sync(dev)
    seconds = time.perf_counter() - t0
    return max(gathered(seconds)), report.reduce()


def transition_timing(checks: Checks, dev: torch.device, quick: bool, repeats: int) -> dict[str, Any]:
    """Extend, Merge, Split ``repeats`` times from a fresh random state; measured vs ``L_tran``."""
    from nereus_lightning.emu import gather_logical_state, registry
    from nereus_lightning.lightning.transition_runner import (
        dag_rank_sets,
    )  # the executor's rank sets per node
    from nereus_lightning.models.groups import prepare_groups
    from nereus_lightning.spec import CLUSTER_PRESETS, Workload
    from nereus_lightning.spec.errors import InfeasiblePlanError
    from nereus_lightning.transition import build_transition
    from nereus_lightning.transition.scenarios import default_models

    world = dist.get_world_size()
    gpu_memory = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
    spec, stages, tp, note = timing_setup(world, timing_model(quick or dev.type == "cpu"), gpu_memory)
    n_from = len(stages) * tp
    start, doubled, merged = doubling_plans(stages, tp, n_from)
    cluster = (CLUSTER_PRESETS["h200x8"] if dev.type == "cuda" else CLUSTER_PRESETS["cpu4"]).with_gpus(world)
    work = Workload("ppo")
    models = default_models(spec)  # the critic a value model, as the body builds it
    mixed = replace(spec, dtype="bfloat16")  # bf16 weights + fp32 master + fp32 moments: 14 B/param
    pairs = {
        f"Extend {n_from}->{2 * n_from} GPUs": (start, doubled),
        f"Merge TP{tp}x2->TP{2 * tp}": (doubled, merged),
        f"Split TP{2 * tp}->TP{tp}x2": (merged, doubled),
    }
    dags: dict[str, Any] = {}
    infeasible: dict[str, str] = {}
    for key, (a, b) in pairs.items():
        try:
            dags[key] = build_transition(a, b, models, cluster, work)
        except InfeasiblePlanError as exc:  # the brain refuses it (memory): say so, time the others
            infeasible[key] = str(exc)
    mixed_cost = {k: build_transition(*pairs[k], default_models(mixed), cluster, work).cost for k in dags}
    samples: dict[str, list[float]] = {k: [] for k in dags}
    reports: dict[str, Any] = {}
    held, first, small = 0, {}, spec.num_params * 12 * len(stages) < 2e9
    specs = {ms.name: models[ms.model] for ms in work.stages}
    for repeat in range(repeats):
        # Every cycle starts from the same random state (same seeds), so a cycle need not end where it began.
        held = random_units(start, specs, dev)
        if repeat == 0:
            first = {name: gather_logical_state(name, dst=0) for name in stages} if small else {}
            prepare_groups([r for dag in dags.values() for r in dag_rank_sets(dag)])
        for key, dag in dags.items():
            seconds, reports[key] = timed_dag(dag, dev)
            samples[key].append(seconds)
    if small:  # the random state went through every transition unchanged
        for name in stages:
            after = gather_logical_state(name, dst=0)
            diff = first[name].differences(after) if dist.get_rank() == 0 else []
            checks.add(f"timing/{name} state unchanged after {repeats} cycles", not diff, diff[:5])
    last = pairs[list(dags)[-1]][1] if dags else start
    live_ok = all(len(registry().live(n)) == last[n].dp for n in stages)
    checks.add("timing/live units match the last target plan", live_ok, None)
    registry().clear()  # free the timed state before the other parts
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    rows: list[dict[str, Any]] = [{"transition": k, "infeasible": msg} for k, msg in infeasible.items()]
    for key, dag in dags.items():
        warm = samples[key][1:] or samples[key]
        measured = statistics.median(warm)
        rows.append(
            {
                "transition": key,
                "model_stages": list(stages),
                "nodes": [f"{n.op.value} {n.model_stage}" for n in dag.nodes],
                "gb_moved_predicted": dag.total_bytes / 1e9,
                "gb_moved_measured": sum(r.measured_bytes for r in reports[key].records) / 1e9,
                "first_s": samples[key][0],
                "median_s": measured,
                "samples_s": samples[key],
                "node_seconds": [r.fastest_seconds for r in reports[key].records],
                "l_tran_s": dag.cost,
                "l_tran_error_pct": 100.0 * (dag.cost - measured) / measured,
                "l_tran_bf16_mixed_s": mixed_cost[key],
                "paper_s": PAPER_EXTEND_4_TO_8_S if key.startswith("Extend 4->8") else None,
            }
        )
    return {
        "model": spec.name,
        "params_per_model": spec.num_params,
        "state_bytes_per_param": 12,
        "tp": tp,
        "stages": list(stages),
        "cluster": cluster.name,
        "repeats": repeats,
        "state_bytes_this_rank": held,
        "note": note,
        "rows": rows,
    }


def print_table(timing: dict[str, Any]) -> None:
    """The timing rows beside the brain's prediction and the paper."""
    print(
        f"\nTransition timing: {timing['model']} ({timing['params_per_model'] / 1e9:.2f} B params per "
        "model), "
        f"{'+'.join(timing['stages'])}, fp32 params + AdamW moments (12 B/param), "
        f"cluster model {timing['cluster']!r}"
    )
    if timing["note"]:
        print(f"  note: {timing['note']}")
    head = (
        f"{'transition':24} {'GB':>7} {'first s':>8} {'median s':>9} {'L_tran s':>9} {'error %':>8} "
        f"{'L_tran bf16 s':>13} {'paper s':>8}"
    )
    print(head)
    for r in timing["rows"]:
        if "infeasible" in r:
            print(f"{r['transition']:24} not timed: the brain calls it infeasible: {r['infeasible'][:150]}")
            continue
        paper = f"{r['paper_s']:8.2f}" if r["paper_s"] is not None else f"{'-':>8}"
        print(
            f"{r['transition']:24} {r['gb_moved_measured']:7.2f} {r['first_s']:8.3f} {r['median_s']:9.3f} "
            f"{r['l_tran_s']:9.3f} {r['l_tran_error_pct']:8.1f} {r['l_tran_bf16_mixed_s']:13.3f} {paper}"
        )
    print(
        "  first = first run (includes communicator creation); median = median of the later runs; error = "
        "(L_tran - median) / median;\n  L_tran bf16 = the brain's price of the paper's state "
        "(bf16 weights + fp32 master + moments, 14 B/param). Paper Split/Merge (8B, 8-64 GPUs): "
        f"{PAPER_SPLIT_MERGE_S[0]}-{PAPER_SPLIT_MERGE_S[1]} s."
    )


# ---- main -----------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> dict:
    """Run the three parts on the torchrun world; rank 0 prints and
    writes the JSON (returned on every rank).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=None, help="JSON path (default benchmarks/results/multigpu_nccl_<N>.json)"
    )
    parser.add_argument(
        "--quick", action="store_true", help="small timed model and 2 repeats (CPU smoke run)"
    )
    parser.add_argument("--repeats", type=int, default=None, help="timed cycles (default 5, --quick 2)")
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=("emu", "ppo", "timing"), help="parts to skip"
    )
    args = parser.parse_args(argv)
    dev = init(args.device)
    rank, world = dist.get_rank(), dist.get_world_size()
    out = Path(args.out) if args.out else RESULTS / f"multigpu_nccl_{world}.json"
    tol = 1e-5 if dev.type == "cpu" else 1e-4
    result: dict[str, Any] = {
        "world": world,
        "backend": dist.get_backend(),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "env": {k: os.environ.get(k) for k in NVLS_ENV},
        "torch": torch.__version__,
        "quick": args.quick,
        "seconds": {},
    }
    checks = Checks()

    def save() -> None:
        result["checks"] = checks.rows
        result["all_passed"] = bool(checks.rows) and all(c["passed"] for c in checks.rows)
        if rank == 0:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=2, default=str))

    # Order matters on gloo: a member-only group (models.groups.member_group) hangs once the ranks
    # are members of unequal numbers of world-made groups (models.replica_groups of replicas that
    # do not cover the world symmetrically; see the models.groups module docstring).
    # The timing prepares its groups; the state chain's are symmetric; both run before the rest.
    parts = {
        "timing": lambda: result.__setitem__(
            "timing", transition_timing(checks, dev, args.quick, args.repeats or (2 if args.quick else 5))
        ),
        "emu": lambda: (state_chain(checks, dev, tol), forward_equivalence(checks, dev, tol)),
        "ppo": lambda: result.__setitem__(
            "ppo", ppo_run(checks, dev, 3, 1e-5 if dev.type == "cpu" else 1e-3)
        ),
    }
    for name, part in parts.items():
        if name in args.skip:
            continue
        t0 = time.perf_counter()
        part()
        result["seconds"][name] = time.perf_counter() - t0
        save()  # what passed so far survives a later failure
    if rank == 0:
        failed = [c["name"] for c in checks.rows if not c["passed"]]
        print(
            f"\n{result['backend']} x {world} ({result['device']}): {len(checks.rows)} checks, {len(failed)} "
            "failed"
        )
        for name in failed:
            print(f"  FAILED {name}")
        if "ppo" in result:
            print(
                f"PPO: {len(result['ppo']['plans'])} steps in {result['ppo']['seconds']:.1f} s "
                "(TP and DP changes)"
            )
        if "timing" in result:
            print_table(result["timing"])
        print(f"JSON: {out}")
    dist.barrier()
    dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
