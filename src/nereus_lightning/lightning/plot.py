"""The end-of-run figure: reward and step latency per step with the transitions marked and labelled,
the GPU pool and the response length beneath (as in ``nereus-simulate``'s figure).

Transition labels sit in a band above the reward, staggered downwards: each label takes the
highest place where its box (measured with the renderer) meets no other label, and the band
grows until every label fits, so labels of neighbouring steps never overlap.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nereus_lightning.lightning.console import describe_changes, plan_of_metrics

LABEL_FONT = 7
LABEL_PAD_PT = 2.0  # points between a label and the next one, and between a label and its line
MAX_CHANGES = 3  # change lines per label; more read "+k more"
ROWS = {"lane": 0.6, "reward": 3.0, "seconds": 2.0, "gpus": 1.0, "length": 1.2}  # height ratios


def change_label(before: Mapping[str, float], after: Mapping[str, float]) -> str:
    """What a transition changed, e.g. ``GPUs 4->3`` or ``actor_train (1,1,1)->(1,1,2)`` (one line each)."""
    gpus = (int(before.get("plan/num_gpus", 0)), int(after.get("plan/num_gpus", 0)))
    items = describe_changes(plan_of_metrics(before), plan_of_metrics(after), gpus)
    if len(items) > MAX_CHANGES:
        items = [*items[: MAX_CHANGES - 1], f"+{len(items) - MAX_CHANGES + 1} more"]
    return "\n".join(items) or "plan kept"


def transition_marks(history: Sequence[Mapping[str, float]]) -> list[tuple[float, str]]:
    """``(x, label)`` per executed transition (on the row of the step it ran before): x between the
    step before and the step after it."""
    marks = []
    for i, h in enumerate(history):
        if h.get("timing_s/transition", 0.0) > 0:
            before = history[i - 1] if i > 0 else h
            marks.append((h["step"] - 0.5, f"step {int(h['step'])}: {change_label(before, h)}"))
    return marks


def draw_run(history: Sequence[Mapping[str, float]], title: str = "nereus-train") -> Any:
    """The figure of a run's history (``NereusCallback.history``); returns the matplotlib Figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]

    def series(key: str, default: float = float("nan")) -> list[float]:
        return [h.get(key, default) for h in history]

    fig, axes = plt.subplots(
        len(ROWS), 1, figsize=(9, 8), sharex=True, gridspec_kw={"height_ratios": list(ROWS.values())}
    )
    lane, top, mid, gpus, length = axes
    top.plot(steps, series("critic/score/mean"), color="tab:blue")
    top.set_ylabel("reward\n(mean score)")
    mid.plot(steps, series("timing_s/step"), color="tab:orange", label="step")
    mid.plot(steps, series("timing_s/transition", 0.0), color="tab:red", label="transition")
    mid.set_ylabel("seconds")
    mid.legend(loc="upper left", fontsize=8)
    gpus.step(steps, series("pool/num_gpus"), where="post", color="k", label="pool")
    gpus.step(steps, series("plan/num_gpus"), where="post", color="tab:green", linestyle="--", label="in use")
    gpus.set_ylabel("GPUs")
    gpus.legend(loc="lower left", fontsize=8)
    length.plot(steps, series("response_length/mean"), color="C3", label="mean")
    length.plot(steps, series("response_length/p95"), "--", color="C3", label="p95")
    length.set_ylabel("response\ntokens")
    length.set_xlabel("RL step")
    length.legend(loc="upper left", fontsize=8)
    for ax in axes[1:]:
        ax.grid(alpha=0.3)
    lane.set_axis_off()
    lane.set_title(title)
    marks = transition_marks(history)
    for x, _ in marks:
        for ax in axes[1:]:
            ax.axvline(x, color="tab:red", linestyle="--", alpha=0.6)
    _label_transitions(fig, lane, marks)
    return fig


def plot_run(history: Sequence[Mapping[str, float]], path: str, title: str = "nereus-train") -> str:
    """Write the PNG of :func:`draw_run`; returns ``path``."""
    import matplotlib.pyplot as plt

    fig = draw_run(history, title)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _label_transitions(fig: Any, lane: Any, marks: Sequence[tuple[float, str]]) -> list[Any]:
    """Place the labels (see the module docstring), each joined to its transition's line by a
    dashed connector; grows the figure until the band holds them all. Returns the labels."""
    placed: list[tuple[Any, float]] = []
    height = 0.0
    for _ in range(4):  # each round lays out, places, and grows the band by what was missing
        fig.tight_layout()
        for text, _ in placed:
            text.remove()
        placed, depth = _stagger(fig, lane, marks)
        height = lane.get_window_extent(fig.canvas.get_renderer()).height * 72 / fig.dpi
        missing = depth - height
        if missing <= 0:
            break
        ratios = list(lane.get_gridspec().get_height_ratios())
        ratios[0] *= (height + missing + LABEL_PAD_PT) / max(height, 1.0)
        lane.get_gridspec().set_height_ratios(ratios)
        fig.set_figheight(fig.get_figheight() + (missing + LABEL_PAD_PT) / 72)
    for (x, _), (_, offset) in zip(marks, placed, strict=True):
        top = max(1.0 - offset / max(height, 1.0), 0.0)
        lane.plot(
            [x, x],
            [0.0, top],
            transform=lane.get_xaxis_transform(),
            color="tab:red",
            linestyle="--",
            alpha=0.6,
        )
    return [text for text, _ in placed]


def _stagger(
    fig: Any, lane: Any, marks: Sequence[tuple[float, str]]
) -> tuple[list[tuple[Any, float]], float]:
    """Each label at the highest offset below the band's top where neither it nor its connector
    (from its top down to the band's bottom) meets a placed label or connector; returns each label
    with its offset (points) and how deep the lowest one reaches."""
    from matplotlib.transforms import Bbox

    renderer = fig.canvas.get_renderer()
    lo, hi = lane.get_xlim()
    bottom = lane.get_window_extent(renderer).y0
    pad = LABEL_PAD_PT * fig.dpi / 72 / 2
    step_pt = LABEL_FONT * 1.2  # try offsets one text line apart
    boxes: list[Bbox] = []
    lines: list[Bbox] = []
    placed = []
    depth = 0.0
    for x, label in marks:
        right = (x - lo) > 0.6 * (hi - lo)  # labels on the right half end at their line
        x_px = lane.transData.transform((x, 0.0))[0]
        offset = LABEL_PAD_PT
        while True:
            text = lane.annotate(
                label,
                xy=(x, 1.0),
                xycoords=("data", "axes fraction"),
                xytext=(-LABEL_PAD_PT if right else LABEL_PAD_PT, -offset),
                textcoords="offset points",
                ha="right" if right else "left",
                va="top",
                fontsize=LABEL_FONT,
                color="tab:red",
                annotation_clip=False,
                gid="transition-label",
            )
            text.set_in_layout(False)
            box = text.get_window_extent(renderer).padded(pad)
            line = Bbox.from_extents(x_px - pad, min(bottom, box.y1), x_px + pad, box.y1)
            hits = [box.overlaps(b) or line.overlaps(b) for b in boxes] + [box.overlaps(ln) for ln in lines]
            if not any(hits):
                break
            text.remove()
            offset += step_pt
        boxes.append(box)
        lines.append(line)
        placed.append((text, offset))
        depth = max(depth, offset + box.height * 72 / fig.dpi)
    return placed, depth
