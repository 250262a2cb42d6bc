"""Held-out variants of the paper-shaped trace: every shipped spot trace x two start ticks x two seeds.

Each variant replays the 25-step paper shape (``sim.trace.paper_trace``) on another stretch of GPU
supply (spot trace, start tick) and another machine (the simulator's hidden efficiencies and noise
are drawn from the seed), for static, always-switch, every-3-steps, Nereus(0.5) and the oracle.
Writes ``benchmarks/results/variants.json``; the README's variants table is generated from it
(``benchmarks/readme_tables.py``).

Usage: ``python benchmarks/bench_variants.py [--out PATH]`` (about a minute per variant on one core).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from nereus_lightning.sim.experiment import make_setup, run_experiment
from nereus_lightning.sim.trace import SPOT_TRACES, paper_trace

RESULTS = Path(__file__).resolve().parent / "results"
POLICIES = ("static", "always", "every_k:3", "nereus:0.5", "oracle")
START_TICKS = (0, 150)  # two stretches of each spot trace (3 ticks per step: 75 ticks a run)
SEEDS = (1, 2)  # the paper trace itself is seed 0 at tick 0 of us-east-2b


def run_variant(supply: str, start_tick: int, seed: int) -> dict:
    """One variant: the summary rows by policy."""
    setup = make_setup("llama3_8b", "paper_cluster2", {"algorithm": "ppo"}, seed=seed)
    res = run_experiment(setup, paper_trace(supply, start_tick), list(POLICIES), plot=False)
    return {r["policy"]: r for r in res["table"]}


def main(argv: list[str] | None = None) -> dict:
    """Run the 12 variants; print one line each; write the JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(RESULTS / "variants.json"))
    args = parser.parse_args(argv)
    runs = []
    for supply in SPOT_TRACES:
        for tick in START_TICKS:
            for seed in SEEDS:
                start = time.perf_counter()
                rows = run_variant(supply, tick, seed)
                runs.append({"supply": supply, "start_tick": tick, "seed": seed, "rows": rows})
                line = ", ".join(f"{n} {r['mean_step_s']:.2f}" for n, r in rows.items())
                print(f"{supply} tick {tick} seed {seed}: {line} ({time.perf_counter() - start:.0f} s)")
    result = {"model": "llama3_8b", "cluster": "paper_cluster2", "algorithm": "ppo", "runs": runs}
    Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
