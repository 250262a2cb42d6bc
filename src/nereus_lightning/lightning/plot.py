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
    bottom.plot(steps, [h.get("timing_s/step", float("nan")) for h in history], color="tab:orange", label="step")
    bottom.plot(steps, [h.get("timing_s/transition", 0.0) for h in history], color="tab:red", label="transition")
    bottom.set_ylabel("seconds")
    bottom.set_xlabel("RL step")
    bottom.legend(loc="upper left")
    for h in history:
        if h.get("timing_s/transition", 0.0) > 0:
            for ax in (top, bottom):
                ax.axvline(h["step"] + 0.5, color="tab:red", linestyle="--", alpha=0.6)
            top.annotate(f"{int(h.get('plan/num_gpus', 0))} GPUs", (h["step"] + 0.5, top.get_ylim()[1]),
                         fontsize=7, rotation=90, va="top", color="tab:red")
    top.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
