"""One GRPO step on one GPU, nereus against TRL's ``GRPOTrainer``, the same work on both sides.

Qwen2 shapes with random weights (``0.5b``, ``1.5b``), bf16, the same 16 prompts x 4 samples, every
response exactly ``--new-tokens`` long (eos ignored), one optimizer step per RL step, a KL-to-reference
loss on both sides. Each system runs in its own process (``--system``); ``--report`` collects the
JSON files into a table. Medians of the steps after ``--warmup``. nereus runs the plan its planner
picks for this job on the GPU as ``cluster=auto`` describes it (every model-stage colocated) and
prints the planner's predicted seconds per stage for it, before calibration and after a
calibration fitted on its first three measured steps. ``--micro-batch``/``--recompute`` override
the plan's inference and training micro-batch and recompute (the sweep ``gpu_e2e.sh`` runs to set
the planner's choice beside the fastest measured one).

On the GPU machine: ``bash benchmarks/gpu_e2e.sh`` (carries TRL and datasets as wheels).
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import json
import os
import shutil
import statistics
import sys
import time
from functools import partial
from pathlib import Path

SHAPES = {  # Qwen2-0.5B and Qwen2-1.5B (tied embeddings, 151,936-token vocabulary)
    "0.5b": dict(
        hidden_size=896,
        num_hidden_layers=24,
        num_attention_heads=14,
        num_key_value_heads=2,
        intermediate_size=4864,
    ),
    "1.5b": dict(
        hidden_size=1536,
        num_hidden_layers=28,
        num_attention_heads=12,
        num_key_value_heads=2,
        intermediate_size=8960,
    ),
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
    ),
}
PROMPTS, SAMPLES = 16, 4
RESULTS = Path(__file__).resolve().parent / "results"


def make_folder(shape: str, root: Path, weights: bool = True) -> Path:
    """A Qwen2 folder of ``shape`` (random weights, bf16; only the config without ``weights``) beside
    a small tokenizer trained here."""
    import torch
    import transformers as tf

    from nereus_lightning.testing.folders import train_tokenizer

    folder = root / f"qwen2-{shape}{'' if weights else '-config'}"
    if (folder / "config.json").is_file():
        return folder
    tokenizer = train_tokenizer(
        [f"Question {i}: what is {i} plus {i + 1}? Answer: {2 * i + 1}." for i in range(400)]
    )
    config = tf.Qwen2Config(
        vocab_size=151936,
        tie_word_embeddings=True,
        max_position_embeddings=4096,
        **SHAPES[shape],
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    if weights:
        tf.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(folder)
    else:
        config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def prompts() -> list[list[dict[str, str]]]:
    """The same 16 chat prompts for both systems."""
    return [[{"role": "user", "content": f"Question {i}: what is {i} plus {i + 1}?"}] for i in range(PROMPTS)]


def reward(data_source=None, solution_str="", ground_truth=None, extra_info=None, **kwargs):  # noqa: ANN001, ANN201
    """A cheap reward (the benchmark times the RL machinery, not the reward)."""
    return float(len(solution_str) % 7) / 7.0


def gpu_bytes() -> float:
    """This GPU's memory, or less where ``GPU_GIB`` caps it (the allocator then refuses beyond it, as a
    smaller card would: an H100's 80 GB on an H200)."""
    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    cap = float(os.environ.get("GPU_GIB", 0)) * 2**30
    if 0 < cap < total:
        torch.cuda.set_per_process_memory_fraction(cap / total)
        return cap
    return float(total)


def params_of(folder: Path) -> int:
    """Parameters of the folder's model (the 12 B/param of fp32 masters and AdamW moments nereus may add)."""
    from nereus_lightning.spec import ModelSpec

    return int(ModelSpec.from_hf_config(folder).num_params)


def prompt_tokens(folder: Path) -> float:
    """Mean tokens of the prompts through the folder's chat template (the planner's prompt_len)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    template = partial(tokenizer.apply_chat_template, add_generation_prompt=True, tokenize=True)
    lengths = [len(template(p)) for p in prompts()]
    return sum(lengths) / len(lengths)


def planned(folder: Path, new_tokens: int):  # noqa: ANN201
    """(plan, models, cluster, workload): the planner's plan for this job on this GPU, the cluster
    ``cluster=auto`` builds from it (``GPU_GIB`` caps its memory); on the CPU the ``h200x8`` preset."""
    import dataclasses

    import torch

    from nereus_lightning.lightning.devices import auto_cluster
    from nereus_lightning.plan.planner import job_models, plan_job
    from nereus_lightning.spec import ModelSpec, Workload, cluster_preset

    models = job_models(ModelSpec.from_hf_config(folder))
    cluster = cluster_preset("h200x8").with_gpus(1)
    if torch.cuda.is_available():
        cluster = dataclasses.replace(auto_cluster(True, 1, 1), gpu_memory=gpu_bytes())
    workload = Workload(
        algorithm="grpo",
        prompts_per_step=PROMPTS,
        samples_per_prompt=SAMPLES,
        prompt_len=prompt_tokens(folder),
        response_len=float(new_tokens),
        response_len_p95=float(new_tokens),
        reward_model=False,
    )
    return plan_job(models, cluster, workload).plan, models, cluster, workload


def predicted_peaks(plan, models, cluster, workload) -> dict[str, float]:  # noqa: ANN001
    """The cost model's peak GiB per workflow stage (gen, infer, train) of ``plan``: its model-stages'
    largest (colocated ones run one after another)."""
    from nereus_lightning.plan.estimate import estimate_plan

    short = {"generation": "gen", "inference": "infer", "training": "train"}
    memory = estimate_plan(plan, models, cluster, workload).stage_memory
    out: dict[str, float] = {}
    for ms in workload.stages:
        if ms.name in memory:
            key = short[ms.stage]
            out[key] = max(out.get(key, 0.0), memory[ms.name] / 2**30)
    return out


def with_slots(plan, micro_batch: int | None, recompute: bool | None):  # noqa: ANN001, ANN201
    """``plan`` with its inference and training model-stages' micro-batch / recompute overridden."""
    import dataclasses

    from nereus_lightning.plan.layout import Plan
    from nereus_lightning.spec.workload import workflow

    kinds = {m.name: m.stage for m in workflow("grpo")}
    changes = {"micro_batch": micro_batch, "recompute": recompute}
    changes = {k: v for k, v in changes.items() if v is not None}
    return Plan.of(
        {
            name: dataclasses.replace(c, **changes) if kinds[name] != "generation" else c
            for name, c in plan.assignments
        }
    )


def keep_plan(plan):  # noqa: ANN001, ANN201
    """A controller that keeps ``plan`` all run (the pool never changes here), so a sweep runs its plan."""
    from nereus_lightning.control import PlanFollower

    class KeepPlan(PlanFollower):
        reason = "given plan"

        def target(self, signals):  # noqa: ANN001, ANN202
            return plan

    return KeepPlan()


def on_last_call(update, steps: int, measure):  # noqa: ANN001, ANN201
    """``update`` whose ``steps``-th call runs through ``measure(call)``, its other calls as they are."""
    calls = 0

    def run(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        nonlocal calls
        calls += 1
        call = partial(update, *args, **kwargs)
        return call() if calls < steps else measure(call)

    return run


def profile_tables(path: Path):  # noqa: ANN201
    """A ``measure`` for :func:`on_last_call`: the call under ``torch.profiler``, its tables in ``path``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    def measure(call):  # noqa: ANN001, ANN202
        cuda = torch.cuda.is_available()
        sync = torch.cuda.synchronize if cuda else lambda: None
        sync()
        start = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
            out = call()
            sync()
        wall = time.perf_counter() - start
        events = prof.key_averages()
        device = sum(e.self_device_time_total for e in events) / 1e6
        counts = {e.key: e.count for e in events if e.key in PROFILE_COUNTED}
        path.write_text(
            f"training stage: {wall:.3f} s wall, {device:.3f} s of device time; calls {counts}\n\n"
            + events.table(sort_by="self_cpu_time_total", row_limit=40)
            + "\n\n"
            + events.table(sort_by="self_device_time_total", row_limit=30)
        )
        return out

    return measure


PROFILE_COUNTED = (
    "cudaStreamSynchronize",
    "cudaMemcpyAsync",
    "cudaLaunchKernel",
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "cudaDeviceSynchronize",
)


def run_nereus(  # noqa: ANN001
    folder: Path,
    steps: int,
    new_tokens: int,
    out: Path,
    plan,
    cluster,
    measure=None,
    layers: str = "compiled",
) -> dict:
    """nereus GRPO on GPU 0 under ``plan``: bf16 weights with fp32 masters, decoder layers run as
    ``layers`` (``algorithm.layers``); with ``measure``, the last step's training stage runs through it
    (:func:`on_last_call`)."""
    import csv

    import lightning.pytorch as pl
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch

    from nereus_lightning.lightning import GRPOModule, NereusCallback, NereusStrategy

    data = out / "prompts.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": p, "data_source": "bench", "ground_truth": ""} for p in prompts()]),
        data,
    )
    module = GRPOModule(
        actor=str(folder),
        data={"train_files": str(data), "max_response_length": new_tokens, "shuffle": False},
        reward_function=reward,
        prompts_per_step=PROMPTS,
        samples_per_prompt=SAMPLES,
        actor_lr=1e-6,
        kl_loss_coef=0.001,
        ignore_eos=True,
        layers=layers,
    )
    if measure is not None:
        module.update = on_last_call(module.update, steps, measure)
    trainer = pl.Trainer(
        accelerator="gpu" if torch.cuda.is_available() else "cpu",
        devices=1,
        precision="bf16-mixed",
        max_steps=steps,
        strategy=NereusStrategy(plan=plan, cluster=cluster, export_hf=False),
        callbacks=[NereusCallback(controller=keep_plan(plan))],
        logger=pl.loggers.CSVLogger(out, name="nereus"),
        log_every_n_steps=1,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(module)
    fit_s = time.perf_counter() - start
    rows = [
        r
        for r in csv.DictReader(open(next((out / "nereus").glob("*/metrics.csv"))))
        if r.get("timing_s/step")
    ]
    steps_ = [
        {
            "step_s": float(r["timing_s/step"]),
            "gen_s": float(r["timing_s/gen"]),
            "infer_s": float(r["timing_s/infer"]),
            "train_s": float(r["timing_s/update_actor"]),
            "peak_gib": float(r.get("perf/max_memory_allocated_gb") or 0.0),
            "peak_gib_by_stage": {
                k: float(r.get(f"perf/max_memory_allocated_gb/{k}") or 0.0) for k in ("gen", "infer", "train")
            },
        }
        for r in rows
    ]
    return {"steps": steps_, "fit_s": fit_s, "plan": str(plan)}


def run_trl(folder: Path, steps: int, new_tokens: int, out: Path) -> dict:
    """TRL's GRPOTrainer (transformers generate, no vLLM) on the same prompts, samples and lengths."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    def trl_reward(completions, **kwargs):  # noqa: ANN001, ANN202
        texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
        return [reward(solution_str=t) for t in texts]

    records: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start, self.gen = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            torch.cuda.synchronize()
            step = time.perf_counter() - self.start
            records.append(
                {
                    "step_s": step,
                    "gen_s": self.gen,
                    "infer_train_s": step - self.gen,
                    "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
                }
            )

    timer = Timer()
    config = GRPOConfig(
        output_dir=str(out / "trl"),
        per_device_train_batch_size=PROMPTS * SAMPLES,
        num_generations=SAMPLES,
        max_completion_length=new_tokens,
        temperature=1.0,
        beta=0.001,
        learning_rate=1e-6,
        bf16=True,
        gradient_accumulation_steps=1,
        num_iterations=1,
        max_steps=steps,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        generation_kwargs={"min_new_tokens": new_tokens},
        model_init_kwargs={"dtype": torch.bfloat16},
    )
    tokenizer = AutoTokenizer.from_pretrained(folder)
    dataset = Dataset.from_list([{"prompt": p} for p in prompts()] * steps)
    trainer = GRPOTrainer(
        model=str(folder),
        reward_funcs=trl_reward,
        args=config,
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[timer],
    )
    generate = trainer.model.generate

    def timed_generate(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = generate(*args, **kwargs)
        torch.cuda.synchronize()
        timer.gen += time.perf_counter() - start
        return result

    trainer.model.generate = timed_generate
    start = time.perf_counter()
    trainer.train()
    return {"steps": records, "fit_s": time.perf_counter() - start}


def cost_model(plan, models, cluster, workload, measured: list[dict]) -> dict:  # noqa: ANN001
    """The planner's seconds per stage for the plan nereus ran, before and after calibrating on 3 steps."""
    from nereus_lightning.control.attribution import calibrate_on_phases, phase_times_of
    from nereus_lightning.plan.calibration import Calibration
    from nereus_lightning.plan.estimate import estimate_plan

    phases = [{"gen": s["gen_s"], "infer": s["infer_s"], "update_actor": s["train_s"]} for s in measured]
    before = phase_times_of(estimate_plan(plan, models, cluster, workload))
    calibration = Calibration()
    for observed in phases[:3]:
        calibrate_on_phases(
            calibration, estimate_plan(plan, models, cluster, workload, calibration), observed
        )
    after = phase_times_of(estimate_plan(plan, models, cluster, workload, calibration))
    median = {k: statistics.median(p[k] for p in phases) for k in phases[0]}
    return {"measured": median, "before": before, "after": after, "efficiencies": calibration.efficiencies()}


def _slots(run: dict) -> str:
    """The inference/training micro-batch and recompute a run used ("planner: mb16" when not overridden)."""
    if run["system"] != "nereus":
        return "-"
    choice = run["planner_choice"]["actor_train"]
    mb = run.get("micro_batch") or choice["micro_batch"]
    rc = choice["recompute"] if run.get("recompute") is None else bool(run["recompute"])
    who = "planner: " if run.get("micro_batch") is None and run.get("recompute") is None else ""
    return f"{who}mb{mb}{' recompute' if rc else ''}"


def _median_steps(run: dict) -> dict[str, float]:
    steps = run["steps"][run["warmup"] :]
    return {k: statistics.median(s[k] for s in steps) for k in steps[0] if not isinstance(steps[0][k], dict)}


def _stage_peaks(run: dict) -> str:
    """Measured peak GiB per stage (gen/infer/train; the step's for TRL) and, for nereus, the prediction."""
    steps = run["steps"][run["warmup"] :]
    if run["system"] != "nereus":
        return f"{max(s['peak_gib'] for s in steps):.1f}"
    measured = {k: max(s["peak_gib_by_stage"][k] for s in steps) for k in ("gen", "infer", "train")}
    predicted = run.get("predicted_peak_gib", {})
    return " / ".join(f"{measured[k]:.1f} ({predicted.get(k, float('nan')):.1f})" for k in measured)


def report(paths: list[Path]) -> str:
    """A markdown table of the runs in ``paths`` (median of the steps after the warm-up), grouped by
    shape and response length, with nereus's speed-up over TRL and its peak against TRL's + 12 B/param."""
    runs = [json.loads(p.read_text()) for p in paths]
    rows = [
        "| shape | N | system | slots | s/step | gen s | infer s | train s | gen tok/s "
        "| peak GiB: gen / infer / train (predicted) | vs TRL |",
        "| --- " * 11 + "|",
    ]
    trl = {(r["shape"], r["new_tokens"]): r for r in runs if r["system"] == "trl"}
    for run in sorted(runs, key=lambda r: (r["shape"], r["new_tokens"], r["system"] != "nereus")):
        med = _median_steps(run)
        infer = f"{med['infer_s']:.2f}" if "infer_s" in med else f"({med['infer_train_s']:.2f} with train)"
        train = f"{med['train_s']:.2f}" if "train_s" in med else "-"
        tokens = PROMPTS * SAMPLES * run["new_tokens"]
        versus = "-"
        other = trl.get((run["shape"], run["new_tokens"]))
        if run["system"] == "nereus" and other is not None:
            base = _median_steps(other)
            peak = max(s["peak_gib"] for s in run["steps"][run["warmup"] :])
            trl_peak = max(s["peak_gib"] for s in other["steps"][other["warmup"] :])
            allowed = trl_peak + 12 * run["params"] / 2**30
            versus = f"{base['step_s'] / med['step_s']:.1f}x faster; peak {peak:.1f} vs {allowed:.1f} allowed"
        rows.append(
            f"| {run['shape']} | {run['new_tokens']} | {run['system']} | {_slots(run)} | {med['step_s']:.2f} "
            f"| {med['gen_s']:.2f} | {infer} | {train} | {tokens / med['gen_s']:,.0f} | {_stage_peaks(run)} "
            f"| {versus} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None, profiler=profile_tables) -> None:  # noqa: ANN001
    """Run one system and shape (``--system``), or print the table of earlier runs (``--report``);
    ``--profile`` runs the last training stage through ``profiler(path)``'s measure."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", choices=("nereus", "trl"))
    parser.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--work", default=os.environ.get("TMPDIR", "/tmp") + "/nereus-gpu-e2e")
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--report", nargs="*", help="JSON files of earlier runs")
    parser.add_argument("--micro-batch", type=int, help="override the plan's inference/training micro-batch")
    parser.add_argument("--recompute", type=int, choices=(0, 1), help="override recompute (0/1)")
    parser.add_argument("--tag", default="", help="suffix of the result file (e.g. mb4)")
    parser.add_argument("--profile", action="store_true", help="profile the last step's training stage")
    parser.add_argument("--layers", default="compiled", help="algorithm.layers: compiled or eager")
    args = parser.parse_args(argv if argv is not None else sys.argv[1:])
    if args.report is not None:
        print(report([Path(p) for p in args.report]))
        return
    import torch

    if args.system is None or not (torch.cuda.is_available() or args.shape == "tiny"):
        print(
            "bench_gpu_e2e: needs a CUDA GPU and --system nereus|trl (--shape tiny runs on the CPU); skipped"
        )
        return
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    folder = make_folder(args.shape, work)
    run_dir = work / f"{args.system}-{args.shape}-n{args.new_tokens}{args.tag and '-' + args.tag}"
    shutil.rmtree(run_dir, ignore_errors=True)  # one run's logs only
    run_dir.mkdir()
    if args.system == "nereus":
        plan, models, cluster, workload = planned(folder, args.new_tokens)
        chosen = {n: {"micro_batch": c.micro_batch, "recompute": c.recompute} for n, c in plan.assignments}
        recompute = None if args.recompute is None else bool(args.recompute)
        plan = with_slots(plan, args.micro_batch, recompute)
        profile = Path(args.out) / f"profile_{args.shape}_n{args.new_tokens}.txt"
        measure = profiler(profile) if args.profile else None
        result = run_nereus(folder, args.steps, args.new_tokens, run_dir, plan, cluster, measure, args.layers)
        result["planner_choice"] = chosen
        result["predicted_peak_gib"] = predicted_peaks(plan, models, cluster, workload)
        result["cost_model"] = cost_model(plan, models, cluster, workload, result["steps"][args.warmup :])
        print(json.dumps(result["cost_model"], indent=1))
    else:
        gpu_bytes()
        result = run_trl(folder, args.steps, args.new_tokens, run_dir)
    result.update(
        system=args.system,
        shape=args.shape,
        warmup=args.warmup,
        new_tokens=args.new_tokens,
        gpu=torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        torch=torch.__version__,
        transformers=importlib.metadata.version("transformers"),
        micro_batch=args.micro_batch,
        recompute=args.recompute,
        layers=args.layers if args.system == "nereus" else None,
        params=params_of(folder),
        gpu_gib=gpu_bytes() / 2**30 if torch.cuda.is_available() else None,
    )
    name = f"gpu_e2e_{args.system}_{args.shape}_n{args.new_tokens}{args.tag and '_' + args.tag}.json"
    path = Path(args.out) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    print(report([path]))
    gc.collect()


if __name__ == "__main__":
    main()
