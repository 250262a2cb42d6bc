"""Outputs of a simulation: per-step CSV, the policy table, and a Figure-11-style plot."""

from __future__ import annotations

import csv
import math
import os
from collections.abc import Sequence
from dataclasses import asdict, fields

from nereus_lightning.sim.simulator import Comparison, StepRecord, Summary

TABLE_COLUMNS = (
    ("policy", "policy", "{}"),
    ("mean_step_s", "mean s/step", "{:.2f}"),
    ("transitions", "transitions", "{}"),
    ("restarts", "restarts", "{}"),
    ("transition_s", "transition s", "{:.1f}"),
    ("transition_share", "in transitions", "{:.3%}"),
    ("gap_to_oracle", "gap to oracle", "{:+.1%}"),
    ("infeasible_steps", "infeasible", "{}"),
)


def write_csv(path: str | os.PathLike, records: Sequence[StepRecord]) -> None:
    """One row per (policy, step)."""
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[x.name for x in fields(StepRecord)])
        writer.writeheader()
        for r in records:
            writer.writerow(asdict(r))


def format_table(summaries: Sequence[Summary], title: str = "") -> str:
    """The policy table as aligned plain text (also readable in logs and READMEs)."""
    head = [h for _, h, _ in TABLE_COLUMNS]
    rows = []
    for s in summaries:
        row = []
        for key, _, fmt in TABLE_COLUMNS:
            value = getattr(s, key)
            row.append("-" if value is None else fmt.format(value))
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=False)) + " |"  # noqa: E731
    out = [title] if title else []
    out += [line(head), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *(line(r) for r in rows)]
    return "\n".join(out)


def plot_comparison(comparison: Comparison, path: str | os.PathLike, title: str = "") -> None:
    """Step latency per policy (transitions marked), the GPU pool and the response length beneath."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    trace = comparison.trace
    steps = list(range(len(trace)))
    fig, axes = plt.subplots(3, 1, figsize=(10, 7.5), sharex=True, gridspec_kw={"height_ratios": [3, 1, 1]})
    top, mid, low = axes
    # Restarts cost minutes: clip the axis at 1.6x the slowest step so step latencies stay
    # readable; clipped points sit on the top edge with their value written beside them.
    values = [r.step_s for recs in comparison.records.values() for r in recs if math.isfinite(r.step_s)]
    cap = 1.6 * max(values, default=1.0)
    for i, (name, recs) in enumerate(comparison.records.items()):
        color = f"C{i}"
        ys = [min(r.step_s + r.transition_s, cap) for r in recs]
        style = ":" if name == "oracle" else "-"
        top.plot(
            steps,
            ys,
            style,
            color=color,
            lw=1.4,
            label=f"{name} ({comparison.summaries[name].mean_step_s:.1f} s/step)",
        )
        for r, y in zip(recs, ys, strict=True):
            if r.action in ("transition", "restart") and name != "oracle":
                top.scatter([r.step], [y], color=color, marker="v", s=28, zorder=3)
            if r.step_s + r.transition_s > cap:
                top.annotate(
                    f"{r.step_s + r.transition_s:.0f} s",
                    (r.step, cap),
                    fontsize=7,
                    ha="left",
                    va="top",
                    color=color,
                    xytext=(3, -2),
                    textcoords="offset points",
                )
            if not r.feasible:
                top.scatter([r.step], [y if math.isfinite(y) else 0], color=color, marker="x", s=40, zorder=4)
    top.set_ylim(0, cap * 1.02)
    top.set_ylabel("step latency (s)\n(incl. transition)")
    top.legend(fontsize=8, loc="lower right", ncol=2)  # the low band is empty: steps take time
    top.set_title(title or trace.name)
    top.grid(alpha=0.3)
    mid.step(steps, trace.num_gpus, where="post", color="k")
    mid.set_ylabel("GPUs")
    mid.grid(alpha=0.3)
    low.plot(steps, trace.response_len, color="C3", label="mean")
    low.plot(steps, trace.response_len_p95, "--", color="C3", label="p95")
    low.set_ylabel("response\ntokens")
    low.set_xlabel("RL step  (markers: v transition/restart, x infeasible)")
    low.legend(fontsize=8, loc="upper left")
    low.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_gamma_sweep(rows: Sequence[dict], path: str | os.PathLike) -> None:
    """Mean step latency and transition count against gamma."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    gammas = [r["gamma"] for r in rows]
    ax.plot(gammas, [r["mean_step_s"] for r in rows], "o-", color="C0")
    ax.set_xlabel("gamma")
    ax.set_ylabel("mean s/step", color="C0")
    ax2 = ax.twinx()
    ax2.plot(gammas, [r["transitions"] for r in rows], "s--", color="C1")
    ax2.set_ylabel("transitions", color="C1")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
