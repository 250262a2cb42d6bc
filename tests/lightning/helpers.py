"""Module-level functions run on the gloo worker pool by the lightning tests."""

from __future__ import annotations

import os

import torch

from nereus_lightning.lightning import GRPOModule, PPOModule
from nereus_lightning.lightning.tasks import RepeatTask
from nereus_lightning.plan.layout import Candidate, Layout, Plan
from nereus_lightning.spec.workload import workflow


def small_task(seed: int = 0) -> RepeatTask:
    """A short task so that steps are fast."""
    return RepeatTask(start_len=3, max_len=6, grow_every=2, seed=seed)


def plan_of(algorithm: str, placement: dict[str, tuple[int, ...]]) -> Plan:
    """Layout(1,1) replicas on the given GPUs per model-stage (all ranks by default)."""
    return Plan.of({m.name: Candidate(Layout(1, 1), len(placement.get(m.name, (0, 1, 2, 3))),
                                      placement.get(m.name, (0, 1, 2, 3))) for m in workflow(algorithm)})


def one_update(rank: int, world_size: int, placement: dict[str, tuple[int, ...]], algorithm: str = "ppo") -> dict:
    """Build the module (same seed everywhere), run one RL step under ``placement``; return params and metrics."""
    torch.manual_seed(0)
    cls = PPOModule if algorithm == "ppo" else GRPOModule
    module = cls(task=small_task(), prompts_per_step=8, seed=3)
    opt = module.configure_optimizers()
    metrics = module.rl_step(0, plan=plan_of(algorithm, placement), optimizer=opt)
    params = {f"actor.{n}": p.detach().clone() for n, p in module.actor.named_parameters()}
    if module.critic is not None:
        params.update({f"critic.{n}": p.detach().clone() for n, p in module.critic.named_parameters()})
    return {"params": params, "metrics": metrics}
