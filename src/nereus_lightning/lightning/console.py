"""What a run tells its user: one line per replan worth knowing, and the end-of-run summary table.

The decision lines go to the ``nereus_lightning`` logger on rank 0 (in ``nereus-train`` they land
on the console and in Hydra's file log); quiet steps (no trigger, or a replan that found no faster
plan) print nothing. The summary table is drawn with rich from the run's files, so the process
that launched the ranks can print it.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from nereus_lightning.console_log import console_handler

log = logging.getLogger("nereus_lightning.console")
if not logging.getLogger().handlers:  # Lightning's rule: a plain Python session still sees the lines
    _package = logging.getLogger("nereus_lightning")
    _package.setLevel(logging.INFO)
    _package.addHandler(console_handler())
    _package.propagate = False

StagePlan = Mapping[str, Any]  # one model-stage of a plan in the decision log's JSON form
LAYOUT_KEYS = ("dp", "tp", "pp")
DETAIL_KEYS = ("micro_batch", "recompute", "gpus")  # what else can change while the layout stays
EXECUTED_KINDS = ("transition", "restart")  # decisions the body carries out by moving state


# ---- plan changes ------------------------------------------------------------------------------
def plan_of_metrics(row: Mapping[str, Any]) -> dict[str, dict[str, int]]:
    """Each model-stage's ``dp``/``tp``/``pp`` (and ``micro_batch`` when logged) from a metrics
    row's ``plan/<stage>/<key>`` columns, in the decision log's plan form."""
    plan: dict[str, dict[str, int]] = {}
    for key, value in row.items():
        parts = key.split("/")
        if len(parts) == 3 and parts[0] == "plan" and value not in (None, ""):
            plan.setdefault(parts[1], {})[parts[2]] = int(float(value))
    return {stage: dims for stage, dims in sorted(plan.items()) if all(k in dims for k in LAYOUT_KEYS)}


def describe_changes(
    before: Mapping[str, StagePlan] | None,
    after: Mapping[str, StagePlan] | None,
    gpus: tuple[int, int] | None = None,
) -> list[str]:
    """What a plan change changed: ``GPUs 4->3``, then ``actor_gen, ref_infer (4,1,1)->(3,1,1)``.

    A stage whose ``(dp,tp,pp)`` stays but whose micro-batch, recomputation or GPUs change reads
    e.g. ``actor_gen micro_batch 3->2``; stages with the same change share one item.
    """
    before, after = before or {}, after or {}
    items = [f"GPUs {gpus[0]}->{gpus[1]}"] if gpus is not None and gpus[0] != gpus[1] else []
    groups: dict[str, list[str]] = {}
    for stage in [*before, *(s for s in after if s not in before)]:
        change = _stage_change(before.get(stage), after.get(stage))
        if change:
            groups.setdefault(change, []).append(stage)
    items += [f"{', '.join(stages)} {change}" for change, stages in groups.items()]
    return items


def _stage_change(old: StagePlan | None, new: StagePlan | None) -> str:
    if old is None or new is None or _layout(old) != _layout(new):
        return f"{_layout(old)}->{_layout(new)}"
    for key in DETAIL_KEYS:
        if key in old and key in new and old[key] != new[key]:
            return f"{key} {old[key]}->{new[key]}"
    return ""


def describe_plan(plan: Mapping[str, StagePlan] | None) -> str:
    """A plan as ``actor_gen (4,1,1); actor_train, critic_train
    (1,1,2)`` (stages sharing a layout grouped).
    """
    groups: dict[str, list[str]] = {}
    for stage, cand in (plan or {}).items():
        groups.setdefault(_layout(cand), []).append(stage)
    return "; ".join(f"{', '.join(stages)} {layout}" for layout, stages in groups.items())


def _layout(cand: StagePlan | None) -> str:
    return "none" if cand is None else "(" + ",".join(str(cand[k]) for k in LAYOUT_KEYS) + ")"


# ---- one line per decision ---------------------------------------------------------------------
def trigger_text(triggers: Sequence[Mapping[str, Any]], limit: int = 70) -> str:
    """The triggers of a decision, e.g. ``pool: 4 -> 3 GPUs`` or ``response_len 7.0 -> 9.9 (+42.0%, ...)``;
    each cut at a word near ``limit`` characters (the decision log keeps the whole text)."""
    parts = []
    for t in triggers:
        name = str(t["kind"]).removeprefix("drift:")
        detail = str(t.get("detail") or "")
        text = detail if detail.startswith(name) else f"{name}: {detail}" if detail else name
        if len(text) > limit:
            text = text[: limit - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."
        parts.append(text)
    return "; ".join(parts)


def _kept(executed: Mapping[str, Any] | None) -> bool:
    return bool(executed) and executed.get("mode") == "kept"  # type: ignore[union-attr]


def decision_line(record: Mapping[str, Any], executed: Mapping[str, Any] | None = None) -> str | None:
    """The console line of one decision-log record (``None``: a quiet step).

    Args:
        record: :meth:`Decision.to_json` of the decision.
        executed: what the strategy did about it (its ``transitions`` record: ``seconds``,
            ``bytes``, ``mode``, ``counts``, ``reason``); ``None`` when nothing was executed.
    """
    step, kind = record["step"], record["decision"]
    trigger = trigger_text(record.get("trigger") or ())
    where = f" [{trigger}]" if trigger else ""
    if kind == "initial":
        latency = record.get("target_latency")
        predicted = f"; predicted {_seconds(latency)}/step" if latency is not None else ""
        return f"step {step} initial plan (dp,tp,pp): {describe_plan(record.get('target_plan'))}{predicted}"
    if kind == "wait" or (kind in EXECUTED_KINDS and record.get("target_plan") is None):
        return f"step {step} waiting{where}: {record.get('reason')}"  # checkpointed: no plan fits the pool
    if kind in EXECUTED_KINDS and not _kept(executed):
        changes = describe_changes(record.get("current_plan"), record.get("target_plan"))
        line = (
            f"step {step} transition{where}: {'; '.join(changes) or 'no layout change'}; {_admission(record)}"
        )
        if kind == "restart":
            line += " (the controller chose checkpoint/restart; run in place)"
        if executed:
            seconds = record.get("measured_s", executed.get("seconds"))
            line += (
                f"; took {_seconds(seconds)}, moved {format_bytes(executed.get('bytes') or 0)} "
                f"({_how(executed)})"
            )
        return line
    if kind in EXECUTED_KINDS:  # the strategy found no safe transition DAG and kept the plan
        return (
            f"step {step} no transition{where}: plan kept, the transition is infeasible "
            f"({executed.get('reason')})"  # type: ignore[union-attr]
        )
    if kind == "keep" and record.get("considered"):  # a faster plan existed and was not admitted
        return f"step {step} no transition{where}: {record.get('reason')}"
    return None


def announce(record: Mapping[str, Any], executed: Mapping[str, Any] | None = None) -> None:
    """Log the decision line of ``record`` (nothing for a quiet step); call it on rank 0."""
    line = decision_line(record, executed)
    if line is not None:
        log.info(line)


def _admission(record: Mapping[str, Any]) -> str:
    """Predicted dL and L_tran, and the payback rule ``L_tran / dL <= gamma * H_x`` (or why it was waived)."""
    d_l, l_tran, h_x, gamma = (record.get(k) for k in ("dL", "L_tran", "H_x", "gamma"))
    known = [
        (name, v, unit) for name, v, unit in (("dL", d_l, "/step"), ("L_tran", l_tran, "")) if v is not None
    ]
    parts = (
        ["predicted " + ", ".join(f"{name} {_seconds(v)}{unit}" for name, v, unit in known)] if known else []
    )
    if record.get("urgent"):
        parts.append("urgent: payback waived")
    elif d_l and d_l > 0 and l_tran is not None and h_x is not None and gamma is not None:
        payback, bound = l_tran / d_l, gamma * h_x
        sign = "<=" if payback <= bound else ">"
        parts.append(f"payback {payback:.2f} steps {sign} gamma*H_x = {gamma:g}*{h_x:g} = {bound:.2f}")
    return ", ".join(parts) or "no prediction"


def _how(executed: Mapping[str, Any]) -> str:
    counts = {k: v for k, v in (executed.get("counts") or {}).items() if v}
    if executed.get("mode") == "dag":
        return "DAG: " + (", ".join(f"{v} {k}" for k, v in counts.items()) or "no nodes")
    return "per-model-stage relayout"


def _seconds(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g} s"


def format_bytes(n: float) -> str:
    """``3.2 MB``-style text for a byte count."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def executed_transitions(decisions: Iterable[Mapping[str, Any]]) -> int:
    """How many of a callback's decision records moved state (not the initial plan, not kept ones)."""
    return sum(
        1
        for d in decisions
        if d.get("decision") in EXECUTED_KINDS and "measured_s" in d and not _kept(d.get("transition"))
    )


# ---- the end-of-run summary --------------------------------------------------------------------
def read_metrics(path: str | None) -> list[dict[str, str]]:
    """The training rows of a Lightning CSV log (rows that carry ``timing_s/transition``)."""
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return [r for r in csv.DictReader(f) if r.get("timing_s/transition") not in (None, "")]


def read_decisions(path: str) -> list[dict[str, Any]]:
    """The records of a decision log (empty when there is none)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def transition_rows(
    rows: Sequence[Mapping[str, str]], decisions: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """One entry per executed transition: step, what changed, why, seconds, bytes moved.

    A metrics row with ``timing_s/transition > 0`` is the step before which a transition ran, as
    its decision's step (decisions count finished steps).
    """
    why = {
        int(d["step"]): trigger_text(d.get("trigger") or ()) or d.get("reason", "")
        for d in decisions
        if d.get("decision") in EXECUTED_KINDS
    }
    out = []
    for i, row in enumerate(rows):
        seconds = float(row.get("timing_s/transition") or 0)
        if seconds <= 0:
            continue
        before = rows[i - 1] if i > 0 else row
        gpus = (_int(before.get("plan/num_gpus")), _int(row.get("plan/num_gpus")))
        step = int(float(row["step"]))
        changes = describe_changes(plan_of_metrics(before), plan_of_metrics(row), gpus)
        out.append(
            {
                "step": step,
                "changed": "; ".join(changes) or "plan kept",
                "why": why.get(step, "-"),
                "seconds": seconds,
                "bytes": float(row.get("transition/bytes") or 0),
            }
        )
    return out


def _int(value: str | None) -> int:
    return int(float(value)) if value not in (None, "") else 0


def output_paths(summary: Mapping[str, Any], out_dir: str) -> dict[str, str]:
    """Where the run's outputs are: the summary's paths, the decision log and checkpoints if written."""
    paths = {
        "metrics": str(summary.get("metrics_csv") or ""),
        "decisions": os.path.join(out_dir, "decisions.jsonl"),
    }
    paths["plot"] = str(summary.get("plot") or "")
    paths["checkpoints"] = os.path.join(out_dir, "checkpoints")
    for key, value in summary.items():  # any other path the summary names (e.g. an HF export)
        if isinstance(value, str) and value not in paths.values() and os.path.exists(value):
            paths[key] = value
    paths["summary"] = os.path.join(out_dir, "summary.json")
    return {
        k: v for k, v in paths.items() if v and os.path.exists(v) and (os.path.isfile(v) or os.listdir(v))
    }


def summary_tables(summary: Mapping[str, Any], out_dir: str, wall_s: float | None = None) -> list[Any]:
    """The rich tables of the end-of-run summary: the run, its transitions, its outputs."""
    from rich.table import Table

    rows = read_metrics(summary.get("metrics_csv"))
    moves = transition_rows(rows, read_decisions(os.path.join(out_dir, "decisions.jsonl")))
    step_s = sum(float(r.get("timing_s/step") or 0) for r in rows)
    moved_s = sum(m["seconds"] for m in moves)
    run = Table(title="nereus-train: run summary", show_header=False, title_justify="left")
    run.add_column("what", style="bold")
    run.add_column("value")
    run.add_row("steps", str(summary.get("steps", len(rows))))
    if wall_s is not None:
        run.add_row("wall time", f"{wall_s:.1f} s")
    if "reward_first10" in summary:
        run.add_row(
            "reward (mean score)",
            f"first 10 steps {summary['reward_first10']:.3f}, last 10 {summary['reward_last10']:.3f}",
        )
    share = moved_s / (step_s + moved_s) if step_s + moved_s > 0 else 0.0
    run.add_row(
        "transitions", f"{len(moves)}, {moved_s:.2f} s = {share:.1%} of the time in steps and transitions"
    )
    tables: list[Any] = [run]
    if moves:
        table = Table(title="transitions", title_justify="left")
        for name, justify in (
            ("step", "right"),
            ("what changed", "left"),
            ("why", "left"),
            ("seconds", "right"),
            ("bytes", "right"),
        ):
            table.add_column(name, justify=justify)  # type: ignore[arg-type]
        for m in moves:
            table.add_row(
                str(m["step"]), m["changed"], m["why"], f"{m['seconds']:.3f}", format_bytes(m["bytes"])
            )
        tables.append(table)
    outputs = Table(title="outputs", show_header=False, title_justify="left")
    outputs.add_column("what", style="bold")
    outputs.add_column("path")
    for name, path in output_paths(summary, out_dir).items():
        outputs.add_row(name, path)
    tables.append(outputs)
    return tables


def print_summary(summary: Mapping[str, Any], out_dir: str, wall_s: float | None = None) -> None:
    """Print the end-of-run summary tables to the console."""
    from rich.console import Console

    console = Console()
    for table in summary_tables(summary, out_dir, wall_s):
        console.print(table)
