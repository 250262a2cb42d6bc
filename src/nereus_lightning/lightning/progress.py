"""`NereusProgressBar`: Lightning's rich progress bar counting RL steps, not batches of an epoch."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import RichProgressBar
from typing_extensions import override

from nereus_lightning.lightning.callback import NereusCallback

DESCRIPTION = "RL step"


class NereusProgressBar(RichProgressBar):
    """Shows ``RL step k/max_steps`` (also after a resume), then the module's progress-bar metrics
    (reward, response length) and the transitions executed so far.

    The count is the trainer's ``global_step``, the total its ``estimated_stepping_batches``
    (``max_steps``, or what the epochs add up to); the transitions come from the
    :class:`~nereus_lightning.lightning.NereusCallback` of the trainer, when it has one.
    """

    @override
    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_train_epoch_start(trainer, pl_module)
        self._show_steps(trainer)

    @override
    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        self._show_steps(trainer)

    def _show_steps(self, trainer: pl.Trainer) -> None:
        if self.progress is None or self.train_progress_bar_id is None:
            return
        total = trainer.estimated_stepping_batches
        self.progress.update(
            self.train_progress_bar_id,
            total=total if total > 0 else float("inf"),  # -1: no step limit
            completed=trainer.global_step,
            description=DESCRIPTION,
        )
        self.refresh()

    @override
    def get_metrics(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the logger's version says nothing about the run
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(callback, NereusCallback):
                items["transitions"] = str(callback.transition_count)
        return items
