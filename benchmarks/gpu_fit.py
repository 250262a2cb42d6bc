"""``nereus-train`` on one GPU with a user's folder: PPO or GRPO, bf16, every model-stage colocated.

Runs the CLI's ``run`` on a Qwen2 folder of the 0.5B shape (random weights, see
``bench_gpu_e2e.make_folder``) with word-problem prompts, and reports what issue "From one GPU up"
checks: that the job runs, the plan it ran (colocated groups), per-stage peak memory
(``perf/max_memory_allocated_gb/<stage>``), seconds per stage, and the time from the end of the
last step to the end of ``fit`` (the shell wrapper adds interpreter exit).

Usage: python benchmarks/gpu_fit.py --algorithm grpo --root /tmp/job --out results/ [--phases] [overrides]
(e.g. ``export_hf=false``: the end of ``fit`` without a Hugging Face export).
"""

from __future__ import annotations

import argparse
import atexit
import csv
import glob
import importlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _job(root: Path, shape: str) -> dict[str, str]:
    from bench_gpu_e2e import make_folder

    from nereus_lightning.rl.wordproblems import make_rows, write_parquet

    root.mkdir(parents=True, exist_ok=True)
    reward = root / "reward.py"
    reward.write_text(
        "def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
        "    return float(str(ground_truth) in solution_str)\n"
    )
    return {
        "model": str(make_folder(shape, root)),
        "train": write_parquet(make_rows(256, "train"), str(root / "train.parquet")),
        "reward": str(reward),
    }


#: What runs between the last step and the end of ``fit`` (``--phases`` times each call).
PHASES = (
    "nereus_lightning.lightning.callback.NereusCallback.on_train_batch_end",
    "nereus_lightning.lightning.callback.NereusCallback.on_train_end",
    "nereus_lightning.lightning.strategy.NereusStrategy.save_checkpoint",
    "nereus_lightning.lightning.strategy.NereusStrategy._checked_for_save",
    "nereus_lightning.lightning.strategy.NereusStrategy.on_train_end",
    "nereus_lightning.lightning.strategy.NereusStrategy.teardown",
    "nereus_lightning.lightning.emu_state.EMUStates.save",
    "nereus_lightning.emu.dcp_state.save_tensors",
    "nereus_lightning.emu.dcp_state._stage",  # one unit into page-locked host memory
    "nereus_lightning.emu.dcp_state._Staged.free",  # its release and unmapping once written
    "nereus_lightning.lightning.console.print_summary",
    "nereus_lightning.cli.train.summarize",
    "lightning.pytorch.callbacks.ModelCheckpoint.on_train_epoch_end",
    "lightning.pytorch.callbacks.ModelCheckpoint.on_validation_end",
    "lightning.pytorch.callbacks.ModelCheckpoint.on_train_end",
    "lightning.pytorch.trainer.trainer.Trainer._teardown",
    "torch.distributed.destroy_process_group",
)


def _time_calls(path: str, events: list[tuple[str, float, float]]) -> None:
    """Wrap the function or method at ``path`` (module.attr or module.Class.attr) to record its calls."""
    parts = path.split(".")
    for cut in range(len(parts) - 1, 0, -1):
        try:
            owner = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:-1]:
            owner = getattr(owner, name)
        break
    original = getattr(owner, parts[-1], None)
    if original is None:
        return

    def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
        begin = time.time()
        try:
            return original(*a, **k)
        finally:
            events.append((path.rsplit(".", 2)[-2] + "." + parts[-1], begin, time.time()))

    setattr(owner, parts[-1], timed)


def _time_exit(base: list[float]) -> None:
    """Print each ``atexit`` callback registered from here on as it runs (seconds from ``base[0]``)."""
    register = atexit.register

    def timed_register(fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
            begin = time.time()
            try:
                return fn(*a, **k)
            finally:
                now, name = time.time(), f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', fn)}"
                spans = f"{begin - base[0]:8.2f} {now - base[0]:8.2f}  {now - begin:7.2f}"
                print(f"  {spans}  atexit {name}", flush=True)

        register(timed, *args, **kwargs)
        return fn

    atexit.register = timed_register


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--algorithm", default="grpo", choices=["grpo", "ppo"])
    parser.add_argument("--root", default="/tmp/nereus-gpu-job")
    parser.add_argument("--out", default="benchmarks/results")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--response", type=int, default=128)
    parser.add_argument("--shape", default="0.5b", help="bench_gpu_e2e.SHAPES: 0.5b, 1.5b, tiny (CPU check)")
    parser.add_argument(
        "--trainer", default="gpu", help="the trainer config group: gpu, or cpu4 for a check here"
    )
    parser.add_argument("--phases", action="store_true", help="time the end-of-fit phases (PHASES)")
    parser.add_argument("overrides", nargs="*", help="more nereus-train overrides, e.g. export_hf=false")
    args = parser.parse_args()
    base = [time.time()]  # the end of the last step, once known (--phases times exit from it)
    if args.phases:
        _time_exit(base)

    from hydra import compose, initialize_config_dir

    from nereus_lightning.cli._hydra import CONFIG_ROOT
    from nereus_lightning.cli.train import leave, run
    from nereus_lightning.lightning.callback import NereusCallback

    job = _job(Path(args.root), args.shape)
    out = Path(args.out) / f"gpu_fit_{args.algorithm}"
    ends = out / "step_ends.txt"
    original = NereusCallback.on_train_batch_end

    def on_train_batch_end(self, trainer, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        original(self, trainer, *a, **k)
        if trainer.global_rank == 0:
            with open(ends, "a") as f:
                f.write(f"{time.time()}\n")

    NereusCallback.on_train_batch_end = on_train_batch_end
    samples = 4 if args.algorithm == "grpo" else 1
    overrides = [
        f"trainer={args.trainer}",
        "trainer.devices=1",
        "trainer.precision=bf16-mixed",
        f"algorithm={args.algorithm}",
        f"algorithm.samples_per_prompt={samples}",
        "algorithm.prompts_per_step=16",
        f"trainer.max_steps={args.steps}",
        f"actor.path={job['model']}",
        f"data.train_files={job['train']}",
        f"custom_reward_function.path={job['reward']}",
        f"data.max_response_length={args.response}",
        "algorithm.ignore_eos=true",
        f"output_dir={out}",
        "plot=false",
        "checkpoint_every=0",
        *args.overrides,
    ]
    with initialize_config_dir(config_dir=str(CONFIG_ROOT), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    out.mkdir(parents=True, exist_ok=True)
    ends.unlink(missing_ok=True)
    events: list[tuple[str, float, float]] = []
    if args.phases:
        for phase in PHASES:
            _time_calls(phase, events)
    start = time.time()
    summary = run(cfg)
    done = time.time()
    last_end = float(open(ends).read().split()[-1])
    base[0] = last_end
    files = sorted(glob.glob(str(out / "logs" / "*" / "metrics.csv")), key=os.path.getmtime)
    rows = [r for r in csv.DictReader(open(files[-1])) if r.get("critic/score/mean")]
    keys = sorted({k for r in rows for k in r if k.startswith(("perf/max_memory", "timing_s/"))})
    per_step = {k: [float(r[k]) for r in rows if r.get(k)] for k in keys}
    first = json.loads(open(out / "decisions.jsonl").readline())
    result = {
        "algorithm": args.algorithm,
        "overrides": args.overrides,
        "steps": summary.get("steps"),
        "fit_s": done - start,
        "last_step_to_fit_end_s": done - last_end,
        "plan": first.get("target_plan"),
        "median": {k: sorted(v)[len(v) // 2] for k, v in per_step.items() if v},
        "max": {k: max(v) for k, v in per_step.items() if v and k.startswith("perf/")},
        "last_step_end": last_end,
    }
    (out / "result.json").write_text(json.dumps(result, indent=1))
    print(json.dumps({k: v for k, v in result.items() if k != "plan"}, indent=1))
    print("plan:", json.dumps(result["plan"]))
    if args.phases:
        print(f"phases after the last step (s from its end; fit ended at {done - last_end:.2f}):")
        for name, begin, end in sorted(events, key=lambda e: e[1]):
            if end >= last_end - 1e-3:
                print(f"  {begin - last_end:8.2f} {end - last_end:8.2f}  {end - begin:7.2f}  {name}")
        print(f"  {time.time() - last_end:8.2f}  main returns", flush=True)
    leave(0)  # as nereus-train ends


if __name__ == "__main__":
    main()
