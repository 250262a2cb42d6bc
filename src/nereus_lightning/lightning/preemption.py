"""`Preemption`: on SIGTERM, SIGINT or SLURM's warning signal, save at a step boundary, say how to resume.

What SLURM, Kubernetes and spot reclamation send before they kill a job (SIGTERM; SLURM's
``--signal=USR1@<s>`` warning), and Ctrl-C, reach some or all of the job's processes at any moment,
often in the middle of a collective. A handler only records the signal (:data:`STATE`); every rank
agrees at the next step boundary (one all-reduce per step), finishes the step in flight (or, with
``step_in_flight="abandon"``, drops it at its next safe point, before any state changes), and the
run's checkpoint callback writes a checkpoint of the last completed step. ``fit`` then returns
normally with :attr:`NereusStrategy.stopped <nereus_lightning.lightning.NereusStrategy.stopped>` saying
why and where; ``nereus-train`` prints the resume command and exits with ``128 + signal``. If no
checkpoint is written within ``grace_s`` seconds of the signal, the process exits anyway (naming the
newest checkpoint), before the platform's own kill comes.

Lightning's handlers do not fit this job: its SIGTERM handler broadcasts from inside the handler (a
collective at an arbitrary point of another collective) and its SLURM handler saves from inside the
handler. The callback replaces them for the run (Lightning restores the original handlers at teardown)
and keeps their effects: the launcher's ranks get the signal (:func:`forward_to`), and on SLURM with
``SLURMEnvironment(auto_requeue=True)`` the requeue signal requeues the job (``scontrol requeue``) once
its checkpoint is written.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import SLURMEnvironment
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import ParallelStrategy
from typing_extensions import override

from nereus_lightning.spec.errors import require

log = logging.getLogger(__name__)

STEP_IN_FLIGHT = ("finish", "abandon")
#: The signals that stop a run: termination, Ctrl-C, and SLURM's default warning signal.
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)


class StepAbandoned(Exception):
    """The step in flight is dropped (``step_in_flight="abandon"``): every rank raises it at one point."""


@dataclass
class _State:
    """What this process's handler recorded: the first stop signal and when; where it goes; the grace."""

    signum: int = 0
    at: float = 0.0
    grace_s: float = 30.0
    forward: Callable[[], list[int]] = list  # the launcher's rank processes (in the launcher only)
    launcher_pid: int = 0
    on_grace_out: Any = None  # called (no arguments) when the grace period runs out
    timer: threading.Timer | None = None


STATE = _State()


def on_signal(signum: int, frame: Any) -> None:
    """The handler: record the first stop signal, forward it to the launcher's ranks, start the clock."""
    if os.getpid() == STATE.launcher_pid:
        _send(STATE.forward(), signum)
    if STATE.signum:
        log.info(
            "received %s again; still stopping (%.0f s of the grace period left)", _name(signum), _left()
        )
        return
    STATE.signum, STATE.at = signum, time.monotonic()
    if STATE.on_grace_out is not None:
        STATE.timer = threading.Timer(STATE.grace_s, STATE.on_grace_out)
        STATE.timer.daemon = True
        STATE.timer.start()


def _left() -> float:
    return max(0.0, STATE.grace_s - (time.monotonic() - STATE.at))


def _name(signum: int) -> str:
    return signal.Signals(signum).name


def install(signals: tuple[int, ...] = SIGNALS) -> dict[int, Any]:
    """Make :func:`on_signal` this process's handler of ``signals`` (main thread only); the old ones."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    previous = {s: signal.getsignal(s) for s in signals}
    for s in signals:
        signal.signal(s, on_signal)
    return previous


def restore(previous: dict[int, Any]) -> None:
    """Put back the handlers :func:`install` replaced."""
    if threading.current_thread() is threading.main_thread():
        for s, handler in previous.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def _send(pids: list[int], signum: int) -> None:
    """Send ``signum`` to each of ``pids`` that is still there."""
    for pid in pids:
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass


def forward_to(pids: Callable[[], list[int]], grace_s: float) -> dict[int, Any]:
    """In a launcher process: forward stop signals to the ranks (``pids()``); kill them ``grace_s`` + 10 s
    after the first if they are still there. Returns the handlers it replaced."""
    STATE.launcher_pid, STATE.forward, STATE.grace_s = os.getpid(), pids, grace_s + 10.0

    def kill_ranks() -> None:
        log.error("the ranks did not stop within the grace period; killing them")
        _send(STATE.forward(), signal.SIGKILL)

    STATE.on_grace_out = kill_ranks
    return install()


class Preemption(Callback):
    """Stop the run cleanly on SIGTERM, SIGINT or SLURM's warning signal, with a checkpoint of the last step.

    Args:
        step_in_flight: ``"finish"`` the step running when the signal comes, then save it; ``"abandon"``
            it at its next safe point (after generation, scoring or inference, before any update) and save
            the last completed step (the module calls :meth:`NereusStrategy.preemption_point`).
        grace_s: seconds from the signal within which the checkpoint must be written; after them the
            process exits anyway with ``128 + signal`` (set it below your platform's kill delay: SLURM's
            ``--signal`` lead, Kubernetes' ``terminationGracePeriodSeconds``).
        requeue: on SLURM's requeue signal, requeue the job after the save (``scontrol requeue``); None:
            when Lightning's ``SLURMEnvironment`` has ``auto_requeue`` on.
    """

    def __init__(
        self, step_in_flight: str = "finish", grace_s: float = 30.0, requeue: bool | None = None
    ) -> None:
        require(
            step_in_flight in STEP_IN_FLIGHT,
            "preemption.step_in_flight",
            f"{step_in_flight!r} is not one of {', '.join(map(repr, STEP_IN_FLIGHT))}",
        )
        require(
            isinstance(grace_s, (int, float)) and grace_s > 0,
            "preemption.grace_s",
            f"must be > 0 seconds, got {grace_s!r}",
        )
        self.step_in_flight = step_in_flight
        self.grace_s = float(grace_s)
        self.requeue = requeue
        self._previous: dict[int, Any] = {}
        self._trainer: pl.Trainer | None = None

    # ---- handlers ----------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        STATE.grace_s = self.grace_s
        STATE.on_grace_out = self._grace_out
        self._previous = install()

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        install()  # again: Lightning's own handlers were registered after setup
        from nereus_lightning.lightning.strategy import NereusStrategy

        if isinstance(trainer.strategy, NereusStrategy):
            trainer.strategy.preemption = self

    @override
    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        restore(self._previous)
        if STATE.timer is not None:
            STATE.timer.cancel()

    def _grace_out(self) -> None:
        """The grace period ran out before the checkpoint was written: exit now, naming the newest one."""
        newest = _newest_checkpoint(self._trainer)
        log.error(
            "%s: no checkpoint written within preemption.grace_s=%.0f s; exiting. Newest checkpoint: %s",
            _name(STATE.signum),
            self.grace_s,
            newest or "none",
        )
        os._exit(128 + STATE.signum)

    # ---- agreement and the stop --------------------------------------------------------
    def agreed(self, trainer: pl.Trainer) -> int:
        """The stop signal some rank received (0: none); collective over the default group."""
        if not (dist.is_available() and dist.is_initialized()):
            return STATE.signum
        flag = torch.tensor([STATE.signum], dtype=torch.int64, device=trainer.strategy.root_device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    def preemption_point(self, trainer: pl.Trainer) -> None:
        """Within a step: raise :class:`StepAbandoned` on every rank when abandoning and a rank got one."""
        if self.step_in_flight != "abandon":
            return
        signum = self.agreed(trainer)
        if signum:
            raise StepAbandoned(f"{_name(signum)}: the step in flight is abandoned")

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        signum = self.agreed(trainer)
        if signum:
            self.stop(trainer, signum)

    def stop(self, trainer: pl.Trainer, signum: int) -> None:
        """Save the last completed step, end ``fit`` after this step and record why (every rank)."""
        trainer.should_stop = True
        started = time.monotonic()
        path = save_now(trainer)
        seconds = time.monotonic() - started
        stopped = {
            "signal": _name(signum),
            "step": trainer.global_step,
            "checkpoint": path,
            "save_s": seconds,
        }
        from nereus_lightning.lightning.strategy import NereusStrategy

        if isinstance(trainer.strategy, NereusStrategy):
            trainer.strategy.stopped = stopped
        if STATE.timer is not None:
            STATE.timer.cancel()
        if trainer.is_global_zero:
            log.warning(
                "%s: stopped after step %d; checkpoint %s written in %.1f s",
                _name(signum),
                trainer.global_step,
                path,
                seconds,
            )
        if trainer.is_global_zero and self._requeues(trainer, signum):
            requeue_slurm_job()

    def _requeues(self, trainer: pl.Trainer, signum: int) -> bool:
        """Whether this stop requeues a SLURM job (its requeue signal, and requeue on or SLURM's auto)."""
        strategy = trainer.strategy
        env = strategy.cluster_environment if isinstance(strategy, ParallelStrategy) else None
        if not isinstance(env, SLURMEnvironment) or signum != int(env.requeue_signal or signal.SIGUSR1):
            return False
        return self.requeue if self.requeue is not None else bool(env.auto_requeue)


def save_now(trainer: pl.Trainer) -> str | None:
    """A checkpoint of the current step through the run's checkpoint callback (its naming, top-k and
    ``last.ckpt``), else ``<default_root_dir>/checkpoints/preempted-step<k>.ckpt``; its real path."""
    from nereus_lightning.lightning.checkpointing import NereusCheckpoint

    callback = trainer.checkpoint_callback
    if isinstance(callback, NereusCheckpoint):
        path = callback.save_now(trainer)
    elif isinstance(callback, ModelCheckpoint):
        candidates = callback._monitor_candidates(trainer)
        callback._save_topk_checkpoint(trainer, candidates)
        callback._save_last_checkpoint(trainer, candidates)
        path = callback._last_checkpoint_saved
    else:
        path = os.path.join(
            trainer.default_root_dir, "checkpoints", f"preempted-step{trainer.global_step}.ckpt"
        )
        trainer.save_checkpoint(path)
    return os.path.realpath(path) if path else None


def _newest_checkpoint(trainer: pl.Trainer | None) -> str | None:
    """The newest complete checkpoint in the run's checkpoint folder (None: none, or no folder)."""
    from nereus_lightning.lightning.checkpoint import latest_checkpoint

    callback = trainer.checkpoint_callback if trainer is not None else None
    folder = callback.dirpath if isinstance(callback, ModelCheckpoint) else None
    return latest_checkpoint(folder) if folder and Path(folder).is_dir() else None  # (a local folder)


def requeue_slurm_job() -> None:
    """``scontrol requeue`` this SLURM job (an array task by its ids), as Lightning's SLURM handler does."""
    array_job = os.environ.get("SLURM_ARRAY_JOB_ID")
    job = (
        f"{array_job}_{os.environ['SLURM_ARRAY_TASK_ID']}"
        if array_job
        else os.environ.get("SLURM_JOB_ID", "")
    )
    if not job.replace("_", "").isdigit():
        log.warning("not requeued: no SLURM job id in the environment")
        return
    result = subprocess.call(["scontrol", "requeue", job])
    if result == 0:
        log.info("requeued SLURM job %s", job)
    else:
        log.warning("requeueing SLURM job %s failed (scontrol exit code %d)", job, result)
