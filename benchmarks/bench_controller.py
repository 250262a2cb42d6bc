"""Controller overhead and policy comparisons.

Default run (a couple of minutes on one core):
- one replan with admission at 1,024 GPUs (Llama-3.1-8B PPO on paper_cluster1): a drift trigger
  and a revocation (urgent) trigger; target < 200 ms each;
- the per-step cost of ``Controller.step`` when no trigger fires; target < 1 ms;
- the paper's 25-step drift trace (paper_cluster2, 8-32 GPUs): the policy table, Nereus' margin
  over the best non-oracle policy, a gamma sweep, and an ablation of Nereus' target choice
  (net-benefit selection and pinned training layouts each switched off alone; the optional
  length forecast switched on).
``--long`` adds the 1,000-step traces (64 ... 1,024 GPUs, each shipped spot trace; static,
every-10-steps, Nereus and the oracle, plus the same ablation; a few minutes each on one core);
``--long-always`` adds always-switch to them (it re-plans every step: much slower).

Usage: ``python benchmarks/bench_controller.py [--long | --long-always] [--skip-paper] [--repeats N]
[--jobs N]`` (``--jobs`` runs the long traces in parallel processes).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict
from pathlib import Path

from nereus_lightning.control import Controller, ControllerConfig, PlannerBackend, StepSignals
from nereus_lightning.control.decision import DecisionLog
from nereus_lightning.plan import Calibration, job_models
from nereus_lightning.sim.experiment import make_setup, run_experiment
from nereus_lightning.sim.policies import ControllerPolicy
from nereus_lightning.sim.simulator import simulate, summarise
from nereus_lightning.sim.trace import SPOT_TRACES, long_trace, paper_trace
from nereus_lightning.spec import CLUSTER_PRESETS, MODEL_PRESETS, Workload

RESULTS = Path(__file__).resolve().parent / "results"
GAMMAS = (0.0, 0.1, 0.25, 0.4, 0.5, 0.65, 0.8, 1.0, 2.0, 5.0)


def _signals(step: int, length: float, gpus: int, draining: int = 0) -> StepSignals:
    return StepSignals(
        step, length, 1.15 * length, 512, tuple(range(gpus)), draining=tuple(range(gpus, gpus + draining))
    )


def replan_times(repeats: int) -> dict[str, float]:
    """Median wall and CPU seconds of one replan (planner + admission + DAG costs) at 1,024 GPUs.

    CPU time (``time.process_time``) is reported beside wall time because shared machines
    time-slice this single-threaded work: the CPU time is what the controller costs.
    """
    backend = PlannerBackend(job_models(MODEL_PRESETS["llama3_8b"]))
    cluster = CLUSTER_PRESETS["paper_cluster1"]
    out: dict[str, list[float]] = {
        k: []
        for k in ("drift", "drift_cpu", "revocation", "revocation_cpu", "no_trigger", "no_trigger_retune")
    }

    def timed(key: str, fn):
        wall, cpu = time.perf_counter(), time.process_time()
        result = fn()
        out[key].append(time.perf_counter() - wall)
        out[f"{key}_cpu"].append(time.process_time() - cpu)
        return result

    for r in range(repeats):
        # Quiet checks off: the last loop times the steps where nothing fires.
        cfg = ControllerConfig(quiet_check_every=0)
        ctl = Controller(backend, cluster, Workload(), cfg, calibration=Calibration())
        ctl.step(_signals(0, 4000.0, 1024))  # initial plan (not timed)
        ctl.step(_signals(1, 4000.0, 1024))
        # +50%: drift trigger
        d = timed("drift", lambda r=r, ctl=ctl: ctl.step(_signals(2, 6000.0 + r, 1024)))
        assert d.kind in ("keep", "transition", "restart"), d
        d = timed("revocation", lambda r=r, ctl=ctl: ctl.step(_signals(3, 6000.0 + r, 960, draining=64)))
        assert d.urgent, d
        steps = 2000
        quiet = [_signals(4 + s, 6000.0 + r + (s % 7), 960) for s in range(steps)]  # tiny jitter: no trigger
        t = time.process_time()
        for sig in quiet:
            d = ctl.step(sig)
        out["no_trigger"].append((time.process_time() - t) / steps)
        assert d.kind == "none", d
        # Lengths moving 2% a step (under the drift threshold): each step looks at a retune.
        steps = 10
        moving = [_signals(5000 + s, 6000.0 * (1.02 if s % 2 else 0.98) + r, 960) for s in range(steps)]
        t = time.process_time()
        for sig in moving:
            d = ctl.step(sig)
        out["no_trigger_retune"].append((time.process_time() - t) / steps)
        assert not d.triggers or d.triggers[0].kind == "retune", d
    return {k: statistics.median(v) for k, v in out.items()}


PAPER_POLICIES = ("static", "always", "every_k:3", "nereus:0.5", "oracle")
LONG_POLICIES = ("static", "every_k:10", "nereus:0.5", "oracle")


#: Nereus with one lever of its target choice switched off at a time (ControllerConfig changes).
ABLATIONS = {
    "nereus without net-benefit selection (first admitted target)": {"selection": "first"},
    "nereus with the length forecast (one step ahead)": {"forecast_steps": 1.0},
    "nereus without pinned training layouts": {"pin_training": False},
    "nereus without retuning micro-batches between replans": {"retune": False},
}


def policy_table(
    trace,
    setup_kwargs,
    policies=PAPER_POLICIES,
    gammas=None,
    out_dir=None,
    oracle_tolerance=0.0,
    ablation=True,
) -> dict:
    """Run ``policies`` on ``trace``; return the summary rows, Nereus' margin, the gamma sweep and the
    ablation.
    """
    setup = make_setup(**setup_kwargs)
    res = run_experiment(
        setup,
        trace,
        list(policies),
        out_dir=out_dir,
        gammas=gammas,
        plot=out_dir is not None,
        oracle_tolerance=oracle_tolerance,
    )
    print(res["text"])
    out = {k: v for k, v in res.items() if k not in ("comparison", "text")}
    for key in ("plot", "gamma_plot"):  # recorded relative to the repository, not this machine's paths
        if key in out:
            out[key] = os.path.relpath(out[key], RESULTS.parent.parent)
    rows = {r["policy"]: r for r in out["table"]}
    nereus = rows.get("nereus(gamma=0.5)")
    others = [r for name, r in rows.items() if name not in ("oracle", "nereus(gamma=0.5)")]
    if nereus and others:
        runner_up = min(others, key=lambda r: r["mean_step_s"])
        margin = runner_up["mean_step_s"] - nereus["mean_step_s"]
        out["nereus_margin"] = {
            "runner_up": runner_up["policy"],
            "s_per_step": margin,
            "relative": margin / runner_up["mean_step_s"],
        }
        print(
            f"Nereus vs the best non-oracle policy ({runner_up['policy']}): {margin:+.2f} s/step "
            f"({margin / runner_up['mean_step_s']:+.2%})"
        )
    if gammas:
        print(
            "gamma sweep:",
            ", ".join(
                f"{r['gamma']:g}: {r['mean_step_s']:.2f} s ({r['transitions']})" for r in res["gamma_sweep"]
            ),
            "| best",
            res["best_gamma"],
        )
    if ablation:
        oracle = res["comparison"].records["oracle"]
        out["ablation"] = [
            asdict(summarise(run_variant(setup, trace, name, changes, out_dir), oracle))
            for name, changes in ABLATIONS.items()
        ]
        for r in out["ablation"]:
            print(
                f"  {r['policy']}: {r['mean_step_s']:.2f} s/step, {r['transitions']} transitions, "
                f"{r['restarts']} restarts"
            )
    return out


def _policy_table_args(args: tuple) -> dict:
    trace, setup_kwargs, policies, gammas, out_dir, tolerance = args
    return policy_table(
        trace, setup_kwargs, policies, gammas=gammas, out_dir=out_dir, oracle_tolerance=tolerance
    )


def run_variant(setup, trace, name: str, changes: dict, out_dir: str | None = None):
    """Nereus(gamma=0.5) with ``changes`` to its ControllerConfig, replayed on ``trace``."""
    log = None
    if out_dir:
        slug = "".join(ch if ch.isalnum() else "_" for ch in name)
        log = DecisionLog(f"{out_dir}/decisions_{slug}.jsonl")
        Path(log.path).unlink(missing_ok=True)
    ctl = Controller(
        setup.backend,
        setup.cluster,
        setup.workload,
        ControllerConfig(**changes),
        calibration=Calibration(),
        log=log,
    )
    return simulate(
        ControllerPolicy(name, ctl), trace, setup.machine, setup.backend, setup.cluster, setup.workload
    )


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark; print tables; write benchmarks/results/controller.json."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--long", action="store_true", help="also run the 1,000-step traces (slow)")
    parser.add_argument(
        "--long-always", action="store_true", help="add always-switch to the long runs (very slow)"
    )
    parser.add_argument(
        "--skip-paper", action="store_true", help="skip the 25-step trace and its gamma sweep"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=1, help="processes for the long traces (one trace each)")
    parser.add_argument("--out", default=str(RESULTS / "controller"), help="folder for CSV/PNG outputs")
    args = parser.parse_args(argv)
    result: dict = {}
    times = replan_times(args.repeats)
    result["overhead"] = {
        "replan_drift_1024_ms": times["drift"] * 1e3,
        "replan_drift_1024_cpu_ms": times["drift_cpu"] * 1e3,
        "replan_revocation_1024_ms": times["revocation"] * 1e3,
        "replan_revocation_1024_cpu_ms": times["revocation_cpu"] * 1e3,
        "step_no_trigger_cpu_ms": times["no_trigger"] * 1e3,
        "step_retune_960_cpu_ms": times["no_trigger_retune"] * 1e3,
        "targets_ms": {"replan": 200.0, "step_no_trigger": 1.0, "step_retune": 200.0},
    }
    print("| what | wall | CPU | target |\n|---|---|---|---|")
    print(
        f"| replan at 1,024 GPUs (drift) | {times['drift'] * 1e3:.1f} ms "
        f"| {times['drift_cpu'] * 1e3:.1f} ms | < 200 ms |"
    )
    print(
        f"| replan at 1,024 GPUs (revocation, urgent) | {times['revocation'] * 1e3:.1f} ms "
        f"| {times['revocation_cpu'] * 1e3:.1f} ms | < 200 ms |"
    )
    print(f"| Controller.step without a trigger | - | {times['no_trigger'] * 1e3:.3f} ms | < 1 ms |")
    print(
        f"| Controller.step without a trigger, lengths moved (a retune look, 960 GPUs) | - "
        f"| {times['no_trigger_retune'] * 1e3:.1f} ms | < 200 ms |"
    )
    paper = {"model": "llama3_8b", "cluster": "paper_cluster2", "workload": {"algorithm": "ppo"}}
    if not args.skip_paper:
        result["paper25"] = policy_table(paper_trace(), paper, gammas=GAMMAS, out_dir=f"{args.out}/paper25")
    if args.long or args.long_always:
        # The oracle re-plans when a length moved by 1% (not every step) to keep this tractable.
        big = {"model": "llama3_8b", "cluster": "paper_cluster1", "workload": {"algorithm": "ppo"}}
        policies = ("always", *LONG_POLICIES) if args.long_always else LONG_POLICIES
        runs = [
            (long_trace(supply), big, policies, None, f"{args.out}/long_{supply}", 0.01)
            for supply in SPOT_TRACES
        ]
        if args.jobs > 1:
            from concurrent.futures import ProcessPoolExecutor

            with ProcessPoolExecutor(max_workers=args.jobs) as pool:
                tables = list(pool.map(_policy_table_args, runs))
        else:
            tables = [_policy_table_args(run) for run in runs]
        for supply, table in zip(SPOT_TRACES, tables, strict=True):
            result[f"long1000_{supply}"] = table
    RESULTS.mkdir(exist_ok=True)
    name = (
        "controller_long.json" if (args.long or args.long_always) and args.skip_paper else "controller.json"
    )
    (RESULTS / name).write_text(json.dumps(result, indent=1, default=str))
    return result


if __name__ == "__main__":
    main()
