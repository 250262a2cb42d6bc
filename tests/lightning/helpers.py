"""Module-level functions run on the gloo worker pool by the lightning tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager, nullcontext

import torch

from nereus_lightning.lightning import GRPOModule, NereusStrategy, PPOModule
from nereus_lightning.plan.layout import Candidate, Plan
from nereus_lightning.rl.tasks import DenseRepeatTask
from nereus_lightning.spec.workload import workflow
from tests.helpers import cand


def small_task(seed: int = 0) -> DenseRepeatTask:
    """A short task so that steps are fast."""
    return DenseRepeatTask(start_len=3, max_len=6, grow_every=2, seed=seed)


def plan_of(algorithm: str, placement: dict) -> Plan:
    """Per model-stage: GPUs (Layout(1,1) replicas), ``((tp, pp), gpus)`` or a Candidate; all ranks, dp4 by
    default."""
    out = {}
    for m in workflow(algorithm):
        spec = placement.get(m.name, (0, 1, 2, 3))
        if isinstance(spec, Candidate):
            out[m.name] = spec
        else:
            out[m.name] = cand(*spec[0], spec[1]) if isinstance(spec[0], tuple) else cand(1, 1, spec)
    return Plan.of(out)


def strategy_at(module, placement: dict, algorithm: str = "ppo") -> NereusStrategy:  # noqa: ANN001
    """``module``'s strategy outside a Trainer, its units built under ``placement`` (collective)."""
    strategy = NereusStrategy.without_trainer(module)
    strategy.transition(plan_of(algorithm, placement))
    return strategy


def one_update(
    rank: int,
    world_size: int,
    placement: dict[str, tuple[int, ...]],
    algorithm: str = "ppo",
    after: Callable[[NereusStrategy], None] | None = None,
    **kwargs: object,
) -> dict:
    """Build the module (same seed everywhere), run one RL step under ``placement``; return params and
    metrics. ``after`` sees the strategy right after the step; ``kwargs`` go to the module (GRPO's
    defaults for an algorithm without a critic).

    Parameters are the logical ones, gathered from the EMUs onto rank 0 (other ranks return none).
    """
    torch.manual_seed(0)
    cls = PPOModule if algorithm == "ppo" else GRPOModule
    module = cls(task=small_task(), prompts_per_step=8, seed=3, adv_estimator=algorithm, **kwargs)
    opt = module.configure_optimizers()
    strategy = strategy_at(module, placement, module.algorithm)
    metrics = module.rl_step(0, strategy, opt)
    if after is not None:
        after(strategy)
    params: dict[str, torch.Tensor] = {}
    roles = [("actor", "actor_train")] + ([("critic", "critic_train")] if module.critic is not None else [])
    for role, stage in roles:
        full = strategy.units.logical_params(stage) or {}
        params.update({f"{role}.{n}": p.detach().clone() for n, p in full.items()})
    return {"params": params, "metrics": metrics}


def rollout_and_scores(rank: int, world_size: int, placement: dict) -> dict:
    """One RL step under ``placement``; the module's rollout and scores next to the rl reference path's
    (``HFGenerateEngine`` over the full actor, seeds of the global sample indices, ``rl.forward``)."""
    import copy

    from nereus_lightning.engines.base import sample_seeds
    from nereus_lightning.engines.hf import HFGenerateEngine
    from nereus_lightning.rl.forward import response_log_probs, response_values

    torch.manual_seed(0)
    module = PPOModule(task=small_task(), prompts_per_step=8, seed=3)
    actor, critic = copy.deepcopy(module.actor), copy.deepcopy(module.critic)  # before the EMUs take them
    module.rl_step(0, strategy_at(module, placement), module.configure_optimizers())
    batch, tok = module.last_rollout, module.tokenizer
    want = HFGenerateEngine(actor, tok.eos_token_id, tok.pad_token_id).generate(
        batch.prompt_ids,
        batch.prompt_mask,
        module.source.max_response_len(0),
        sample_seeds=sample_seeds(3, 0, range(len(batch))),
    )
    width = batch.response_ids.shape[-1]
    args = (batch.prompt_ids, batch.prompt_mask, batch.response_ids, batch.response_mask)
    with torch.no_grad():
        log_probs, _ = response_log_probs(actor, *args)
        values = response_values(critic, *args)
    return {
        "same_responses": torch.equal(want.response_ids[:, :width], batch.response_ids)
        and torch.equal(want.response_mask[:, :width], batch.response_mask)
        and not want.response_mask[:, width:].any(),
        "log_prob_err": float((log_probs - batch.old_log_probs).abs().max()),
        "value_err": float((values - batch.values).abs().max()),
    }


def quiet_trainer(devices: int, strategy, max_steps: int, callbacks: list, logger, **kwargs):  # noqa: ANN001, ANN201
    """A CPU ``Trainer`` logging every step, without a bar, a model summary or (unless asked) checkpoints."""
    import lightning.pytorch as pl

    kwargs.setdefault("enable_checkpointing", False)
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_steps=max_steps,
        callbacks=callbacks,
        logger=logger,
        log_every_n_steps=1,
        enable_model_summary=False,
        enable_progress_bar=False,
        **kwargs,
    )


def fit(
    tmp: str,
    devices: int,
    max_steps: int,
    algorithm: str = "ppo",
    ckpt_path: str | None = None,
    every: int = 0,
    module=None,
    last: bool = False,
    write_back: bool = False,
    precision: str = "32-true",
):  # noqa: ANN001, ANN201
    """A short Trainer run with DP-only plans over all ranks; returns the trainer and metric rows.

    ``every``: a checkpoint ``ckpt/s<step>.ckpt`` every that many steps (and ``ckpt/last.ckpt``
    with ``last``); ``write_back``: the strategy's; ``precision``: the Trainer's.
    """
    import csv
    import glob

    import lightning.pytorch as pl

    from nereus_lightning.control import PoolFollower
    from nereus_lightning.lightning import NereusCallback, ReMaxModule

    classes = {"ppo": PPOModule, "grpo": GRPOModule, "remax": ReMaxModule}
    if module is None:
        kwargs = (
            {"samples_per_prompt": 2, "prompts_per_step": 4}
            if algorithm == "grpo"
            else {"prompts_per_step": 8}
        )
        module = classes[algorithm](task=small_task(), seed=3, **kwargs)
    callbacks = [NereusCallback(controller=PoolFollower(module.algorithm))]
    if every:
        callbacks.append(
            pl.callbacks.ModelCheckpoint(
                dirpath=os.path.join(tmp, "ckpt"),
                filename="s{step}",
                every_n_train_steps=every,
                save_top_k=-1,
                save_last=last,
                auto_insert_metric_name=False,
            )
        )
    trainer = quiet_trainer(
        devices,
        NereusStrategy(write_back=write_back),
        max_steps,
        callbacks,
        pl.loggers.CSVLogger(tmp, name="logs"),
        precision=precision,
        enable_checkpointing=bool(every),
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    files = sorted(glob.glob(os.path.join(tmp, "logs", "*", "metrics.csv")), key=os.path.getmtime)
    rows = [r for r in csv.DictReader(open(files[-1])) if r.get("critic/score/mean")]
    return trainer, rows


class DyingPPOModule(PPOModule):
    """PPO whose rank 1 dies (hard exit) at RL step 2: the failure-path test."""

    def rl_step(self, step, strategy, optimizer=None):  # noqa: ANN001, ANN201
        if step == 2 and torch.distributed.get_rank() == 1:
            os._exit(3)
        return super().rl_step(step, strategy, optimizer)


# Two PPO plans the transition brain accepts (model-stages of one stage on disjoint ranks). P1 -> P2
# merges actor_gen into TP4, splits both trainers, extends actor_infer and destroys a critic_infer
# replica; P2 -> P1 undoes it.
EMU_P1 = {
    "actor_gen": ((2, 1), (0, 1, 2, 3)),
    "actor_infer": (0,),
    "ref_infer": (1,),
    "critic_infer": (2, 3),
    "actor_train": ((2, 1), (0, 1)),
    "critic_train": ((1, 2), (2, 3)),
}
EMU_P2 = {
    "actor_gen": ((4, 1), (0, 1, 2, 3)),
    "actor_infer": (0, 1),
    "ref_infer": (2,),
    "critic_infer": (3,),
    "actor_train": (0, 1),
    "critic_train": (2, 3),
}


def emu_transitions(rank: int, world_size: int) -> dict:
    """Steps under P1, P2, P1: each plan change runs a transition DAG; logical state kept bit for bit."""

    torch.manual_seed(0)
    module = PPOModule(task=small_task(), prompts_per_step=4, seed=3)
    opt = module.configure_optimizers()
    strategy = NereusStrategy.without_trainer(module)
    plans = [plan_of("ppo", p) for p in (EMU_P1, EMU_P2, EMU_P1)]
    out: dict = {"transitions": [], "diffs": [], "rewards": []}
    for step, plan in enumerate(plans):
        before = None
        if step:
            before = {n: strategy.units.logical_state(n) for n in strategy.units.plan}
        strategy.transition(plan)
        if step:
            info = dict(strategy.units.last_transition)
            info.pop("observations", None)
            out["transitions"].append(info)
            after = {n: strategy.units.logical_state(n) for n in strategy.units.plan}
            if rank == 0:
                out["diffs"].append({n: before[n].differences(after[n]) for n in before})
        metrics = module.rl_step(step, strategy, opt)
        out["rewards"].append(metrics["critic/score/mean"])
    out["full_model_numel"] = sum(p.numel() for p in module.actor.parameters())
    return out


def emu_infeasible_keeps_plan(rank: int, world_size: int) -> dict:
    """A target the brain calls infeasible leaves the units (and the strategy's plan) where they are."""
    from nereus_lightning import transition
    from nereus_lightning.spec.errors import InfeasiblePlanError

    module = PPOModule(task=small_task(), prompts_per_step=4, seed=3)
    strategy = strategy_at(module, EMU_P1)
    kept, p1 = strategy.units.plan, strategy.plan

    def infeasible(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise InfeasiblePlanError("test: no safe order")

    build, transition.build_transition = transition.build_transition, infeasible
    try:
        strategy.transition(plan_of("ppo", EMU_P2))
    finally:
        transition.build_transition = build
    return {
        "moved": strategy.units.plan != kept,
        "same": strategy.plan == p1,
        "info": dict(strategy.units.last_transition),
    }


class NaNGradientPPOModule(PPOModule):
    """PPO whose advantages turn NaN at RL step 1, so the actor's gradient norm is NaN: the guard's test."""

    def update(self, strategy, batch, optimizer=None, step=0):  # noqa: ANN001, ANN201
        if step == 1:
            batch.advantages = batch.advantages * float("nan")
        return super().update(strategy, batch, optimizer, step)


def _poisoning(move):  # noqa: ANN001, ANN202
    """``move`` (EMU.offload / onload), then every tensor into fresh
    storage and the old one filled with NaN.
    """

    def moved(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        was = self.resident
        move(self, *args, **kwargs)
        if self.resident != was:
            for _, _, tensor in self._all():
                old = tensor.data
                tensor.data = old.clone()
                if old.is_floating_point():
                    old.fill_(float("nan"))
                    if self.stale:  # offloaded without its values: none may be read before a refill
                        tensor.data.fill_(float("nan"))

    return moved


@contextmanager
def storage_moves():  # noqa: ANN201
    """EMU offload and onload that move storage on the CPU too (where host and device are one).

    Each move gives every tensor of the unit fresh storage and poisons the old one with NaN, as a
    real host/device move leaves the old place invalid: whatever still reads the old storage (a
    module parameter that is not the EMU's tensor, a weight sync into a stale copy) computes NaN.
    A unit offloaded without its values (``keep=False``) is NaN on the host too: only its refill makes
    it right.
    """
    from nereus_lightning.emu import EMU

    offload, onload = EMU.offload, EMU.onload
    EMU.offload, EMU.onload = _poisoning(offload), _poisoning(onload)
    try:
        yield
    finally:
        EMU.offload, EMU.onload = offload, onload


def _trained_state(strategy: NereusStrategy) -> dict:
    """The logical parameters of every model-stage on rank 0 (empty elsewhere; collective)."""
    out = {}
    for stage in strategy.units.plan:
        full = strategy.units.logical_params(stage) or {}
        out.update({f"{stage}.{n}": p.detach().clone() for n, p in full.items()})
    return out


def offload_run(rank: int, world_size: int, placements: list, folder: str, moving: bool) -> dict:
    """PPO steps under ``placements`` (one step each: a change runs a transition), a save, then one
    step of a module resumed from it; with ``moving``, under :func:`storage_moves`.

    Returns rank 0's logical parameters of every model-stage at the end, this rank's unit
    residency after every step, every step's mean score, and before the save the model-stages that
    follow their training stage (and whether this rank's units of them are stale on the host).
    """
    plans = [plan_of("ppo", p) for p in placements]

    def fresh() -> tuple[PPOModule, NereusStrategy]:
        torch.manual_seed(0)
        module = PPOModule(task=small_task(), prompts_per_step=4, seed=3)
        return module, NereusStrategy.without_trainer(module)

    with storage_moves() if moving else nullcontext():
        module, strategy = fresh()
        opt = module.configure_optimizers()
        out: dict = {"residency": [], "scores": []}
        for step, plan in enumerate(plans):
            strategy.transition(plan)
            out["scores"].append(module.rl_step(step, strategy, opt)["critic/score/mean"])
            out["residency"].append(strategy.units.residency())
        following = strategy.units.residency_of.following
        out["following"] = dict(following)
        out["stale"] = {n: unit.stale for n in following if (unit := strategy.units._local(n)) is not None}
        strategy.units.save(folder)
        out["after_save"] = strategy.units.residency()
        resumed, again = fresh()
        again.units.resume_from = folder
        again.transition(plans[-1])
        metrics = resumed.rl_step(len(plans), again, resumed.configure_optimizers())
        out["scores"].append(metrics["critic/score/mean"])
        out["residency"].append(again.units.residency())
        out["params"] = _trained_state(again)
    return out


def update_and_reference(
    rank: int, world_size: int, placement: dict, algorithm: str = "ppo", **kwargs: object
) -> dict | None:
    """One RL step through the strategy under ``placement`` and, on rank 0, the one-process reference
    update (:func:`~nereus_lightning.rl.algorithm.update_actor` / ``update_critic``) of the same batch
    from the same weights; returns per model the relative difference of the two (rank 0 only)."""
    import copy

    from nereus_lightning.rl.algorithm import update_actor, update_critic
    from nereus_lightning.rl.update import ADAMW

    torch.manual_seed(0)
    cls = PPOModule if algorithm == "ppo" else GRPOModule
    module = cls(task=small_task(), prompts_per_step=8, seed=3, adv_estimator=algorithm, **kwargs)
    before = {"actor": copy.deepcopy(module.actor), "critic": copy.deepcopy(module.critic)}
    strategy = strategy_at(module, placement, module.algorithm)
    module.rl_step(0, strategy, module.configure_optimizers())
    batch, cfg = module.last_rollout, module.rl_config
    out: dict = {}
    for role, update in (("actor", update_actor), ("critic", update_critic)):
        got = strategy.units.logical_params(f"{role}_train") if before[role] is not None else None
        if got is None:  # not rank 0, or no such model
            continue
        net, lr = copy.deepcopy(before[role]), cfg.actor_lr if role == "actor" else cfg.critic_lr
        update(net, torch.optim.AdamW(net.parameters(), lr=lr, **ADAMW), batch, cfg)
        want = dict(net.named_parameters())
        flat_got = torch.cat([got[n].reshape(-1) for n in sorted(got)])
        flat_want = torch.cat([want[n].detach().reshape(-1) for n in sorted(got)])
        out[role] = float((flat_got - flat_want).norm() / flat_want.norm())  # as the layout tests measure
        out[f"{role}_moved"] = max(
            float((p - want[n]).abs().max()) for n, p in before[role].named_parameters()
        )
    return out or None
