"""The one update loop of an RL step: PPO epochs x mini-batches, one optimizer step of each trained model per
mini-batch.

The strategy (each training model-stage's replica, :class:`~nereus_lightning.lightning.module.RLModule`)
and the one-process reference (:func:`~nereus_lightning.rl.algorithm.update_actor`) both run
:func:`run_updates`. What differs is a :class:`Trainee`'s: which rows of the mini-batch it computes and
how (row micro-batches of a plain model, or packed micro-batches through a sharded replica's pipeline),
and how its gradients are reduced, clipped and stepped. Every micro-batch's loss is divided by its
global mini-batch's normaliser (:meth:`~nereus_lightning.rl.algorithm.RLConfig.normalizer`, by
``loss_agg_mode``), so the losses of all micro-batches and replicas sum to the mini-batch's loss
whatever the layout.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypedDict

import torch
from torch import Tensor

from nereus_lightning.rl.batch import RolloutBatch

if TYPE_CHECKING:
    from nereus_lightning.rl.algorithm import RLConfig

log = logging.getLogger(__name__)


class AdamWHyper(TypedDict):
    """AdamW's keyword arguments besides the learning rate."""

    betas: tuple[float, float]
    eps: float
    weight_decay: float


#: AdamW's hyper-parameters for every trained model: the strategy's EMU-bound optimizers, the module's
#: Lightning optimizer and the reference loop's.
ADAMW = AdamWHyper(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
ON_NONFINITE = ("raise", "skip")


class NonFiniteError(RuntimeError):
    """A reward, loss or gradient norm is NaN or infinite; the message names the step and where."""


@dataclass(frozen=True)
class Stepped:
    """What one optimizer step of a :class:`Trainee` found."""

    norm: float | None  # the global gradient norm before clipping; None where this rank does not report it
    problem: str | None = None  # why nothing was stepped ("<name>'s gradient norm is nan (...)")


class Trainee(Protocol):
    """One trained model as :func:`run_updates` drives it, on this rank."""

    @property
    def role(self) -> str:
        """``actor`` or ``critic``: the prefix of its metrics."""
        ...

    def backward(self, mini: RolloutBatch, normalizer: Tensor, tokens: Tensor) -> dict[str, Tensor]:
        """Backward of this rank's rows of the global mini-batch ``mini`` into the model's gradients.

        Args:
            normalizer: the mini-batch's loss denominator (its tokens or sequences, by ``loss_agg_mode``).
            tokens: its response tokens (token-weights the per-micro-batch metric means).

        Returns:
            The metrics this rank reports: contributions that sum over micro-batches and replicas.
        """
        ...

    def step(self, max_norm: float, samples: int) -> Stepped:
        """The optimizer step after :meth:`backward`: gradients reduced over replicas and clipped to
        ``max_norm``; nothing stepped when the norm is not finite. ``samples``: samples consumed."""
        ...


#: Sums an update's metrics over the ranks and joins their problems (the same result on every rank).
Gather = Callable[[dict[str, float], list[str]], tuple[dict[str, float], list[str]]]


def run_updates(
    batch: RolloutBatch,
    cfg: RLConfig,
    trainees: Sequence[Trainee],
    gather: Gather | None = None,
    after_update: Callable[[], None] | None = None,
    on_nonfinite: str = "raise",
    step: int = 0,
) -> dict[str, float]:
    """``cfg.ppo_epochs`` passes over ``cfg.mini_batches`` contiguous mini-batches of the global ``batch``
    (sorted by sample index, on every rank), each one backward and one optimizer step of every trainee.

    Args:
        gather: sums each update's metrics over ranks (None: this rank's are the job's).
        after_update: called after each update (the strategy's weight sync into the other model-stages).
        on_nonfinite: a non-finite gradient norm ``"raise"`` s :class:`NonFiniteError` or ``"skip"`` s
            that trainee's step (counted in ``train/skipped_update``).
        step: the RL step, for messages.

    Returns:
        The metrics' mean over updates (verl's names), ``<role>/grad_norm`` and ``train/skipped_update``
        (the share of updates a non-finite norm skipped).
    """
    sums: dict[str, float] = {}
    updates = skipped = 0
    for epoch in range(cfg.ppo_epochs):
        for mini in batch.split(cfg.mini_batches):
            # samples consumed: counted once, in the first epoch over the batch
            part, problems = _update(mini, cfg, trainees, len(mini) if epoch == 0 else 0)
            if gather is not None:
                part, problems = gather(part, problems)
            if problems:
                if on_nonfinite == "raise":
                    raise NonFiniteError(
                        f"step {step}: {problems[0]}; set trainer.on_nonfinite=skip to skip such updates"
                    )
                if _rank() == 0:
                    log.warning("step %d: %s: update skipped (trainer.on_nonfinite=skip)", step, problems[0])
                skipped += 1
            for k, v in part.items():
                sums[k] = sums.get(k, 0.0) + v
            updates += 1
            if after_update is not None:
                after_update()
    out = {k: v / updates for k, v in sums.items()}
    out["train/skipped_update"] = skipped / updates
    return out


def _update(
    mini: RolloutBatch, cfg: RLConfig, trainees: Sequence[Trainee], samples: int
) -> tuple[dict[str, float], list[str]]:
    """One update over the global mini-batch ``mini``: each trainee's backward, then its step.

    The trainees are independent models, so each steps (and drops its gradients) before the next one's
    backward: co-located training model-stages never hold two trainees' gradients at once. Every rank
    runs the trainees in the same order, so each group's collectives come in the same order on its ranks.
    """
    mask = mini.response_mask.float()
    normalizer = cfg.normalizer(mask)  # the global mini-batch's: every layout and micro-batching alike
    tokens = mask.sum().clamp_min(1.0)
    part: dict[str, float] = {}
    problems: list[str] = []
    for trainee in trainees:
        for k, v in trainee.backward(mini, normalizer, tokens).items():
            part[k] = part.get(k, 0.0) + float(v)
        done = trainee.step(cfg.grad_clip, samples)
        if done.problem is not None:
            problems.append(done.problem)
        elif done.norm is not None:
            part[f"{trainee.role}/grad_norm"] = done.norm
    return part, problems


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
