"""The end-of-run figure: reward and step latency per step, with transitions marked."""

from __future__ import annotations

from collections.abc import Sequence


def plot_run(history: Sequence[dict[str, float]], path: str, title: str = "nereus-train") -> str:
    """Write a PNG of ``critic/score/mean`` and ``timing_s/step`` per step; dashed lines mark transitions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in history]
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 5.5), sharex=True)
    top.plot(steps, [h.get("critic/score/mean", float("nan")) for h in history], color="tab:blue")
    top.set_ylabel("reward (mean score)")
    bottom.plot(
        steps, [h.get("timing_s/step", float("nan")) for h in history], color="tab:orange", label="step"
    )
    bottom.plot(
        steps, [h.get("timing_s/transition", 0.0) for h in history], color="tab:red", label="transition"
    )
    bottom.set_ylabel("seconds")
    bottom.set_xlabel("RL step")
    bottom.legend(loc="upper left")
    for i, h in enumerate(history):
        if h.get("timing_s/transition", 0.0) > 0:
            for ax in (top, bottom):
                ax.axvline(h["step"] + 0.5, color="tab:red", linestyle="--", alpha=0.6)
            label = change_label(h, history[i + 1]) if i + 1 < len(history) else "transition"
            top.annotate(
                label,
                (h["step"] + 0.5, top.get_ylim()[0]),
                fontsize=7,
                rotation=90,
                va="bottom",
                ha="right",
                color="tab:red",
            )
    top.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def change_label(before: dict[str, float], after: dict[str, float]) -> str:
    """What a transition changed, e.g. ``GPUs 4->3`` or ``actor_train TP1PP1->TP1PP2``."""
    parts = []
    if before.get("plan/num_gpus") != after.get("plan/num_gpus"):
        parts.append(f"GPUs {int(before.get('plan/num_gpus', 0))}->{int(after.get('plan/num_gpus', 0))}")
    stages = sorted({k.split("/")[1] for k in after if k.startswith("plan/") and k.count("/") == 2})
    for stage in stages:
        if any(before.get(f"plan/{stage}/{d}") != after.get(f"plan/{stage}/{d}") for d in ("tp", "pp")):
            b = {d: int(before.get(f"plan/{stage}/{d}", 0)) for d in ("tp", "pp")}
            a = {d: int(after.get(f"plan/{stage}/{d}", 0)) for d in ("tp", "pp")}
            parts.append(f"{stage} TP{b['tp']}PP{b['pp']}->TP{a['tp']}PP{a['pp']}")
    return "\n".join(parts[:2]) or "DP re-fit"  # one line per change: rotated labels stay inside the axes
