"""`nereus-plan`: the fastest DP/TP/PP plan of an RL job per model-stage, without any GPU.

Example::

    nereus-plan model=llama3_8b cluster=paper_cluster2 cluster.num_gpus=16 workload.response_len=4096
    nereus-plan model=qwen3_14b cluster=h200x8 algorithm=grpo output.json=plan.json
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
from hydra.errors import InstantiationException
from hydra.utils import instantiate
from omegaconf import DictConfig

from nereus_lightning.cli._hydra import CONFIG_ROOT, compose, to_dict
from nereus_lightning.plan.calibration import Calibration
from nereus_lightning.plan.estimate import PlanEstimate
from nereus_lightning.plan.layout import Plan
from nereus_lightning.plan.overlap import colocated, describe_groups
from nereus_lightning.plan.planner import plan_job, sharded_alternatives
from nereus_lightning.spec.errors import InfeasiblePlanError, NereusConfigError
from nereus_lightning.spec.workload import GenerationEngine, workflow

#: nereus-plan's own config root (kept apart so its `model`/`cluster` groups do not clash with
#: the plain `model:`/`cluster:` keys of nereus-simulate and nereus-train).
PLAN_CONFIGS = CONFIG_ROOT / "plan"
GB = 1e9


def plan_config(overrides: Sequence[str] = ()) -> DictConfig:
    """The composed nereus-plan config with command-line style ``overrides``."""
    return compose(PLAN_CONFIGS, "plan", overrides)


def _stage_rows(plan: Plan, est: PlanEstimate, algorithm: str) -> list[dict[str, Any]]:
    stage_of = {ms.name: ms.stage for ms in workflow(algorithm)}
    group_of = {n: g for g in colocated(plan, stage_of) for n in g}
    rows = []
    for name, cand in plan.items():
        rows.append(
            {
                "model_stage": name,
                "stage": stage_of[name],
                # Model-stages of one stage sharing GPUs run one after another, in this order.
                "colocated_group": list(group_of.get(name, (name,))),
                "dp": cand.dp,
                "tp": cand.layout.tp,
                "pp": cand.layout.pp,
                # ZeRO: the stage (0: unsharded) and the shard degree inside each replica.
                "zero": cand.layout.zero,
                "shard": cand.layout.shard,
                "num_gpus": cand.num_gpus,
                "gpus": list(cand.gpus),
                "micro_batch": cand.micro_batch,
                "recompute": cand.recompute,
                "latency_s": est.stage_latency[name],
                "peak_memory_bytes": est.stage_memory.get(name, 0.0),
            }
        )
    return rows


def _plan_dict(plan: Plan, est: PlanEstimate, algorithm: str) -> dict[str, Any]:
    return {
        "step_latency_s": est.step_latency,
        "phase_latency_s": dict(est.phase_latency),
        "feasible": est.feasible,
        "violations": list(est.violations),
        "model_stages": _stage_rows(plan, est, algorithm),
        "colocated": [list(g) for g in colocated(plan, {ms.name: ms.stage for ms in workflow(algorithm)})],
    }


def _plain(value: Any) -> Any:
    """A workload field as JSON has it (the generation engine as its fields)."""
    return dataclasses.asdict(value) if isinstance(value, GenerationEngine) else value


def _build(node: Any) -> Any:
    """``hydra.utils.instantiate`` that re-raises our config errors as themselves (not wrapped)."""
    try:
        return instantiate(node)
    except InstantiationException as exc:
        if isinstance(exc.__cause__, (NereusConfigError, InfeasiblePlanError)):
            raise exc.__cause__ from None
        raise


def _reward_model(cfg: DictConfig) -> bool:
    """Whether a reward model scores responses: ``workload.reward_model``, else whether ``model.reward``
    names one (a reward function otherwise, as nereus-train without ``reward_model.path``)."""
    named = cfg.model.get("reward") is not None
    given = cfg.workload.get("reward_model")
    if given is None:
        return named
    if not isinstance(given, bool):
        raise NereusConfigError(f"workload.reward_model: must be true, false or null, got {given!r}")
    if named and not given:
        raise NereusConfigError(
            f"workload.reward_model=false, but model.reward={cfg.model.reward} names a reward model; "
            "drop model.reward (a reward function scores) or workload.reward_model (the model does)"
        )
    return given


def plan_from_config(cfg: DictConfig) -> dict[str, Any]:
    """Plan the job a composed nereus-plan config describes; returns a JSON-ready dict.

    Raises:
        NereusConfigError: an invalid config value (the message names the field).
        InfeasiblePlanError: nothing fits (the message names the binding constraint).
    """
    models = _build(cfg.model)
    cluster = _build(cfg.cluster)
    workload_cfg = to_dict(cfg.workload)
    if cfg.get("algorithm"):
        workload_cfg["algorithm"] = cfg.algorithm
    workload_cfg["reward_model"] = _reward_model(cfg)
    workload = _build(workload_cfg)
    calibration = None
    if cfg.get("calibration"):
        path = Path(str(cfg.calibration))
        if not path.is_file():
            raise NereusConfigError(f"calibration: no file at {str(path)!r}")
        calibration = Calibration()
        calibration.load_state_dict(json.loads(path.read_text()))
    alternatives = int(cfg.output.alternatives)
    if alternatives < 0:
        raise NereusConfigError(f"output.alternatives: must be >= 0, got {alternatives}")
    result = plan_job(models, cluster, workload, calibration, alternatives=alternatives)
    algorithm = workload.algorithm
    out = {
        "models": {role: spec.name for role, spec in models.items()},
        "cluster": {
            "name": cluster.name,
            "num_gpus": cluster.num_gpus,
            "gpus_per_node": cluster.gpus_per_node,
            "gpu_memory_bytes": cluster.gpu_memory,
        },
        "workload": {k: _plain(getattr(workload, k)) for k in workload_cfg if k != "_target_"},
        "memory_cap_bytes": result.estimate.memory_cap,
        **_plan_dict(result.plan, result.estimate, algorithm),
        "alternatives": [_plan_dict(p, e, algorithm) for p, e in result.alternatives],
        "sharded_alternatives": {
            name: {
                "dp": opt.dp,
                "tp": opt.layout.tp,
                "pp": opt.layout.pp,
                "zero": opt.layout.zero,
                "shard": opt.layout.shard,
                "num_gpus": opt.gpus,
                "micro_batch": opt.micro_batch,
                "recompute": opt.recompute,
                "latency_s": opt.latency,
                "peak_memory_bytes": opt.peak_memory,
                "offered": offered,
            }
            for name, (opt, offered) in sharded_alternatives(
                models, cluster, workload, result.plan, calibration
            ).items()
        },
    }
    target = cfg.output.get("json")
    if target:
        Path(str(target)).write_text(json.dumps(out, indent=2))
    return out


def render(result: dict[str, Any]) -> None:
    """Print the plan as a rich table per model-stage, then the step latency."""
    from rich.console import Console
    from rich.table import Table

    cap = result["memory_cap_bytes"]
    cl, wl = result["cluster"], result["workload"]
    title = (
        f"{result['models']['actor']} {wl['algorithm'].upper()} on {cl['num_gpus']} GPUs of {cl['name']}, "
        f"prompt {wl['prompt_len']} + response {wl['response_len']:g} tokens, {wl['prompts_per_step']} "
        "prompts"
    )
    table = Table(title=title, title_justify="left")
    columns = (
        "model-stage",
        "runs",
        "dp",
        "tp",
        "pp",
        "ZeRO",
        "GPUs",
        "micro-batch",
        "recompute",
        "time s",
        "peak/cap GB",
    )
    for col in columns:
        table.add_column(
            col, justify="left" if col in ("model-stage", "runs", "GPUs") else "right", no_wrap=True
        )
    letters = {tuple(g): chr(ord("A") + i) for i, g in enumerate(result["colocated"])}
    stage = None
    for row in result["model_stages"]:
        if stage is not None and row["stage"] != stage:
            table.add_section()
        stage = row["stage"]
        gpus = row["gpus"]
        contiguous = gpus == list(range(gpus[0], gpus[-1] + 1))
        span = f"{row['num_gpus']} [{gpus[0]}-{gpus[-1]}]" if contiguous else f"{row['num_gpus']} {gpus}"
        group = row["colocated_group"]
        runs = (
            f"in turn {letters[tuple(group)]}{group.index(row['model_stage']) + 1}"
            if len(group) > 1
            else "concurrent"
        )
        table.add_row(
            row["model_stage"],
            runs,
            str(row["dp"]),
            str(row["tp"]),
            str(row["pp"]),
            f"Z{row['zero']}x{row['shard']}" if row["shard"] > 1 else "-",
            span,
            str(row["micro_batch"]),
            "yes" if row["recompute"] else "no",
            f"{row['latency_s']:.2f}",
            f"{row['peak_memory_bytes'] / GB:.1f}/{cap / GB:.1f}",
        )
    console = Console()
    if not console.is_terminal:
        console = Console(width=120)  # pipes and logs: do not squeeze the table into 80 columns
    console.print(table)
    for group, letter in letters.items():
        console.print(f"colocated {letter} (share GPUs, run one after another): {describe_groups([group])}")
    phases = ", ".join(f"{k} {v:.2f} s" for k, v in result["phase_latency_s"].items())
    console.print(f"step latency: [bold]{result['step_latency_s']:.2f} s[/bold] ({phases})")
    for i, alt in enumerate(result["alternatives"], 1):
        layout = ", ".join(
            f"{r['model_stage']} ({r['dp']},{r['tp']},{r['pp']}"
            + (f",Z{r['zero']}x{r['shard']})" if r["shard"] > 1 else ")")
            for r in alt["model_stages"]
        )
        console.print(f"alternative {i}: {alt['step_latency_s']:.2f} s: {layout}")
    chosen = {row["model_stage"]: row for row in result["model_stages"]}
    for name, alt in result["sharded_alternatives"].items():
        console.print(_sharded_line(name, alt, chosen[name]))


def _sharded_line(name: str, alt: dict[str, Any], chosen: dict[str, Any]) -> str:
    """What the fastest ZeRO-sharded candidate of a training model-stage would do (the plan has another)."""
    rc = " rc" if alt["recompute"] else ""
    line = (
        f"{name}: fastest ZeRO-sharded candidate on {alt['num_gpus']} GPUs is dp{alt['dp']} "
        f"Z{alt['zero']}x{alt['shard']} TP{alt['tp']}xPP{alt['pp']} mb{alt['micro_batch']}{rc}: "
        f"{alt['latency_s']:.2f} s, {alt['peak_memory_bytes'] / GB:.1f} GB "
        f"(chosen: {chosen['latency_s']:.2f} s)"
    )
    if not alt["offered"]:
        line += (
            f"; not offered: TP{alt['tp']}xPP{alt['pp']} fits unsharded nowhere, and a transition to another "
            "layout moves a sharded stage's state whole (only a change of its shard degree re-cuts it in "
            "place), so only where nothing else fits"
        )
    return line


@hydra.main(config_path=str(PLAN_CONFIGS), config_name="plan", version_base=None)
def _app(cfg: DictConfig) -> None:
    try:
        result = plan_from_config(cfg)
    except (NereusConfigError, InfeasiblePlanError) as exc:
        print(f"nereus-plan: {exc}", file=sys.stderr)
        sys.exit(2)
    render(result)
    if cfg.output.get("json"):
        print(f"wrote {cfg.output.json}")


def main() -> None:
    """Console entry point (Hydra parses the command line)."""
    _app()


if __name__ == "__main__":
    main()
