"""The README's generated tables: nereus-plan's 8B plan, nereus-simulate's trace, verl's names, algorithms.

Each sits in the README between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``.
``python benchmarks/readme_tables.py`` rewrites them from this version's code (a few seconds, no
GPU); ``--check`` only says which are stale (exit 1), as ``tests/packaging/test_readme.py`` does.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Callable
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
REGION = re.compile(r"(<!-- generated: (?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- end generated -->)", re.S)

#: The README's nereus-plan example, at two response lengths.
PLAN_JOB = ["model=llama3_8b", "cluster=paper_cluster2", "cluster.num_gpus=16", "output.alternatives=0"]
PLAN_LENGTHS = {"2K responses": 2048, "4K responses": 4096}


def plan_table() -> str:
    """Per model-stage (dp,tp,pp) and micro-batch at each length; alike neighbours share a row."""
    from nereus_lightning.cli.plan import plan_config, plan_from_config

    configs = [plan_config([*PLAN_JOB, f"workload.response_len={n}"]) for n in PLAN_LENGTHS.values()]
    results = [plan_from_config(cfg) for cfg in configs]
    cells: dict[str, list[str]] = {}
    for result in results:
        for row in result["model_stages"]:
            layout = f"({row['dp']},{row['tp']},{row['pp']}), {row['micro_batch']}"
            cells.setdefault(row["model_stage"], []).append(layout)
    rows: list[tuple[list[str], list[str]]] = []
    for stage, layouts in cells.items():
        if rows and rows[-1][1] == layouts:
            rows[-1][0].append(stage)
        else:
            rows.append(([stage], layouts))
    head = ["model-stage", *[f"{name}: (dp,tp,pp), micro-batch" for name in PLAN_LENGTHS]]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    lines += [f"| {' / '.join(stages)} | {' | '.join(layouts)} |" for stages, layouts in rows]
    lines.append("| step latency | " + " | ".join(f"{r['step_latency_s']:.1f} s" for r in results) + " |")
    return "\n".join(lines)


def simulate_table() -> str:
    """``nereus-simulate``'s default comparison (the paper's 25-step trace) and what it says."""
    from nereus_lightning.cli._hydra import CONFIG_ROOT, compose
    from nereus_lightning.cli.simulate import simulate_from_config

    cfg = compose(CONFIG_ROOT, "simulate", ["output_dir=null", "plot=false"])
    summaries = simulate_from_config(cfg)["comparison"].summaries
    head = ["policy", "mean s/step", "transitions", "restarts", "time in transitions", "gap to oracle"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name, s in summaries.items():
        gap = "-" if s.gap_to_oracle is None else f"{s.gap_to_oracle:+.1%}"
        share = f"{s.transition_share:.1%}"
        row = [name, f"{s.mean_step_s:.2f}", str(s.transitions), str(s.restarts), share, gap]
        if name.startswith("nereus"):
            row[:2] = [f"**{row[0]}**", f"**{row[1]}**"]
        lines.append("| " + " | ".join(row) + " |")
    nereus = next(s for n, s in summaries.items() if n.startswith("nereus"))
    static, always = summaries["static"], summaries["always-switch"]
    lines += [
        "",
        f"Nereus is {1 - nereus.mean_step_s / static.mean_step_s:.0%} below static with "
        f"{nereus.infeasible_steps} infeasible steps and {nereus.restarts} restarts, "
        f"{nereus.mean_step_s / always.mean_step_s - 1:+.1%} against always-switch's mean step for "
        f"{nereus.transition_s / always.transition_s:.0%} of its time in transitions, and "
        f"{nereus.gap_to_oracle:+.1%} from the oracle.",
    ]
    return "\n".join(lines)


def verl_table() -> str:
    """verl's keys nereus-train accepts, and ours."""
    from nereus_lightning.cli.verl import alias_table

    return alias_table()


def algorithms_table() -> str:
    """The registered algorithms: their preset, what the planner prices for them, what they need."""
    from nereus_lightning.cli._hydra import CONFIG_ROOT
    from nereus_lightning.spec.algorithms import algorithm_names, algorithm_spec
    from nereus_lightning.spec.workload import workflow

    presets = {p.stem for p in (Path(CONFIG_ROOT) / "algorithm").glob("*.yaml")}
    head = ["`adv_estimator`", "preset", "model-stages priced (and a reward model's)", "samples per prompt"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for name in algorithm_names():
        spec = algorithm_spec(name)
        names = " / ".join(f"`{n}`" for n in (name, *spec.aliases))
        preset = f"`algorithm={name}`" if name in presets else "-"
        stages = ", ".join(m.name for m in workflow(name) if m.model != "reward")
        lines.append(f"| {names} | {preset} | {stages} | >= {spec.min_samples_per_prompt} |")
    return "\n".join(lines)


TABLES: dict[str, Callable[[], str]] = {
    "algorithms": algorithms_table,
    "plan-8b": plan_table,
    "simulate-paper25": simulate_table,
    "verl-names": verl_table,
}


def regions(text: str) -> dict[str, str]:
    """The README's generated regions by name: their current bodies."""
    return {m.group("name"): m.group("body") for m in REGION.finditer(text)}


def render(text: str) -> str:
    """``text`` with every generated region rewritten."""

    def fill(match: re.Match[str]) -> str:
        return f"{match.group(1)}{TABLES[match.group('name')]()}\n{match.group(4)}"

    return REGION.sub(fill, text)


def main(argv: list[str] | None = None) -> int:
    """Rewrite the README's tables, or with ``--check`` report the stale ones (exit 1)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only say which tables are stale")
    args = parser.parse_args(argv)
    text = README.read_text()
    fresh = render(text)
    stale = [name for name, body in regions(text).items() if regions(fresh)[name] != body]
    if args.check:
        print("stale: " + ", ".join(stale) if stale else "every table is current")
        return 1 if stale else 0
    README.write_text(fresh)
    print("rewrote: " + (", ".join(stale) or "nothing (every table was current)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
