"""The console: decision lines, the progress bar, the run figure's labels, the summary table."""

from __future__ import annotations

import io
import itertools
import re

import pytest
import torch

from nereus_lightning.lightning.console import decision_line, describe_changes, format_bytes


def _tiny_module():
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            loss = self.layer(batch).pow(2).mean()
            self.log("reward", 1.0 - loss.detach(), prog_bar=True)
            return loss

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(64, 2), batch_size=2)

    return Tiny()


def _fit(tmp_path, max_steps: int, ckpt_path: str | None = None) -> str:
    """Fit the tiny module to ``max_steps`` with the Nereus bar recording its console; the rendered text."""
    import lightning.pytorch as pl

    from nereus_lightning.lightning.progress import NereusProgressBar

    out = io.StringIO()
    bar = NereusProgressBar(console_kwargs={"file": out, "width": 120, "force_terminal": False})
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        callbacks=[bar],
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
    )
    trainer.fit(_tiny_module(), ckpt_path=ckpt_path)
    trainer.save_checkpoint(str(tmp_path / f"step{max_steps}.ckpt"))
    return out.getvalue()


def test_progress_bar_counts_rl_steps_also_after_a_resume(tmp_path):
    first = _fit(tmp_path, 3)
    assert "RL step" in first and "Epoch" not in first and _count(first) == "3/3"
    resumed = _fit(tmp_path, 5, ckpt_path=str(tmp_path / "step3.ckpt"))
    assert _count(resumed) == "5/5"  # Lightning's own bar reads 5/2 here: batches left, not steps
    assert "reward" in resumed and "v_num" not in resumed


def _count(rendered: str) -> str:
    """The ``k/total`` column of the last rendered bar."""
    return re.findall(r"(?<![\d.])\d+/[\d.]+(?![\d.])", rendered)[-1]
