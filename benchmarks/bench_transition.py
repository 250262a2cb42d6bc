"""Transition DAGs: overlap coordination (Table 5), planning time, and L_tran against the paper.

Default run (about a minute on one core):
1. **Overlap coordination** (the paper's Table 5): random PPO plan pairs (Llama-3.1-8B, 8 to 256
   GPUs) per overlap kind; the global DAG's outcome (valid / reported infeasible / invalid, which
   must stay 0) beside the per-component baseline's (safe / GPU or memory conflict / wait cycle).
2. **Planning time**: ``build_transition`` (cache cleared) plus ``validate``, timed together, at
   32 ... 1,024 GPUs, for planner-made transitions (the plan for N/2 GPUs -> the plan for N GPUs,
   and a response-length drift 1,024 -> 4,096 tokens at N GPUs), colocated plans doubled or
   re-laid out, and random relocations. Medians of this process's CPU time (judged: other
   processes sharing the machine count least) and of wall time. Target <= 5 ms at 1,024 GPUs;
   the paper reports 1.22 ms.
3. **L_tran vs the paper**: doubling the GPUs of an actor + critic training job (Llama-3.1-8B) on
   ``paper_cluster3``, 4 -> 8 ... 32 -> 64, beside the paper's measured Extend times.

Usage: ``python benchmarks/bench_transition.py [--cases N] [--repeats N]``
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.spec import CLUSTER_PRESETS, MODEL_PRESETS, Workload
from nereus_lightning.spec.errors import InfeasiblePlanError
from nereus_lightning.transition import build_transition, clear_cache, per_component_baseline, validate
from nereus_lightning.transition.scenarios import OVERLAP_KINDS, default_models, random_case

RESULTS = Path(__file__).resolve().parent / "results"
PAPER_EXTEND_S = {4: 2.45, 8: 5.58, 16: 6.52, 32: 8.48}  # from N GPUs to 2N
PAPER_TABLE5 = "global 100% vs per-component 34-62% success"
TP1, TP2 = Layout(1, 1), Layout(2, 1)


def overlap_table(cases_per_kind: int, sizes: tuple[int, ...], seed: int = 0) -> dict[str, dict[str, float]]:
    """Success rates of the global DAG and of the per-component baseline per overlap kind."""
    rng = random.Random(seed)
    out: dict[str, dict[str, float]] = {}
    for kind in OVERLAP_KINDS:
        c = {
            "cases": 0,
            "global_valid": 0,
            "global_infeasible": 0,
            "global_invalid": 0,
            "baseline_ok": 0,
            "baseline_ok_when_feasible": 0,
            "baseline_conflict": 0,
            "baseline_wait_cycle": 0,
        }
        for i in range(cases_per_kind):
            case = random_case(rng, kind, sizes[i % len(sizes)])
            c["cases"] += 1
            feasible = False
            try:
                dag = build_transition(*case.args())
                if validate(dag).valid:
                    c["global_valid"] += 1
                    feasible = True
                else:
                    c["global_invalid"] += 1
            except InfeasiblePlanError:
                c["global_infeasible"] += 1
            base = per_component_baseline(*case.args())
            c["baseline_ok"] += base.ok
            c["baseline_ok_when_feasible"] += base.ok and feasible
            c["baseline_conflict"] += base.outcome == "conflict"
            c["baseline_wait_cycle"] += base.outcome == "wait cycle"
        c["global_success_pct"] = 100.0 * c["global_valid"] / max(1, c["global_valid"] + c["global_invalid"])
        c["baseline_success_pct_on_feasible"] = (
            100.0 * c["baseline_ok_when_feasible"] / max(1, c["global_valid"])
        )
        out[kind] = c
    return out


def _planner_plans(n: int):
    """Planner-made (current, target) pairs at ``n`` GPUs, or None if the planner is missing."""
    try:
        from nereus_lightning.plan.planner import job_models, plan_job
    except ImportError:  # pragma: no cover - the planner is another helper's work
        return None
    models = job_models(MODEL_PRESETS["llama3_8b"])
    cluster = CLUSTER_PRESETS["paper_cluster1"].with_gpus(n)
    work = Workload("ppo")
    drift = replace(work, response_len=4096, response_len_p95=0)
    half = plan_job(models, CLUSTER_PRESETS["paper_cluster1"].with_gpus(n // 2), work).plan
    full = plan_job(models, cluster, work).plan
    longer = plan_job(models, cluster, drift).plan
    return models, cluster, work, {"grow N/2->N": (half, full), "drift 1K->4K tokens": (full, longer)}


class Timing(NamedTuple):
    """Milliseconds of repeated runs: CPU time of this process (judged: other processes sharing
    the machine count least) and wall time, best and median."""

    cpu_best: float
    cpu_median: float
    wall_median: float


def _time(fn, repeats: int, setup=None) -> Timing:
    """Time ``fn()`` over ``repeats`` runs (``setup()`` runs untimed before each).

    CPU time is ``time.process_time`` and wall time ``time.perf_counter`` of the same runs; the
    garbage collector is off during the runs, as in ``timeit`` (one collection before them: a
    collection before every run would traverse every object this process holds, e.g. the overlap
    table's leftovers, and time the caches it flushes rather than the code).
    """
    cpu, wall = [], []
    gc.collect()
    gc.disable()
    try:
        for _ in range(repeats):
            if setup is not None:
                setup()  # e.g. empty the DAG cache: freeing the previous DAG is not construction
            t0, w0 = time.process_time(), time.perf_counter()
            fn()
            cpu.append(time.process_time() - t0)
            wall.append(time.perf_counter() - w0)
    finally:
        gc.enable()
    return Timing(1e3 * min(cpu), 1e3 * statistics.median(cpu), 1e3 * statistics.median(wall))


def planning_times(sizes: tuple[int, ...], repeats: int) -> list[dict[str, object]]:
    """Milliseconds of DAG construction and validation per scenario and size (CPU and wall)."""
    rows: list[dict[str, object]] = []
    for n in sizes:
        for name, args in _scenarios(n).items():
            row: dict[str, object] = {"gpus": n, "scenario": name}

            def build(args=args):
                return build_transition(*args)

            clear_cache()
            try:
                dag = build()
            except InfeasiblePlanError:
                t = _time(lambda: _swallow(build), repeats, setup=clear_cache)
                row.update(outcome="infeasible", **_fields("build", t), **_fields("total", t))
                rows.append(row)
                continue
            row.update(
                outcome="valid" if validate(dag).valid else "INVALID",
                nodes=len(dag.nodes),
                lanes=sum(n.width for n in dag.nodes),  # replica-level primitive calls
                resource_edges=dag.resource_edges,
            )
            b = _time(build, repeats, setup=clear_cache)
            v = _time(lambda dag=dag: validate(dag), repeats)
            both = _time(lambda: validate(build()), repeats, setup=clear_cache)
            c = _time(lambda args=args: build_transition(*args).cost, repeats, setup=clear_cache)
            row.update(
                **_fields("build", b),
                **_fields("validate", v),
                **_fields("total", both),  # build + validate, timed together
                cost_ms=c.cpu_median,
                l_tran_s=dag.cost,
            )
            rows.append(row)
    return rows


def _scenarios(n: int) -> dict[str, tuple]:
    """The (current, target, models, cluster, workload) of every timed scenario at ``n`` GPUs."""
    scenarios = {}
    planned = _planner_plans(n)
    if planned:
        models, cluster, work, pairs = planned
        for name, (a, b) in pairs.items():
            scenarios[name] = (a, b, models, cluster, work)
    models, cluster, work = (
        default_models(),
        CLUSTER_PRESETS["paper_cluster3"].with_gpus(n),
        Workload("ppo"),
    )
    scenarios["colocated: DP x2"] = (colocated_plan(n // 2), colocated_plan(n), models, cluster, work)
    relayout = colocated_plan(n, gen=Layout(1, 1), infer=Layout(2, 1), train=Layout(4, 1))
    scenarios["colocated: relayout"] = (colocated_plan(n), relayout, models, cluster, work)
    case = random_case(random.Random(n), "cross_model_cross_stage", n, slack=(1.5, 2.0))
    scenarios["random relocation"] = case.args()
    return scenarios


def _machine() -> str:
    """What the timings ran on: CPUs, load, Python."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    return f"{os.cpu_count()} CPUs, load average {load:.2f} at the end, Python {platform.python_version()}"


def _fields(name: str, t: Timing) -> dict[str, float]:
    """The JSON fields of one timing: ``<name>_ms`` (best CPU), ``_median_ms`` (CPU), ``_wall_median_ms``."""
    return {
        f"{name}_ms": t.cpu_best,
        f"{name}_median_ms": t.cpu_median,
        f"{name}_wall_median_ms": t.wall_median,
    }


def _swallow(fn) -> None:
    try:
        fn()
    except InfeasiblePlanError:
        pass


def colocated_plan(n: int, gen: Layout = TP2, infer: Layout = TP1, train: Layout = TP2) -> Plan:
    """A PPO plan on ``n`` GPUs (a multiple of 8) that time-shares every GPU between the stages.

    Each block of 8 GPUs holds the same pattern: generation on all 8; actor, reference, critic
    and reward inference on 2 each; actor and critic training on 4 each. ``colocated_plan(2n)``
    keeps every unit of ``colocated_plan(n)`` in place, so doubling is pure Extend.
    """
    blocks = range(0, n, 8)
    span = {
        "actor_gen": (0, 8, gen), "actor_infer": (0, 2, infer), "ref_infer": (2, 4, infer),
        "critic_infer": (4, 6, infer), "reward_infer": (6, 8, infer),
        "actor_train": (0, 4, train), "critic_train": (4, 8, train),
    }  # fmt: skip
    out = {}
    for name, (lo, hi, layout) in span.items():
        gpus = tuple(b + g for b in blocks for g in range(lo, hi))
        out[name] = Candidate(layout, len(gpus) // layout.size, gpus)
    return Plan.of(out)


def doubling_plan(n: int) -> Plan:
    """Actor and critic training on ``n`` GPUs, TP2 units; doubling keeps every unit in place.

    plan(2n) = plan(n) + the same pattern shifted by n GPUs, so going from n to 2n is pure
    Extend onto the new GPUs (new nodes once n >= 8), as in the paper's experiment.
    """
    actor, critic = [(0, 1)], [(2, 3)]
    size = 4
    while size < n:
        actor += [(a + size, b + size) for a, b in actor]
        critic += [(a + size, b + size) for a, b in critic]
        size *= 2
    flat = lambda units: tuple(g for u in units for g in u)  # noqa: E731
    return Plan.of(
        {
            "actor_train": Candidate(Layout(2, 1), len(actor), flat(actor)),
            "critic_train": Candidate(Layout(2, 1), len(critic), flat(critic)),
        }
    )


def paper_extend() -> list[dict[str, float]]:
    """Predicted L_tran for doubling an 8B actor + critic training job, beside the paper."""
    model = MODEL_PRESETS["llama3_8b"]
    cluster = CLUSTER_PRESETS["paper_cluster3"]
    work = Workload("ppo")
    rows = []
    for n, measured in PAPER_EXTEND_S.items():
        dag = build_transition(doubling_plan(n), doubling_plan(2 * n), default_models(model), cluster, work)
        assert validate(dag).valid
        # Sensitivity: the same moves for inference model-stages (bf16 weights only, 16 GB per replica).
        light = build_transition(
            _as_inference(doubling_plan(n)),
            _as_inference(doubling_plan(2 * n)),
            default_models(model),
            cluster,
            work,
        )
        rows.append(
            {
                "from_gpus": n,
                "to_gpus": 2 * n,
                "extends": sum(n.width for n in dag.nodes),  # replica-level Extends
                "nodes": len(dag.nodes),
                "gb_moved": dag.total_bytes / 1e9,
                "predicted_s": dag.cost,
                "predicted_weights_only_s": light.cost,
                "paper_s": measured,
            }
        )
    return rows


def _as_inference(plan: Plan) -> Plan:
    return Plan.of({name.replace("_train", "_infer"): cand for name, cand in plan.items()})


def main(argv: list[str] | None = None) -> dict:
    """Run the three benchmarks, print tables and write ``results/transition.json``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", type=int, default=40, help="random cases per overlap kind")
    parser.add_argument("--repeats", type=int, default=21, help="timing repeats (medians are reported)")
    args = parser.parse_args(argv)

    table = overlap_table(args.cases, (8, 16, 32, 64, 128, 256))
    print(f"\nOverlap coordination (Table 5; paper: {PAPER_TABLE5})")
    print(
        f"{'overlap kind':26} {'cases':>5} {'global ok':>9} {'infeas.':>7} {'invalid':>7} "
        f"{'global %':>8} {'baseline % (feasible)':>21} {'conflict':>8} {'wait cyc':>8}"
    )
    for kind, c in table.items():
        print(
            f"{kind:26} {c['cases']:5d} {c['global_valid']:9d} {c['global_infeasible']:7d} "
            f"{c['global_invalid']:7d} "
            f"{c['global_success_pct']:8.1f} {c['baseline_success_pct_on_feasible']:21.1f} "
            f"{c['baseline_conflict']:8d} {c['baseline_wait_cycle']:8d}"
        )

    timing = planning_times((32, 64, 128, 256, 512, 1024), args.repeats)
    print(
        "\nPlanning time: build_transition (DAG cache empty) + validate, timed together; medians of CPU and"
    )
    print(
        "wall ms over the repeats (CPU judged); target <= 5 ms at 1,024 GPUs, paper 1.22 ms. 'lanes': "
        "replica-level"
    )
    print("primitive calls carried by the nodes; 'cost': build_transition + L_tran, CPU median.")
    print(
        f"{'gpus':>5} {'scenario':22} {'outcome':10} {'nodes':>5} {'lanes':>5} {'edges':>5} {'build':>7} "
        f"{'validate':>8} {'total cpu':>9} {'total wall':>10} {'cost':>7}"
    )
    for r in timing:
        print(
            f"{r['gpus']:5d} {r['scenario']:22} {r['outcome']:10} {r.get('nodes', 0):5d} "
            f"{r.get('lanes', 0):5d} {r.get('resource_edges', 0):5d} {r['build_median_ms']:7.2f} "
            f"{r.get('validate_median_ms', 0.0):8.2f} "
            f"{r['total_median_ms']:9.2f} {r['total_wall_median_ms']:10.2f} {r.get('cost_ms', 0.0):7.2f}"
        )
    at_max = [r for r in timing if r["gpus"] == 1024]
    summary = {
        "target_ms": 5.0,
        "judged_by": "median process CPU time (time.process_time) of build + validate, timed together",
        "worst_cpu_median_ms_at_1024": max(r["total_median_ms"] for r in at_max),
        "worst_wall_median_ms_at_1024": max(r["total_wall_median_ms"] for r in at_max),
        "machine": _machine(),
    }
    summary["meets_target_at_1024"] = summary["worst_cpu_median_ms_at_1024"] <= summary["target_ms"]
    print(
        f"worst at 1,024 GPUs: {summary['worst_cpu_median_ms_at_1024']:.2f} ms CPU, "
        f"{summary['worst_wall_median_ms_at_1024']:.2f} ms wall (target 5 ms); {summary['machine']}"
    )

    extend = paper_extend()
    print(
        "\nL_tran of DP doubling (Extend), Llama-3.1-8B actor + critic training, paper_cluster3 (8 x H200 "
        "per node)"
    )
    print(
        f"{'GPUs':>8} {'extends':>7} {'GB moved':>9} {'predicted s':>11} "
        f"{'weights only s':>14} {'paper s':>8}"
    )
    for r in extend:
        print(
            f"{r['from_gpus']:>3} -> {r['to_gpus']:<3} {r['extends']:7d} {r['gb_moved']:9.0f} "
            f"{r['predicted_s']:11.2f} "
            f"{r['predicted_weights_only_s']:14.2f} {r['paper_s']:8.2f}"
        )
    print(
        "Assumptions: TP2 x PP1 units (the smallest TP that fits 8B training state in 127 GB), actor and "
        "critic"
    )
    print(
        "on disjoint GPUs, every existing unit stays in place and new units fill the new GPUs (new nodes "
        "from 8 on);"
    )
    print("Extend moves bf16 weights + fp32 master weights + AdamW moments (14 B/param, 112 GB per replica);")
    print(
        "NVLink 900 GB/s per GPU, one 25 GB/s HDR NIC per node shared by the node's transfers, 50 ms "
        "communicator"
    )
    print(
        "set-up per node, no process start-up, allocation or synchronisation overheads (the calibration "
        "learns those)."
    )

    result = {
        "overlap_table": table,
        "planning_time": timing,
        "planning_time_summary": summary,
        "paper_extend": extend,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "transition.json").write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
