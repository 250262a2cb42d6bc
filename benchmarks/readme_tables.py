"""The README's generated tables: nereus-plan's 8B plan, nereus-simulate's trace, verl's names, algorithms,
and the simulated gamma sweep, ablation, held-out variants and drift families.

Each sits in the README between ``<!-- generated: NAME -->`` and ``<!-- end generated -->``.
``python benchmarks/readme_tables.py`` rewrites them from this version's code (a few seconds, no
GPU); ``--check`` only says which are stale (exit 1), as ``tests/packaging/test_readme.py`` does.
The simulated sweeps take minutes, so their tables are rendered from the JSON their benchmark
writes (``bench_controller.py``: gamma sweep and ablation; ``bench_variants.py``;
``bench_drift_families.py``), and the test checks that the JSON's Nereus run on the paper trace is the
one this version's ``nereus-simulate`` gives.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import re
import sys
from collections.abc import Callable
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
sys.path.insert(0, str(Path(__file__).resolve().parent))  # the benchmark scripts beside this one
RESULTS = Path(__file__).resolve().parent / "results"
NEREUS = "nereus(gamma=0.5)"
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


@functools.cache
def paper_summaries() -> dict:
    """``nereus-simulate``'s default comparison (the paper's 25-step trace): summaries by policy."""
    from nereus_lightning.cli._hydra import CONFIG_ROOT, compose
    from nereus_lightning.cli.simulate import simulate_from_config

    cfg = compose(CONFIG_ROOT, "simulate", ["output_dir=null", "plot=false"])
    return dict(simulate_from_config(cfg)["comparison"].summaries)


def stale_results() -> list[str]:
    """The result files whose Nereus runs this version no longer reproduces.

    Checked on the cheapest run each file holds: the paper trace (``controller.json``, against
    :func:`paper_summaries`) and the first held-out variant (``variants.json``, re-run).
    """
    import bench_variants

    stale = []
    paper = next(r for r in _results("controller.json")["paper25"]["table"] if r["policy"] == NEREUS)
    if not math.isclose(paper["mean_step_s"], paper_summaries()[NEREUS].mean_step_s, rel_tol=1e-9):
        stale.append("controller.json")
    first = _results("variants.json")["runs"][0]
    fresh = bench_variants.run_variant(first["supply"], first["start_tick"], first["seed"])[NEREUS]
    if not math.isclose(first["rows"][NEREUS]["mean_step_s"], fresh["mean_step_s"], rel_tol=1e-9):
        stale.append("variants.json")
    return stale


def simulate_table() -> str:
    """``nereus-simulate``'s default comparison (the paper's 25-step trace) and what it says."""
    summaries = paper_summaries()
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


def _results(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def _gap(row: dict) -> str:
    return "-" if row.get("gap_to_oracle") is None else f"{row['gap_to_oracle']:+.1%}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return lines + ["| " + " | ".join(r) + " |" for r in rows]


def gamma_table() -> str:
    """Nereus(gamma) on the paper trace (``benchmarks/results/controller.json``), the best gamma in bold."""
    paper = _results("controller.json")["paper25"]
    rows = []
    for r in paper["gamma_sweep"]:
        row = [
            f"{r['gamma']:g}",
            f"{r['mean_step_s']:.2f}",
            str(r["transitions"]),
            str(r["restarts"]),
            f"{r['transition_share']:.1%}",
            _gap(r),
        ]
        if r["gamma"] == paper["best_gamma"]:
            row[:2] = [f"**{row[0]}**", f"**{row[1]}**"]
        rows.append(row)
    head = ["gamma", "mean s/step", "transitions", "restarts", "time in transitions", "gap to oracle"]
    return "\n".join(_table(head, rows))


def ablation_table() -> str:
    """Nereus(0.5) with one lever of its target choice changed (``controller.json``'s ablation)."""
    paper = _results("controller.json")["paper25"]
    nereus = next(r for r in paper["table"] if r["policy"] == NEREUS)
    rows = [
        [
            r["policy"],
            f"{r['mean_step_s']:.2f}",
            str(r["transitions"]),
            str(r["restarts"]),
            str(r["infeasible_steps"]),
            _gap(r),
        ]
        for r in [nereus, *paper["ablation"]]
    ]
    return "\n".join(
        _table(
            ["variant", "mean s/step", "transitions", "restarts", "infeasible steps", "gap to oracle"], rows
        )
    )


def _best(rows: dict) -> str:
    """The non-oracle policy with the lowest mean step (Nereus on a tie)."""
    others = {n: r for n, r in rows.items() if n != "oracle"}
    low = min(r["mean_step_s"] for r in others.values())
    return (
        NEREUS
        if others[NEREUS]["mean_step_s"] <= low * (1 + 1e-9)
        else min(others, key=lambda n: others[n]["mean_step_s"])
    )


def variants_table() -> str:
    """The paper shape on other supply stretches and machines (``benchmarks/results/variants.json``)."""
    runs = _results("variants.json")["runs"]
    names = ["static", "always-switch", "every-3-steps", NEREUS, "oracle"]
    rows = []
    for run in runs:
        best = _best(run["rows"])
        means = {n: f"{run['rows'][n]['mean_step_s']:.2f}" for n in names}
        cells = [f"**{means[n]}**" if n == best else means[n] for n in names]
        rows.append(
            [
                run["supply"],
                str(run["start_tick"]),
                str(run["seed"]),
                *cells,
                str(run["rows"][NEREUS]["infeasible_steps"]),
            ]
        )
    head = [
        "spot trace",
        "start tick",
        "seed",
        "static",
        "always-switch",
        "every-3",
        "Nereus",
        "oracle",
        "Nereus infeasible steps",
    ]
    wins = sum(_best(run["rows"]) == NEREUS for run in runs)
    gaps = [run["rows"][NEREUS]["gap_to_oracle"] for run in runs]
    return "\n".join(
        [
            *_table(head, rows),
            "",
            f"Nereus is the lowest non-oracle policy in {wins} of "
            f"{len(runs)} variants, {sum(gaps) / len(gaps):+.1%} from the oracle on average.",
        ]
    )


def families_table() -> str:
    """Per model x cluster x algorithm and drift family (``benchmarks/results/drift_families.json``)."""
    data = _results("drift_families.json")
    rows = []
    for run in data["runs"]:
        r, best = run["rows"], _best(run["rows"])
        fewest = min(x["infeasible_steps"] for n, x in r.items() if n != "oracle")
        rows.append(
            [
                run["combination"],
                run["family"],
                str(run["seed"]),
                best.replace(NEREUS, "**Nereus**"),
                f"{r[NEREUS]['mean_step_s']:.2f}",
                _gap(r[NEREUS]),
                f"{r[NEREUS]['infeasible_steps']} ({fewest})",
            ]
        )
    head = [
        "model, algorithm, cluster, pool",
        "family",
        "seed",
        "best non-oracle",
        "Nereus s/step",
        "Nereus gap to oracle",
        "Nereus infeasible steps (fewest of any)",
    ]
    s = data["summary"]
    return "\n".join(
        [
            *_table(head, rows),
            "",
            f"Nereus is the best non-oracle policy in {s['nereus_best']} "
            f"of {s['runs']} runs, has no more infeasible steps than any other policy in "
            f"{s['nereus_fewest_infeasible']}, and is {s['mean_gap_to_oracle']:+.2%} from the "
            "oracle on average.",
            "",
            *_combinations_table(data["combinations"]),
            "",
            f"Per combination (mean s/step and infeasible steps over all its runs), Nereus is the "
            f"best non-oracle policy in {s['combinations_nereus_best']} of {s['combinations']} and "
            f"has no more infeasible steps than any other in {s['combinations_nereus_fewest_infeasible']}.",
        ]
    )


def _combinations_table(combinations: list[dict]) -> list[str]:
    """Per combination: every policy's mean s/step / infeasible steps over its runs, the best in bold."""
    names = list(combinations[0]["policies"])
    rows = []
    for c in combinations:
        p = c["policies"]
        best = _best(p)
        cells = [f"{p[n]['mean_step_s']:.2f} / {p[n]['infeasible_steps']}" for n in names]
        rows.append(
            [
                c["combination"],
                str(c["runs"]),
                *(f"**{x}**" if n == best else x for n, x in zip(names, cells, strict=True)),
            ]
        )
    return _table(["model, algorithm, cluster, pool", "runs", *names], rows)


TABLES: dict[str, Callable[[], str]] = {
    "algorithms": algorithms_table,
    "plan-8b": plan_table,
    "simulate-paper25": simulate_table,
    "verl-names": verl_table,
    "gamma-sweep": gamma_table,
    "ablation": ablation_table,
    "variants": variants_table,
    "families": families_table,
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
        stale += stale_results()
        print("stale: " + ", ".join(stale) if stale else "every table is current")
        return 1 if stale else 0
    README.write_text(fresh)
    print("rewrote: " + (", ".join(stale) or "nothing (every table was current)"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
