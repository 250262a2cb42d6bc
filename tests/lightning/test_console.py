"""The console: decision lines, the progress bar, the run figure's labels, the summary table."""

from __future__ import annotations

import io
import itertools
import re

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


# ---- decision lines ----------------------------------------------------------------------------
def _pool_records():
    """A pool 4 -> 3 decision (actor_gen dp4 -> dp3, the rest one rank) as the decision log holds it."""
    from nereus_lightning.control.decision import Decision
    from nereus_lightning.control.triggers import Trigger
    from tests.lightning.helpers import plan_of

    one = {
        "actor_infer": (0,),
        "ref_infer": (1,),
        "critic_infer": (2,),
        "actor_train": (0,),
        "critic_train": (1,),
    }
    before = plan_of("ppo", {**one, "actor_gen": (0, 1, 2, 3)})
    after = plan_of("ppo", {**one, "actor_gen": (0, 1, 2), "critic_train": ((1, 2), (1, 2))})
    pool = Trigger("pool", 20.0, detail="4 -> 3 GPUs")
    common = {"triggers": (pool,), "current": before, "horizon": 20.0, "gamma": 0.5}
    moved = Decision(30, "transition", target=after, delta_latency=0.0078, transition_cost=0.0107, **common)
    kept = Decision(
        30, "keep", reason="payback failed for every candidate", considered=({"verdict": "x"},), **common
    )
    return moved.to_json(), kept.to_json(), Decision(31, "none").to_json()


def test_decision_line_names_step_trigger_stages_prediction_and_measurement():
    moved, _, _ = _pool_records()
    moved["measured_s"] = 0.25
    executed = {"seconds": 0.2, "bytes": 3.2e6, "mode": "dag", "counts": {"split": 0, "extend": 2}}
    assert decision_line(moved, executed) == (
        "step 30 transition [pool: 4 -> 3 GPUs]: actor_gen (4,1,1)->(3,1,1); critic_train (1,1,1)->(1,1,2); "
        "predicted dL 0.0078 s/step, L_tran 0.0107 s, payback 1.37 steps <= gamma*H_x = 0.5*20 = 10.00; "
        "took 0.25 s, moved 3.2 MB (DAG: 2 extend)"
    )


def test_quiet_steps_stay_quiet_and_rejections_say_why():
    _, kept, quiet = _pool_records()
    assert decision_line(quiet) is None
    assert decision_line({**kept, "considered": []}) is None  # no faster plan existed: nothing to say
    assert (
        decision_line(kept) == "step 30 no transition [pool: 4 -> 3 GPUs]: payback failed for every candidate"
    )
    stuck = {**kept, "decision": "restart", "target_plan": None, "reason": "no plan fits the pool"}
    assert decision_line(stuck) == "step 30 waiting [pool: 4 -> 3 GPUs]: no plan fits the pool"


def test_a_transition_the_strategy_could_not_run_reads_as_kept_and_is_not_counted():
    from nereus_lightning.lightning.console import executed_transitions

    moved, _, _ = _pool_records()
    infeasible = {"mode": "kept", "reason": "Split does not fit", "bytes": 0}
    assert decision_line(moved, infeasible).startswith("step 30 no transition [pool: 4 -> 3 GPUs]: plan kept")
    done = {**moved, "measured_s": 0.1, "transition": {"mode": "dag", "bytes": 10}}
    refused = {**moved, "measured_s": 0.1, "transition": infeasible}
    initial = {"step": 0, "decision": "initial"}
    assert executed_transitions([initial, done, refused, done]) == 2


def test_triggers_read_as_signal_and_change_and_long_ones_are_cut_at_a_word():
    from nereus_lightning.lightning.console import trigger_text

    drift = {"kind": "drift:response_len", "detail": "response_len 7.0 -> 9.9 (+42.0%, threshold 30%)"}
    assert trigger_text([drift, {"kind": "pool", "detail": "4 -> 3 GPUs"}]) == (
        "response_len 7.0 -> 9.9 (+42.0%, threshold 30%); pool: 4 -> 3 GPUs"
    )
    memory = {
        "kind": "memory",
        "detail": "predicted peak memory exceeds the cap: actor_gen: GPU 0 needs 1.1 GB",
    }
    assert trigger_text([memory]) == "memory: predicted peak memory exceeds the cap: actor_gen: GPU 0..."


def test_changes_group_stages_and_name_what_else_changed():
    a = {"actor_gen": {"dp": 4, "tp": 1, "pp": 1, "micro_batch": 3}, "ref_infer": {"dp": 4, "tp": 1, "pp": 1}}
    b = {"actor_gen": {"dp": 4, "tp": 1, "pp": 1, "micro_batch": 2}, "ref_infer": {"dp": 4, "tp": 1, "pp": 1}}
    assert describe_changes(a, b, gpus=(4, 4)) == ["actor_gen micro_batch 3->2"]
    c = {name: {**stage, "dp": 3} for name, stage in a.items()}
    assert describe_changes(a, c, gpus=(4, 3)) == ["GPUs 4->3", "actor_gen, ref_infer (4,1,1)->(3,1,1)"]
    assert format_bytes(3.2e6) == "3.2 MB" and format_bytes(512) == "512 B"


# ---- the run figure ----------------------------------------------------------------------------
def _history(transitions: set[int], steps: int = 60) -> list[dict[str, float]]:
    """A history whose pool drops after step 28 and whose plan changes before every step in
    ``transitions`` (the row of that step carries the transition)."""
    history, dp = [], 4
    for step in range(steps):
        if step in transitions:
            dp = 3 if dp == 4 else 4
        row = {"step": float(step), "critic/score/mean": step / steps, "timing_s/step": 0.3}
        row |= {"pool/num_gpus": 3.0 if step > 28 else 4.0, "response_length/mean": 4.0 + step / 4}
        row |= {"plan/num_gpus": float(dp), "plan/actor_gen/dp": float(dp), "plan/actor_gen/tp": 1.0}
        row |= {"plan/actor_gen/pp": 1.0, "timing_s/transition": 0.1 if step in transitions else 0.0}
        history.append(row)
    return history


def test_run_figure_labels_of_neighbouring_transitions_never_overlap(tmp_path):
    import matplotlib.pyplot as plt
    from matplotlib.text import Text

    from nereus_lightning.lightning.plot import draw_run

    steps = {28, 29, 40, 41, 42, 43, 44, 45}  # one step apart: the labels would sit on each other
    fig = draw_run(_history(steps))
    renderer = fig.canvas.get_renderer()
    labels = [t for t in fig.findobj(Text) if t.get_gid() == "transition-label"]
    assert sorted(int(t.get_text().split(":")[0].removeprefix("step ")) for t in labels) == sorted(steps)
    boxes = [t.get_window_extent(renderer) for t in labels]
    for a, b in itertools.combinations(boxes, 2):
        assert not a.overlaps(b)
    assert all(fig.bbox.x0 <= b.x0 and b.x1 <= fig.bbox.x1 and fig.bbox.y0 <= b.y0 for b in boxes)
    assert [ax.get_ylabel() for ax in fig.axes[-2:]] == ["GPUs", "response\ntokens"]
    plt.close(fig)


# ---- the summary table ---------------------------------------------------------------------------
def test_summary_table_lists_each_transition_and_where_the_outputs_are(tmp_path):
    import csv
    import json

    from rich.console import Console

    from nereus_lightning.lightning.console import summary_tables

    moved, _, _ = _pool_records()
    (tmp_path / "decisions.jsonl").write_text(json.dumps({**moved, "step": 29}) + "\n")
    rows = _history({29})
    for row in rows:
        row["transition/bytes"] = 3.2e6 if row["timing_s/transition"] else 0.0
    metrics = tmp_path / "metrics.csv"
    with open(metrics, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    summary = {"steps": 60, "reward_first10": 0.06, "reward_last10": 0.6, "metrics_csv": str(metrics)}
    console = Console(file=io.StringIO(), width=160, record=True)
    for table in summary_tables(summary, str(tmp_path), wall_s=12.5):
        console.print(table)
    text = console.export_text()
    assert "60" in text and "12.5 s" in text and "first 10 steps 0.060, last 10 0.600" in text
    assert re.search(
        r"\b29 .*GPUs 4->3; actor_gen \(4,1,1\)->\(3,1,1\).*pool: 4 -> 3 GPUs.*0\.100.*3\.2 MB", text
    )
    assert "1, 0.10 s = 0.6% of the time in steps and transitions" in text
    assert str(metrics) in text and str(tmp_path / "decisions.jsonl") in text


# ---- logging -------------------------------------------------------------------------------------
def test_other_ranks_log_only_warnings_to_the_console_and_say_which_rank(monkeypatch):
    import logging

    from lightning_utilities.core.rank_zero import rank_zero_only

    from nereus_lightning.console_log import ConsoleFormatter, RankFilter

    def record(level: int) -> logging.LogRecord:
        return logging.LogRecord("nereus_lightning", level, __file__, 1, "kernels off", None, None)

    monkeypatch.setattr(rank_zero_only, "rank", 2, raising=False)
    console, everything = RankFilter("WARNING"), RankFilter("NOTSET")
    assert not console.filter(record(logging.INFO)) and everything.filter(record(logging.INFO))
    warning = record(logging.WARNING)
    assert console.filter(warning) and ConsoleFormatter().format(warning) == "[rank 2] WARNING: kernels off"
    monkeypatch.setattr(rank_zero_only, "rank", 0)
    info = record(logging.INFO)
    assert console.filter(info) and ConsoleFormatter().format(info) == "kernels off"


def test_lightning_records_go_through_the_root_handlers_only():
    import logging

    from nereus_lightning.console_log import LIBRARY_LOGGERS, propagate_to_root

    saved = {
        n: (list(logging.getLogger(n).handlers), logging.getLogger(n).propagate) for n in LIBRARY_LOGGERS
    }
    own = logging.StreamHandler(io.StringIO())
    logging.getLogger("lightning").addHandler(own)
    logging.getLogger("lightning.pytorch").propagate = False
    try:
        assert logging.getLogger().handlers  # pytest's capture handler stands in for Hydra's
        propagate_to_root()
        for name in LIBRARY_LOGGERS:
            assert not logging.getLogger(name).handlers and logging.getLogger(name).propagate
    finally:
        for name, (handlers, propagate) in saved.items():
            logging.getLogger(name).handlers[:] = handlers
            logging.getLogger(name).propagate = propagate
