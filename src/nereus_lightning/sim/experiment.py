"""One call from plain settings (a Hydra config, a notebook) to a finished comparison on disk."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from nereus_lightning.control.backend import PlannerBackend
from nereus_lightning.control.controller import ControllerConfig
from nereus_lightning.plan.calibration import Calibration
from nereus_lightning.plan.planner import job_models
from nereus_lightning.sim.machine import TRUE_EFFICIENCY, TrueMachine
from nereus_lightning.sim.policies import PolicySpec
from nereus_lightning.sim.report import format_table, plot_comparison, plot_gamma_sweep, write_csv
from nereus_lightning.sim.simulator import Comparison, compare, gamma_sweep
from nereus_lightning.sim.trace import DriftTrace, build_trace
from nereus_lightning.spec.cluster import ClusterSpec, cluster_preset
from nereus_lightning.spec.errors import NereusConfigError
from nereus_lightning.spec.model import ModelSpec, model_preset
from nereus_lightning.spec.workload import Workload


@dataclass
class Setup:
    """Everything a simulation runs on: planner backend, cluster, workload and the true machine."""

    backend: PlannerBackend
    cluster: ClusterSpec
    workload: Workload
    machine: TrueMachine


def make_setup(
    model: str | ModelSpec = "llama3_8b",
    cluster: str | ClusterSpec = "paper_cluster2",
    workload: Mapping[str, Any] | Workload | None = None,
    noise: float = 0.03,
    transition_factor: float = 1.25,
    restart_s: float = 300.0,
    seed: int = 0,
    efficiency: Mapping[str, float] | None = None,
    alternatives: int = 4,
) -> Setup:
    """Build a :class:`Setup` from preset names and plain numbers."""
    spec = model_preset(model) if isinstance(model, str) else model
    clus = cluster_preset(cluster) if isinstance(cluster, str) else cluster
    if workload is None or isinstance(workload, Mapping):
        known = {f.name for f in fields(Workload)}
        unknown = set(workload or {}) - known
        if unknown:
            raise NereusConfigError(f"workload: unknown fields {sorted(unknown)}; known: {sorted(known)}")
        work = Workload(**dict(workload or {}))
    else:
        work = workload
    # Policies are compared on speed: the machine knows every plan's true memory, so no plan needs
    # the real planner's headroom (its lean rule).
    backend = PlannerBackend(job_models(spec), alternatives=alternatives, step_tolerance=0.0)
    truth = Calibration({**TRUE_EFFICIENCY, **dict(efficiency or {})})
    machine = TrueMachine(
        backend, truth, noise=noise, transition_factor=transition_factor, restart_s=restart_s, seed=seed
    )
    return Setup(backend, clus, work, machine)


def trace_from_config(cfg: Mapping[str, Any]) -> DriftTrace:
    """A trace from ``path`` (a saved DriftTrace) or from :func:`build_trace` arguments."""
    args = dict(cfg)
    path = args.pop("path", None)
    if path:
        return DriftTrace.load(path)
    for key in ("mean", "p95"):
        if args.get(key) is not None:
            args[key] = tuple(float(x) for x in args[key])
    return build_trace(**args)


def controller_config(cfg: Mapping[str, Any] | None) -> ControllerConfig:
    """A ControllerConfig from a mapping, naming unknown keys."""
    known = {f.name for f in fields(ControllerConfig)}
    unknown = set(cfg or {}) - known
    if unknown:
        raise NereusConfigError(f"controller: unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return ControllerConfig(**dict(cfg or {}))


def run_experiment(
    setup: Setup,
    trace: DriftTrace,
    policies: Sequence[str | PolicySpec],
    controller: ControllerConfig | None = None,
    out_dir: str | None = None,
    gammas: Sequence[float] | None = None,
    plot: bool = True,
    notice: bool = True,
    oracle_tolerance: float = 0.0,
) -> dict[str, Any]:
    """Compare ``policies`` on ``trace``; write CSV, table, JSON, decision logs and plots to ``out_dir``."""
    specs = [p if isinstance(p, PolicySpec) else PolicySpec.parse(str(p)) for p in policies]
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
    comparison: Comparison = compare(
        trace,
        specs,
        setup.backend,
        setup.cluster,
        setup.workload,
        setup.machine,
        Calibration,
        controller,
        log_dir=out_dir,
        notice=notice,
        oracle_tolerance=oracle_tolerance,
    )
    table = format_table(list(comparison.summaries.values()), title=trace.name)
    result: dict[str, Any] = {
        "trace": trace.name,
        "steps": len(trace),
        "table": comparison.table(),
        "text": table,
    }
    if gammas:
        rows = gamma_sweep(
            trace,
            gammas,
            setup.backend,
            setup.cluster,
            setup.workload,
            setup.machine,
            Calibration,
            controller,
            oracle=comparison.records["oracle"],
            notice=notice,
        )
        best = min(rows, key=lambda r: r["mean_step_s"])
        result["gamma_sweep"] = rows
        result["best_gamma"] = best["gamma"]
    if out_dir:
        write_csv(
            os.path.join(out_dir, "steps.csv"), [r for recs in comparison.records.values() for r in recs]
        )
        with open(os.path.join(out_dir, "summary.md"), "w") as f:
            f.write(table + "\n")
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump({k: v for k, v in result.items() if k != "text"}, f, indent=1)
        if plot:
            result["plot"] = os.path.join(out_dir, "steps.png")
            plot_comparison(comparison, result["plot"])
            if gammas:
                result["gamma_plot"] = os.path.join(out_dir, "gamma_sweep.png")
                plot_gamma_sweep(result["gamma_sweep"], result["gamma_plot"])
    result["comparison"] = comparison
    return result
