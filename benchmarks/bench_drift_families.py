"""Policies on the drift families (``sim.drift_families``) over 8 model x cluster x algorithm combinations.

For every combination and family (one seeded member each, ``--seeds`` more): the policy table
(static, always-switch, every-3-steps, Nereus(0.5), oracle): mean s/step, infeasible steps and
the gap to the oracle; then per combination whether Nereus is the best non-oracle policy with no
more infeasible steps than any other. Writes ``benchmarks/results/drift_families.json``.

Usage: ``python benchmarks/bench_drift_families.py [--seeds N] [--combos i,j] [--families a,b]``.
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


def main(argv: list[str] | None = None) -> dict:
    """Run the grid; print one line per run and a summary; write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=1)
    parser.add_argument("--combos", default="", help="comma-separated indices into COMBINATIONS")
    parser.add_argument("--families", default="", help="comma-separated family names")
    parser.add_argument("--out", default=str(RESULTS / "drift_families.json"))
    args = parser.parse_args(argv)
    combos = [COMBINATIONS[int(i)] for i in args.combos.split(",")] if args.combos else list(COMBINATIONS)
    families = args.families.split(",") if args.families else list(FAMILIES)
    runs = []
    for combo in combos:
        for family in families:
            for seed in range(args.seeds):
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
    summary = {
        "runs": len(runs),
        "nereus_best": sum(r["best"] for r in runs),
        "nereus_fewest_infeasible": sum(r["fewest_infeasible"] for r in runs),
        "mean_gap_to_oracle": sum(gaps) / len(gaps),
    }
    print(json.dumps(summary))
    Path(args.out).parent.mkdir(exist_ok=True)
    Path(args.out).write_text(json.dumps({"summary": summary, "runs": runs}, indent=1))
    return summary


if __name__ == "__main__":
    main()
