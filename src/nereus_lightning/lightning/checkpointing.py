"""`NereusCheckpoint`: Lightning's ``ModelCheckpoint`` for RL runs: bounded disk, ``last.ckpt`` a link.

- ``max_ckpt_to_keep=N`` (verl's ``max_actor_ckpt_to_keep``) keeps the newest ``N`` step checkpoints:
  Lightning's own top-k over the monitored ``step`` (``mode="max"``), so the oldest is removed after a
  newer one is complete; None keeps all.
- ``last.ckpt`` is Lightning's ``save_last="link"``: a symbolic link to the newest complete
  checkpoint, never a second copy, replaced atomically (a link written beside it, then renamed over it).
- The run's last step is always saved when training ends (a run of 12 steps with ``every_n_train_steps=5``
  ends with ``step12.ckpt``), and :meth:`NereusCheckpoint.save_now` saves the current step on request
  (a preemption).
- Paths in a resumed callback state are kept only when they are checkpoints of this callback's folder,
  and nothing outside that folder is ever removed, whatever a checkpoint's state says.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from typing_extensions import override

from nereus_lightning.lightning.checkpoint import META_FILE
from nereus_lightning.spec.errors import require

log = logging.getLogger(__name__)


class NereusCheckpoint(ModelCheckpoint):
    """Step checkpoints every ``every_n_train_steps`` under ``dirpath``, the newest ``max_ckpt_to_keep`` kept.

    Args:
        dirpath: the folder of the checkpoints.
        filename: Lightning's pattern (``step{step}`` gives ``step10.ckpt``).
        every_n_train_steps: save after every that many RL steps (and at the end of training).
        max_ckpt_to_keep: keep the newest that many step checkpoints (None: all).
    """

    def __init__(
        self,
        dirpath: str | os.PathLike,
        filename: str = "step{step}",
        every_n_train_steps: int = 10,
        max_ckpt_to_keep: int | None = None,
    ) -> None:
        require(
            max_ckpt_to_keep is None or (isinstance(max_ckpt_to_keep, int) and max_ckpt_to_keep >= 1),
            "max_ckpt_to_keep",
            f"must be a whole number >= 1 (or null: keep every checkpoint), got {max_ckpt_to_keep!r}",
        )
        require(
            isinstance(every_n_train_steps, int) and every_n_train_steps >= 1,
            "checkpoint_every",
            f"must be a whole number >= 1, got {every_n_train_steps!r}",
        )
        super().__init__(
            dirpath=os.fspath(dirpath),
            filename=filename,
            monitor="step",
            mode="max",
            save_top_k=-1 if max_ckpt_to_keep is None else max_ckpt_to_keep,
            save_last="link",
            every_n_train_steps=every_n_train_steps,
            auto_insert_metric_name=False,
        )
        self._doomed: list[str] = []  # checkpoints top-k dropped, removed after last.ckpt moves on

    def save_now(self, trainer: pl.Trainer) -> str:
        """Save the current step as a step checkpoint (kept, counted, linked as ``last.ckpt``); its path."""
        if self._last_global_step_saved != trainer.global_step or not self._last_checkpoint_saved:
            candidates = self._monitor_candidates(trainer)
            self._save_topk_checkpoint(trainer, candidates)
            self._save_last_checkpoint(trainer, candidates)
        return self._last_checkpoint_saved

    @override
    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.global_step > 0 and self._last_global_step_saved != trainer.global_step:
            self.save_now(trainer)  # the run's last steps are never lost

    @staticmethod
    @override
    def _link_checkpoint(trainer: pl.Trainer, filepath: str, linkpath: str) -> None:
        """``linkpath`` -> ``filepath`` as a relative symbolic link, replaced in one rename (rank 0)."""
        if trainer.is_global_zero and os.path.abspath(filepath) != os.path.abspath(linkpath):
            link_atomically(filepath, linkpath)
        trainer.strategy.barrier()

    @override
    def _remove_checkpoint(self, trainer: pl.Trainer, filepath: str) -> None:
        """Remove ``filepath`` once ``last.ckpt`` names the newest checkpoint, and only when it is a
        checkpoint
        directly in this callback's folder."""
        if self._owns(filepath):
            self._doomed.append(filepath)
        else:
            log.warning("not removing %s: it is not a checkpoint of %s", filepath, self.dirpath)

    @override
    def _save_last_checkpoint(self, trainer: pl.Trainer, monitor_candidates: dict[str, Any]) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        doomed, self._doomed = self._doomed, []
        for filepath in doomed:  # after the link moved: last.ckpt never names a removed checkpoint
            super()._remove_checkpoint(trainer, filepath)

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        if state.get("dirpath") == self.dirpath:  # (Lightning ignores the paths of another folder)
            models = state.get("best_k_models") or {}
            kept = {p: v for p, v in models.items() if self._owns(p)}
            if len(kept) < len(models):
                log.warning(
                    "the checkpoint's state names %s outside %s; ignored",
                    sorted(set(models) - set(kept)),
                    self.dirpath,
                )
            state["best_k_models"] = kept
        for key in ("best_model_path", "kth_best_model_path", "last_model_path"):
            if state.get(key) and not self._owns(state[key]):
                state[key] = ""
        super().load_state_dict(state)

    def _owns(self, filepath: Any) -> bool:
        """Whether ``filepath`` names a checkpoint directly in :attr:`dirpath` (a ``.ckpt`` name, no link
        out of it, and a Nereus checkpoint directory if it exists)."""
        if not isinstance(filepath, str) or self.dirpath is None:
            return False
        path = Path(filepath)
        inside = os.path.realpath(path.parent) == os.path.realpath(self.dirpath)
        named = re.fullmatch(r"[^/\\]+\.ckpt", path.name) is not None and not path.name.startswith(".")
        ours = not path.exists() or path.is_symlink() or (path / META_FILE).is_file()
        return inside and named and ours


class JobRecord(Callback):
    """Stores the job's configuration (``record``) in every checkpoint, as ``checkpoint["nereus_job"]``."""

    def __init__(self, record: dict[str, Any]) -> None:
        self.record = record

    @override
    def on_save_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        checkpoint["nereus_job"] = self.record


def link_atomically(target: str | os.PathLike, link: str | os.PathLike) -> None:
    """Make ``link`` a symbolic link to ``target`` (relative), replacing what was there in one rename.

    A directory in its place (a ``last.ckpt`` copy of an older nereus-lightning) is renamed aside and
    removed after the link is in place, so ``link`` always names a complete checkpoint.
    """
    from nereus_lightning.lightning.checkpoint import remove, replace_path

    link = Path(link)
    fresh = link.with_name(f".{link.name}.link")
    remove(fresh)
    os.symlink(os.path.relpath(target, link.parent), fresh)
    replace_path(fresh, link)
