"""Policies on the drift families (``sim.drift_families``) over 8 model x cluster x algorithm combinations.

For every combination and family (one seeded member each, ``--seeds`` more): the policy table
(static, always-switch, every-3-steps, Nereus(0.5), oracle): mean s/step, infeasible steps and
the gap to the oracle, and per run whether Nereus is the best non-oracle policy with no more
infeasible steps than any other; then the same verdict per combination, on each policy's mean
s/step and total infeasible steps over all its families and seeds. Writes
``benchmarks/results/drift_families.json``.

Usage: ``python benchmarks/bench_drift_families.py [--seeds N] [--first-seed S] [--combos i,j]
[--families a,b]`` (``--first-seed``: held-out members, seeds S .. S+N-1).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from nereus_lightning.sim.drift_families import COMBINATIONS, FAMILIES, Combination, family_trace
from nereus_lightning.sim.experiment import make_setup, run_experiment

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("static", "always", "every_k:3", "nereus:0.5")
NEREUS = "nereus(gamma=0.5)"


def run_one(combo: Combination, family: str, seed: int) -> dict:
    """One family member on one combination: the summary rows by policy."""
    setup = make_setup(combo.model, combo.cluster, {"algorithm": combo.algorithm}, seed=seed)
    trace = family_trace(family, combo.shape, seed)
    res = run_experiment(setup, trace, list(POLICIES), plot=False)
    return {r["policy"]: r for r in res["table"]}


def verdict(rows: dict) -> dict:
    """Nereus against the other non-oracle policies on one run."""
    nereus = rows[NEREUS]
    others = [r for n, r in rows.items() if n not in ("oracle", NEREUS)]
    runner = min(others, key=lambda r: r["mean_step_s"])
    return {
        "best": nereus["mean_step_s"] <= runner["mean_step_s"] * (1 + 1e-9),
        "runner_up": runner["policy"],
        "margin": runner["mean_step_s"] - nereus["mean_step_s"],
        "fewest_infeasible": nereus["infeasible_steps"] <= min(r["infeasible_steps"] for r in others),
        "gap": nereus["gap_to_oracle"],
    }


def combination_verdicts(runs: list[dict]) -> list[dict]:
    """Per combination, over all its families and seeds: each policy's mean s/step and total
    infeasible steps, and whether Nereus is the best non-oracle policy with the fewest infeasible."""
    out = []
    for name in dict.fromkeys(r["combination"] for r in runs):
        mine = [r for r in runs if r["combination"] == name]
        policies = {
            p: {
                "mean_step_s": sum(r["rows"][p]["mean_step_s"] for r in mine) / len(mine),
                "infeasible_steps": sum(r["rows"][p]["infeasible_steps"] for r in mine),
            }
            for p in mine[0]["rows"]
        }
        nereus = policies[NEREUS]
        others = {p: v for p, v in policies.items() if p not in ("oracle", NEREUS)}
        runner = min(others, key=lambda p: others[p]["mean_step_s"])
        out.append(
            {
                "combination": name,
                "runs": len(mine),
                "policies": policies,
                "best": nereus["mean_step_s"] <= others[runner]["mean_step_s"] * (1 + 1e-9),
                "runner_up": runner,
                "margin": others[runner]["mean_step_s"] - nereus["mean_step_s"],
                "fewest_infeasible": nereus["infeasible_steps"]
                <= min(v["infeasible_steps"] for v in others.values()),
            }
        )
    return out


def main(argv: list[str] | None = None) -> dict:
    """Run the grid; print one line per run and a summary; write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--first-seed", type=int, default=0, help="the first seed of each family run")
    parser.add_argument("--combos", default="", help="comma-separated indices into COMBINATIONS")
    parser.add_argument("--families", default="", help="comma-separated family names")
    parser.add_argument("--out", default=str(RESULTS / "drift_families.json"))
    args = parser.parse_args(argv)
    combos = [COMBINATIONS[int(i)] for i in args.combos.split(",")] if args.combos else list(COMBINATIONS)
    families = args.families.split(",") if args.families else list(FAMILIES)
    runs = []
    for combo in combos:
        for family in families:
            for seed in range(args.first_seed, args.first_seed + args.seeds):
                t = time.perf_counter()
                rows = run_one(combo, family, seed)
                v = verdict(rows)
                runs.append({"combination": combo.name, "family": family, "seed": seed, "rows": rows, **v})
                cells = " ".join(
                    f"{n.split('(')[0]}={r['mean_step_s']:.2f}/{r['infeasible_steps']}"
                    for n, r in rows.items()
                )
                ok = "OK" if v["best"] and v["fewest_infeasible"] else "FAIL"
                print(
                    f"{combo.name} | {family} s{seed} | {cells} | gap {v['gap']:+.1%} "
                    f"{ok} ({time.perf_counter() - t:.1f} s)",
                    flush=True,
                )
    gaps = [r["gap"] for r in runs]
    combinations = combination_verdicts(runs)
    for c in combinations:
        cells = " ".join(
            f"{n.split('(')[0]}={v['mean_step_s']:.2f}/{v['infeasible_steps']}"
            for n, v in c["policies"].items()
        )
        ok = "OK" if c["best"] and c["fewest_infeasible"] else "FAIL"
        print(f"{c['combination']} | {c['runs']} runs | {cells} | {ok}", flush=True)
    summary = {
        "runs": len(runs),
        "nereus_best": sum(r["best"] for r in runs),
        "nereus_fewest_infeasible": sum(r["fewest_infeasible"] for r in runs),
        "mean_gap_to_oracle": sum(gaps) / len(gaps),
        "combinations": len(combinations),
        "combinations_nereus_best": sum(c["best"] for c in combinations),
        "combinations_nereus_fewest_infeasible": sum(c["fewest_infeasible"] for c in combinations),
    }
    print(json.dumps(summary))
    Path(args.out).parent.mkdir(exist_ok=True)
    result = {"summary": summary, "combinations": combinations, "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1))
    return summary


if __name__ == "__main__":
    main()
