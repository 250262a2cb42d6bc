"""``nereus-train``: RL post-training with adaptive parallelism, configured by Hydra.

With no arguments it runs the embedded default: a tiny Llama-style actor built from a config,
the byte tokenizer, the repeat task (answers grow as training goes on), PPO on 4 gloo CPU
processes, and a GPU-supply schedule that takes a rank away and gives it back. Examples::

    nereus-train
    nereus-train algorithm=grpo trainer.max_steps=40
    nereus-train +experiment=quick logger=tensorboard
    nereus-train ckpt_path=outputs/.../checkpoints/last.ckpt trainer.devices=2
"""

from __future__ import annotations

import glob
import json
import os
import sys
from typing import Any

from nereus_lightning.spec.errors import InfeasiblePlanError, NereusConfigError

CONFIG_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


def check_feasible(cfg: Any, world_size: int) -> None:
    """Fail fast, before any model is built: the planner must find a plan for the first pool."""
    from nereus_lightning.plan.planner import plan_job

    counts = cfg.resources.get("counts") if cfg.get("resources") else None
    pool = min(int(counts[0]), world_size) if counts else world_size
    cluster = job_cluster(cfg).with_gpus(pool)
    plan_job(_job_models(cfg), cluster, _workload(cfg, float(cfg.task.get("start_len", 8)) + 3))


def job_cluster(cfg: Any) -> Any:
    """The cluster preset of ``cfg`` with its per-GPU memory override applied (``"auto"``: see below)."""
    from dataclasses import replace

    from nereus_lightning.spec import cluster_preset

    cluster = cluster_preset(str(cfg.cluster))
    memory = cfg.get("cluster_gpu_memory")
    if memory == "auto":
        memory = tight_gpu_memory(cfg, cluster)
    return replace(cluster, gpu_memory=float(memory)) if memory else cluster


def job_cluster_preset(cfg: Any) -> Any:
    """The cluster preset named by ``cfg.cluster``."""
    from nereus_lightning.spec import cluster_preset

    return cluster_preset(str(cfg.cluster))


def _workload(cfg: Any, length: float) -> Any:
    from nereus_lightning.spec import Workload

    return Workload(
        algorithm=_algorithm_name(cfg),
        prompts_per_step=int(cfg.algorithm.prompts_per_step),
        samples_per_prompt=int(cfg.algorithm.get("samples_per_prompt", 1)),
        prompt_len=4,
        response_len=float(length),
        response_len_p95=float(length),
        reward_model=bool(cfg.get("reward_model")),
    )


def _job_models(cfg: Any) -> Any:
    from nereus_lightning.plan.planner import job_models
    from nereus_lightning.spec import model_preset

    actor = model_preset(cfg.actor.preset)
    critic = model_preset(cfg.actor.critic) if cfg.actor.get("critic") else actor
    reward = model_preset(cfg.reward_model) if cfg.get("reward_model") else None
    return job_models(actor, critic=critic if _algorithm_name(cfg) == "ppo" else None, reward=reward)


def _threshold(ok: Any, lo: float, hi: float) -> float | None:
    """The smallest memory in [lo, hi] for which ``ok(memory)`` holds (bisection to 1 kB), None if none."""
    if not ok(hi):
        return None
    while hi - lo > 1e3:
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    return hi


def tight_gpu_memory(cfg: Any, cluster: Any) -> float | None:
    """Per-GPU memory that makes the run's drift matter, found with the planner itself.

    Just too small for the longest responses' state under one-rank layouts (the planner must
    split a model-stage with TP or PP when responses have grown), yet enough for one-rank layouts
    at the first steps and for a feasible plan while the supply schedule holds the fewest ranks.
    None (keep the preset) when no such memory exists.
    """
    from dataclasses import replace

    from nereus_lightning.plan.planner import plan_job
    from nereus_lightning.spec.errors import InfeasiblePlanError

    task = cfg.task
    models = _job_models(cfg)
    steps = int(cfg.trainer.max_steps)

    def budget(step: int) -> float:
        grown = int(task.start_len) + step // max(int(task.grow_every), 1)
        return float(min(int(task.max_len), grown) + 3)

    counts = list(cfg.resources.counts) if cfg.get("resources") and cfg.resources.get("counts") else [0]
    full = max(counts) if counts[0] else int(cfg.trainer.devices)
    fewest = min(counts) if counts[0] else full
    low_steps = [i for i, c in enumerate(counts) if c == fewest] or [0]

    def plan(memory: float, length: float, gpus: int) -> Any:
        try:
            return plan_job(
                models, replace(cluster, gpu_memory=memory).with_gpus(gpus), _workload(cfg, length)
            ).plan
        except InfeasiblePlanError:
            return None

    def single(memory: float, length: float, gpus: int) -> bool:
        p = plan(memory, length, gpus)
        return p is not None and all(c.layout.size == 1 for _, c in p.items())

    lo, hi = 0.0, cluster.gpu_memory
    start = _threshold(lambda m: single(m, budget(0), full), lo, hi)
    during_drop = _threshold(lambda m: plan(m, budget(max(low_steps)), fewest) is not None, lo, hi)
    end = _threshold(lambda m: single(m, budget(steps - 1), full), lo, hi)
    if start is None or during_drop is None or end is None:
        return None
    floor = max(start, during_drop)
    return (floor + end) / 2 if end - floor > 2e3 else None


def _algorithm_name(cfg: Any) -> str:
    target = str(cfg.algorithm._target_)
    for name, cls in (("grpo", "GRPOModule"), ("remax", "ReMaxModule"), ("ppo", "PPOModule")):
        if target.endswith(cls):
            return name
    raise NereusConfigError(
        f"algorithm._target_: {target!r} is not one of PPOModule, GRPOModule, ReMaxModule"
    )


def _world_size(cfg: Any) -> int:
    devices = cfg.trainer.get("devices", 1)
    if isinstance(devices, int) and devices > 0:
        return devices
    if cfg.trainer.get("accelerator") == "cpu":
        return os.cpu_count() or 1
    import torch

    return max(torch.cuda.device_count(), 1)


def _quiet() -> None:
    """Silence third-party warnings that say nothing about this run (inherited by forked ranks)."""
    import warnings

    for pattern in (
        ".*past_key_values.*",
        ".*LeafSpec.*",
        ".*in eval mode at the start of training.*",
        ".*`overwrite` will default to False.*",
        ".*assuming the intent is to save in a single process.*",
        ".*optimizer.step\\(\\).*",
        ".*weights_only.*",
        ".*ModelCheckpoint with manual optimization.*",
        ".*does not have many workers.*",
        ".*Checkpoint directory.*exists.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)


def run(cfg: Any) -> dict[str, Any]:
    """Train as configured; returns a summary (reward first/last 10 steps, transitions, paths)."""
    import time

    started = time.perf_counter()
    import lightning.pytorch as pl

    from nereus_lightning.console_log import propagate_to_root

    propagate_to_root()  # each log record once: through Hydra's handlers, not also Lightning's
    _quiet()
    from hydra.utils import instantiate

    from nereus_lightning.control import SequenceResources
    from nereus_lightning.lightning import NereusCallback, NereusStrategy
    from nereus_lightning.lightning.console import print_summary
    from nereus_lightning.lightning.progress import NereusProgressBar

    world = _world_size(cfg)
    if cfg.get("cluster_gpu_memory") == "auto":  # resolve once, here, for every rank
        from omegaconf import open_dict

        with open_dict(cfg):
            cfg.cluster_gpu_memory = tight_gpu_memory(cfg, job_cluster_preset(cfg))
        memory = cfg.cluster_gpu_memory
        print(
            f"nereus-train: per-GPU memory {memory:.6g} bytes (auto)"
            if memory
            else "nereus-train: cluster_gpu_memory=auto found no memory that forces a layout change; keeping the preset's"
        )
    check_feasible(cfg, world)
    out = str(cfg.output_dir)
    os.makedirs(out, exist_ok=True)
    task = instantiate(cfg.task, seed=int(cfg.seed))
    # Partial first: objects passed to instantiate() would be turned into configs.
    module = instantiate(cfg.algorithm, _partial_=True)(
        actor=cfg.actor.preset,
        critic=cfg.actor.get("critic"),
        reward_model=cfg.get("reward_model"),
        task=task,
        seed=int(cfg.seed),
    )
    counts = cfg.resources.get("counts") if cfg.get("resources") else None
    resources = SequenceResources(tuple(int(c) for c in counts)) if counts else None

    def controller(pl_module: Any, world_size: int) -> Any:
        from nereus_lightning.lightning.control import default_controller

        return default_controller(
            pl_module,
            world_size,
            os.path.join(out, "decisions.jsonl"),
            cluster=job_cluster(cfg),
            **dict(cfg.controller or {}),
        )

    plot_path = os.path.join(out, "run.png") if cfg.plot else None
    if cfg.get("adapt", True):
        callback = NereusCallback(controller=controller, resources=resources, plot_path=plot_path)
    else:  # adaptation off: every model-stage data-parallel over all ranks, never changed
        from nereus_lightning.lightning import PoolFollower

        callback = NereusCallback(controller=PoolFollower(_algorithm_name(cfg)), plot_path=plot_path)
    ckpt_dir = os.path.join(out, "checkpoints")
    checkpoint = pl.callbacks.ModelCheckpoint(
        dirpath=ckpt_dir,
        filename="step{step}",
        every_n_train_steps=int(cfg.get("checkpoint_every", 10)),
        save_last=True,  # checkpoints/last.ckpt: written by the ranks themselves, resumable
        save_top_k=-1,
        auto_insert_metric_name=False,
    )
    loggers = [instantiate(v) for v in (cfg.logger or {}).values()]
    callbacks = [callback, NereusProgressBar()] + ([checkpoint] if cfg.save_checkpoint else [])
    trainer = instantiate(
        cfg.trainer,
        strategy=NereusStrategy(cluster=job_cluster(cfg)),
        callbacks=callbacks,
        logger=loggers or False,
        enable_checkpointing=bool(cfg.save_checkpoint),
    )
    try:
        trainer.fit(module, ckpt_path=cfg.ckpt_path)
    except Exception as exc:  # a rank died or raised: say so and point at the last checkpoint
        last = latest_checkpoint(ckpt_dir)
        hint = f"resume with: nereus-train ckpt_path={last}" if last else "no checkpoint was written yet"
        raise RuntimeError(f"training stopped: {type(exc).__name__}: {exc}\n{hint}") from exc
    summary = summarize(out)
    summary["plot"] = plot_path
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print_summary(summary, out, wall_s=time.perf_counter() - started)
    return summary


def latest_checkpoint(ckpt_dir: str) -> str | None:
    """The newest checkpoint directory under ``ckpt_dir`` (None if there is none)."""
    found = [p for p in glob.glob(os.path.join(ckpt_dir, "*")) if os.path.isdir(p)]
    return max(found, key=os.path.getmtime) if found else None


def summarize(out: str) -> dict[str, Any]:
    """Reward over the first and last 10 steps, transitions and plan changes, from the CSV log."""
    import csv

    files = sorted(glob.glob(os.path.join(out, "logs", "*", "metrics.csv")), key=os.path.getmtime)
    if not files:
        return {}
    rows = [r for r in csv.DictReader(open(files[-1])) if r.get("critic/score/mean")]
    scores = [float(r["critic/score/mean"]) for r in rows]
    trans = [r for r in rows if float(r.get("timing_s/transition") or 0) > 0]
    first = scores[:10]
    last = scores[-10:]
    return {
        "steps": len(scores),
        "reward_first10": sum(first) / max(len(first), 1),
        "reward_last10": sum(last) / max(len(last), 1),
        "transitions": len(trans),
        "transition_steps": [int(float(r["step"])) for r in trans],
        "metrics_csv": files[-1],
    }


def main() -> None:
    """The ``nereus-train`` entry point (Hydra)."""
    import hydra
    from omegaconf import DictConfig

    from nereus_lightning.cli._help import register_help_resolver

    register_help_resolver()

    @hydra.main(version_base="1.3", config_path="../configs", config_name="train")
    def _main(cfg: DictConfig) -> None:
        try:
            run(cfg)
        except (NereusConfigError, InfeasiblePlanError) as exc:
            print(f"nereus-train: {exc}", file=sys.stderr)
            sys.exit(2)

    _main()


if __name__ == "__main__":
    main()
