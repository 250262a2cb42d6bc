"""The cost model's generation seconds before calibration, repriced by this version, against the
measured ones of ``bench_gpu_e2e.py`` runs (issue 31: decode priced at length, within 50%).

Usage: ``PYTHONPATH=src:. python benchmarks/gpu_generation_pricing.py RUN.json ...`` (the nereus JSON
files of ``benchmarks/results/h100``); on the CPU: each run's plan, model shape and prompt length are
rebuilt from its JSON, the cluster as ``cluster=auto`` built it from the GPU's name and memory.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.bench_gpu_e2e import PROMPTS, SAMPLES, make_folder, prompt_tokens

from nereus_lightning.control.attribution import phase_times_of
from nereus_lightning.plan.estimate import estimate_plan
from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.plan.planner import job_models
from nereus_lightning.spec import ModelSpec, Workload
from nereus_lightning.spec.cluster import DeviceFacts, cluster_from_devices


def _plan(text: str) -> Plan:
    """The plan a run recorded (its ``repr``)."""
    return eval(text, {"Plan": Plan, "Candidate": Candidate, "Layout": Layout})  # noqa: S307  # our own JSON


def repriced(run: dict, root: Path) -> float:
    """Generation seconds this version's cost model predicts, before calibration, for ``run``."""
    folder = make_folder(run["shape"], root, weights=False)
    cluster = cluster_from_devices(DeviceFacts(run["gpu"], run["gpu_gib"] * 2**30), 1, 1)
    n = float(run["new_tokens"])
    workload = Workload(
        algorithm="grpo",
        prompts_per_step=PROMPTS,
        samples_per_prompt=SAMPLES,
        prompt_len=prompt_tokens(folder),
        response_len=n,
        response_len_p95=n,
        reward_model=False,
    )
    models = job_models(ModelSpec.from_hf_config(folder))
    return phase_times_of(estimate_plan(_plan(run["plan"]), models, cluster, workload))["gen"]


def main() -> None:
    """Print a markdown table: shape, N, measured, recorded and repriced generation seconds."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path, help="nereus JSON files of bench_gpu_e2e.py")
    args = parser.parse_args()
    runs = sorted((json.loads(p.read_text()) for p in args.runs), key=lambda r: (r["shape"], r["new_tokens"]))
    print("| GPU | shape | N | generation s measured | predicted then | predicted now | error now |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    with tempfile.TemporaryDirectory() as root:
        for run in runs:
            cost = run["cost_model"]
            measured, now = cost["measured"]["gen"], repriced(run, Path(root))
            print(
                f"| {run['gpu']} | {run['shape']} | {run['new_tokens']:,} | {measured:.2f} "
                f"| {cost['before']['gen']:.2f} | {now:.2f} | {100 * (now / measured - 1):+.0f}% |"
            )


if __name__ == "__main__":
    main()
