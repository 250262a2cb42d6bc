"""The public surface: lazy exports, the "nereus" strategy name, the plot, stage partitions."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

from nereus_lightning.lightning.stages import slot_of
from nereus_lightning.rl.batch import dp_slice
from tests.lightning.helpers import plan_of


def test_importing_the_package_does_not_import_lightning():
    code = (
        "import sys, nereus_lightning, nereus_lightning.control; print('lightning' in sys.modules, 'torch' "
        "in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    assert out == ["False", "False"]


def test_strategy_is_registered_as_nereus():
    import lightning.pytorch as pl

    from nereus_lightning import NereusStrategy

    trainer = pl.Trainer(
        accelerator="cpu", devices=2, strategy="nereus", logger=False, enable_progress_bar=False
    )
    assert isinstance(trainer.strategy, NereusStrategy) and trainer.strategy.num_processes == 2


def test_slots_cover_the_batch_once_in_order():
    assert [dp_slice(2, 4, r) for r in range(4)] == [slice(0, 1), slice(1, 2), slice(2, 2), slice(2, 2)]
    plan = plan_of("ppo", {"actor_train": ((1, 2), (3, 2, 1, 0))})  # dp2 x PP2
    slots = [slot_of(plan, "actor_train", r, 8) for r in range(4)]
    assert [(s.replica, s.position, s.start, s.stop) for s in slots] == [
        (1, 1, 4, 8),
        (1, 0, 4, 8),
        (0, 1, 0, 4),
        (0, 0, 0, 4),
    ]
    assert [s.is_leader for s in slots] == [False, True, False, True]


def test_plot_marks_what_each_transition_changed(tmp_path):
    from nereus_lightning.lightning.plot import change_label, plot_run, transition_marks

    a = {
        "step": 0.0,
        "critic/score/mean": 0.1,
        "timing_s/step": 1.0,
        "timing_s/transition": 0.0,
        "plan/num_gpus": 4.0,
        "plan/actor_train/dp": 2.0,
        "plan/actor_train/tp": 1.0,
        "plan/actor_train/pp": 1.0,
    }
    b = {**a, "step": 1.0, "timing_s/transition": 0.2, "plan/actor_train/dp": 1.0, "plan/actor_train/pp": 2.0}
    assert change_label(a, b) == "actor_train (2,1,1)->(1,1,2)"
    assert transition_marks([a, b]) == [(0.5, "step 1: actor_train (2,1,1)->(1,1,2)")]  # before step 1
    assert change_label(a, {**a, "plan/num_gpus": 3.0}) == "GPUs 4->3"
    path = plot_run([a, b], str(tmp_path / "run.png"))
    assert (tmp_path / "run.png").stat().st_size > 1000 and path.endswith("run.png")


def test_rollout_engine_is_chosen_by_name_and_vllm_says_how_to_install():
    import importlib.util

    import pytest

    from nereus_lightning import PPOModule
    from nereus_lightning.spec.errors import NereusConfigError
    from tests.lightning.helpers import small_task

    with pytest.raises(NereusConfigError, match="rollout_engine.*'hf'"):
        PPOModule(task=small_task(), rollout_engine="sglang")
    if importlib.util.find_spec("vllm") is None:
        with pytest.raises(NereusConfigError, match="vllm is not installed"):
            PPOModule(task=small_task(), prompts_per_step=2, rollout_engine="vllm")


def test_lightning_reads_no_attribute_by_name():
    # Strategy, callback, module, units and controller meet through typed protocols and concrete
    # types (mypy checks them), not duck typing. Only the checkpoint codec reflects, over the fields
    # and module paths of the nereus dataclasses it stores.
    import nereus_lightning.lightning as package

    found = [
        f"{path.name}:{node.lineno}: {node.func.id}(...)"
        for path in sorted(Path(package.__file__).parent.glob("*.py"))
        if path.name != "checkpoint.py"
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("hasattr", "getattr")
    ]
    assert found == []


def test_a_module_that_optimizes_automatically_is_told_what_to_set():
    import lightning.pytorch as pl
    import pytest

    from nereus_lightning.lightning import NereusStrategy
    from nereus_lightning.spec.errors import NereusConfigError

    class Automatic(pl.LightningModule):
        pass

    with pytest.raises(NereusConfigError, match="Automatic optimizes automatically; set self.automatic_opt"):
        NereusStrategy().connect(Automatic())
