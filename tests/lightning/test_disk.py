"""Bounded disk: the newest ``max_ckpt_to_keep`` step checkpoints, ``last.ckpt`` a link to the newest, and a
save that fails (a full disk) leaves nothing behind."""

from __future__ import annotations

import os
import resource
import signal
from pathlib import Path

import lightning.pytorch as pl
import pytest

from nereus_lightning.lightning import NereusCallback, NereusCheckpoint, NereusStrategy, PPOModule
from nereus_lightning.lightning.checkpoint import latest_checkpoint, read_checkpoint
from tests.lightning.helpers import quiet_trainer, small_task

pytestmark = pytest.mark.distributed


class Watch(pl.Callback):
    """Rank 0 notes the step checkpoints on disk before every step (after the previous step's save)."""

    def __init__(self, folder: Path, notes: Path) -> None:
        self.folder, self.notes = folder, notes

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # noqa: ANN001, ANN201
        if trainer.is_global_zero and self.folder.is_dir():
            steps = sorted(p.name for p in self.folder.iterdir() if p.name.startswith("step"))
            with open(self.notes, "a") as f:
                f.write(" ".join(steps) + "\n")


class FullDiskStrategy(NereusStrategy):
    """Rank 1 may write no file beyond 1 kB while ``step10.ckpt`` is saved (writes fail as on a full disk)."""

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):  # noqa: ANN001, ANN201
        full = "step10" in str(filepath) and self.global_rank == 1
        limits = resource.getrlimit(resource.RLIMIT_FSIZE)
        if full:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (1024, limits[1]))
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        finally:
            resource.setrlimit(resource.RLIMIT_FSIZE, limits)


def run(
    tmp: Path,
    max_steps: int,
    callbacks: list,
    ckpt_path: str | None = None,
    keep: int | None = 2,
    strategy=NereusStrategy,
):  # noqa: ANN001, ANN201
    from nereus_lightning.control import PoolFollower

    module = PPOModule(task=small_task(), seed=3, prompts_per_step=4)
    checkpoint = NereusCheckpoint(tmp / "ckpt", every_n_train_steps=5, max_ckpt_to_keep=keep)
    callbacks = [NereusCallback(controller=PoolFollower("ppo")), *callbacks, checkpoint]
    trainer = quiet_trainer(
        2, strategy(export_hf="never"), max_steps, callbacks, False, enable_checkpointing=True
    )
    trainer.fit(module, ckpt_path=ckpt_path)
    return trainer


def test_the_newest_two_are_kept_and_last_resumes_the_newest(tmp_path):
    folder, notes = tmp_path / "ckpt", tmp_path / "notes"
    run(tmp_path, 30, [Watch(folder, notes)])
    seen = [line.split() for line in notes.read_text().splitlines()]
    assert seen[-1] == ["step20.ckpt", "step25.ckpt"]  # before the last step
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step25.ckpt", "step30.ckpt"]
    assert all(len(s) <= 2 for s in seen)  # at no step were more than two on disk
    assert os.readlink(folder / "last.ckpt") == "step30.ckpt"  # a link, not a second copy
    run(
        tmp_path / "again", 31, [Watch(folder, tmp_path / "again.notes")], ckpt_path=str(folder / "last.ckpt")
    )
    assert len((tmp_path / "again.notes").read_text().splitlines()) == 1  # resumed at step 30: one step left
    assert read_checkpoint(tmp_path / "again" / "ckpt" / "last.ckpt").global_step == 31


def test_a_save_on_a_full_disk_leaves_no_partial_folder(tmp_path):
    with pytest.raises(Exception, match=r"step10\.ckpt.*(File too large|a writer thread failed)"):
        run(tmp_path, 12, [], keep=None, strategy=FullDiskStrategy)
    folder = tmp_path / "ckpt"
    assert sorted(p.name for p in folder.iterdir()) == ["last.ckpt", "step5.ckpt"]  # no .step10.ckpt.partial
    assert latest_checkpoint(folder) == str(folder / "step5.ckpt")
